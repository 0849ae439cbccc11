"""Pages of the jaxcomm site that are written at build time.

* ``api/``: one page per family of :mod:`jaxcomm.registry` (its methods in
  the registry's order, compressors in sections by ``kind`` where the
  registry gives one), one page per public module (its ``__all__``), the
  core names of ``jaxcomm`` and an overview. A method registered tomorrow
  appears without editing a page.
* ``examples/``: one page per ``examples/*.py`` script (its docstring and
  its code), read without running or importing it.
* The Markdown pages under ``benchmarks/`` get one title each and headings
  one level apart (several are written by benchmark scripts that start at
  ``##`` or with a paragraph).
* Inline code that names a page of the site (```docs/usage.md```,
  ```tpu.md```, ```ARCHITECTURE.md```) or a documented object
  (```jaxcomm.parallel.DataParallel```, ```parallel.state_layout```,
  ```jaxcomm.topk(0.01)```) becomes a link to it.

The generated folders are owned by this module: it rewrites a file only
when its text changed (so incremental builds stay incremental) and removes
the files it no longer writes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib
import re
import sys
import types

from docutils import nodes
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.inspect import object_description

logger = logging.getLogger(__name__)

# Public modules with a page of their own, in the order of the overview.
MODULES = (
  ("jaxcomm.parallel", "Data-parallel steps, meshes, per-device state"),
  ("jaxcomm.collectives", "The collectives the compressors are built on"),
  ("jaxcomm.wire", "Bytes on the wire: claimed, read from HLO, priced"),
  ("jaxcomm.aot", "Compiling a step for a TPU topology without one"),
  ("jaxcomm.advise", "Pricing every method on a pod"),
  ("jaxcomm.registry", "The list of methods"),
  ("jaxcomm.kernels", "Pallas kernels and their plain-jnp paths"),
)

# A page per family: (page, title). A family the registry gains later gets
# a page named after it.
FAMILY_PAGES = {
  "compressor": ("compressors", "Gradient compressors"),
  "optimizer": ("optimizers", "Communication-efficient optimizers"),
  "local": ("local", "Local-update and decentralized methods"),
  "delay": ("delay", "When the average is applied"),
}
# Section titles of the family packages under jaxcomm/transforms/.
PACKAGE_TITLES = {
  "quantize": "Quantization",
  "sparsify": "Sparsification",
  "lowrank": "Low rank",
  "local": "Local-update methods",
  "gossip": "Decentralized methods (gossip)",
}
KIND_TITLES = {
  "quantize": "Quantization",
  "sparsify": "Sparsification",
  "lowrank": "Low rank",
}

# Benchmark pages that open without a heading, or whose first heading is
# one section among several, and the title each gets.
BENCHMARK_TITLES = {
  "benchmarks/bench": "Kernels, PowerSGD, quantizers, sparsifiers and wire "
                      "bytes (micro-benchmarks)",
  "benchmarks/convergence": "Convergence on the char-LSTM",
  "benchmarks/sharded": "The sharded transformer step: bytes, memory, time",
  "benchmarks/sharded_memory": "Memory of the sharded step per compressor",
}

# Files of the repository that are pages of the site, besides docs/*.
REPO_PAGES = {
  "ARCHITECTURE.md": "architecture",
  "README.md": "guides/getting_started",
}

GENERATED_HEADER = (".. This page is written by docs/_ext/jaxcomm_site.py "
                    "at build time; edit that file, not this one.\n\n")


# --------------------------------------------------------------------------
# reST helpers


def rst_text(s: str) -> str:
  """Plain text (a registry summary or paper) as inline reST: `code` as
  literals, reST's markup characters escaped elsewhere."""
  out = []
  for i, part in enumerate(str(s).split("`")):
    if i % 2:
      # Inline markup next to a letter needs an escaped space beside it.
      out.append("\\ ``" + part + "``\\ " if part else "")
    else:
      part = part.replace("\\", "\\\\")
      part = re.sub(r"([*|`])", r"\\\1", part)
      out.append(re.sub(r"_(?=\W|$)", r"\\_", part))
  text = "".join(out)
  return re.sub(r"(^|\s)\\ |\\ (?=\s|$)", r"\1", text)


