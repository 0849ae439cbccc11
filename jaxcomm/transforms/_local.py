"""Local-update training: talk less often instead of sending less.

Every method here is a whole Optax optimizer around an ``inner`` one that
each device runs on its own gradients. Between synchronisations the devices'
params differ, so they live per device (``DataParallel`` lays them out with
a leading axis over the data axis, as it does per-device state). At a sync
the devices meet again:

* :func:`local_sgd` (Stich 2018; post-local SGD, Lin et al. 2020): average
  the params every ``period`` steps (every step before ``start_step``);
* :func:`adacomm` (Wang & Joshi 2019): the same with a period that follows
  the training loss, ``tau = ceil(sqrt(F_now / F_0) tau_0)``;
* :func:`overlap_local_sgd` (Wang, Liang & Joshi 2020): pull each model
  towards an anchor, ``x_i <- (1 - alpha) x_i + alpha z``, and average the
  pulled models into the next anchor, which is first used one period later
  (so that average can travel while the next period computes);
* :func:`diloco` (Douillard et al. 2023; Streaming DiLoCo 2025): average the
  pseudo-gradient ``anchor - x_i`` (optionally through any jaxcomm
  compressor, whose error feedback spans syncs) and apply it to the anchor
  with an ``outer`` optimizer; ``fragments`` sync parts of the model in
  turn, ``overlap_steps`` applies a fragment's result that many steps later.

One engine runs them all (:func:`_local_engine`): the local step, the
non-finite guard, the sync schedule and a ``lax.switch`` whose branches hold
the collectives, so a step that does not sync issues none. The state keeps
``anchor``, the last synchronised model (replicated), and ``synced``, which
leaves every device holds equal to ``anchor`` after this step;
:func:`apply_updates` uses it so devices agree bit for bit after a sync.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _per_device
from jaxcomm import _policy
from jaxcomm import _registry
from jaxcomm import _vma
from jaxcomm.collectives import _core


class LocalState(NamedTuple):
  """State of a local-update optimizer (:func:`local_sgd`, :func:`diloco`…).

  Attributes:
    count: steps taken (``int32``, the same on every device).
    anchor: the last synchronised model, params-shaped, the same on every
      device (DiLoCo's global params, Overlap Local SGD's anchor).
    synced: params-shaped booleans: which leaves every device set to
      ``anchor`` in this step (read by :func:`apply_updates`).
    inner: the inner optimizer's state (per device).
    skipped: local steps this device skipped because its gradient or its
      updated params were not finite (``int32``, per device).
    outer: DiLoCo: one outer-optimizer state per fragment (replicated).
    compress: DiLoCo: one compressor state per fragment.
    schedule: ADACOMM: an :class:`AdaCommSchedule`.
  """

  count: jax.Array
  anchor: Any
  synced: Any
  inner: Any
  skipped: jax.Array
  outer: Any = ()
  compress: Any = ()
  schedule: Any = ()


class AdaCommSchedule(NamedTuple):
  """ADACOMM's adaptive period.

  Attributes:
    period: the current period ``tau``.
    next_sync: the step count at which the next sync happens.
    next_update: the step count from which the next sync recomputes tau.
    loss0: the device-averaged loss of the first period (``F_0``); NaN
      until the first sync.
    loss_sum: this device's sum of finite losses since the last sync.
    loss_steps: how many losses ``loss_sum`` holds (per device).
  """

  period: jax.Array
  next_sync: jax.Array
  next_update: jax.Array
  loss0: jax.Array
  loss_sum: jax.Array
  loss_steps: jax.Array


def local_states(opt_state) -> list[LocalState]:
  """Every :class:`LocalState` in an optimizer state, in order."""
  return _compressor.states_of(opt_state, LocalState)


def apply_updates(params, updates, opt_state):
  """``optax.apply_updates``, then every leaf a local-update optimizer
  synchronised in this step set to its anchor exactly.

  ``params + (anchor - params)`` rounds differently on devices whose params
  differ, so after a sync they would agree only to float rounding; this
  makes them agree bit for bit. Without a :class:`LocalState` in
  ``opt_state`` it is ``optax.apply_updates``.
  """
  new = optax.apply_updates(params, updates)
  states = local_states(opt_state)
  if not states:
    return new
  if len(states) > 1:
    raise ValueError(
      f"opt_state holds {len(states)} local-update optimizer states; use one "
      "local-update optimizer (local_sgd, adacomm, overlap_local_sgd, "
      "diloco) per train step")
  st = states[0]
  if isinstance(st.synced, tuple) and not st.synced:
    return new     # gossip: devices never set to a common value
  return jax.tree.map(
    lambda p, a, s: jnp.where(s, a.astype(p.dtype), p), new, st.anchor,
    st.synced)


# ------------------------------------------------------------ the engine --

def switch(index, branches: Sequence[Callable], operand):
  """``lax.switch`` whose branches may differ in which outputs vary over
  the data axis: every output is marked varying where any branch's is."""
  if len(branches) == 1:
    return branches[0](operand)
  shapes = [jax.eval_shape(b, operand) for b in branches]
  want = _vma.union_varying(shapes)

  def wrap(b):
    def run(op):
      return jax.tree.map(_vma.mark_varying, b(op), want)
    return run

  return jax.lax.switch(index, [wrap(b) for b in branches], operand)


def _all_finite(leaves) -> jax.Array:
  ok = jnp.array(True)
  for x in leaves:
    ok = ok & jnp.all(jnp.isfinite(x))
  return ok


def _where(c, a, b):
  return jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)


def mean_leaves(leaves, axis_name):
  """The device average of ``leaves`` (one fused float32 psum), each back
  in its own dtype."""
  n = _core.axis_size(axis_name)
  tot = _core.fused_psum(leaves, axis_name)
  return [(t / n).astype(l.dtype) for t, l in zip(tot, leaves)]


def fragment_leaves(params, fragments: int) -> list[list[int]]:
  """Leaf indices (``jax.tree.leaves`` order) of each fragment: contiguous
  runs of leaves of about equal size (leaves in tree order follow the
  model's layers, so a fragment is a block of layers, as Streaming DiLoCo
  syncs blocks of layers)."""
  sizes = [int(np.size(l)) for l in jax.tree.leaves(params)]
  if fragments > len(sizes):
    raise ValueError(
      f"fragments={fragments} but params have {len(sizes)} leaves: use at "
      f"most {len(sizes)} fragments")
  total = sum(sizes)
  groups, cur, acc = [], [], 0
  for j, s in enumerate(sizes):
    left_leaves = len(sizes) - j
    left_groups = fragments - len(groups)
    # Close the group once it reaches its share, keeping one leaf for each
    # group still to fill.
    if cur and (left_leaves < left_groups
                or (acc >= total * (len(groups) + 1) / fragments
                    and left_groups > 1)):
      groups.append(cur)
      cur = []
    cur.append(j)
    acc += s
  groups.append(cur)
  while len(groups) < fragments:  # pragma: no cover (guarded above)
    groups.append([])
  return groups


