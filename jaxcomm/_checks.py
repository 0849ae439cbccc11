"""Argument checks shared by every factory: one message per kind of mistake.

Each check names the argument and what was expected, returns the value in
its canonical Python type, and lets a JAX tracer through where a value may
be a traced hyperparameter (``optax.inject_hyperparams``).
"""

from __future__ import annotations

import math
from typing import Any
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _is_int(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, np.integer))


# Step counters are int32 in every state: a step setting above this is never
# reached (and would not fit the comparison).
MAX_STEP = 2**31 - 1


def step(name: str, value, lo: int = 0) -> int:
  """A step count or period: an int in ``[lo, MAX_STEP]``; the error says
  that counters are int32."""
  if _is_int(value) and value > MAX_STEP:
    raise ValueError(f"{name} must be <= {MAX_STEP} (step counters are "
                     f"int32), got {value!r}")
  return integer(name, value, lo)


def integer(name: str, value, lo: int | None = None, hi: int | None = None,
            *, allow_none: bool = False) -> int | None:
  """``value`` as an int in ``[lo, hi]`` (bounds optional), or None when
  ``allow_none``; booleans are refused."""
  if allow_none and value is None:
    return None
  # optax.inject_hyperparams hands every int default it was not told to
  # keep static to the factory as a concrete 0-d integer array.
  if isinstance(value, jax.Array) and not isinstance(
      value, jax.core.Tracer) and value.ndim == 0 and jnp.issubdtype(
        value.dtype, jnp.integer):
    value = int(value)
  if not _is_int(value) or (lo is not None and value < lo) or (
      hi is not None and value > hi):
    bounds = (f" in [{lo}, {hi}]" if lo is not None and hi is not None
              else f" >= {lo}" if lo is not None
              else f" <= {hi}" if hi is not None else "")
    raise ValueError(
      f"{name} must be an int{bounds}{' or None' if allow_none else ''}, "
      f"got {value!r}")
  return int(value)


# jax.random.PRNGKey takes a seed that fits an int64.
MAX_SEED = 2**63 - 1


def seed(name: str, value) -> Any:
  """A PRNG seed: an int in ``[0, MAX_SEED]`` (booleans, floats and
  strings refused here rather than by JAX at the first traced step). A
  traced integer passes unchecked (an injected hyperparameter); a traced
  value of another dtype is refused."""
  if isinstance(value, jax.core.Tracer):
    if not jnp.issubdtype(value.dtype, jnp.integer) or value.ndim:
      raise ValueError(f"{name} must be an int >= 0, got a traced "
                       f"{value.dtype}{list(value.shape)}")
    return value
  return integer(name, value, 0, MAX_SEED)


def boolean(name: str, value) -> bool:
  """``value``, which must be a Python bool."""
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool, got {value!r}")
  return value


def number(name: str, value, lo: float | None = None, hi: float | None = None,
           *, lo_open: bool = False, finite: bool = True) -> Any:
  """A real number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN is
  refused, and so is an infinity unless ``finite=False`` (for an argument
  whose documentation gives an infinity a meaning). Tracers pass unchecked
  (injected hyperparameters)."""
  if isinstance(value, jax.core.Tracer):
    return value
  # float("1") is 1.0: a string (or bool) is refused here, not deep inside
  # the first traced step.
  if isinstance(value, (str, bytes, bool)):
    raise ValueError(f"{name} must be a number, got {value!r}")
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}") from None
  bad = (lo is not None and (v <= lo if lo_open else v < lo)) or (
    hi is not None and v > hi)
  if finite and math.isinf(v):
    raise ValueError(f"{name} must be a finite number, got {value!r}")
  if bad or math.isnan(v):
    lo_s = "(" if lo_open else "["
    raise ValueError(f"{name} must be in {lo_s}{lo}, {hi}], got {value!r}")
  return value


def decay(name: str, value, who: str | None = None) -> Any:
  """A decay or momentum in ``[0, 1)``: :func:`number` in ``[0, 1]``, then
  1 refused (its message prefixed by ``who``, when given). Tracers pass
  unchecked (injected hyperparameters)."""
  number(name, value, 0.0, 1.0)
  if not isinstance(value, jax.core.Tracer) and float(value) >= 1.0:
    prefix = f"{who}: " if who else ""
    raise ValueError(f"{prefix}{name} must be in [0, 1), got {value!r}")
  return value