def mark_code(text: str) -> str:
  """``text`` with each call written in it (``optax.chain(jaxcomm.<name>(
  ...), optax.<opt>(lr))``) between back-quotes, for :func:`rst_text`."""
  out, i = [], 0
  for m in re.finditer(r"\b(?:optax|jaxcomm)\.", text):
    if m.start() < i:
      continue
    j, depth = m.start(), 0
    while j < len(text):
      c = text[j]
      if c == "(":
        depth += 1
      elif c == ")":
        if depth == 0:
          break
        depth -= 1
      elif depth == 0 and not (c.isalnum() or c in "._<>"):
        break
      j += 1
    out.append(text[i:m.start()] + "`" + text[m.start():j] + "`")
    i = j
  return "".join(out) + text[i:]


def heading(text: str, char: str, over: bool = False) -> str:
  line = char * max(len(text), 3)
  return (f"{line}\n" if over else "") + f"{text}\n{line}\n\n"


def indent(text: str, by: str = "   ") -> str:
  return "\n".join(by + line if line.strip() else "" for line in
                   text.splitlines()) + "\n"


def public_names(module: types.ModuleType) -> list[str]:
  """``module.__all__``, or, without one, its public functions, classes
  and UPPER_CASE constants defined in jaxcomm."""
  names = getattr(module, "__all__", None)
  if names is not None:
    return list(names)
  logger.warning("%s has no __all__; documenting the names it defines",
                 module.__name__, type="jaxcomm", subtype="all")
  out = []
  for name, obj in vars(module).items():
    if name.startswith("_") or isinstance(obj, types.ModuleType):
      continue
    if inspect.isclass(obj) or inspect.isfunction(obj):
      if getattr(obj, "__module__", "").startswith("jaxcomm"):
        out.append(name)
    elif name.isupper():
      out.append(name)
  return out


def directive_for(qualname: str, obj) -> str:
  """The directive documenting ``obj`` under the name ``qualname``."""
  if isinstance(obj, types.ModuleType):
    return (heading(f"``{qualname}``", "~")
            + f".. automodule:: {qualname}\n   :members:\n\n")
  if inspect.isclass(obj):
    opts = "   :members:\n"
    described = documented_attributes(obj)
    if described:
      # Napoleon documents these from the docstring's Attributes section;
      # autodoc would describe a property among them a second time.
      opts += f"   :exclude-members: {', '.join(described)}\n"
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):
      # A NamedTuple's fields are described by its docstring's Attributes.
      opts = ""
    return f".. autoclass:: {qualname}\n{opts}\n"
  if callable(obj):
    return f".. autofunction:: {qualname}\n\n"
  return data_directive(qualname, obj)


def documented_attributes(cls) -> list[str]:
  """The names in the Attributes section of ``cls``'s docstring."""
  doc = inspect.getdoc(cls) or ""
  names = []
  inside = item = None
  for line in doc.splitlines():
    if re.fullmatch(r"\s*Attributes:\s*", line):
      inside, item = len(line) - len(line.lstrip()), None
      continue
    if inside is None or not line.strip():
      continue
    depth = len(line) - len(line.lstrip())
    if depth <= inside:
      inside = None
      continue
    item = depth if item is None else item
    m = re.match(r"\s*(\w+)\s*(\([^)]*\))?\s*:", line)
    if m and depth == item:
      names.append(m.group(1))
  return names


