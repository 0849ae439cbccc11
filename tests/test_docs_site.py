"""The built documentation site (``make docs-site``), opened in a browser.

A headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven
by selenium) loads the pages from a local HTTP server: the index without
console errors, the site's search finding PowerSGD's API page, that page's
parameters and typeset math, and no request leaving this machine. Every
internal link and anchor of every page is checked from the HTML files, and
no page may load a script, stylesheet or font from the network.

Without a built site or a browser the tests skip, naming what is missing;
with ``JAXCOMM_REQUIRE_SITE=1`` (CI) they fail instead.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import json
import os
import pathlib
import posixpath
import re
import shutil
import tempfile
import threading
import urllib.parse

import pytest

try:
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service
  from selenium.webdriver.common.keys import Keys
  from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the docs extra is not installed: the tests skip
  webdriver = None

SITE = pathlib.Path(__file__).resolve().parent.parent / "docs/_build/html"
REQUIRE = os.environ.get("JAXCOMM_REQUIRE_SITE") == "1"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-quic", "--no-first-run",
                  "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1024")
WAIT_S = 60


def _missing(reason: str):
  if REQUIRE:
    pytest.fail(f"{reason} (JAXCOMM_REQUIRE_SITE=1)")
  pytest.skip(reason)


# --------------------------------------------------------------------------
# The built HTML, parsed


class _Page(html.parser.HTMLParser):
  """The ids, links and loaded resources of one HTML page."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.ids: set[str] = set()
    self.links: list[tuple[str, str]] = []      # (tag.attr, url)
    self.resources: list[tuple[str, str]] = []  # what the page loads

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    for key in ("id", "name"):
      if a.get(key):
        self.ids.add(a[key])
    for key in ("href", "src"):
      if a.get(key) is not None:
        self.links.append((f"{tag}.{key}", a[key]))
    if tag in ("script", "img", "iframe", "video", "audio", "source",
               "embed") and a.get("src"):
      self.resources.append((tag, a["src"]))
    if tag == "link" and a.get("href"):
      self.resources.append((f"link[rel={a.get('rel', '')}]", a["href"]))
    if tag == "object" and a.get("data"):
      self.resources.append((tag, a["data"]))


@functools.lru_cache(maxsize=None)
def _parse(path: pathlib.Path) -> _Page:
  page = _Page()
  page.feed(path.read_text(encoding="utf-8", errors="replace"))
  return page


def _html_files() -> list[pathlib.Path]:
  """The pages (not the theme's Jinja macros it leaves under _static)."""
  return sorted(p for p in SITE.rglob("*.html")
                if p.relative_to(SITE).parts[0] != "_static")


def _is_external(url: str) -> bool:
  parsed = urllib.parse.urlsplit(url)
  if parsed.scheme in ("http", "https", "ftp", "ws", "wss") or (
      not parsed.scheme and url.startswith("//")):
    return parsed.hostname not in ("localhost", "127.0.0.1", "::1")
  return False


def _local_target(page: pathlib.Path, url: str):
  """(file, fragment) that ``url`` on ``page`` names inside the site, or
  None for a link that leaves the site (another scheme or host)."""
  parsed = urllib.parse.urlsplit(url)
  if parsed.scheme in ("mailto", "javascript", "data", "tel"):
    return None
  if parsed.scheme or url.startswith("//"):
    if _is_external(url):
      return None
    path = parsed.path.lstrip("/")
    target = SITE / urllib.parse.unquote(path)
  elif parsed.path.startswith("/"):
    target = SITE / urllib.parse.unquote(parsed.path.lstrip("/"))
  elif parsed.path:
    rel = posixpath.normpath(posixpath.join(
      page.parent.relative_to(SITE).as_posix(),
      urllib.parse.unquote(parsed.path)))
    target = SITE / rel
  else:
    target = page
  if target.is_dir():
    target = target / "index.html"
  return target, urllib.parse.unquote(parsed.fragment)


@pytest.fixture(scope="module")
def site() -> pathlib.Path:
  if not (SITE / "index.html").is_file():
    _missing(f"the site is not built ({SITE}/index.html is missing; run "
             "`make docs-site`)")
  return SITE