@dataclasses.dataclass(frozen=True)
class LocalSpec:
  """Static description of a local-update optimizer (wire accounting).

  ``wire(params, n, step)`` lists the collectives step ``step`` (0-based)
  moves; ``step=None`` every collective the compiled step holds (each
  sync branch once), as the HLO lists them.
  """

  method: str
  period: int
  start_step: int = 0
  fragments: int = 1
  compressor: Any = None
  extra_floats: int = 0
  adaptive: bool = False

  def offsets(self) -> list[int]:
    return [((f + 1) * self.period) // self.fragments
            for f in range(self.fragments)]

  def syncing(self, count: int) -> list[int]:
    """Fragments that sync at step count ``count`` (1-based)."""
    if count <= self.start_step:
      return list(range(self.fragments))
    return [f for f, off in enumerate(self.offsets())
            if count >= off and (count - off) % self.period == 0]

  def _fragment_wire(self, frag_params, n: int, sync_index) -> list:
    if self.compressor is not None:
      spec = _compressor.spec_of(self.compressor)
      return list(spec.wire(frag_params, n, sync_index))
    size = sum(int(np.size(l)) for l in jax.tree.leaves(frag_params))
    return [("all-reduce", 4 * (size + self.extra_floats))]

  def wire(self, params, n: int, step: int | None = None) -> list:
    leaves = jax.tree.leaves(params)
    groups = fragment_leaves(params, self.fragments)
    if step is None:
      out = []
      for g in groups:
        out.extend(self._fragment_wire([leaves[j] for j in g], n, None))
      return out
    if self.adaptive:
      raise ValueError(
        "adacomm's sync steps follow the training loss: pass step=None for "
        "the collectives of one sync")
    count = step + 1
    out = []
    for f in self.syncing(count):
      out.extend(self._fragment_wire([leaves[j] for j in groups[f]], n,
                                     self._syncs_before(f, count)))
    return out

  def _syncs_before(self, f: int, count: int) -> int:
    """How many times fragment ``f`` synced at step counts below
    ``count`` (the compressor's own step counter at this sync)."""
    early = min(count - 1, self.start_step)
    off = self.offsets()[f]
    lo = max(self.start_step + 1, off)   # first count past the sync phase
    first = off + -(-(lo - off) // self.period) * self.period
    later = 0 if first >= count else (count - 1 - first) // self.period + 1
    return early + later

  def bytes_per_step(self, params, n: int, steps: int) -> float:
    """Average bytes sent per device per step over ``steps`` steps."""
    from jaxcomm import wire as _wire  # pylint: disable=import-outside-toplevel
    total = 0.0
    for s in range(steps):
      total += _wire.summarize(self.wire(params, n, s), n).total_sent
    return total / max(steps, 1)


def _local_engine(inner, *, method: str, axis_name, period: int,
                  start_step: int = 0, fragments: int = 1,
                  sync_fns=None, init_extra=None, schedule_fn=None,
                  merge=None, spec: LocalSpec):
  """The shared machinery; see the module docstring.

  Args:
    inner: the local optimizer.
    sync_fns: ``sync_fns[f](x_leaves, anchor_leaves, state) -> (anchor
      leaves, x leaves, outer, compress)`` for fragment ``f``'s leaves; the
      branch that holds the collectives.
    init_extra: ``(params) -> dict`` of extra state fields.
    schedule_fn: ``(count, state, value) -> (do_sync: [F] bool, schedule,
      extra_scalar or None)``; None: the fixed period schedule.
    merge: ``(count, x_leaves, anchor_leaves) -> (x_leaves, synced)`` run
      after the switch (Streaming DiLoCo's delayed merge); None: replace.
  """
  inner = optax.with_extra_args_support(inner)
  offsets = spec.offsets()

  def init_fn(params):
    extra = init_extra(params) if init_extra is not None else {}
    return LocalState(
      count=jnp.zeros([], jnp.int32),
      anchor=jax.tree.map(jnp.asarray, params),
      synced=jax.tree.map(lambda _: jnp.array(False), params),
      inner=inner.init(params),
      skipped=jnp.zeros([], jnp.int32),
      **extra)

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"jaxcomm.{method} needs params: call "
                       "tx.update(grads, state, params)")
    if not isinstance(state, LocalState):
      raise ValueError(
        f"jaxcomm.{method}: state must be the LocalState its init returned, "
        f"got {type(state).__name__}")
    _core.check_axis(axis_name, f"jaxcomm.{method}", grads=updates)
    treedef = jax.tree.structure(params)
    p_leaves = jax.tree.leaves(params)
    # The local step: each device on its own gradient, nothing sent.
    u, inner_new = inner.update(updates, state.inner, params, **extra_args)
    x = jax.tree.leaves(optax.apply_updates(params, u))
    ok = _all_finite(jax.tree.leaves(updates)) & _all_finite(x)
    x = [jnp.where(ok, a, p) for a, p in zip(x, p_leaves)]
    inner_new = _where(ok, inner_new, state.inner)
    skipped = state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32)
    count = state.count + 1

    schedule = state.schedule
    value = extra_args.get("value")
    if schedule_fn is None:
      do = [(count <= start_step) | ((count >= off)
                                     & ((count - off) % period == 0))
            for off in offsets]
    else:
      do, schedule = schedule_fn(count, state, value, ok)
    groups = fragment_leaves(params, fragments)
    anchor = jax.tree.leaves(state.anchor)

    # Which branch: fragment f syncs (the first that does; offsets are
    # distinct modulo the period), or none (index F, no collective).
    index = jnp.int32(fragments)
    for f in reversed(range(fragments)):
      index = jnp.where(do[f], f, index)

    def run_fragment(f):
      def branch(op):
        x_l, a_l, outer, comp, sched = op
        xs = [x_l[j] for j in groups[f]]
        as_ = [a_l[j] for j in groups[f]]
        new_a, new_x, outer, comp, sched = sync_fns[f](
          xs, as_, outer, comp, sched)
        a_l, x_l = list(a_l), list(x_l)
        for k, j in enumerate(groups[f]):
          a_l[j], x_l[j] = new_a[k], new_x[k]
        return x_l, a_l, outer, comp, sched
      return branch

    def no_sync(op):
      return op

    branches = [run_fragment(f) for f in range(fragments)] + [no_sync]
    x, anchor, outer, comp, schedule = switch(
      index, branches, (x, anchor, state.outer, state.compress, schedule))

    frag_of = {j: f for f, g in enumerate(groups) for j in g}
    if merge is not None:
      x, synced_l = merge(count, x, anchor, frag_of)
    else:
      synced_l = [do[frag_of[j]] for j in range(len(x))]
    new_params = jax.tree.unflatten(treedef, x)
    out = jax.tree.map(lambda n_, p: (n_ - p).astype(p.dtype), new_params,
                       params)
    new_state = LocalState(
      count=count, anchor=jax.tree.unflatten(treedef, anchor),
      synced=jax.tree.unflatten(treedef, list(synced_l)), inner=inner_new,
      skipped=skipped, outer=outer, compress=comp, schedule=schedule)
    return out, new_state

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, spec), update_fn)