def data_directive(qualname: str, obj) -> str:
  """A constant: its ``#:`` comment or the string after its assignment,
  found in whichever jaxcomm module defines it; its value when short.

  (autodoc would show the docstring of the value's type, e.g. ``dict``'s,
  for a constant defined in another module than the one it is shown in.)"""
  name = qualname.rsplit(".", 1)[1]
  doc = None
  for modname, module in sorted(sys.modules.items()):
    if (not modname.startswith("jaxcomm") or module is None
        or getattr(module, name, _MISSING) is not obj):
      continue
    try:
      docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
    except PycodeError:
      continue
    if ("", name) in docs:
      doc = "\n".join(docs[("", name)]).strip()
      break
  modname = qualname.rsplit(".", 1)[0]
  text = f".. py:data:: {name}\n   :module: {modname}\n"
  value = object_description(obj)
  if len(value) <= 70 and "\n" not in value:
    text += f"   :value: {value}\n"
  text += "\n"
  if doc:
    text += indent(doc) + "\n"
  return text


_MISSING = object()


def summary_table(module, names: list[str]) -> str:
  """An autosummary of the functions, classes and modules among ``names``
  (relative to the current module), and a list of its constants (whose
  summary autosummary would take from their type)."""
  code = [n for n in names if is_code(getattr(module, n))]
  data = [n for n in names if n not in code]
  out = ""
  if code:
    out += (".. autosummary::\n   :nosignatures:\n\n"
            + "".join(f"   {n}\n" for n in code) + "\n")
  if data:
    out += ("Constants: " + ", ".join(f":data:`{n}`" for n in data)
            + ".\n\n")
  return out


def is_code(obj) -> bool:
  return (isinstance(obj, types.ModuleType) or inspect.isclass(obj)
          or callable(obj))


# --------------------------------------------------------------------------
# api/


def _family_page(family: str, methods: list, described: str,
                 extras: dict[str, list[str]]) -> str:
  import jaxcomm  # pylint: disable=import-outside-toplevel
  page, title = FAMILY_PAGES.get(family, (family, family.capitalize()))
  del page
  out = [GENERATED_HEADER, heading(title, "=", over=True),
         ".. currentmodule:: jaxcomm\n\n",
         rst_text(mark_code(described[:1].upper() + described[1:]))
         + ".\n\n"]

  # Sections: the family package each method's module is in (quantize,
  # sparsify, lowrank; local, gossip), in the order in which the registry
  # first names one of its methods.
  sections: dict = {}
  for m in methods:
    sections.setdefault(package_of(m), []).append(m)
  rows = []
  for m in methods:
    rows.append(f"   * - :func:`~jaxcomm.{m.attr}`\n"
                f"     - {rst_text(m.summary) or '..'}\n"
                f"     - {rst_text(m.paper)}\n")
  out.append(".. list-table:: In the registry's order\n"
             "   :header-rows: 1\n   :widths: 18 52 30\n\n"
             "   * - factory\n     - what it does\n     - paper\n"
             + "".join(rows) + "\n")

  for package, members in sections.items():
    level = "-"
    if len(sections) > 1:
      short = package.rsplit(".", 1)[-1]
      kind = getattr(members[0], "kind", None)
      title = PACKAGE_TITLES.get(short) or KIND_TITLES.get(kind) or short
      out.append(heading(title, "-"))
      level = "~"
    # The package's docstring introduces its methods (and is the target of
    # :mod:`jaxcomm.transforms.<package>`).
    out.append(f".. automodule:: {package}\n\n"
               ".. currentmodule:: jaxcomm\n\n")
    for m in members:
      if getattr(jaxcomm, m.attr, None) is not m.factory:
        logger.warning("registered method %s is not jaxcomm.%s", m.name,
                       m.attr, type="jaxcomm", subtype="registry")
      out.append(heading(m.attr, level))
      facts = [f"Paper: {rst_text(m.paper)}."]
      if m.aliases:
        facts.append("Also called " + ", ".join(f"``{a}``" for a in m.aliases)
                     + " on the command line.")
      if m.name != m.attr:
        facts.append(f"Registered as ``{m.name}``.")
      out.append(" ".join(facts) + "\n\n")
      out.append(directive_for(f"jaxcomm.{m.attr}", m.factory))
      for extra in extras.get(m.attr, []):
        out.append(directive_for(f"jaxcomm.{extra}", getattr(jaxcomm, extra)))
  return "".join(out)