# --------------------------------------------------------------------------
# The browser and the server


class _Quiet(http.server.SimpleHTTPRequestHandler):

  def log_message(self, *args):  # keeps pytest's output clean
    del args


@pytest.fixture(scope="module")
def server(site):
  handler = functools.partial(_Quiet, directory=str(site))
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{httpd.server_address[1]}"
  httpd.shutdown()
  httpd.server_close()
  thread.join(timeout=10)


def _browser_paths() -> tuple[str, str]:
  chromium = shutil.which("chromium") or "/usr/bin/chromium"
  driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
  if not os.access(chromium, os.X_OK):
    _missing("no Chromium (apt-get install -y chromium chromium-driver)")
  if not os.access(driver, os.X_OK):
    _missing("no chromedriver (apt-get install -y chromium-driver)")
  return chromium, driver


@pytest.fixture(scope="module")
def browser(server):
  del server
  if webdriver is None:
    _missing("selenium is not installed (pip install -e '.[docs]')")
  chromium, driver_path = _browser_paths()
  profile = tempfile.mkdtemp(prefix="jaxcomm-chromium-")
  options = webdriver.ChromeOptions()
  options.binary_location = chromium
  for flag in CHROMIUM_FLAGS:
    options.add_argument(flag)
  options.add_argument(f"--user-data-dir={profile}")
  options.set_capability("goog:loggingPrefs",
                         {"browser": "ALL", "performance": "ALL"})
  driver = webdriver.Chrome(options=options,
                            service=Service(executable_path=driver_path))
  driver.set_page_load_timeout(WAIT_S)
  try:
    yield driver
  finally:
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, condition, what: str):
  return WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(
      condition, message=f"waited {WAIT_S} s for {what}")


def _open(driver, url: str) -> None:
  driver.get(url)
  _wait(driver, lambda d: d.execute_script(
      "return document.readyState") == "complete", f"{url} to load")


def _requests(driver) -> list[str]:
  """The URLs the browser requested since the last call."""
  urls = []
  for entry in driver.get_log("performance"):
    message = json.loads(entry["message"])["message"]
    if message.get("method") == "Network.requestWillBeSent":
      urls.append(message["params"]["request"]["url"])
  return urls


def _severe(driver) -> list[str]:
  return [e["message"] for e in driver.get_log("browser")
          if e.get("level") == "SEVERE"]


def _assert_local(urls: list[str]) -> None:
  """No URL goes over the network to another host (the browser's own
  chrome:// pages, data: and blob: URLs stay inside it)."""
  outside = [u for u in urls if _is_external(u)]
  assert not outside, f"requests that leave this machine: {outside}"


def _method_page(site: pathlib.Path, name: str) -> pathlib.Path:
  """The API page documenting ``jaxcomm.<name>``, read from the HTML."""
  for path in sorted((site / "api").glob("*.html")):
    if f"jaxcomm.{name}" in _parse(path).ids:
      return path
  raise AssertionError(f"no page under api/ has the anchor jaxcomm.{name}")


# --------------------------------------------------------------------------
# In the browser


def test_index_loads_without_console_errors(site, server, browser):
  del site
  browser.get_log("browser")
  browser.get_log("performance")
  _open(browser, f"{server}/index.html")
  _wait(browser, lambda d: d.find_elements("css selector", "h1"),
        "the index's title")
  assert "jaxcomm" in browser.title
  links = browser.find_elements("css selector", "nav a.reference.internal")
  assert any("api/index.html" in (a.get_attribute("href") or "")
             for a in links), "the navigation has no API reference link"
  assert _severe(browser) == []
  _assert_local(_requests(browser))


def test_search_lists_the_powersgd_page(site, server, browser):
  expected = _method_page(site, "powersgd").relative_to(site).as_posix()
  browser.get_log("browser")
  _open(browser, f"{server}/search.html")
  box = _wait(browser, lambda d: next(
      (e for e in d.find_elements("css selector", "input[name=q]")
       if e.is_displayed()), None), "a visible search box")
  box.clear()
  box.send_keys("powersgd" + Keys.ENTER)

  def result_links(d):
    hrefs = [a.get_attribute("href") or "" for a in d.find_elements(
        "css selector", "#search-results a")]
    return hrefs if any(expected in h for h in hrefs) else None
  hrefs = _wait(browser, result_links, f"a search result linking {expected}")
  assert any(f"{expected}#jaxcomm.powersgd" in h for h in hrefs), hrefs
  assert _severe(browser) == []
  _assert_local(_requests(browser))


