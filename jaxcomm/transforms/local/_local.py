"""Local-update training: talk less often instead of sending less.

Every method here is a whole Optax optimizer around an ``inner`` one that
each device runs on its own gradients. Between synchronisations the devices'
params differ, so they live per device (``DataParallel`` lays them out with
a leading axis over the data axis, as it does per-device state). At a sync
the devices meet again:

* :func:`jaxcomm.local_sgd` (Stich 2018; post-local SGD, Lin et al. 2020):
  average the params every ``period`` steps (every step before
  ``start_step``);
* :func:`jaxcomm.adacomm` (Wang & Joshi 2019): the same with a period that
  follows the training loss, ``tau = ceil(sqrt(F_now / F_0) tau_0)``;
* :func:`jaxcomm.overlap_local_sgd` (Wang, Liang & Joshi 2020): pull each
  model towards an anchor, ``x_i <- (1 - alpha) x_i + alpha z``, and
  average the pulled models into the next anchor, which is first used one
  period later (so that average can travel while the next period
  computes);
* :func:`jaxcomm.diloco` (Douillard et al. 2023; Streaming DiLoCo 2025):
  average the pseudo-gradient ``anchor - x_i`` (optionally through any
  jaxcomm compressor, whose error feedback spans syncs) and apply it to
  the anchor with an ``outer`` optimizer; ``fragments`` sync parts of the
  model in turn, ``overlap_steps`` applies a fragment's result that many
  steps later.

One engine runs them all (:mod:`jaxcomm._local_engine`): the
local step, the non-finite guard, the sync schedule and a ``lax.switch``
whose branches hold the collectives, so a step that does not sync issues
none; :func:`jaxcomm.apply_updates` makes devices agree bit for bit after
a sync. DiLoCo is in :mod:`jaxcomm.transforms.local._diloco`.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import optax

from jaxcomm import _checks
from jaxcomm import _registry
from jaxcomm._local_engine import AdaCommSchedule
from jaxcomm._local_engine import LocalSpec
from jaxcomm._local_engine import _check_inner
from jaxcomm._local_engine import _local_engine
from jaxcomm._local_engine import mean_leaves
from jaxcomm.collectives import _core

# -------------------------------------------------------------- factories --

def _average_sync(axis_name):
  def sync(xs, anchors, outer, comp, sched):
    new = mean_leaves(xs, axis_name)
    return new, new, outer, comp, sched
  return sync


@_registry.method(
    paper="Stich 2018; Lin et al. 2020",
    summary=(
      "params averaged (one fused all-reduce) every `period` steps; "
      "synchronous before `start_step` (post-local SGD)"))
def local_sgd(inner: optax.GradientTransformation, period: int, *,
              start_step: int = 0, axis_name="data"
              ) -> optax.GradientTransformationExtraArgs:
  """Local SGD: devices step alone; params averaged every ``period`` steps.

  Each device runs ``inner`` on its own gradients; every ``period`` steps
  the params are averaged:

  .. math::
    x_i \\leftarrow x_i + \\mathrm{inner}(g_i), \\qquad
    x_i \\leftarrow \\frac{1}{n} \\sum_j x_j \\ \\text{every } H \\text{ steps}

  (Stich 2018; Lin et al. 2020.) With ``start_step > 0`` it is post-local
  SGD: synchronous (params averaged every step) up to step ``start_step``,
  local after. Each device keeps its own ``inner`` state (its own momentum,
  as in the papers). A sync is one fused all-reduce of the params (float32,
  ``4 P`` bytes); steps between syncs issue no collective. With
  ``period=1`` and a linear ``inner`` (SGD, momentum SGD) it follows
  synchronous data-parallel training to float rounding.

  Use it as the whole optimizer of a :class:`jaxcomm.parallel.DataParallel`
  step (params are then laid out per device), or in a hand-written
  ``shard_map`` step with params per device and
  :func:`jaxcomm.apply_updates`.

  Args:
    inner: the optimizer each device runs on its local gradient (e.g.
      ``optax.sgd(0.1, momentum=0.9)``).
    period: steps between syncs (``H``), an int >= 1.
    start_step: steps of synchronous training first (post-local SGD), an
      int >= 0.
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState`, its ``update`` needs
    ``params`` and returns updates to apply with
    :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``inner`` is not an optax transformation, ``period``
      is not an int >= 1, ``start_step`` not an int >= 0 or ``axis_name``
      not a valid axis name; at ``update``, when called without
      ``params`` or where ``axis_name`` is not bound (outside
      ``shard_map``).

  Examples:
    Eight devices, each fitting its own target (device ``i``'s example is
    ``i``) by SGD at rate 0.5, syncing every 2 steps. After step 1 device
    ``i`` holds ``w_i = 0.5 i`` (no collective ran); step 2 moves it to
    ``0.75 i`` and averages: every device then holds
    ``0.75 * 3.5 = 2.625``:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> def show(x):                               # one value per device
    ...   return np.asarray(x, np.float64).round(3).tolist()
    >>> tx = jaxcomm.local_sgd(optax.sgd(0.5), period=2)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(())})
    >>> batch = jnp.arange(8.0)                    # one example per device
    >>> params, state, _ = dp.step(params, state, batch)
    >>> show(params["w"])                          # apart before the sync
    [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    >>> params, state, _ = dp.step(params, state, batch)
    >>> show(params["w"])                          # equal after it
    [2.625, 2.625, 2.625, 2.625, 2.625, 2.625, 2.625, 2.625]
  """
  _check_inner("inner", inner)
  period = _checks.step("period", period, 1)
  start_step = _checks.step("start_step", start_step)
  _checks.axis_name(axis_name)
  spec = LocalSpec("local_sgd", period, start_step=start_step)
  return _local_engine(inner, method="local_sgd", axis_name=axis_name,
                       period=period, start_step=start_step,
                       sync_fns=[_average_sync(axis_name)], spec=spec)


@_registry.method(
    paper="Wang & Joshi 2019",
    summary=(
      "local SGD whose period follows the loss: `tau = ceil(sqrt(F_l / "
      "F_0) tau_0)` every `interval` steps"))
