"""Every public name of jaxcomm is documented to the docstring contract.

The public surface is the literal ``__all__`` of ``jaxcomm``,
``jaxcomm.transforms`` and its family packages (found by walking the
package, not listed here), ``jaxcomm.parallel``, ``jaxcomm.collectives``,
``jaxcomm.wire``, ``jaxcomm.aot``, ``jaxcomm.advise``, ``jaxcomm.registry``
and ``jaxcomm.kernels``. For each public function, class and public method
of a public class:

1. a docstring that ``help()`` shows (``__doc__`` set), written as one
   literal in the source (nothing appended at import time), a one-line
   summary then a blank line;
2. ``Args:`` with an entry for every parameter of ``inspect.signature``
   (``*args:`` / ``**kwargs:`` for the variadic ones); the keyword options
   :func:`jaxcomm._compressor.shared_options` adds to a factory's signature
   are covered by one ``**options:`` entry naming each in double
   back-ticks and :func:`jaxcomm.compressed`; a class's constructor
   parameters (a NamedTuple's fields) in ``Args:`` or ``Attributes:``;
3. ``Returns:`` (or ``Yields:``) unless annotated ``-> None``;
4. ``Raises:`` with at least one entry where the function raises: its
   source holds a ``raise``, calls ``_checks.*`` or a ``check_*`` /
   ``_check_*`` helper, or it is a registered method (every registered
   method validates its arguments);
5. every registered method has an ``Examples:`` section whose ``>>>``
   lines run it across devices (``shard_map``, ``DataParallel`` or
   ``pmap``); tests/test_doctests.py runs them. An ``Examples:`` section
   holds ``>>>`` lines, and no docstring keeps an old ``Example::``
   literal block.

The sections are read by a small Google-style parser written here (headers
at the docstring's base indent, entries at the next indent), independent
of any documentation tool. A failure lists exactly what a name misses.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
import textwrap
import types

import pytest

import jaxcomm
import jaxcomm.aot
import jaxcomm.kernels
import jaxcomm.transforms
from jaxcomm import _compressor
from jaxcomm import registry

CORE_MODULES = ("jaxcomm", "jaxcomm.transforms", "jaxcomm.parallel",
                "jaxcomm.collectives", "jaxcomm.wire", "jaxcomm.aot",
                "jaxcomm.advise", "jaxcomm.registry", "jaxcomm.kernels")

# What shared_options adds to a compressor factory's signature.
SHARED_OPTIONS = ("start_step", "clip_norm", "momentum", "momentum_masking",
                  "lr_schedule", "residual_decay", "shift_rate")

_HEADERS = ("Args", "Arguments", "Attributes", "Returns", "Return", "Yields",
            "Raises", "Examples", "Example", "Note", "Notes", "References",
            "See Also", "Warning", "Warnings", "Todo")
_HEADER_RE = re.compile(r"^(%s):\s*$" % "|".join(_HEADERS))
_ENTRY_RE = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)\s*(\([^)]*\))?\s*:(\s|$)")


# ------------------------------------------------------- section parsing --

def parse_sections(doc: str) -> dict[str, list[tuple[str, str]]]:
  """A Google-style docstring's sections: header -> ``[(entry, text)]``.

  Headers are lines ``Name:`` at the docstring's base indent; a section
  runs to the next line back at that indent. Entries are the lines of the
  section at its first line's indent that read ``name:`` or ``name
  (type):``; an entry's text is its line and the more indented lines
  after it. A section without such entries (``Returns:`` prose) gets one
  entry named ``""`` holding its whole text.
  """
  lines = inspect.cleandoc(doc).splitlines()
  out: dict[str, list[tuple[str, str]]] = {}
  i = 0
  while i < len(lines):
    m = _HEADER_RE.match(lines[i])
    if not m:
      i += 1
      continue
    body = []
    i += 1
    while i < len(lines) and (not lines[i].strip()
                              or lines[i][0] in " \t"):
      body.append(lines[i])
      i += 1
    while body and not body[-1].strip():
      body.pop()
    entries: list[tuple[str, str]] = []
    indents = [len(b) - len(b.lstrip()) for b in body if b.strip()]
    if indents:
      base = indents[0]
      for b in body:
        stripped = b.strip()
        indent = len(b) - len(b.lstrip())
        e = _ENTRY_RE.match(stripped) if indent == base else None
        if e:
          entries.append((e.group(1), stripped))
        elif entries:
          entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + stripped)
      if not entries:
        entries = [("", "\n".join(b.strip() for b in body))]
    out.setdefault(m.group(1), []).extend(entries)
  return out


def test_parser_reads_google_sections():
  """The parser itself, on a docstring written for it."""
  doc = textwrap.dedent('''\
      Summary.

      Args:
        x: the input; its text
          goes on here (y: not an entry).
        *args: more.
        **options: ``a``, ``b``.
      Returns:
        The result.

      Raises:
        ValueError: when x is bad.
        jax.errors.ConcretizationTypeError: when traced.
      Examples:
        >>> 1 + 1
        2
      ''')
  s = parse_sections(doc)
  assert [n for n, _ in s["Args"]] == ["x", "*args", "**options"]
  assert "goes on here" in s["Args"][0][1]
  assert s["Returns"] == [("", "The result.")]
  assert [n for n, _ in s["Raises"]] == [
    "ValueError", "jax.errors.ConcretizationTypeError"]
  assert ">>> 1 + 1" in s["Examples"][0][1]
  assert parse_sections("One line.") == {}


# ----------------------------------------------------------- the surface --

def _family_packages() -> list[str]:
  """The public modules under jaxcomm.transforms (family packages)."""
  return sorted(
    f"jaxcomm.transforms.{info.name}"
    for info in pkgutil.iter_modules(jaxcomm.transforms.__path__)
    if not info.name.startswith("_"))


def public_modules() -> list[str]:
  """The core public modules and the family packages."""
  return list(CORE_MODULES) + _family_packages()


MODULES = public_modules()


def _specificity(module: str) -> tuple:
  """Where a name shared by several modules is reported: its most
  specific module (a family package before jaxcomm.transforms before
  jaxcomm)."""
  return (-module.count("."), module)


def public_names() -> dict[str, object]:
  """``"module.name"`` (and ``"module.Class.method"``) -> object, each
  object once, under its most specific public module."""
  out: dict[str, object] = {}
  seen: set[int] = set()
  for mod_name in sorted(MODULES, key=_specificity):
    module = importlib.import_module(mod_name)
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name, None)
      if obj is None or isinstance(obj, types.ModuleType) or id(obj) in seen:
        continue
      if not (callable(obj) or inspect.isclass(obj)):
        continue                       # constants: documented in prose
      seen.add(id(obj))
      out[f"{mod_name}.{name}"] = obj
      if inspect.isclass(obj):
        for attr, member in _public_methods(obj):
          out[f"{mod_name}.{name}.{attr}"] = member
  return out


def _public_methods(cls) -> list[tuple[str, object]]:
  """The public methods and properties ``cls`` itself defines."""
  out = []
  for attr, raw in vars(cls).items():
    if attr.startswith("_"):
      continue
    if isinstance(raw, (staticmethod, classmethod)):
      raw = raw.__func__
    if isinstance(raw, (property, functools.cached_property)):
      out.append((attr, raw))
    elif inspect.isfunction(raw) and raw.__module__.startswith("jaxcomm"):
      out.append((attr, raw))
  return out


NAMES = public_names()
REGISTERED = {id(m.factory): m.name for m in registry.methods()}


def test_surface_is_found():
  """The walk finds the modules and names known to be public (an empty
  list would make the tests below vacuous)."""
  assert {"jaxcomm", "jaxcomm.parallel", "jaxcomm.collectives",
          "jaxcomm.wire", "jaxcomm.aot", "jaxcomm.advise",
          "jaxcomm.registry", "jaxcomm.kernels"} <= set(MODULES), MODULES
  found = [id(obj) for obj in NAMES.values()]
  for obj in (jaxcomm.compressed, jaxcomm.powersgd, jaxcomm.LeafPolicy,
              jaxcomm.parallel.DataParallel, jaxcomm.registry.get):
    assert id(obj) in found, obj
  assert len(REGISTERED) > 30
  # The options this test expects one **options entry to name are the
  # ones shared_options adds.
  assert tuple(n for n, _ in _compressor.SHARED_OPTIONS) == SHARED_OPTIONS


def test_top_level_exports_every_factory():
  """``jaxcomm`` lists every name of ``jaxcomm.transforms`` (a new factory
  needs its line in jaxcomm/__init__.py too)."""
  missing = sorted(set(jaxcomm.transforms.__all__) - set(jaxcomm.__all__))
  assert not missing, f"not in jaxcomm.__all__: {missing}"
  for name in jaxcomm.transforms.__all__:
    assert getattr(jaxcomm, name) is getattr(jaxcomm.transforms, name), name


# -------------------------------------------------------- literal __all__ --

def _all_problems(module_name: str) -> list[str]:
  module = importlib.import_module(module_name)
  spec = importlib.util.find_spec(module_name)
  tree = ast.parse(spec.loader.get_source(module_name))
  problems = []
  if not (module.__doc__ or "").strip():
    problems.append("no module docstring")
  assigns = []
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
      targets = [node.target]
    if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
      assigns.append(node)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "__all__"):
      problems.append(f"__all__.{node.func.attr}(...) on line {node.lineno}")
    if isinstance(node, ast.ImportFrom) and any(
        a.name == "*" for a in node.names):
      problems.append(f"wildcard import on line {node.lineno}")
  if len(assigns) != 1:
    problems.append(f"__all__ is assigned {len(assigns)} times (want once)")
  for node in assigns:
    value = getattr(node, "value", None)
    if not (isinstance(node, (ast.Assign, ast.AnnAssign))
            and isinstance(value, (ast.List, ast.Tuple))
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                    for e in value.elts)):
      problems.append(f"__all__ on line {node.lineno} is not a literal list "
                      "of strings")
  names = list(getattr(module, "__all__", []))
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    problems.append(f"__all__ lists {dupes} twice")
  absent = [n for n in names if not hasattr(module, n)]
  if absent:
    problems.append(f"__all__ lists {absent}, which do not exist")
  undocumented = [n for n in names
                  if isinstance(getattr(module, n, None), types.ModuleType)
                  and not (getattr(module, n).__doc__ or "").strip()]
  if undocumented:
    problems.append(f"modules without a docstring in __all__: {undocumented}")
  internal = [n for n in names if n == "main" or n.endswith("_pallas")]
  if internal:
    problems.append(f"internal names in __all__: {internal}")
  return problems


@pytest.mark.parametrize("module_name", MODULES)
def test_literal_all(module_name):
  problems = _all_problems(module_name)
  assert not problems, f"{module_name}:\n  " + "\n  ".join(problems)


# ------------------------------------------------------- the docstrings --

def _source_tree(obj):
  """The AST of ``obj``'s own source (decorators unwrapped), or None."""
  try:
    src = inspect.getsource(inspect.unwrap(obj))
  except (OSError, TypeError):
    return None
  return ast.parse(textwrap.dedent(src))


