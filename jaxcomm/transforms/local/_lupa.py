"""LUPA-SGD (Haddadpour, Kamani, Mahdavi & Cadambe 2019): local SGD whose
period grows linearly with the round index.

Local updates with periodic averaging, adaptive synchronization: round
``j`` (0-based) runs ``tau_j = tau_0 + a j`` local steps, then the params
are averaged. The paper's adaptive scheme ``tau_j = tau_0 (1 + alpha j)``
is this with ``a = alpha tau_0`` (an integer here, so that the sync steps
are exact integers on every device and in the numpy replay); its
experiments pick ``alpha`` so that ``R`` rounds cover ``T`` steps,
``alpha = 2 T / (tau_0 R (R + 1))``, which :func:`lupa_increment` turns
into ``a``. Built on the local-update engine like ADACOMM: the schedule is
a replicated counter in ``LocalState.schedule``, the sync one fused
all-reduce inside the engine's ``lax.switch``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _checks
from jaxcomm import _registry
from jaxcomm._local_engine import LocalSpec
from jaxcomm._local_engine import _check_inner
from jaxcomm._local_engine import _local_engine
from jaxcomm._local_engine import mean_leaves


class LupaSchedule(NamedTuple):
  """LUPA-SGD's period schedule (replicated).

  Attributes:
    period: the current round's length ``tau_j``.
    next_sync: the step count at which round ``j`` ends.
  """

  period: jax.Array
  next_sync: jax.Array


def lupa_periods(period: int, increment: int, max_period: int | None,
                 rounds: int) -> list[int]:
  """The first ``rounds`` round lengths ``min(tau_0 + a j, max_period)``."""
  cap = max_period if max_period is not None else float("inf")
  return [int(min(period + increment * j, cap)) for j in range(rounds)]


def lupa_increment(period: int, total_steps: int, rounds: int) -> int:
  """The paper's ``alpha tau_0`` for ``rounds`` rounds over
  ``total_steps`` steps, rounded to an integer ``a >= 0``."""
  period = _checks.step("period", period, 1)
  total_steps = _checks.step("total_steps", total_steps, 1)
  rounds = _checks.step("rounds", rounds, 1)
  return max(0, round(2 * total_steps / (rounds * (rounds + 1))))


@dataclasses.dataclass(frozen=True)
class LupaSpec(LocalSpec):
  """LUPA-SGD's wire accounting: the sync steps follow the static linear
  schedule, so ``wire(params, n, step)`` lists each step's collectives."""

  increment: int = 0
  max_period: int | None = None

  def sync_counts(self, upto: int) -> set[int]:
    out, c, j = set(), 0, 0
    while True:
      c += lupa_periods(self.period, self.increment, self.max_period,
                        j + 1)[-1]
      if c > upto:
        return out
      out.add(c)
      j += 1

  def syncing(self, count: int) -> list[int]:
    return [0] if count in self.sync_counts(count) else []


@_registry.method(
    paper="Haddadpour et al. 2019 (LUPA-SGD)",
    summary=(
      "local SGD whose period grows linearly with the round, `tau_j = "
      "tau_0 + a j` (adaptive synchronization); params averaged at each "
      "round's end"))
def lupa_sgd(inner: optax.GradientTransformation, period: int, *,
             increment: int = 1, max_period: int | None = None,
             axis_name="data") -> optax.GradientTransformationExtraArgs:
  """LUPA-SGD: local SGD with a linearly growing period.

  .. math::
    \\tau_j = \\tau_0 + a\\, j, \\qquad
    x_i \\leftarrow \\frac{1}{n} \\sum_k x_k \\ \\text{after round } j

  (Haddadpour et al. 2019, adaptive synchronization: ``tau_j = (1 +
  alpha j) tau_0``, here ``a = alpha tau_0`` rounded to an integer; see
  :func:`lupa_increment`.) Early rounds sync often, while the models move
  fast; later rounds run longer alone. Each device keeps its own ``inner``
  state; a sync is one fused float32 all-reduce of the params (``4 P``
  bytes) inside the engine's conditional, and a step between syncs issues
  no collective.

  Args:
    inner: the optimizer each device runs on its local gradient.
    period: the first round's length ``tau_0``, an int >= 1.
    increment: steps added to the period each round (``a``), an int >= 0
      (0: local SGD with a fixed period).
    max_period: the longest round (default: no cap).
    axis_name: the data axis (a name, a tuple of names, or None).

  Example::

    tx = jaxcomm.lupa_sgd(optax.sgd(0.1), period=2, increment=2)
  """
  _check_inner("inner", inner)
  period = _checks.step("period", period, 1)
  increment = _checks.integer("increment", increment, 0)
  if max_period is not None:
    max_period = _checks.integer("max_period", max_period, period)
  _checks.axis_name(axis_name)
  cap = max_period

  def init_extra(params):
    del params
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return {"schedule": LupaSchedule(period=i32(period),
                                     next_sync=i32(period))}

  def schedule_fn(count, state, value, ok):
    del value, ok
    s = state.schedule
    return [count == s.next_sync], s

  def sync(xs, anchors, outer, comp, s):
    del anchors
    new = mean_leaves(xs, axis_name)
    tau = s.period + increment
    if cap is not None:
      tau = jnp.minimum(tau, cap)
    s = LupaSchedule(period=tau, next_sync=s.next_sync + tau)
    return new, new, outer, comp, s

  spec = LupaSpec("lupa_sgd", period, increment=increment,
                  max_period=max_period)
  return _local_engine(inner, method="lupa_sgd", axis_name=axis_name,
                       period=period, sync_fns=[sync],
                       init_extra=init_extra, schedule_fn=schedule_fn,
                       spec=spec)


__all__ = [
  "LupaSchedule",
  "lupa_increment",
  "lupa_sgd",
]