def package_of(m) -> str:
  """The package whose (private) module defines method ``m``'s factory."""
  modname = inspect.unwrap(m.factory).__module__
  head, _, last = modname.rpartition(".")
  return head if last.startswith("_") and head else modname


def _module_page(modname: str) -> str:
  module = importlib.import_module(modname)
  names = public_names(module)
  out = [GENERATED_HEADER, heading(f"``{modname}``", "=", over=True),
         f".. automodule:: {modname}\n\n", f".. currentmodule:: {modname}\n\n"]
  if modname == "jaxcomm.registry":
    out.append(_registry_table())
  out.append(heading("Contents", "-"))
  out.append(summary_table(module, names))
  # Submodules in __all__ come last, each a section of its own.
  names = sorted(names, key=lambda n: isinstance(getattr(module, n),
                                                 types.ModuleType))
  for n in names:
    out.append(directive_for(f"{modname}.{n}", getattr(module, n)))
  return "".join(out)


def _registry_table() -> str:
  from jaxcomm import registry  # pylint: disable=import-outside-toplevel
  rows = []
  for m in registry.methods():
    page = FAMILY_PAGES.get(m.family, (m.family,))[0]
    kind = getattr(m, "kind", None)
    rows.append(f"   * - :func:`{m.name} <jaxcomm.{m.attr}>`\n"
                f"     - :doc:`{m.family} <{page}>`"
                + (f" ({kind})" if kind else "") + "\n"
                f"     - {rst_text(m.paper)}\n")
  return (heading("Registered methods", "-")
          + "Every method of :func:`jaxcomm.registry.methods`, in its "
            "order.\n\n"
          + ".. list-table::\n   :header-rows: 1\n   :widths: 25 25 50\n\n"
            "   * - method\n     - family\n     - paper\n"
          + "".join(rows) + "\n")


def _core_page(names: list[str]) -> str:
  out = [GENERATED_HEADER, heading("``jaxcomm``: the core", "=", over=True),
         ".. automodule:: jaxcomm\n\n", ".. currentmodule:: jaxcomm\n\n",
         "The names of ``jaxcomm`` that are not a registered method (those "
         "are on the family pages) nor a module (:doc:`index`).\n\n"]
  import jaxcomm  # pylint: disable=import-outside-toplevel
  out.append(summary_table(jaxcomm, names))
  for n in names:
    out.append(directive_for(f"jaxcomm.{n}", getattr(jaxcomm, n)))
  return "".join(out)


def _api_index(families: list[str]) -> str:
  from jaxcomm import _registry  # pylint: disable=import-outside-toplevel
  from jaxcomm import registry  # pylint: disable=import-outside-toplevel
  out = [GENERATED_HEADER, heading("API reference", "=", over=True),
         "Every method is a factory on ``jaxcomm`` (``jaxcomm.powersgd``), "
         "listed on the page of its family in the order of "
         ":mod:`jaxcomm.registry`; the names every method is built from are "
         "on :doc:`core`, and each public module has a page of its "
         "own.\n\n",
         heading("Methods by family", "-")]
  for fam in families:
    page, title = FAMILY_PAGES.get(fam, (fam, fam.capitalize()))
    count = len(registry.methods(fam))
    desc = _registry.FAMILIES.get(fam, "")
    out.append(f"* :doc:`{page}` ({count}): {rst_text(mark_code(desc))}\n")
  out.append("\n" + heading("Modules", "-"))
  out.append("* :doc:`core`: ``jaxcomm``'s own names\n")
  for modname, blurb in MODULES:
    out.append(f"* :doc:`{modname.split('.')[-1]}`: :mod:`{modname}`, "
               f"{blurb[:1].lower()}{blurb[1:]}\n")
  out.append("\n" + heading("Where the methods live", "-"))
  out.append("Each family package's names are documented under "
             "``jaxcomm``, on its family's page.\n\n"
             ".. automodule:: jaxcomm.transforms\n\n")
  pages = [FAMILY_PAGES.get(f, (f,))[0] for f in families]
  pages += ["core"] + [m.split(".")[-1] for m, _ in MODULES]
  out.append("\n.. toctree::\n   :hidden:\n\n"
             + "".join(f"   {p}\n" for p in pages))
  return "".join(out)


