"""LUPA-SGD (Haddadpour, Kamani, Mahdavi & Cadambe 2019): local SGD whose
period grows linearly with the round index.

Local updates with periodic averaging, adaptive synchronization: round
``j`` (0-based) runs ``tau_j = tau_0 + a j`` local steps, then the params
are averaged. The paper's adaptive scheme ``tau_j = tau_0 (1 + alpha j)``
is this with ``a = alpha tau_0`` (an integer here, so that the sync steps
are exact integers on every device and in the numpy replay); its
experiments pick ``alpha`` so that ``R`` rounds cover ``T`` steps,
``alpha = 2 T / (tau_0 R (R + 1))``, which :func:`jaxcomm.lupa_increment` turns
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
  """The increment ``a`` for :func:`jaxcomm.lupa_sgd` from a step budget.

  The paper's ``alpha tau_0``, with ``alpha = 2 T / (tau_0 R (R + 1))``
  chosen so that ``R`` rounds cover ``T`` steps:
  ``a = round(2 T / (R (R + 1)))``, an integer ``>= 0`` (it does not
  depend on ``period``, which is checked only).

  Args:
    period: the first round's length ``tau_0``, an int >= 1.
    total_steps: the training steps ``T``, an int >= 1.
    rounds: the number of rounds ``R``, an int >= 1.

  Returns:
    The increment ``a``, an int >= 0, for ``lupa_sgd(..., increment=a)``.

  Raises:
    ValueError: when ``period``, ``total_steps`` or ``rounds`` is not an
      int >= 1.

  Examples:
    >>> import jaxcomm
    >>> jaxcomm.lupa_increment(4, total_steps=1000, rounds=10)  # 2000 / 110
    18
  """
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
  :func:`jaxcomm.lupa_increment`.) Early rounds sync often, while the
  models move fast; later rounds run longer alone. Each device keeps its
  own ``inner`` state; a sync is one fused float32 all-reduce of the
  params (``4 P`` bytes) inside the engine's conditional, and a step
  between syncs issues no collective.

  Args:
    inner: the optimizer each device runs on its local gradient.
    period: the first round's length ``tau_0``, an int >= 1.
    increment: steps added to the period each round (``a``), an int >= 0
      (0: local SGD with a fixed period).
    max_period: the longest round, an int >= ``period`` (default: no
      cap).
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``schedule`` is a
    :class:`jaxcomm.LupaSchedule`; its ``update`` needs ``params`` and
    returns updates to apply with :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``inner`` is not an optax transformation, ``period``
      is not an int >= 1, ``increment`` not an int >= 0, ``max_period``
      neither None nor an int >= ``period``, or ``axis_name`` is not a
      valid axis name; at ``update``, when called without ``params`` or
      where ``axis_name`` is not bound.

  Examples:
    Rounds of 1, 2, 3, ... steps (``period=1``, ``increment=1``): the 8
    devices, each fitting its own target by SGD, agree after steps 1, 3
    and 6 (the rounds' ends) and differ in between:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> tx = jaxcomm.lupa_sgd(optax.sgd(0.5), period=1, increment=1)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(())})
    >>> batch = jnp.arange(8.0)                    # one example per device
    >>> for step in range(1, 7):
    ...   params, state, _ = dp.step(params, state, batch)
    ...   agree = len(set(np.asarray(params["w"]).tolist())) == 1
    ...   print(step, agree, int(state.schedule.next_sync))
    1 True 3
    2 False 3
    3 True 6
    4 False 6
    5 False 6
    6 True 10
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