def _check_inner(name: str, tx) -> None:
  if not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise ValueError(
      f"{name} must be an optax GradientTransformation (e.g. "
      f"optax.sgd(0.1)), got {type(tx).__name__}")


# -------------------------------------------------------------- factories --

def _average_sync(axis_name):
  def sync(xs, anchors, outer, comp, sched):
    new = mean_leaves(xs, axis_name)
    return new, new, outer, comp, sched
  return sync


@_registry.method(
    family="local",
    paper="Stich 2018; Lin et al. 2020",
    summary=(
      "params averaged (one fused all-reduce) every `period` steps; "
      "synchronous before `start_step` (post-local SGD)"))
def local_sgd(inner: optax.GradientTransformation, period: int, *,
              start_step: int = 0, axis_name="data"
              ) -> optax.GradientTransformationExtraArgs:
  """Local SGD: each device runs ``inner`` alone; params are averaged every
  ``period`` steps.

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
    inner: the optimizer each device runs on its local gradient.
    period: steps between syncs (``H``), an int >= 1.
    start_step: steps of synchronous training first (post-local SGD).
    axis_name: the data axis (a name, a tuple of names, or None).

  Example::

    tx = jaxcomm.local_sgd(optax.sgd(0.1, momentum=0.9), period=8)
  """
  _check_inner("inner", inner)
  period = _checks.integer("period", period, 1)
  start_step = _checks.integer("start_step", start_step, 0)
  _compressor._check_axis_name(axis_name)
  spec = LocalSpec("local_sgd", period, start_step=start_step)
  return _local_engine(inner, method="local_sgd", axis_name=axis_name,
                       period=period, start_step=start_step,
                       sync_fns=[_average_sync(axis_name)], spec=spec)