def api_pages() -> dict[str, str]:
  """{path under api/: text}: every page of the API reference."""
  import jaxcomm  # pylint: disable=import-outside-toplevel
  from jaxcomm import _registry  # pylint: disable=import-outside-toplevel
  from jaxcomm import registry  # pylint: disable=import-outside-toplevel

  methods = registry.methods()
  method_attrs = {m.attr for m in methods}
  top = public_names(jaxcomm)
  top_set = set(top)

  # Names a method's module exports beside its factory (its state type)
  # are documented after the factory, on the family page.
  extras: dict[str, list[str]] = {}
  placed: set[str] = set()
  for m in methods:
    wrapped = inspect.unwrap(m.factory)
    module = inspect.getmodule(wrapped)
    for n in getattr(module, "__all__", ()):
      if (n in top_set and n not in method_attrs and n not in placed
          and not isinstance(getattr(jaxcomm, n, None), types.ModuleType)):
        extras.setdefault(m.attr, []).append(n)
        placed.add(n)

  families = []
  for m in methods:
    if m.family not in families:
      families.append(m.family)
  pages = {}
  for fam in families:
    page = FAMILY_PAGES.get(fam, (fam,))[0]
    pages[f"{page}.rst"] = _family_page(
        fam, registry.methods(fam), _registry.FAMILIES.get(fam, fam), extras)
  core = [n for n in top if n not in method_attrs and n not in placed
          and not isinstance(getattr(jaxcomm, n, None), types.ModuleType)
          and n != "__version__"]
  pages["core.rst"] = _core_page(core)
  for modname, _ in MODULES:
    pages[f"{modname.split('.')[-1]}.rst"] = _module_page(modname)
  pages["index.rst"] = _api_index(families)
  return pages


# --------------------------------------------------------------------------
# examples/


def _example_page(path: pathlib.Path, rel: str) -> tuple[str, str]:
  """(title, page) for one example script: its docstring, then its code
  after the docstring."""
  source = path.read_text(encoding="utf-8")
  doc, code_from = "", 1
  try:
    tree = ast.parse(source)
  except SyntaxError:
    tree = None
  if tree is not None:
    doc = ast.get_docstring(tree) or ""
    if doc and tree.body:
      code_from = tree.body[0].end_lineno + 1
  lines = doc.strip().splitlines()
  first = lines[0].strip() if lines else path.stem
  # "DiLoCo with a compressed pseudo-gradient: 4-bit codes, every 20 steps"
  # is titled by what comes before the colon; the whole line opens the page.
  title = first.split(": ", 1)[0].rstrip(".")
  body = "\n".join(lines[1:]).strip()
  out = [GENERATED_HEADER, heading(title, "=", over=True)]
  if title != first.rstrip("."):
    out.append(first + "\n\n")
  if body:
    out.append(body + "\n\n")
  total = len(source.splitlines())
  while code_from <= total and not source.splitlines()[code_from - 1].strip():
    code_from += 1
  out.append(f".. literalinclude:: {rel}\n   :language: python\n"
             f"   :caption: examples/{path.name}\n   :linenos:\n"
             f"   :lines: {code_from}-\n   :lineno-start: {code_from}\n\n")
  return title, "".join(out)