def _literal_docstring(obj) -> str | None:
  """The docstring written in ``obj``'s source (decorators unwrapped), or
  None when the source cannot be read."""
  tree = _source_tree(obj)
  if tree is None or not tree.body or not isinstance(
      tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return None
  return ast.get_docstring(tree.body[0], clean=True) or ""


def _raises(tree) -> bool:
  """Whether source raises: a ``raise``, a ``_checks.*`` call, or a call
  of a ``check_*`` / ``_check_*`` helper."""
  if tree is None:
    return False
  for node in ast.walk(tree):
    if isinstance(node, ast.Raise):
      return True
    if isinstance(node, ast.Call):
      f = node.func
      if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
          and f.value.id == "_checks"):
        return True
      name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
      if re.match(r"^_?check(_|$)", name):
        return True
  return False


_LITERAL_RE = re.compile(r"``[^`]*``|:\w+:`[^`]*`|`[^`]*`")


_BUILTIN_TYPES = frozenset({"int", "float", "str", "bool", "bytes", "list",
                            "dict", "tuple", "set", "frozenset", "None"})


def _typed_returns(sections) -> str | None:
  """The text Sphinx would read as a return *type*, if it is prose.

  Napoleon splits the first line of ``Returns:`` at its first single
  colon outside literals and roles, and makes what precedes it the return
  type, which nitpicky mode resolves as a class name. None when there is
  no such colon, or only a literal, a role or a builtin type before it.
  """
  for head in ("Returns", "Return", "Yields"):
    for _, text in sections.get(head, [])[:1]:
      first = text.splitlines()[0] if text else ""
      masked = _LITERAL_RE.sub(lambda m: "\0" * len(m.group()), first)
      m = re.search(r"(?<!:):(?!:)", masked)
      if m:
        before = masked[:m.start()].replace("\0", "").strip(" ,.()")
        if before and before not in _BUILTIN_TYPES:
          return first[:m.start()]
  return None