@_registry.method(
    family="local",
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
    period: the first period ``tau_0``.
    interval: steps between period updates (default ``10 * period``).
    max_period: the largest period allowed (default ``period``: the period
      only shrinks as the loss falls, as in the paper's experiments).
    learning_rate: the inner learning-rate schedule, for the
      ``eta_0 / eta_l`` factor (optional).
    axis_name: the data axis.
  """
  _check_inner("inner", inner)
  period = _checks.integer("period", period, 1)
  interval = _checks.integer("interval", interval if interval is not None
                             else 10 * period, 1)
  max_period = _checks.integer("max_period", max_period if max_period
                               is not None else period, 1)
  if learning_rate is not None and not callable(learning_rate):
    raise ValueError("learning_rate must be a schedule (a callable of the "
                     f"step) or None, got {learning_rate!r}")
  _compressor._check_axis_name(axis_name)

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
    family="local",
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
    period: steps between pulls (``tau``).
    alpha: the pull towards the anchor, in ``(0, 1]``.
    axis_name: the data axis.
  """
  _check_inner("inner", inner)
  period = _checks.integer("period", period, 1)
  alpha = float(_checks.number("alpha", alpha, 0.0, 1.0, lo_open=True))
  _compressor._check_axis_name(axis_name)

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


@_registry.method(
    family="local",
    static=("alpha",),
    paper="Douillard et al. 2023; Streaming DiLoCo 2025; SparseLoCo 2025",
    summary=(
      "the mean pseudo-gradient `theta - x_i` (optionally through any "
      "jaxcomm compressor, its error feedback kept from sync to sync) "
      "drives `outer`; `fragments` blocks of layers synced in turn, each "
      "block's result merged `overlap_steps` later"))
def diloco(inner: optax.GradientTransformation,
           outer: optax.GradientTransformation, period: int, *,
           compressor: optax.GradientTransformation | None = None,
           fragments: int = 1, overlap_steps: int = 0,
           alpha: float | None = None, axis_name="data"
           ) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: local inner steps, an outer optimizer on the averaged
  pseudo-gradient.

  .. math::
    \\Delta = \\frac{1}{n}\\sum_i (\\theta - x_i), \\qquad
    \\theta \\leftarrow \\theta + \\mathrm{outer}(\\Delta), \\qquad
    x_i \\leftarrow \\theta

  (Douillard et al. 2023: ``inner`` AdamW, ``outer`` Nesterov SGD with lr
  0.7 and momentum 0.9, ``period`` H = 500.) ``theta`` is the state's
  ``anchor``, the global model; devices agree with it exactly after each
  sync.

  * ``compressor``: any jaxcomm compressor (``jaxcomm.topk(0.02)``,
    ``jaxcomm.int8()``, …) averages the pseudo-gradients instead of a dense
    all-reduce; its error feedback carries over from sync to sync
    (SparseLoCo is top-k with error feedback on the pseudo-gradient; with
    ``compressor`` set, an outer ``optax.sgd(1.0)`` applies its mean as is).
  * ``fragments > 1`` (Streaming DiLoCo): the leaves are cut into that many
    contiguous blocks of about equal size; block ``f`` syncs at steps
    ``(f + 1) H / F + k H``, so each step moves at most one block, and each
    block has its own outer state (and compressor state).
  * ``overlap_steps = tau > 0``: a block's new global values are merged
    into the local params ``tau`` steps after its sync, ``x <- alpha x +
    (1 - alpha) theta`` (``alpha`` default 0.5; with ``alpha=0`` the devices
    agree exactly after the merge), so the sync's traffic has ``tau``
    steps of compute to hide behind.

  Args:
    inner: the optimizer each device runs locally (AdamW in the paper).
    outer: the optimizer applied to the averaged pseudo-gradient.
    period: inner steps between syncs of a fragment (``H``).
    compressor: a jaxcomm compressor for the pseudo-gradient, or None.
    fragments: blocks synced in turn (Streaming DiLoCo), ``<= period``.
    overlap_steps: steps between a block's sync and its merge, ``< period``.
    alpha: the merge's weight on the local params (only with
      ``overlap_steps > 0``).
    axis_name: the data axis.

  Example::

    tx = jaxcomm.diloco(optax.adamw(4e-4), optax.sgd(0.7, momentum=0.9,
                        nesterov=True), period=50)
  """
  _check_inner("inner", inner)
  _check_inner("outer", outer)
  period = _checks.integer("period", period, 1)
  fragments = _checks.integer("fragments", fragments, 1, period)
  overlap_steps = _checks.integer("overlap_steps", overlap_steps, 0,
                                  period - 1)
  if alpha is not None and overlap_steps == 0:
    raise ValueError("alpha weighs the local params in a delayed merge; it "
                     "needs overlap_steps > 0")
  alpha = float(_checks.number("alpha", 0.5 if alpha is None else alpha,
                               0.0, 1.0))
  if compressor is not None:
    _compressor.spec_of(compressor)  # a jaxcomm compressor, named if not
    if getattr(_compressor.spec_of(compressor), "axis_name", axis_name) \
        != axis_name:
      raise ValueError(
        f"compressor averages over axis_name="
        f"{_compressor.spec_of(compressor).axis_name!r} but diloco's "
        f"axis_name is {axis_name!r}: build both on the same data axis")
  _compressor._check_axis_name(axis_name)
  outer = optax.with_extra_args_support(outer)

  groups_of = {}

  def groups(params):
    key = jax.tree.structure(params), tuple(
      int(np.size(l)) for l in jax.tree.leaves(params))
    if key not in groups_of:
      groups_of[key] = fragment_leaves(params, fragments)
    return groups_of[key]

  def init_extra(params):
    leaves = jax.tree.leaves(params)
    gs = groups(params)
    frag = [[jnp.asarray(leaves[j]) for j in g] for g in gs]
    return {
      "outer": tuple(outer.init(f) for f in frag),
      "compress": (tuple(compressor.init(f) for f in frag)
                   if compressor is not None else ())}

  def make_sync(f):
    def sync(xs, anchors, outer_s, comp_s, sched):
      delta = [(a.astype(jnp.float32) - x.astype(jnp.float32)).astype(
        x.dtype) for a, x in zip(anchors, xs)]
      if compressor is not None:
        mean, c = compressor.update(delta, comp_s[f], anchors)
        comp_s = tuple(c if k == f else s for k, s in enumerate(comp_s))
      else:
        mean = mean_leaves(delta, axis_name)
      # The pseudo-gradient points like a gradient: theta - x_i.
      u, o = outer.update(list(mean), outer_s[f], list(anchors))
      outer_s = tuple(o if k == f else s for k, s in enumerate(outer_s))
      new = [optax.apply_updates(a, du) for a, du in zip(anchors, u)]
      x_new = xs if overlap_steps else new
      return new, x_new, outer_s, comp_s, sched
    return sync

  spec = LocalSpec("diloco", period, fragments=fragments,
                   compressor=compressor)
  offsets = spec.offsets()

  merge = None
  if overlap_steps:
    def merge(count, x, anchor, frag_of):
      due = [(count - overlap_steps >= off)
             & ((count - overlap_steps - off) % period == 0)
             for off in offsets]
      out, synced = [], []
      for j, (xj, aj) in enumerate(zip(x, anchor)):
        d = due[frag_of[j]]
        mixed = (alpha * xj + (1 - alpha) * aj.astype(xj.dtype)).astype(
          xj.dtype)
        out.append(jnp.where(d, mixed, xj))
        synced.append(d & (alpha == 0.0))
      return out, synced

  # Fragments are cut from the params at init; the engine re-cuts them the
  # same way from the params it is given (same structure and sizes).
  return _local_engine(inner, method="diloco", axis_name=axis_name,
                       period=period, fragments=fragments,
                       sync_fns=[make_sync(f) for f in range(fragments)],
                       init_extra=init_extra, merge=merge, spec=spec)


# ------------------------------------------------------------- 0/1 Adam --

class ZeroOneAdamState(NamedTuple):
  """The moments and schedules of :func:`zero_one_adam` (its
  :class:`LocalState`'s ``inner``).

  Attributes:
    mu: the momentum (identical on every device while the variance is
      updated; each device's own between syncs after the freeze).
    nu: the variance (replicated; frozen after ``var_freeze_step``).
    accum: each device's accumulated local update since the last sync
      (``-sum lr * update``), the paper's ``u``.
    lrs: the sum of the learning rates of those local steps.
    var_interval: steps between variance updates (doubles every
      ``var_update_scaler`` updates).
    var_counter: variance updates since the interval last doubled.
    local_interval: steps between syncs after the freeze (doubles every
      ``local_step_scaler`` steps, up to ``local_step_clipper``).
    local_counter: steps since the local interval last doubled.
  """

  mu: Any
  nu: Any
  accum: Any
  lrs: jax.Array
  var_interval: jax.Array
  var_counter: jax.Array
  local_interval: jax.Array
  local_counter: jax.Array


def zero_one_schedule(steps: int, var_freeze_step: int,
                      var_update_scaler: int, local_step_scaler: int,
                      local_step_clipper: int) -> list[int]:
  """The branch :func:`zero_one_adam` takes at each step ``0..steps-1``:
  0 a dense step (variance update), 1 a 1-bit gradient step, 2 a local
  step, 3 a local step ending in a 1-bit sync (plain Python, for wire
  accounting and documentation)."""
  out = []
  var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
  for s in range(steps):
    count = s + 1
    if count <= var_freeze_step:
      is_var = count % var_interval == 0
      out.append(0 if is_var else 1)
      if is_var:
        var_counter += 1
        if var_counter == var_update_scaler:
          var_counter, var_interval = 0, var_interval * 2
    else:
      out.append(3 if count % local_interval == 0 else 2)
      local_counter += 1
      if local_counter == local_step_scaler:
        local_counter = 0
        local_interval = min(local_step_clipper, local_interval * 2)
  return out


@dataclasses.dataclass(frozen=True)
class ZeroOneSpec(LocalSpec):
  """Wire accounting of :func:`zero_one_adam`: the collectives of the
  branch a step takes (``step=None``: all three exchanges, as the HLO
  holds them)."""

  exchanges: tuple = ()
  schedule_args: tuple = ()

  def wire(self, params, n: int, step: int | None = None) -> list:
    dense, grad_ex, mom_ex = self.exchanges
    claim = lambda tx: list(_compressor.spec_of(tx).wire(params, n))
    if step is None:
      return claim(dense) + claim(grad_ex) + claim(mom_ex)
    branch = zero_one_schedule(step + 1, *self.schedule_args)[step]
    return {0: claim(dense), 1: claim(grad_ex), 2: [],
            3: claim(mom_ex)}[branch]


@_registry.method(
    family="optimizer",
    paper="Lu et al. 2022",
    summary=(
      "warm-up: exact mean gradient on variance-update steps (their "
      "interval doubling), the 1-bit average (`onebit()` exchange) on the"
      " others; after: local Adam steps with each device's own momentum; "
      "every `local_interval` steps (doubling, clipped) a 1-bit sync of "
      "the accumulated updates; params per device in between (a "
      "local-update optimizer, below)"))
def zero_one_adam(learning_rate: float | Callable[[jax.Array], jax.Array],
                  b1: float = 0.9, b2: float = 0.999,
                  eps: float = 1e-8, weight_decay: float = 0.0, *,
                  var_freeze_step: int, var_update_scaler: int = 16,
                  local_step_scaler: int = 32678,
                  local_step_clipper: int = 16, axis_name="data",
                  policy=None) -> optax.GradientTransformationExtraArgs:
  """0/1 Adam: adaptive variance freezing and 1-bit syncs of local steps.

  (Lu et al. 2022, Algorithm 1, with DeepSpeed's published schedule.)
  Up to ``var_freeze_step`` every step exchanges the gradient: at the
  steps where the variance is updated (every ``var_interval`` steps, an
  interval that doubles after every ``var_update_scaler`` updates) the
  exact mean ``gbar`` (one fused psum) updates ``nu = b2 nu + (1 - b2)
  gbar^2`` and ``mu``; at the others the 1-bit average (worker and server
  error, :func:`jaxcomm.onebit`'s exchange) updates ``mu`` alone. After the
  freeze each device takes local steps with its own momentum
  ``mu_i = b1 mu_i + (1 - b1) g_i``, ``x_i -= lr (mu_i / (sqrt(nu) + eps) +
  wd x_i)``, accumulating ``u_i`` (the sum of those updates); every
  ``local_interval`` steps (doubling every ``local_step_scaler`` steps up
  to ``local_step_clipper``) the devices sync: ``ubar`` is the 1-bit
  average of ``u_i (sqrt(nu) + eps)`` (a second error-feedback state),
  ``mu = -ubar / sum(lr)`` and every device restarts from ``x = anchor +
  ubar / (sqrt(nu) + eps)``, ``anchor`` the params at the last sync. As
  in DeepSpeed's implementation there is no bias correction, and the
  gradient exchange's errors are not carried into the momentum exchange.

  Params differ between devices between syncs: use it as the whole
  optimizer of a :class:`jaxcomm.parallel.DataParallel` step (params per
  device) or a hand-written step with :func:`jaxcomm.apply_updates`.

  Args:
    learning_rate: a number or an optax schedule.
    b1, b2, eps: Adam's constants.
    weight_decay: added to the update as ``wd x`` (DeepSpeed's form).
    var_freeze_step: steps with a variance (static).
    var_update_scaler: variance updates before their interval doubles.
    local_step_scaler: steps before the sync interval doubles.
    local_step_clipper: the largest sync interval.
    axis_name: the data axis.
    policy: the exchanges' :class:`jaxcomm.LeafPolicy`.
  """
  # pylint: disable=import-outside-toplevel
  from jaxcomm.transforms import _dense
  from jaxcomm.transforms import _quantization
  var_freeze_step = _checks.integer("var_freeze_step", var_freeze_step, 0)
  var_update_scaler = _checks.integer("var_update_scaler",
                                      var_update_scaler, 1)
  local_step_scaler = _checks.integer("local_step_scaler",
                                      local_step_scaler, 1)
  local_step_clipper = _checks.integer("local_step_clipper",
                                       local_step_clipper, 1)
  for name, v, lo, hi in (("b1", b1, 0.0, 1.0), ("b2", b2, 0.0, 1.0),
                          ("eps", eps, 0.0, None),
                          ("weight_decay", weight_decay, 0.0, None)):
    _checks.number(name, v, lo, hi)
  if not callable(learning_rate):
    _checks.number("learning_rate", learning_rate, 0.0, None)
  _compressor._check_axis_name(axis_name)
  schedule = (learning_rate if callable(learning_rate)
              else (lambda _: learning_rate))
  dense = _dense.mean_gradients(axis_name)
  grad_ex = _quantization.onebit(axis_name=axis_name, policy=policy)
  mom_ex = _quantization.onebit(axis_name=axis_name, policy=policy)
  spec = ZeroOneSpec("zero_one_adam", 1, exchanges=(dense, grad_ex, mom_ex),
                     schedule_args=(var_freeze_step, var_update_scaler,
                                    local_step_scaler, local_step_clipper))
  f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)

  def init_fn(params):
    zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32),
                         params)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    inner = ZeroOneAdamState(
      mu=zeros, nu=zeros, accum=zeros, lrs=jnp.zeros([], jnp.float32),
      var_interval=i32(1), var_counter=i32(0), local_interval=i32(1),
      local_counter=i32(0))
    return LocalState(
      count=i32(0), anchor=jax.tree.map(jnp.asarray, params),
      synced=jax.tree.map(lambda _: jnp.array(False), params),
      inner=inner, skipped=i32(0),
      compress=(dense.init(params), grad_ex.init(params),
                mom_ex.init(params)))

  def step_of(mu, nu, x):
    return jax.tree.map(
      lambda m, v, p: m / (jnp.sqrt(v) + eps) + weight_decay
      * p.astype(jnp.float32), mu, nu, x)

  def skipped_by(old, new):
    return (_compressor.stats(new)[0].nonfinite_steps
            > _compressor.stats(old)[0].nonfinite_steps)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("jaxcomm.zero_one_adam needs params: call "
                       "tx.update(grads, state, params)")
    if not isinstance(state, LocalState) or not isinstance(
        state.inner, ZeroOneAdamState):
      raise ValueError("jaxcomm.zero_one_adam: state must be the "
                       "LocalState its init returned")
    _core.check_axis(axis_name, "jaxcomm.zero_one_adam", grads=updates)
    s = state.inner
    lr = jnp.asarray(schedule(state.count), jnp.float32)
    count = state.count + 1
    g = f32(updates)
    x = f32(params)
    anchor = f32(state.anchor)
    cs = state.compress

    def synchronous(exchange_index, variance):
      def branch(op):
        mu, nu, accum, lrs, cs = op
        ex = (dense, grad_ex)[exchange_index]
        mean, new_c = ex.update(g, cs[exchange_index], state.anchor)
        skip = skipped_by(cs[exchange_index], new_c)
        mean = f32(mean)
        new_nu = (jax.tree.map(lambda v, m: b2 * v + (1 - b2) * m * m, nu,
                               mean) if variance else nu)
        new_mu = jax.tree.map(lambda m, gb: b1 * m + (1 - b1) * gb, mu, mean)
        new_a = jax.tree.map(lambda a, u: a - lr * u, anchor,
                             step_of(new_mu, new_nu, anchor))
        keep = lambda new, old: _where(skip, old, new)
        cs = tuple(new_c if k == exchange_index else c
                   for k, c in enumerate(cs))
        return (keep(new_a, anchor), keep(new_a, anchor), keep(new_mu, mu),
                keep(new_nu, nu), accum, lrs, cs, jnp.array(True),
                jnp.zeros([], jnp.int32))
      return branch

    def local(sync):
      def branch(op):
        mu, nu, accum, lrs, cs = op
        new_mu = jax.tree.map(lambda m, gi: b1 * m + (1 - b1) * gi, mu, g)
        upd = step_of(new_mu, nu, x)
        new_x = jax.tree.map(lambda p, u: p - lr * u, x, upd)
        new_acc = jax.tree.map(lambda a, u: a - lr * u, accum, upd)
        ok = _all_finite(jax.tree.leaves(g)) & _all_finite(
          jax.tree.leaves(new_x))
        new_mu, new_x, new_acc = (_where(ok, new_mu, mu), _where(ok, new_x, x),
                                  _where(ok, new_acc, accum))
        new_lrs = lrs + lr
        bad = jnp.where(ok, 0, 1).astype(jnp.int32)
        if not sync:
          return (anchor, new_x, new_mu, nu, new_acc, new_lrs, cs,
                  jnp.array(False), bad)
        denom = jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)
        w = jax.tree.map(lambda a, d: a * d, new_acc, denom)
        ubar, c2 = mom_ex.update(w, cs[2], state.anchor)
        ubar = f32(ubar)
        mu_s = jax.tree.map(lambda u: -u / jnp.maximum(new_lrs, 1e-30), ubar)
        new_a = jax.tree.map(lambda a, u, d: a + u / d, anchor, ubar, denom)
        zero = jax.tree.map(jnp.zeros_like, new_acc)
        return (new_a, new_a, mu_s, nu, zero, jnp.zeros_like(new_lrs),
                (cs[0], cs[1], c2), jnp.array(True), bad)
      return branch

    phase2 = count > var_freeze_step
    is_var = count % s.var_interval == 0
    sync = count % s.local_interval == 0
    index = jnp.where(phase2, jnp.where(sync, 3, 2),
                      jnp.where(is_var, 0, 1)).astype(jnp.int32)
    new_a, new_x, mu, nu, accum, lrs, cs, synced, bad = switch(
      index, [synchronous(0, True), synchronous(1, False), local(False),
              local(True)], (s.mu, s.nu, s.accum, s.lrs, cs))
    # Schedules (replicated counters).
    var_counter = s.var_counter + jnp.where(~phase2 & is_var, 1, 0)
    double = var_counter == var_update_scaler
    var_interval = jnp.where(double, s.var_interval * 2, s.var_interval)
    var_counter = jnp.where(double, 0, var_counter)
    local_counter = s.local_counter + jnp.where(phase2, 1, 0)
    widen = local_counter == local_step_scaler
    local_interval = jnp.where(
      widen, jnp.minimum(local_step_clipper, s.local_interval * 2),
      s.local_interval)
    local_counter = jnp.where(widen, 0, local_counter)
    inner = ZeroOneAdamState(
      mu=mu, nu=nu, accum=accum, lrs=lrs,
      var_interval=var_interval.astype(jnp.int32),
      var_counter=var_counter.astype(jnp.int32),
      local_interval=local_interval.astype(jnp.int32),
      local_counter=local_counter.astype(jnp.int32))
    out = jax.tree.map(lambda n_, p: (n_ - p).astype(p.dtype), new_x,
                       params)
    new_anchor = jax.tree.map(lambda a, p: a.astype(p.dtype), new_a,
                              state.anchor)
    return out, LocalState(
      count=count, anchor=new_anchor,
      synced=jax.tree.map(lambda _: synced, params), inner=inner,
      skipped=state.skipped + bad, compress=cs)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, spec), update_fn)


# ------------------------------------------------------------- D-PSGD ----

@dataclasses.dataclass(frozen=True)
class GossipSpec:
  """Wire accounting of :func:`dpsgd`: one collective-permute of the
  params (float32) per neighbour of the step's mixing phase."""

  topology: str
  adaptive: bool = False
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None) -> list:
    from jaxcomm.collectives import _gossip  # pylint: disable=import-outside-toplevel
    size = sum(int(np.size(l)) for l in jax.tree.leaves(params))
    return _gossip.gossip_wire(self.topology, n, size, step)


def _gossip_inner_step(method, inner, axis_name, updates, state, params,
                       compress_type, extra_args):
  """The step every gossip method starts with: checks (params given, the
  method's own state, gradients not already summed over the axis), the
  local ``inner`` update, and the finiteness guard (a non-finite gradient
  or update keeps the inner state and contributes nothing this step).

  Returns:
    ``(n, u, inner_new, ok)``: the axis size, the inner update, the inner
    state to keep and whether the step was finite.
  """
  if params is None:
    raise ValueError(f"jaxcomm.{method} needs params: call "
                     "tx.update(grads, state, params)")
  if not isinstance(state, LocalState) or (
      compress_type is not None
      and not isinstance(state.compress, compress_type)):
    raise ValueError(f"jaxcomm.{method}: state must be the LocalState its "
                     f"init returned, got {type(state).__name__}")
  n = _core.check_axis(axis_name, f"jaxcomm.{method}", grads=updates)
  u, inner_new = inner.update(updates, state.inner, params, **extra_args)
  ok = _all_finite(jax.tree.leaves(updates)) & _all_finite(
    jax.tree.leaves(u))
  return n, u, _where(ok, inner_new, state.inner), ok


@_registry.method(
    family="local",
    paper="Lian et al. 2017; Ying et al. 2021",
    summary=(
      "no sync: every step each device mixes its params with its "
      "neighbours', `x_i <- sum_j W_ij x_j` (ring, 2-D torus, hypercube, "
      "one-peer exponential graph), as collective-permutes of one fused "
      "buffer: bytes per device flat in the number of devices"),
    gossip=True)
def dpsgd(inner: optax.GradientTransformation, *, topology: str = "ring",
          axis_name="data") -> optax.GradientTransformationExtraArgs:
  """Decentralized SGD: each device mixes its params with its neighbours'.

  .. math::
    x_i \\leftarrow \\sum_j W_{ij} x_j + \\mathrm{inner}(g_i(x_i))

  (Lian et al. 2017.) ``W`` is the doubly stochastic mixing matrix of
  ``topology`` (:func:`jaxcomm.collectives.mixing_matrix`): ``"ring"``,
  ``"torus"``, ``"hypercube"`` (time-varying: one dimension per step) or
  ``"exponential"`` (the one-peer exponential graph, Ying et al. 2021). No
  all-reduce: each step sends the params once per neighbour
  (collective-permutes of one fused float32 buffer), so a device's traffic
  does not grow with the number of devices. Params stay per device and
  never agree exactly; :func:`jaxcomm.parallel.synchronized` gives their
  average and :func:`jaxcomm.parallel.consensus_distance` how far apart
  they are. A device whose gradient is not finite still mixes (the mixing
  stays doubly stochastic) but skips its own update (counted).

  Args:
    inner: the optimizer each device applies to its own gradient.
    topology: the communication graph.
    axis_name: the data axis.
  """
  # pylint: disable=import-outside-toplevel
  from jaxcomm.collectives import _gossip
  _check_inner("inner", inner)
  _checks.choice("topology", topology, _gossip.MIXING_TOPOLOGIES)
  _compressor._check_axis_name(axis_name)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    _, u, inner_new, ok = _gossip_inner_step(
      "dpsgd", inner, axis_name, updates, state, params, None, extra_args)
    p_leaves, treedef = jax.tree.flatten(params)
    mixed = _gossip.gossip_mix(p_leaves, axis_name, topology, state.count)
    u_leaves = jax.tree.leaves(u)
    new = [jnp.where(ok, m + d.astype(m.dtype), m)
           for m, d in zip(mixed, u_leaves)]
    out = jax.tree.unflatten(treedef, [(x - p).astype(p.dtype)
                                       for x, p in zip(new, p_leaves)])
    return out, LocalState(
      count=state.count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, GossipSpec(topology)), update_fn)


# ---------------------------------------------------------- CHOCO-SGD ----

class ChocoState(NamedTuple):
  """CHOCO-SGD's gossip memory (per device), one flat float32 buffer per
  bucket of the compressor's layout, then one for the leaves its policy
  sends dense.

  Attributes:
    public: ``x_hat_i``, this device's public copy: the sum of every
      message it sent (what its neighbours know of its params).
    mixed: ``s_i = sum_j W_ij x_hat_j``, the neighbours' public copies as
      the mixing weighs them (the self term included): kept as one sum, so
      a device stores two params-sized buffers whatever its degree.
    key: PRNG key data (the same on every device; random-k's coordinates).
  """

  public: Any
  mixed: Any
  key: jax.Array


# The public copies describe the old graph: on another device count they
# restart at 0, as at init (the params, which resize_params moves, carry
# the model).
_per_device.register(ChocoState, public=_per_device.restart(0.0),
                     mixed=_per_device.restart(0.0))


@dataclasses.dataclass(frozen=True)
class ChocoSpec:
  """Wire accounting of :func:`choco`: per neighbour, one
  collective-permute of every bucket's compressed message and the dense
  leaves (float32), fused into one buffer."""

  compressor: Any
  topology: str
  adaptive: bool = False
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None) -> list:
    del step
    from jaxcomm.collectives import _gossip  # pylint: disable=import-outside-toplevel
    words = _choco_message_words(self.compressor, params, n)
    return _gossip.gossip_wire(self.topology, n, words, None)


def _choco_parts(spec, params):
  """Static split of ``params``' leaves: (paths, layouts, compressed leaf
  indices, dense leaf indices)."""
  leaves = jax.tree.leaves(params)
  paths = spec.paths(params)
  comp = _policy.select(list(range(len(leaves))), paths,
                                    _policy.COMPRESS)
  dense = [i for i, p in enumerate(paths) if p == _policy.DENSE]
  return paths, spec.layouts(params), comp, dense


def _choco_context(n, layout, index, step, key):
  return _compressor.Context(axis_name=None, num_devices=n,
                             device_index=index, step=step, key=key,
                             layout=layout)


def _choco_message_words(spec, params, n: int) -> int:
  """uint32 words of one device's fused CHOCO message."""
  _, layouts, _, dense = _choco_parts(spec, params)
  leaves = jax.tree.leaves(params)
  words = sum(int(np.size(leaves[i])) for i in dense)
  for lay in layouts:
    out = jax.eval_shape(
      lambda x, lay=lay: spec.codec.message(
        x, _choco_context(n, lay, jnp.int32(0), jnp.int32(0),
                          jax.random.PRNGKey(0)))[0],
      jax.ShapeDtypeStruct((lay.size,), jnp.float32))
    words += int(np.size(out))
  return words


CHOCO_TOPOLOGIES = ("ring", "torus")


@_registry.method(
    family="local",
    paper="Koloskova et al. 2019",
    summary=(
      "decentralized SGD gossiping compressed differences `q = C(x - "
      "x_hat)` (top-k, random-k or EF-signSGD messages, one permute per "
      "neighbour); ring or torus"),
    gossip=True)
def choco(inner: optax.GradientTransformation, compressor, *,
          gamma: float, topology: str = "ring", axis_name="data",
          seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """CHOCO-SGD: decentralized SGD gossiping compressed model differences.

  Each step, on device ``i`` (Koloskova, Stich & Jaggi 2019, Algorithm 2,
  in the memory-efficient form of Koloskova et al. 2020):

  .. math::
    x_i^{+} &= x_i + \\mathrm{inner}(g_i(x_i)) \\\\
    q_i &= C(x_i^{+} - \\hat x_i), \\quad \\hat x_i \\mathrel{+}= q_i,
      \\quad s_i \\mathrel{+}= \\textstyle\\sum_j W_{ij} q_j \\\\
    x_i &\\leftarrow x_i^{+} + \\gamma (s_i - \\hat x_i)

  ``C`` is ``compressor``'s operator: only ``q_i``'s compact message
  travels, once per neighbour (top-k: values and indices; random-k: the
  values, the coordinates coming from a key every device shares;
  EF-signSGD: packed signs and per-leaf scales). The leaves
  ``compressor``'s policy sends dense travel as float32 (``C`` is the
  identity on them). ``s_i = sum_j W_ij x_hat_j`` is kept as one sum, so
  the memory is two params-sized buffers. The public copies start at 0.

  Params stay per device and never agree exactly, as in :func:`dpsgd`. A
  device whose gradient is not finite skips its own step (counted) but
  still gossips, so every public copy stays what its neighbours hold.

  Args:
    inner: the optimizer each device applies to its own gradient.
    compressor: a jaxcomm compressor with a gossip message
      (:func:`jaxcomm.topk` without ``value_bits``, :func:`jaxcomm.randomk`,
      :func:`jaxcomm.ef_signsgd`); only its operator, leaf policy and
      buckets are used (not its error feedback: CHOCO's public copies
      play that role).
    gamma: the consensus step size in ``(0, 1]``; smaller for stronger
      compression (the paper tunes it per compressor).
    topology: a fixed graph, ``"ring"`` or ``"torus"``: the public copies
      must be updated by every neighbour that weighs them, every step.
    axis_name: the data axis.
    seed: seed of the PRNG key kept in the state.
  """
  # pylint: disable=import-outside-toplevel
  from jaxcomm.collectives import _gossip
  _check_inner("inner", inner)
  spec = _compressor.spec_of(compressor)
  if spec.codec.message is None:
    raise ValueError(
      f"compressor {spec.codec.name} has no gossip message; choco takes "
      "jaxcomm.topk (without value_bits), jaxcomm.randomk or "
      "jaxcomm.ef_signsgd")
  if spec.start_step:
    raise ValueError(f"compressor: choco compresses from the first step; "
                     f"got start_step={spec.start_step}")
  gamma = _checks.number("gamma", gamma, 0.0, 1.0, lo_open=True)
  _checks.choice("topology", topology, CHOCO_TOPOLOGIES)
  _compressor._check_axis_name(axis_name)
  seed = _checks.integer("seed", seed, 0)
  inner = optax.with_extra_args_support(inner)
  codec = spec.codec

  def buffers(params):
    _, layouts, _, dense = _choco_parts(spec, params)
    leaves = jax.tree.leaves(params)
    sizes = [lay.size for lay in layouts] + [
      sum(int(np.size(leaves[i])) for i in dense)]
    return tuple(jnp.zeros((s,), jnp.float32) for s in sizes)

  def init_fn(params):
    for path, leaf in zip(jax.tree.leaves(jax.tree.map(
        lambda x: jnp.iscomplexobj(x), params)), jax.tree.leaves(params)):
      if path:
        raise ValueError("jaxcomm.choco: complex params are not supported, "
                         f"got a {leaf.dtype} leaf")
    zeros = buffers(params)
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32),
                      compress=ChocoState(public=zeros, mixed=zeros,
                                          key=jax.random.PRNGKey(seed)))

  def update_fn(updates, state, params=None, **extra_args):
    n, u, inner_new, ok = _gossip_inner_step(
      "choco", inner, axis_name, updates, state, params, ChocoState,
      extra_args)
    p_leaves, treedef = jax.tree.flatten(params)
    u_leaves = jax.tree.leaves(u)
    half = [p.astype(jnp.float32) + jnp.where(ok, d, 0).astype(jnp.float32)
            for p, d in zip(p_leaves, u_leaves)]
    _, layouts, comp, dense = _choco_parts(spec, params)
    xs = [_buckets.flatten([half[comp[j]] for j in lay.leaves])
          for lay in layouts] + [_buckets.flatten([half[i] for i in dense])]
    cs = state.compress
    key, step_key = jax.random.split(cs.key)
    index = _core.axis_index(axis_name)

    # This device's messages: one per bucket, the dense leaves as they are.
    words, own = [], []
    for lay, x, pub in zip(layouts, xs, cs.public):
      w, q = codec.message(x - pub, _choco_context(n, lay, index,
                                                    state.count, step_key))
      words.append(w)
      own.append(q)
    own.append(xs[-1] - cs.public[-1])
    words.append(_core.to_words(own[-1]))
    sizes = [int(w.shape[0]) for w in words]
    msg = jnp.concatenate(words) if words else jnp.zeros((0,), jnp.uint32)

    def decode(flat):
      parts = _buckets.unflatten(flat, [(s,) for s in sizes])
      out = [codec.decode(w, _choco_context(n, lay, index, state.count,
                                            step_key))
             for lay, w in zip(layouts, parts[:-1])]
      return out + [_core.from_words(parts[-1], jnp.float32)]

    mixed_q = _gossip.gossip_messages(msg, own, decode, axis_name, topology)
    public = [p + q for p, q in zip(cs.public, own)]
    mixed = [m + q for m, q in zip(cs.mixed, mixed_q)]
    new_x = [x + gamma * (m - p) for x, m, p in zip(xs, mixed, public)]

    out = [jnp.zeros_like(p) for p in p_leaves]
    for lay, x in zip(layouts, new_x[:-1]):
      for j, leaf in zip(lay.leaves, lay.split(x)):
        i = comp[j]
        out[i] = (leaf - p_leaves[i].astype(jnp.float32)).astype(
          p_leaves[i].dtype)
    offset = 0
    for i in dense:
      size = int(np.size(p_leaves[i]))
      leaf = new_x[-1][offset:offset + size].reshape(p_leaves[i].shape)
      out[i] = (leaf - p_leaves[i].astype(jnp.float32)).astype(
        p_leaves[i].dtype)
      offset += size
    return jax.tree.unflatten(treedef, out), LocalState(
      count=state.count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
      compress=ChocoState(public=tuple(public), mixed=tuple(mixed), key=key))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, ChocoSpec(spec, topology)), update_fn)