def adacomm(inner: optax.GradientTransformation, period: int, *,
            interval: int | None = None, max_period: int | None = None,
            learning_rate: Callable | None = None, axis_name="data"
            ) -> optax.GradientTransformationExtraArgs:
  """ADACOMM: local SGD whose period follows the training loss.

  .. math::
    \\tau_l = \\left\\lceil \\sqrt{\\frac{F(x_{l})}{F(x_0)}
    \\frac{\\eta_0}{\\eta_l}}\\; \\tau_0 \\right\\rceil

  (Wang & Joshi 2019, eq. 17/18.) The period starts at ``tau_0 = period``
  and is recomputed at the first sync after every ``interval`` steps (the
  paper's wall-clock interval ``T0``, in steps), from ``F(x_l)``, the
  device-averaged training loss since the last sync, and ``F(x_0)``, that of
  the first period. With ``learning_rate`` (a schedule) the ratio also
  carries ``eta_0 / eta_l``, the paper's rule for a decaying rate. The loss
  reaches the optimizer as ``value`` (``tx.update(g, s, p, value=loss)``,
  as :class:`~jaxcomm.parallel.DataParallel` passes it); it travels in the
  sync's fused all-reduce as one more float.

  Args:
    inner: the optimizer each device runs locally.
    period: the first period ``tau_0``, an int >= 1.
    interval: steps between period updates, an int >= 1 (default
      ``10 * period``).
    max_period: the largest period allowed, an int >= 1 (default
      ``period``: the period only shrinks as the loss falls, as in the
      paper's experiments).
    learning_rate: the inner learning-rate schedule, for the
      ``eta_0 / eta_l`` factor (optional).
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``schedule`` is an
    :class:`jaxcomm.AdaCommSchedule`; its ``update`` needs ``params`` and
    ``value`` (the loss) and returns updates to apply with
    :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``inner`` is not an optax transformation, ``period``,
      ``interval`` or ``max_period`` is not an int >= 1,
      ``learning_rate`` is neither None nor callable, or ``axis_name`` is
      not a valid axis name; at ``update``, when called without
      ``params`` or ``value``, or where ``axis_name`` is not bound.

  Examples:
    Eight devices fitting targets ``1 + 0.1 i`` by SGD, starting with a
    period of 2 and recomputing it at every sync (``interval=2``). The
    devices sync at step 2, where the loss of steps 1-2 becomes ``F_0``,
    and at step 4, where the loss of steps 3-4 has fallen below
    ``F_0 / 4``: ``tau = ceil(sqrt(F / F_0) * 2) = 1``, so from then on
    they sync every step:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> tx = jaxcomm.adacomm(optax.sgd(0.5), period=2, interval=2)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)  # passes value
    >>> params, state = dp.init({"w": jnp.zeros(())})
    >>> batch = 1.0 + 0.1 * jnp.arange(8.0)        # one example per device
    >>> for step in range(1, 7):
    ...   params, state, _ = dp.step(params, state, batch)
    ...   agree = len(set(np.asarray(params["w"]).tolist())) == 1
    ...   print(step, agree, int(state.schedule.period))
    1 False 2
    2 True 2
    3 False 2
    4 True 1
    5 True 1
    6 True 1
    >>> round(float(state.schedule.loss0), 3)      # F_0
    0.586
  """
  _check_inner("inner", inner)
  period = _checks.step("period", period, 1)
  interval = _checks.integer("interval", interval if interval is not None
                             else 10 * period, 1)
  max_period = _checks.integer("max_period", max_period if max_period
                               is not None else period, 1)
  if learning_rate is not None and not callable(learning_rate):
    raise ValueError("learning_rate must be a schedule (a callable of the "
                     f"step) or None, got {learning_rate!r}")
  _checks.axis_name(axis_name)

  def init_extra(params):
    del params
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return {"schedule": AdaCommSchedule(
      period=i32(period), next_sync=i32(period), next_update=i32(interval),
      loss0=jnp.asarray(jnp.nan, jnp.float32),
      loss_sum=jnp.zeros([], jnp.float32), loss_steps=i32(0))}

  def schedule_fn(count, state, value, ok):
    if value is None:
      raise ValueError(
        "jaxcomm.adacomm needs the training loss: call tx.update(grads, "
        "state, params, value=loss) (DataParallel passes it)")
    s = state.schedule
    v = jnp.asarray(value, jnp.float32).reshape(())
    good = ok & jnp.isfinite(v)
    s = s._replace(loss_sum=s.loss_sum + jnp.where(good, v, 0.0),
                   loss_steps=s.loss_steps + good.astype(jnp.int32))
    return [count == s.next_sync], s

  def sync(xs, anchors, outer, comp, s):
    del anchors
    n = _core.axis_size(axis_name)
    local = s.loss_sum / jnp.maximum(s.loss_steps, 1).astype(jnp.float32)
    tot = _core.fused_psum(list(xs) + [local], axis_name)
    new = [(t / n).astype(x.dtype) for t, x in zip(tot[:-1], xs)]
    loss = tot[-1] / n
    count = s.next_sync
    loss0 = jnp.where(jnp.isnan(s.loss0), loss, s.loss0)
    ratio = loss / jnp.maximum(loss0, 1e-12)
    if learning_rate is not None:
      ratio = ratio * (jnp.asarray(learning_rate(0), jnp.float32)
                       / jnp.maximum(jnp.asarray(learning_rate(count),
                                                 jnp.float32), 1e-30))
    tau = jnp.ceil(jnp.sqrt(jnp.maximum(ratio, 0.0)) * period)
    tau = jnp.clip(jnp.where(jnp.isfinite(tau), tau, period), 1,
                   max_period).astype(jnp.int32)
    renew = count >= s.next_update
    new_period = jnp.where(renew, tau, s.period)
    s = AdaCommSchedule(
      period=new_period, next_sync=count + new_period,
      next_update=jnp.where(renew, s.next_update + interval, s.next_update),
      loss0=loss0, loss_sum=jnp.zeros_like(s.loss_sum),
      loss_steps=jnp.zeros_like(s.loss_steps))
    return new, new, outer, comp, s

  spec = LocalSpec("adacomm", period, extra_floats=1, adaptive=True)
  return _local_engine(inner, method="adacomm", axis_name=axis_name,
                       period=period, sync_fns=[sync],
                       init_extra=init_extra, schedule_fn=schedule_fn,
                       spec=spec)


