"""The local-update engine: one step for every method that lets params
differ between syncs (:func:`_local_engine`), its state, and
:func:`jaxcomm.apply_updates`, which makes devices agree bit for bit after
a sync.

The engine runs the local step, the non-finite guard, the sync schedule
and a ``lax.switch`` whose branches hold the collectives, so a step that
does not sync issues none. The state keeps ``anchor``, the last
synchronised model (replicated), and ``synced``, which leaves every device
holds equal to ``anchor`` after this step.
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
from jaxcomm import _vma
from jaxcomm import wire
from jaxcomm.collectives import _core


class LocalState(NamedTuple):
  """State of a local-update or gossip optimizer.

  Every local-update method (:func:`jaxcomm.local_sgd`,
  :func:`jaxcomm.adacomm`, :func:`jaxcomm.overlap_local_sgd`,
  :func:`jaxcomm.lupa_sgd`, :func:`jaxcomm.hierarchical_sgd`,
  :func:`jaxcomm.diloco`, :func:`jaxcomm.muloco`, :func:`jaxcomm.fedcom`,
  :func:`jaxcomm.fedcomgate`) keeps one; the gossip methods
  (:func:`jaxcomm.dpsgd`, :func:`jaxcomm.choco`, :func:`jaxcomm.sgp`,
  :func:`jaxcomm.dcd_psgd`, :func:`jaxcomm.ecd_psgd`,
  :func:`jaxcomm.squarm`) keep one with ``anchor`` and ``synced`` empty
  (``()``: their devices never set their params to a common value) and
  their gossip memory in ``compress``.

  Attributes:
    count: steps taken (``int32``, the same on every device).
    anchor: the last synchronised model, params-shaped, the same on every
      device (DiLoCo's global params, Overlap Local SGD's anchor).
    synced: params-shaped booleans: which leaves every device set to
      ``anchor`` in this step (read by :func:`jaxcomm.apply_updates`).
    inner: the inner optimizer's state (per device).
    skipped: local steps this device skipped because its gradient or its
      updated params were not finite, and syncs skipped because their
      result was not finite in the params' dtypes (``int32``, per
      device).
    outer: DiLoCo: one outer-optimizer state per fragment (replicated).
    compress: DiLoCo: one compressor state per fragment; FedCOM and
      hierarchical SGD: their compressor's state; the gossip methods:
      their memory (:class:`jaxcomm.ChocoState`,
      :class:`jaxcomm.PushSumState`, :class:`jaxcomm.ReplicaState`,
      :class:`jaxcomm.SquarmState`).
    schedule: ADACOMM: an :class:`jaxcomm.AdaCommSchedule`; LUPA-SGD: a
      :class:`jaxcomm.LupaSchedule`; FedCOMGATE: a
      :class:`jaxcomm.FedcomState`.
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
  """Every :class:`jaxcomm.LocalState` in an optimizer state, in order.

  Args:
    opt_state: an optimizer state: a local-update or gossip optimizer's
      own, or one that holds it (an ``optax.chain``'s, for instance).

  Returns:
    A list of the :class:`jaxcomm.LocalState` values found, in tree
    order; empty when there is none.
  """
  return _compressor.states_of(opt_state, LocalState)


