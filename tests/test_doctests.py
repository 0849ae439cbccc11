"""The ``>>>`` examples in jaxcomm's docstrings run, on the 8 CPU devices
conftest made."""

import doctest
import importlib
import pkgutil

import pytest

import jaxcomm


def _modules_with_examples() -> list[str]:
  out = []
  for info in pkgutil.walk_packages(jaxcomm.__path__, "jaxcomm."):
    if info.name.endswith("__main__"):
      continue
    module = importlib.import_module(info.name)
    if ">>>" in (importlib.util.find_spec(info.name).loader
                 .get_source(info.name) or ""):
      out.append(module.__name__)
  return sorted(out)


MODULES = _modules_with_examples()


def test_examples_are_found():
  """The walk finds the modules known to hold examples (a moved module is
  still found; an empty list would make the test below vacuous)."""
  assert {"jaxcomm.registry", "jaxcomm.advise"} <= set(MODULES), MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS
                           | doctest.NORMALIZE_WHITESPACE, verbose=False)
  assert result.attempted > 0, f"{name}: no example ran"
  assert result.failed == 0, f"{name}: {result.failed} example(s) failed"