def example_pages(repo: pathlib.Path, outdir: pathlib.Path
                  ) -> dict[str, str]:
  scripts = sorted(p for p in (repo / "examples").glob("*.py")
                   if not p.name.startswith("_"))
  pages = {}
  entries = []
  for p in scripts:
    rel = os.path.relpath(p, outdir).replace(os.sep, "/")
    _, text = _example_page(p, rel)
    pages[f"{p.stem}.rst"] = text
    entries.append(p.stem)
  index = [GENERATED_HEADER, heading("Examples", "=", over=True),
           "Complete scripts under ``examples/`` in the repository; each "
           "page shows the script's docstring and its code.\n\n"]
  if not entries:
    index.append("No example scripts yet.\n")
  for stem in entries:
    index.append(f"* :doc:`{stem}`: ``examples/{stem}.py``\n")
  if entries:
    index.append("\n.. toctree::\n   :hidden:\n\n"
                 + "".join(f"   {stem}\n" for stem in entries))
  pages["index.rst"] = "".join(index)
  return pages


# --------------------------------------------------------------------------
# Writing the folders


def write_folder(folder: pathlib.Path, pages: dict[str, str]) -> None:
  """Writes ``pages`` under ``folder``: a file only when its text changed;
  removes the .rst files there that ``pages`` no longer holds."""
  folder.mkdir(parents=True, exist_ok=True)
  for old in folder.glob("*.rst"):
    if old.name not in pages:
      old.unlink()
  for name, text in pages.items():
    path = folder / name
    if not path.exists() or path.read_text(encoding="utf-8") != text:
      path.write_text(text, encoding="utf-8")


def generate(app) -> None:
  src = pathlib.Path(app.srcdir)
  repo = src.parent
  write_folder(src / "api", api_pages())
  write_folder(src / "examples", example_pages(repo, src / "examples"))


# --------------------------------------------------------------------------
# Benchmark pages: one title, headings one level apart

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def normalize_headings(text: str, title: str | None) -> str:
  """``text`` (Markdown) with one H1 and no heading more than one level
  below the one before it.

  The title is ``title`` when given, else the page's first heading when the
  page opens with one (it is promoted), else nothing is changed."""
  lines = text.splitlines()
  fenced = False
  heads = []  # (line index, level, text)
  for i, line in enumerate(lines):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      m = _HEADING.match(line)
      if m:
        heads.append((i, len(m.group(1)), m.group(2)))
  first_text = next((i for i, line in enumerate(lines) if line.strip()), None)
  if title is None:
    if heads and heads[0][0] == first_text:
      i, _, title = heads.pop(0)
      lines[i] = ""
    else:
      return text
  if heads:
    low = min(level for _, level, _ in heads)
    prev = 1
    for i, level, head in heads:
      new = min(level - low + 2, prev + 1)
      lines[i] = "#" * new + " " + head
      prev = new
  return "# " + title + "\n\n" + "\n".join(lines) + "\n"


def on_source_read(app, docname: str, source: list[str]) -> None:
  del app
  if not docname.startswith("benchmarks/"):
    return
  source[0] = normalize_headings(source[0], BENCHMARK_TITLES.get(docname))


# --------------------------------------------------------------------------
# Inline code that names a page or an object becomes a link

_PATH = re.compile(r"[\w./-]+\.md|docs/benchmarks/?")
_NAME = re.compile(r"((?:jaxcomm\.)?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
                   r"(\(.*\))?")


def _page_for(text: str, docname: str, env) -> str | None:
  """The docname ``text`` (a path written in a page) names, or None."""
  text = text.strip()
  if text.rstrip("/") in ("docs/benchmarks", "benchmarks"):
    return "guides/benchmarks"
  if text in REPO_PAGES:
    return REPO_PAGES[text]
  here = posix_dirname(docname)
  candidates = []
  stem = text[:-3]
  if stem.startswith("docs/"):
    candidates.append(stem[len("docs/"):])
  candidates += [posix_join(here, stem), stem, "benchmarks/" + stem]
  for c in candidates:
    c = os.path.normpath(c).replace(os.sep, "/")
    if c in env.found_docs:
      return c
  return None