def apply_updates(params, updates, opt_state):
  """``optax.apply_updates``, then synced leaves set to the anchor exactly.

  Every leaf a local-update optimizer synchronised in this step (its
  state's ``synced`` flag) is set to the state's ``anchor``.
  ``params + (anchor - params)`` rounds differently on devices whose params
  differ, so after a sync they would agree only to float rounding; this
  makes them agree bit for bit. Without a :class:`jaxcomm.LocalState` in
  ``opt_state``, or with a gossip optimizer's (which never syncs), it is
  ``optax.apply_updates``. Use it in a hand-written ``shard_map`` step
  (:class:`jaxcomm.parallel.DataParallel` calls it for you).

  Args:
    params: this device's params (the same tree ``tx.update`` was given).
    updates: the updates ``tx.update`` returned.
    opt_state: the new optimizer state ``tx.update`` returned (the
      local-update state itself, or a state that holds it, such as an
      ``optax.chain``'s).

  Returns:
    The new params, a tree like ``params``.

  Raises:
    ValueError: when ``opt_state`` holds more than one
      :class:`jaxcomm.LocalState` (use one local-update optimizer per
      train step).

  Examples:
    A hand-written step of :func:`jaxcomm.local_sgd` with ``period=1`` on
    8 devices whose params differ: after the sync every device holds the
    same value, bit for bit, the mean of the locally updated params
    (``mean(w - 0.5 g) = 3.5 - 0.5 * 1 = 3.0``):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> tx = jaxcomm.local_sgd(optax.sgd(0.5), period=1)
    >>> def step(w, g):                  # this device's params, gradient
    ...   state = tx.init(w)
    ...   updates, state = tx.update(g, state, w)
    ...   return jaxcomm.apply_updates(w, updates, state)
    >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"),
    ...                           out_specs=P("data")))
    >>> w = f(jnp.arange(8.0), jnp.ones(8))     # device i: w = i, g = 1
    >>> np.asarray(w, np.float64).tolist()
    [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
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
  """The device average of ``leaves`` (one fused float32 psum; complex
  leaves as real and imaginary pairs), each back in its own dtype."""
  n = _core.axis_size(axis_name)
  if not leaves:
    return []
  tot = _core.psum(_buckets.flatten_real(leaves), axis_name)
  return _buckets.unflatten_like(tot / n, leaves)


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

  def _fragment_wire(self, frag_params, n: int, sync_index,
                     splits=None) -> list:
    if self.compressor is not None:
      spec = _compressor.spec_of(self.compressor)
      if splits is not None:
        return list(spec.wire(frag_params, n, sync_index, splits=splits))
      return list(spec.wire(frag_params, n, sync_index))
    size = sum(int(np.size(l)) for l in jax.tree.leaves(frag_params))
    return [("all-reduce", 4 * (size + self.extra_floats))]

  def wire(self, params, n: int, step: int | None = None,
           splits=None) -> list:
    leaves = jax.tree.leaves(params)
    groups = fragment_leaves(params, self.fragments)
    part = ((lambda g: None) if splits is None
            else (lambda g: [splits[j] for j in g]))
    if step is None:
      out = []
      for g in groups:
        out.extend(self._fragment_wire([leaves[j] for j in g], n, None,
                                       part(g)))
      return out
    if self.adaptive:
      raise ValueError(
        "adacomm's sync steps follow the training loss: pass step=None for "
        "the collectives of one sync")
    count = step + 1
    out = []
    for f in self.syncing(count):
      out.extend(self._fragment_wire([leaves[j] for j in groups[f]], n,
                                     self._syncs_before(f, count),
                                     part(groups[f])))
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
    total = 0.0
    for s in range(steps):
      total += wire.summarize(self.wire(params, n, s), n).total_sent
    return total / max(steps, 1)


def _local_engine(inner, *, method: str, axis_name, period: int,
                  start_step: int = 0, fragments: int = 1,
                  sync_fns=None, init_extra=None, schedule_fn=None,
                  merge=None, spec: LocalSpec, correct=None,
                  levels: int = 1):
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
    correct: ``(updates, state) -> updates`` applied to the gradient before
      the local step (FedCOMGATE's tracking correction); None: as given.
    levels: with ``fragments == 1``, the number of sync branches, each on
      every leaf (``sync_fns[k]`` and ``do[k]``: hierarchical averaging's
      group and global syncs); 1: one branch per fragment.
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
    _checks.state_type(f"jaxcomm.{method}", state, LocalState)
    _core.check_axis(axis_name, f"jaxcomm.{method}", grads=updates)
    treedef = jax.tree.structure(params)
    p_leaves = jax.tree.leaves(params)
    # The local step: each device on its own gradient, nothing sent.
    if correct is not None:
      updates = correct(updates, state)
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
    frag_of = {j: f for f, g in enumerate(groups) for j in g}
    if levels > 1:   # every branch on every leaf
      groups = [list(range(len(x)))] * levels
    nb = len(groups)

    # Which branch: fragment f syncs (the first that does; offsets are
    # distinct modulo the period), or none (index F, no collective).
    index = jnp.int32(nb)
    for f in reversed(range(nb)):
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

    branches = [run_fragment(f) for f in range(nb)] + [no_sync]
    before = (x, anchor, state.outer, state.compress, schedule)
    after = switch(index, branches, before)
    # A sync whose result is not finite in the params' dtypes (an outer
    # step past float16's range, a mean past bfloat16's) is skipped: the
    # params stay this step's local ones and the anchor, outer, compressor
    # and schedule states as they were; the step is counted. The anchor
    # is computed from averaged values, the same on every device, and so
    # is the decision taken on it (its type stays unvarying); params a
    # device's own sync result takes past the range are kept there.
    anchor_ok = _all_finite(after[1])
    x_ok = anchor_ok & _all_finite(after[0])
    _, anchor, outer, comp, schedule = _where(anchor_ok, after, before)
    x = _where(x_ok, after[0], before[0])
    skipped = skipped + jnp.where(ok & ~x_ok, 1, 0).astype(jnp.int32)

    if merge is not None:
      x, synced_l = merge(count, x, anchor, frag_of)
    else:
      synced_l = [do[frag_of[j]] & anchor_ok for j in range(len(x))]
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


__all__ = [
  "apply_updates",
  "local_states",
  "AdaCommSchedule",
  "LocalState",
]
