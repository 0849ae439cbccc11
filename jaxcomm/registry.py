"""The one list of jaxcomm's methods: name, factory, family and paper.

Each public factory registers itself beside its definition with
``@_registry.method(paper=...)`` (:mod:`jaxcomm._registry`; its family,
and a compressor's kind, is the package of :mod:`jaxcomm.transforms` it
lives in); ``train.py`` (its ``--compressor``, ``--optimizer`` and ``--local``
choices), the benchmarks, the test battery and the README's tables
(``make docs``) all read this list.

  >>> import jaxcomm
  >>> m = jaxcomm.registry.get("topk")
  >>> tx = m.make(ratio=0.001)           # the factory, defaults filled in
  >>> jaxcomm.registry.names("compressor")[:2]
  ['dense', 'cast']
  >>> "ratio" in m.static_args           # it sets k: static under injection
  True
"""

from __future__ import annotations

from typing import Callable

# Importing the families registers their methods.
from jaxcomm import transforms as _transforms  # noqa: F401
from jaxcomm._registry import COMMON_KEYWORDS  # noqa: F401
from jaxcomm._registry import FAMILIES
from jaxcomm._registry import KINDS  # noqa: F401
from jaxcomm._registry import Method
from jaxcomm._registry import derive_static_args  # noqa: F401
from jaxcomm._registry import method  # noqa: F401
from jaxcomm._registry import registered

__all__ = [
  "FAMILIES",
  "KINDS",
  "Method",
  "get",
  "lookup",
  "method",
  "methods",
  "names",
]


def methods(family: str | None = None) -> list[Method]:
  """Every method, or those of one family, in table order.

  Args:
    family: None for every method, or a key of :data:`FAMILIES`
      (``"compressor"``, ``"optimizer"``, ``"local"``, ``"delay"``).

  Returns:
    A list of :class:`Method`.

  Raises:
    ValueError: when ``family`` is not a key of :data:`FAMILIES`.

  Examples:
    >>> import jaxcomm
    >>> optimizers = jaxcomm.registry.methods("optimizer")
    >>> "onebit_adam" in [m.name for m in optimizers]
    True
    >>> {m.family for m in optimizers}
    {'optimizer'}
  """
  if family is not None and family not in FAMILIES:
    raise ValueError(f"family must be one of {sorted(FAMILIES)}, got "
                     f"{family!r}")
  return [m for m in registered() if family is None or m.family == family]


def names(family: str | None = None) -> list[str]:
  """The names of :func:`methods`.

  Args:
    family: None for every method, or a key of :data:`FAMILIES`.

  Returns:
    A list of str, in table order.

  Raises:
    ValueError: when ``family`` is not a key of :data:`FAMILIES`.
  """
  return [m.name for m in methods(family)]


def get(name: str, family: str | None = None) -> Method:
  """The method called ``name`` (or one of its aliases, any case).

  Args:
    name: a method's name or alias (any case).
    family: None to search every family, or a key of :data:`FAMILIES` to
      search that one only.

  Returns:
    The :class:`Method`.

  Raises:
    ValueError: naming ``name`` and the valid choices, when no method
      (of ``family``) has that name; or when ``family`` is unknown.

  Examples:
    >>> import jaxcomm
    >>> m = jaxcomm.registry.get("TOPK")
    >>> m.name, m.factory is jaxcomm.topk, m.defaults
    ('topk', True, {'ratio': 0.01})
  """
  key = str(name).lower()
  for m in methods(family):
    if key == m.name or key in m.aliases:
      return m
  raise ValueError(f"unknown method {name!r}"
                   + (f" of family {family!r}" if family else "")
                   + f"; valid choices: {', '.join(names(family))}")


def lookup(factory: Callable) -> Method | None:
  """The method whose factory is ``factory``.

  Args:
    factory: a callable, e.g. ``jaxcomm.powersgd``.

  Returns:
    Its :class:`Method`, or None when ``factory`` is not registered.

  Examples:
    >>> import jaxcomm
    >>> jaxcomm.registry.lookup(jaxcomm.powersgd).paper
    'Vogels et al. 2019'
    >>> jaxcomm.registry.lookup(print) is None
    True
  """
  for m in registered():
    if m.factory is factory:
      return m
  return None