def posix_dirname(docname: str) -> str:
  return docname.rsplit("/", 1)[0] if "/" in docname else ""


def posix_join(a: str, b: str) -> str:
  return f"{a}/{b}" if a else b


def _object_for(text: str, objects) -> tuple[str, object] | None:
  m = _NAME.fullmatch(text.strip())
  if not m:
    return None
  name, call = m.group(1), m.group(2)
  if "." not in name and not call:
    return None  # a bare word: too often not the object
  for full in (name, "jaxcomm." + name):
    if full in objects:
      return full, objects[full]
  return None


def on_doctree_resolved(app, doctree, docname: str) -> None:
  env = app.env
  objects = env.get_domain("py").objects
  for literal in list(doctree.findall(nodes.literal)):
    if _inside(literal, (nodes.reference, nodes.title, nodes.literal_block,
                         nodes.FixedTextElement)):
      continue
    if any(isinstance(a, nodes.Element) and a.tagname == "desc_signature"
           for a in _ancestors(literal)):
      continue
    text = literal.astext()
    uri = None
    if _PATH.fullmatch(text.strip()):
      target = _page_for(text, docname, env)
      if target is not None and target != docname:
        uri = app.builder.get_relative_uri(docname, target)
    else:
      found = _object_for(text, objects)
      if found is not None:
        full, entry = found
        uri = app.builder.get_relative_uri(docname, entry.docname)
        if entry.docname == docname:
          uri = ""
        uri += "#" + entry.node_id
    if uri is None:
      continue
    ref = nodes.reference("", "", internal=True, refuri=uri)
    literal.replace_self(ref)
    ref.append(literal)


def _ancestors(node):
  node = node.parent
  while node is not None:
    yield node
    node = node.parent


def _inside(node, classes) -> bool:
  return any(isinstance(a, classes) for a in _ancestors(node))


# --------------------------------------------------------------------------
# viewcode's links back from a source page to the documentation


def fix_viewcode_backlinks(app) -> list:
  """Points each source page's "[docs]" links at anchors that exist.

  viewcode links every object of a source module to ``<refname>.<name>``,
  one ``refname`` per module: the module under which it first saw one of
  its objects documented. jaxcomm documents objects under the public name
  that re-exports them (``jaxcomm.kernels.pack_signs`` for
  ``jaxcomm/kernels/bitpack.py``), some under two. This picks, per source
  module, the public module under which most of its objects are documented
  and drops the links of objects that are not documented under it."""
  entries = getattr(app.env, "_viewcode_modules", {})
  objects = app.env.get_domain("py").objects
  for modname, entry in list(entries.items()):
    if not isinstance(entry, tuple):
      continue
    code, tags, used, refname = entry
    counts: dict[str, int] = {}
    for full in objects:
      for name in used:
        if full.endswith("." + name):
          prefix = full[:-len(name) - 1]
          counts[prefix] = counts.get(prefix, 0) + 1
    if counts:
      refname = max(counts, key=lambda p: (counts[p], p == refname))
    used = {n: d for n, d in used.items() if f"{refname}.{n}" in objects}
    entries[modname] = (code, tags, used, refname)
  return []


def setup(app):
  app.connect("builder-inited", generate)
  app.connect("source-read", on_source_read)
  app.connect("doctree-resolved", on_doctree_resolved)
  # Before viewcode writes its pages (it connects at the default 500).
  app.connect("html-collect-pages", fix_viewcode_backlinks, priority=100)
  return {"version": "1", "parallel_read_safe": True,
          "parallel_write_safe": True}