def _returns_none(obj) -> bool:
  ann = inspect.signature(obj).return_annotation
  return ann is None or ann == "None"


def _entries(sections, *headers) -> dict[str, str]:
  return {n: t for h in headers for n, t in sections.get(h, []) if n}


def _check_args(want: list[str], added: list[str], sections,
                where: str) -> list[str]:
  """Problems of the ``Args:`` (and, for classes, ``Attributes:``)
  entries against the parameter names ``want``; ``added``: the options
  shared_options put in the signature, for one ``**options:`` entry."""
  problems = []
  heads = ("Args", "Arguments") + (("Attributes",) if where == "class"
                                  else ())
  have = _entries(sections, *heads)
  missing = [p for p in want if p not in have]
  if missing:
    problems.append(f"{'/'.join(heads[::2])}: no entry for "
                    f"{', '.join(missing)}")
  shared = [p for p in added if p not in have]
  if shared:
    text = have.get("**options")
    if text is None:
      problems.append("Args: no **options entry for the shared options "
                      f"({', '.join(shared)})")
    else:
      unnamed = [p for p in shared if f"``{p}``" not in text]
      if unnamed:
        problems.append("Args: **options does not name "
                        + ", ".join(f"``{p}``" for p in unnamed))
      if ":func:`jaxcomm.compressed`" not in text:
        problems.append("Args: **options does not say they are forwarded "
                        "to :func:`jaxcomm.compressed`")
  if where != "class":
    known = set(want) | ({"**options"} if added else set())
    unknown = [n for n in _entries(sections, "Args", "Arguments")
               if n not in known]
    if unknown:
      problems.append(f"Args documents {', '.join(unknown)}, which the "
                      "signature does not have")
  return problems


