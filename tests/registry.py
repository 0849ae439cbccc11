"""The registry of every public compressor, with its numpy reference.

A compressor joins the shared battery (``tests/test_battery.py``) by adding
an :class:`Entry` to :data:`ENTRIES` (usually from its own test module's
``register()`` call at import time, listed in :data:`MODULES`).

The numpy reference is written from the paper, independently of the code
under test. The battery's harness (``numpy_run``) adds error feedback and the
leaf policy around it: the reference only sees the compressed leaves (after
``x = g + e``) of all ``n`` devices for one step and returns the averaged
update and what each device sent.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any
from typing import Callable

import numpy as np
import optax

import jaxcomm

# Modules that register entries (imported by the battery).
MODULES = [
  "tests.entries_dense",
  "tests.entries_lazy",
  "tests.entries_mx",
  "tests.entries_quantization",
  "tests.entries_sparsification",
  "tests.entries_sketch",
  "tests.entries_powersgd",
  "tests.entries_optimizers",
]


@dataclasses.dataclass
class Entry:
  """One compressor configuration in the battery.

  Attributes:
    name: test id.
    make: ``make(axis_name=..., **overrides) -> GradientTransformation``;
      by default ``factory(**kwargs, **overrides, axis_name=axis_name)``.
    ref_init: ``ref_init(shapes) -> ref_state`` for the compressed leaves.
    ref_step: ``ref_step(xs, ref_state, step, key, n) -> (mean, sent,
      ref_state)``; ``xs[i][j]`` is device i's float64 (x = g + e) array for
      compressed leaf j; ``key`` is the step's jax PRNG key (the same one
      the transform's codec receives: split from ``PRNGKey(seed)`` each
      step); ``mean[j]`` the averaged update, ``sent[i][j]`` what device i
      sent (the residual becomes ``x - sent``).
    error_feedback: whether the configuration keeps residuals.
    conserves: whether ``n * mean == sum_i sent_i`` (linear aggregation), so
      that the battery checks global conservation of gradient mass.
    extra_mass: optional ``extra_mass(host_state) -> array`` of additional
      gradient mass the state holds (e.g. a server-side error), added to the
      conservation balance, per compressed leaf flattened and concatenated.
    static_args: factory arguments ``optax.inject_hyperparams`` must keep
      static (shape-setting ones, strings, bools); by default those of the
      factory's line in ``jaxcomm.registry``.
    factory: the public factory (for ``optax.inject_hyperparams``).
    kwargs: the arguments ``make`` passes to ``factory``.
    bad_args: ``[(kwargs, argument_name), ...]`` that must raise ValueError
      naming the argument.
    rtol, atol: tolerances for reference equality (float32 vs float64).
    stochastic: draws random numbers (reference gets the same key).
    numpy_run: for a whole optimizer (whose exchange is not ``x = g + e``
      of the gradient): ``numpy_run(grads_seq, n) -> (updates, residuals,
      sent)`` replaces the harness's error-feedback loop around
      ``ref_step``.
    dense_optimizer: for a whole optimizer, ``() -> GradientTransformation``
      of the optimizer it replaces: the program-growth test compares with
      the dense mean and it (:meth:`dense_baseline`) instead of the bare
      dense mean, and the TPU tier with the plain jit step applying it.
    forced_memory: the reference-equality tests start each step's
      reference from the transform's residuals (checked against the
      reference one step earlier) instead of the twin's own: for
      deterministic rounding to a coarse grid, where an ulp of float32
      drift in the residual moves a later value across a rounding tie.
  """

  name: str
  ref_init: Callable[[list], Any]
  ref_step: Callable[..., tuple]
  make: Callable[..., Any] | None = None
  error_feedback: bool = True
  conserves: bool = True
  extra_mass: Callable[[Any], np.ndarray] | None = None
  static_args: tuple | None = None
  factory: Callable[..., Any] | None = None
  kwargs: dict = dataclasses.field(default_factory=dict)
  bad_args: list = dataclasses.field(default_factory=list)
  rtol: float = 1e-4
  atol: float = 1e-5
  stochastic: bool = False
  numpy_run: Callable[..., tuple] | None = None
  dense_optimizer: Callable[[], Any] | None = None
  forced_memory: bool = False

  def dense_baseline(self):
    """The dense mean and the optimizer a whole optimizer replaces (None
    for a compressor)."""
    if self.dense_optimizer is None:
      return None
    return optax.chain(jaxcomm.mean_gradients(), self.dense_optimizer())

  def __post_init__(self):
    if self.static_args is None:
      method = jaxcomm.registry.lookup(self.factory)
      self.static_args = method.static_args if method is not None else ()
    if self.make is None:
      if self.factory is None:
        raise ValueError(f"{self.name}: give make or factory")
      self.make = lambda axis_name, **kw: self.factory(
        **{**self.kwargs, **kw, "axis_name": axis_name})


ENTRIES: dict[str, Entry] = {}
# The module each entry was registered from (the caller of register()).
SOURCES: dict[str, str] = {}


def register(entry: Entry) -> Entry:
  if entry.name in ENTRIES:
    raise ValueError(f"duplicate registry entry {entry.name!r}")
  ENTRIES[entry.name] = entry
  SOURCES[entry.name] = inspect.currentframe().f_back.f_globals["__name__"]
  return entry


def load(modules=None) -> dict[str, Entry]:
  """Imports every module in ``modules`` (default :data:`MODULES`) and
  returns the entries.

  Nothing here is optional: a missing module, or one that fails to import,
  raises (a deleted family must not silently leave the battery), and so
  does a module that registers no entry.
  """
  modules = MODULES if modules is None else modules
  for mod in modules:
    importlib.import_module(mod)
    if mod not in SOURCES.values():
      raise AssertionError(
        f"{mod} is listed in tests.registry.MODULES but registered no "
        "battery entry")
  return ENTRIES