# ------------------------------------------------- SGP (push-sum SGD) ----

class PushSumState(NamedTuple):
  """SGP's push-sum weight ``w_i`` (float32, per device): the params a
  device holds are the de-biased ``z_i = x_i / w_i``."""

  weight: jax.Array


# Push-sum's weight is the device's share of the mass on the old graph: it
# restarts at 1 (the de-biased params become the numerators).
_per_device.register(PushSumState, weight=_per_device.restart(1.0))


@dataclasses.dataclass(frozen=True)
class PushSumSpec:
  """Wire accounting of :func:`sgp`: one collective-permute of the params
  and the weight (float32) per matching class of the step's graph."""

  topology: Any
  adaptive: bool = False
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None) -> list:
    from jaxcomm.collectives import _gossip  # pylint: disable=import-outside-toplevel
    size = sum(int(np.size(l)) for l in jax.tree.leaves(params)) + 1
    return _gossip.push_sum_wire(self.topology, n, size, step)


@_registry.method(
    family="local",
    paper="Assran et al. 2019",
    summary=(
      "stochastic gradient push: push-sum over the directed exponential "
      "graph or any directed graph (`x / w` de-biases column-stochastic "
      "mixing)"),
    gossip=True)
def sgp(inner: optax.GradientTransformation, *, topology="exponential",
        axis_name="data") -> optax.GradientTransformationExtraArgs:
  """Stochastic gradient push: decentralized SGD over a directed graph.

  Each step, on device ``i`` (Assran et al. 2019, Algorithm 1, push-sum
  of Kempe et al. 2003):

  .. math::
    x_i &= w_i z_i + \\mathrm{inner}(g_i(z_i)) \\\\
    (x_i, w_i) &\\leftarrow \\textstyle\\sum_j p_{ij} (x_j, w_j), \\quad
      z_i = x_i / w_i

  ``p_ji = 1 / (1 + d_i)``: a device keeps one share and pushes one to each
  of its ``d_i`` out-neighbours; no device needs to know who sends to it,
  so links may be one-way and in-degrees unequal (the mixing is only
  column stochastic; dividing by the push-sum weight ``w_i`` removes the
  bias this gives). The params a device holds are ``z_i``; ``w_i`` is in
  the state. Params and weight travel as one float32 buffer, one
  collective-permute per class of edges in which every device sends and
  receives at most once.

  Args:
    inner: the optimizer each device applies to its own gradient.
    topology: ``"exponential"`` (SGP's one-peer directed exponential
      graph: in step ``k`` device ``i`` sends to ``i + 2^(k mod log2 n)``;
      its weights stay 1, so it is D-PSGD on that graph) or a list of
      each device's out-neighbours (a fixed directed graph).
    axis_name: the data axis.
  """
  # pylint: disable=import-outside-toplevel
  from jaxcomm.collectives import _gossip
  _check_inner("inner", inner)
  if isinstance(topology, str):
    _checks.choice("topology", topology, ("exponential",))
  else:
    topology = _gossip.check_directed_graph(topology)
  _compressor._check_axis_name(axis_name)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32),
                      compress=PushSumState(weight=jnp.ones([], jnp.float32)))

  def update_fn(updates, state, params=None, **extra_args):
    _, u, inner_new, ok = _gossip_inner_step(
      "sgp", inner, axis_name, updates, state, params, PushSumState,
      extra_args)
    p_leaves, treedef = jax.tree.flatten(params)
    w = state.compress.weight
    x = [w * p.astype(jnp.float32) + jnp.where(ok, d, 0).astype(jnp.float32)
         for p, d in zip(p_leaves, jax.tree.leaves(u))]
    flat = jnp.concatenate([_buckets.flatten(x, jnp.float32),
                            w.astype(jnp.float32)[None]])
    mixed = _gossip.push_sum_mix(flat, axis_name, topology, state.count)
    new_w = mixed[-1]
    z = _buckets.unflatten(mixed[:-1] / new_w, [p.shape for p in p_leaves])
    out = jax.tree.unflatten(treedef, [
      (zi - p.astype(jnp.float32)).astype(p.dtype)
      for zi, p in zip(z, p_leaves)])
    return out, LocalState(
      count=state.count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
      compress=PushSumState(weight=new_w))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, PushSumSpec(topology)), update_fn)


__all__ = [
  "adacomm",
  "apply_updates",
  "choco",
  "diloco",
  "dpsgd",
  "local_sgd",
  "local_states",
  "overlap_local_sgd",
  "sgp",
  "zero_one_adam",
  "AdaCommSchedule",
  "ChocoState",
  "LocalState",
  "PushSumState",
  "ZeroOneAdamState",
]