def _parameters(obj, *, skip_first: bool) -> tuple[list[str], list[str]]:
  """``(names, added)``: the documented names of ``obj``'s parameters
  (``*args`` / ``**kwargs`` spelled so), and those shared_options added."""
  params = list(inspect.signature(obj).parameters.values())
  if skip_first and params and params[0].name in ("self", "cls"):
    params = params[1:]
  own = set()
  try:
    own = set(inspect.signature(inspect.unwrap(obj),
                                follow_wrapped=False).parameters)
  except (TypeError, ValueError):
    pass
  names, added = [], []
  for p in params:
    if p.kind is p.VAR_POSITIONAL:
      names.append("*" + p.name)
    elif p.kind is p.VAR_KEYWORD:
      names.append("**" + p.name)
    elif p.name in SHARED_OPTIONS and p.name not in own:
      added.append(p.name)
    else:
      names.append(p.name)
  return names, added


def _class_parameters(cls) -> list[str]:
  """A class's constructor parameters (none for a Protocol)."""
  if getattr(cls, "_is_protocol", False):
    return []
  try:
    params = inspect.signature(cls).parameters.values()
  except (TypeError, ValueError):
    return []
  return [("*" if p.kind is p.VAR_POSITIONAL else "**"
           if p.kind is p.VAR_KEYWORD else "") + p.name for p in params]


def _class_raises(cls) -> bool:
  """Whether the constructor a class defines raises."""
  for attr in ("__init__", "__new__", "__post_init__"):
    fn = vars(cls).get(attr)
    if isinstance(fn, staticmethod):
      fn = fn.__func__
    if (inspect.isfunction(fn) and fn.__module__.startswith("jaxcomm")
        and _raises(_source_tree(fn))):
      return True
  return False