def state_type(who: str, state, cls: type, owner: str | None = None):
  """Refuses a ``state`` that is not a ``cls``, the state ``who``'s init
  returns (``owner`` names what built it: "this {owner}'s init"; without
  it, "its init")."""
  if not isinstance(state, cls):
    init = f"this {owner}'s init" if owner else "its init"
    raise ValueError(f"{who}: state must be the {cls.__name__} {init} "
                     f"returned, got {type(state).__name__}")


def static_number(name: str, value, default: float, lo: float) -> float:
  """``value`` (``default`` when None) as a finite Python float ``>= lo``
  that sets a message size: a traced value (an injected
  hyperparameter) is refused by name."""
  value = default if value is None else value
  if isinstance(value, jax.core.Tracer):
    raise ValueError(f"{name} sets the message size and must be static (a "
                     "Python number)")
  return float(number(name, value, lo, None, finite=True))


def ratio(name: str, value) -> float:
  """A fraction in ``(0, 1]`` (static: it sets message sizes)."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
      f"{name} sets the message size and must be static (a Python number); "
      f"list it in optax.inject_hyperparams(static_args=...)")
  # float("0.1") is 0.1: a string (or bool) is refused here, as number()
  # refuses it.
  if isinstance(value, (str, bytes, bool)):
    raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
  try:
    r = float(value)
  except (TypeError, ValueError):
    raise ValueError(
      f"{name} must be a number in (0, 1], got {value!r}") from None
  if not 0.0 < r <= 1.0:   # also refuses NaN
    raise ValueError(f"{name} must be in (0, 1], got {value!r}")
  return r


def selects_one(name: str, ratio: float, sizes: Sequence[int],
                codec: str, unit: str = "leaf") -> None:
  """Refuses a fraction ``ratio`` whose ``k = ratio * L`` is below 1 for
  every ``L`` in ``sizes`` (each compressed leaf, or bucket): the floor
  ``k = max(1, ceil(ratio * L))`` would then send one element per leaf
  (STC, SBC) or, for a threshold, none (SIDCo), whatever the ratio. Not
  refused where some leaf keeps ``k >= 1`` (the others get the floor), nor
  without compressed leaves."""
  sizes = [int(s) for s in sizes]
  if not sizes:
    return
  big = max(sizes)
  if ratio * big < 1:
    raise ValueError(
      f"{codec}: {name}={ratio!r} keeps fewer than one element of every "
      f"compressed {unit} (the largest has {big}: {name} * {big} = "
      f"{ratio * big:.3g}); use {name} >= 1/{big} = {1 / big:.3g}")


def choice(name: str, value, options: Sequence) -> Any:
  """``value``, which must be one of ``options``."""
  if value not in options:
    raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
  return value


# error_feedback's values: the classic residual, none, EF21's estimates, or
# DIANA's shifts (the same per-device estimates, moved by a fraction).
EF21 = "ef21"
DIANA = "diana"


def error_feedback(value) -> bool | str:
  """``True`` (the classic residual), ``False`` (none), ``"ef21"``
  (Richtarik et al. 2021: per-device gradient estimates) or ``"diana"``
  (Mishchenko et al. 2019: per-device shifts, for unbiased compressors)."""
  if isinstance(value, bool) or (isinstance(value, str)
                                 and value in (EF21, DIANA)):
    return value
  raise ValueError(
    "error_feedback must be True (keep what was not sent and add it to the "
    "next step), False (none), 'ef21' (EF21: compress the change of a "
    "per-device gradient estimate) or 'diana' (DIANA: compress the "
    "difference from a per-device shift, for unbiased compressors), got "
    f"{value!r}")


def axis_name(value) -> Any:
  """A mesh axis name (a str), a non-empty tuple of distinct names, or None
  (one device, no collectives)."""
  names = (value,) if isinstance(value, str) else value
  ok = value is None or (
    isinstance(names, (tuple, list)) and len(names) > 0
    and all(isinstance(a, str) for a in names))
  if not ok:
    raise ValueError(
      "axis_name must be a mesh axis name (a str), a non-empty tuple of "
      f"them, or None for one device without collectives; got {value!r}")
  if value is not None and len(set(names)) != len(names):
    raise ValueError(f"axis_name must name each axis once, got {value!r}")
  return value