@_registry.method(
    paper="Wang, Liang & Joshi 2020",
    static=("alpha",),
    summary=(
      "each model pulled towards an anchor, `x <- (1-a) x + a z`; the "
      "pulled models' average is the next anchor, first read one period "
      "later"))
def overlap_local_sgd(inner: optax.GradientTransformation, period: int, *,
                      alpha: float = 0.5, axis_name="data"
                      ) -> optax.GradientTransformationExtraArgs:
  """Overlap Local SGD: local steps pulled towards a one-period-old anchor.

  .. math::
    x_i \\leftarrow (1 - \\alpha) x_i + \\alpha z, \\qquad
    z \\leftarrow \\frac{1}{n} \\sum_j x_j

  (Wang, Liang & Joshi 2020.) Every ``period`` steps each device pulls its
  model towards the anchor ``z`` and the pulled models are averaged into
  the next anchor. That average is first read one period later, at the
  next pull: it can travel while the next period computes (nothing in the
  sync step consumes it), the delay the paper's algorithm tolerates. The
  devices' models stay apart (``alpha < 1``); evaluate their average
  (:func:`jaxcomm.parallel.synchronized`). The paper's optional slow
  momentum on the anchor is not included.

  Args:
    inner: the optimizer each device runs locally.
    period: steps between pulls (``tau``), an int >= 1.
    alpha: the pull towards the anchor, in ``(0, 1]``.
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``anchor`` is ``z``; its
    ``update`` needs ``params`` and returns updates to apply with
    :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``inner`` is not an optax transformation, ``period``
      is not an int >= 1, ``alpha`` is not in ``(0, 1]`` or ``axis_name``
      is not a valid axis name; at ``update``, when called without
      ``params`` or where ``axis_name`` is not bound.

  Examples:
    Eight devices fitting targets ``i`` by SGD at rate 0.5, ``period=2``,
    ``alpha=0.5``; the first anchor is the initial model, 0. After two
    local steps device ``i`` holds ``0.75 i``; the pull halves it to
    ``0.375 i``, and the pulled models' mean ``0.375 * 3.5 = 1.3125``
    becomes the next anchor. The devices stay apart:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> tx = jaxcomm.overlap_local_sgd(optax.sgd(0.5), period=2, alpha=0.5)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(())})
    >>> batch = jnp.arange(8.0)                    # one example per device
    >>> for _ in range(2):
    ...   params, state, _ = dp.step(params, state, batch)
    >>> np.asarray(params["w"], np.float64).round(4).tolist()
    [0.0, 0.375, 0.75, 1.125, 1.5, 1.875, 2.25, 2.625]
    >>> round(float(state.anchor["w"]), 4)         # read at the next pull
    1.3125
  """
  _check_inner("inner", inner)
  period = _checks.step("period", period, 1)
  alpha = float(_checks.number("alpha", alpha, 0.0, 1.0, lo_open=True))
  _checks.axis_name(axis_name)

  def sync(xs, anchors, outer, comp, sched):
    pulled = [((1 - alpha) * x + alpha * a.astype(x.dtype)).astype(x.dtype)
              for x, a in zip(xs, anchors)]
    return mean_leaves(pulled, axis_name), pulled, outer, comp, sched

  def merge(count, x, anchor, frag_of):
    del anchor, frag_of
    synced = jnp.array(False)
    return x, [synced] * len(x)

  spec = LocalSpec("overlap_local_sgd", period)
  return _local_engine(inner, method="overlap_local_sgd",
                       axis_name=axis_name, period=period,
                       sync_fns=[sync], merge=merge, spec=spec)


__all__ = [
  "adacomm",
  "local_sgd",
  "overlap_local_sgd",
]