def test_powersgd_page_shows_parameters_and_typeset_math(site, server,
                                                         browser):
  page = _method_page(site, "powersgd").relative_to(site).as_posix()
  browser.get_log("browser")
  _open(browser, f"{server}/{page}#jaxcomm.powersgd")
  sig = _wait(browser, lambda d: d.find_element(
      "css selector", "dt[id='jaxcomm.powersgd']"), "powersgd's signature")
  assert "powersgd" in sig.text and "rank" in sig.text
  body = sig.find_element("xpath", "following-sibling::dd[1]")
  fields = body.find_elements("css selector", "dl.field-list > dt")
  assert any(f.text.strip().startswith("Parameters") for f in fields), (
      [f.text for f in fields])
  params = body.find_element(
      "xpath", ".//dl[contains(@class, 'field-list')]/dt[starts-with("
               "normalize-space(.), 'Parameters')]/following-sibling::dd[1]")
  assert "rank" in params.text

  # MathJax replaces every math element's TeX with its typeset output.
  maths = _wait(browser, lambda d: d.find_elements(
      "css selector", "div.math, span.math"), "math on the page")
  _wait(browser, lambda d: all(
      m.find_elements("css selector", "mjx-container") for m in maths),
      "MathJax to typeset every math element")
  mine = body.find_elements("css selector", "div.math, span.math")
  assert mine, "powersgd's docstring has no math on the page"
  for m in maths:
    assert not re.search(r"\\(frac|sum|top|mathrm|operatorname)", m.text), (
        f"raw TeX left on the page: {m.text!r}")
  assert _severe(browser) == []
  _assert_local(_requests(browser))


# --------------------------------------------------------------------------
# From the HTML files


def test_every_internal_link_and_anchor_resolves(site):
  broken = []
  files = _html_files()
  assert len(files) > 20, f"only {len(files)} pages were built"
  for page in files:
    for where, url in _parse(page).links:
      target = _local_target(page, url)
      if target is None:
        continue
      path, fragment = target
      name = f"{page.relative_to(site)}: {where}={url!r}"
      if not path.is_file():
        broken.append(f"{name} (no file {path.relative_to(site)})")
      elif fragment and path.suffix == ".html" and (
          fragment not in _parse(path).ids):
        broken.append(f"{name} (no anchor #{fragment})")
  assert not broken, (f"{len(broken)} broken links:\n"
                      + "\n".join(broken[:60]))


def test_no_page_loads_anything_from_the_network(site):
  external = []
  for page in _html_files():
    for tag, url in _parse(page).resources:
      if _is_external(url):
        external.append(f"{page.relative_to(site)}: <{tag}> {url}")
  # Stylesheets may pull fonts and other sheets in by url() and @import.
  for sheet in site.rglob("*.css"):
    text = sheet.read_text(encoding="utf-8", errors="replace")
    for url in re.findall(r"""(?:url\(\s*['"]?|@import\s+['"])([^'")\s]+)""",
                          text):
      if _is_external(url):
        external.append(f"{sheet.relative_to(site)}: {url}")
  assert not external, "\n".join(external)


def test_every_registered_method_has_its_api_entry(site):
  """The family pages are written from the registry at build time."""
  built = (site / "index.html").stat().st_mtime
  newest = max(p.stat().st_mtime for p in (site.parent.parent.parent /
                                          "jaxcomm").rglob("*.py"))
  if newest > built and not REQUIRE:
    pytest.skip("jaxcomm/ changed after the site was built (make docs-site)")
  from jaxcomm import registry  # pylint: disable=import-outside-toplevel
  ids = set()
  for path in (site / "api").glob("*.html"):
    ids |= _parse(path).ids
  missing = [m.attr for m in registry.methods()
             if f"jaxcomm.{m.attr}" not in ids]
  assert not missing, f"no API entry for {missing} (rebuild the site?)"