def problems_of(qualname: str, obj) -> list[str]:
  """What ``obj``'s docstring misses of the contract."""
  is_property = isinstance(obj, (property, functools.cached_property))
  doc = obj.__doc__ if not is_property else (
    obj.fget.__doc__ if isinstance(obj, property) else obj.__doc__)
  if not (doc or "").strip():
    return ["no docstring (help() shows none: __doc__ is empty; a "
            "docstring must be one string literal)"]
  problems = []
  literal = _literal_docstring(obj.fget if isinstance(obj, property)
                               else obj)
  if literal is not None and literal != inspect.cleandoc(doc):
    problems.append("__doc__ differs from the docstring in the source "
                    "(text assembled or replaced at import time is "
                    "invisible to tools: write it in the docstring)")
  lines = inspect.cleandoc(doc).splitlines()
  if not lines[0].strip():
    problems.append("the first line is empty (want a one-line summary)")
  elif len(lines) > 1 and lines[1].strip():
    problems.append("the summary runs on to a second line (want one line, "
                    "then a blank line)")
  if re.search(r"^\s*Examples?::\s*$", doc, re.M):
    problems.append("an old 'Example::' literal block: make it an "
                    "'Examples:' doctest or remove it")
  sections = parse_sections(doc)
  for head in ("Examples", "Example"):
    for _, text in sections.get(head, []):
      if ">>>" not in text:
        problems.append(f"{head}: holds no '>>>' line")
  if is_property:
    return problems
  registered = id(obj) in REGISTERED
  if inspect.isclass(obj):
    problems += _check_args(_class_parameters(obj), [], sections, "class")
    if _class_raises(obj) and not _entries(sections, "Raises"):
      problems.append("Raises: missing (its constructor raises)")
    return problems
  names, added = _parameters(obj, skip_first=_is_method(qualname))
  problems += _check_args(names, added, sections, "function")
  if not _returns_none(obj) and not (sections.get("Returns")
                                     or sections.get("Return")
                                     or sections.get("Yields")):
    problems.append("Returns: missing (or annotate -> None)")
  typed = _typed_returns(sections)
  if typed:
    problems.append(f"Returns: {typed!r} reads as the return type (a "
                    "colon on the first line); write the type in ``...`` "
                    "or drop the colon")
  if (registered or _raises(_source_tree(obj))) and not _entries(
      sections, "Raises"):
    problems.append("Raises: missing" + (
      " (a registered method validates its arguments)" if registered
      else " (it raises, directly or through an argument check)"))
  if registered:
    examples = "\n".join(t for h in ("Examples", "Example")
                         for _, t in sections.get(h, []))
    if ">>>" not in examples:
      problems.append("Examples: missing (a registered method needs a "
                      "'>>>' example that runs it across devices)")
    elif not re.search(r"shard_map|DataParallel|pmap", examples):
      problems.append("Examples: does not run the method across devices "
                      "(shard_map, DataParallel or pmap)")
  return problems


def _is_method(qualname: str) -> bool:
  """Whether ``qualname`` names a method of a public class."""
  owner = qualname.rsplit(".", 1)[0]
  return owner in NAMES and inspect.isclass(NAMES[owner])


@pytest.mark.parametrize("qualname", sorted(NAMES))
def test_docstring_contract(qualname):
  problems = problems_of(qualname, NAMES[qualname])
  assert not problems, f"{qualname}:\n  " + "\n  ".join(problems)


def test_checker_finds_what_is_missing():
  """The checker flags a function that misses each part of the contract."""
  def bad(x, y, *rest, **options):
    """Does a thing
    over two lines.

    Args:
      x: the x.
      z: not a parameter.
    """
    if x:
      raise ValueError("x")
    return y

  problems = problems_of("m.bad", bad)
  text = "\n".join(problems)
  assert "summary runs on" in text
  assert "no entry for y, *rest, **options" in text
  assert "Args documents z" in text
  assert "Returns: missing" in text
  assert "Raises: missing" in text

  def good(x, **options) -> None:
    """Does a thing.

    Args:
      x: the x.
      **options: the rest.

    Raises:
      ValueError: when ``x`` is true.
    """
    if x:
      raise ValueError("x")

  assert problems_of("m.good", good) == []

  def assembled(x) -> None:
    """Does a thing.

    Args:
      x: the x.
    """
    del x

  assembled.__doc__ += "\n    Appended at import time."
  assert any("differs from the docstring in the source" in p
             for p in problems_of("m.assembled", assembled))
  assert problems_of("m.nodoc", lambda: None)[0].startswith("no docstring")
