"""SparCML (Renggli et al. 2019): a sparse all-reduce of top-k messages
that streams (index, value) pairs while the sum is sparse and switches to
dense values once the union of the devices' supports passes the
break-even density.

The all-reduce is the paper's split allgather (``SSAR_Split_allgather``,
and ``DSAR_Split_allgather`` once dense): the bucket's index space is cut
into ``n`` ranges of ``m = ceil(L / n)`` positions, one owned by each
device.

1. **Sparse reduce-scatter.** Each device sends the owner of every range
   its selected pairs in that range (one all-to-all); the owner adds them
   into its range.
2. **All-gather of the reduced ranges.** Each owner's sum holds the union
   of the devices' supports in its range. While that union is small it
   travels as pairs (the sparse stream); once some owner's union passes
   the break-even density (pairs as large as the range's dense values) it
   travels dense. A 4-byte all-reduce of the largest union decides, the
   same way on every device.

Each phase moves at most what the dense all-reduce's matching phase moves
(its reduce-scatter, then its all-gather), plus the 4-byte count.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.collectives import _sparse
from jaxcomm.transforms.sparsify import _sparsification as _sp

SPARSE, DENSE, SWITCH = "sparse", "dense", "switch"


class SparcmlState(NamedTuple):
  """SparCML's state, one per bucket (in ``CompressState.codec``; the same
  on every device).

  Attributes:
    union: int32, the largest union of the devices' supports in one
      owner's range at the last step (positions received there, counted
      once; 0 where the reduce-scatter was dense).
    dense_steps: int32, steps whose all-gather went dense.
  """

  union: jax.Array
  dense_steps: jax.Array


class Plan(NamedTuple):
  """The static shape of one bucket's exchange on ``n`` devices.

  Attributes:
    m: positions per owner's range (``ceil(L / n)``).
    c1: pairs per (device, owner) message of the reduce-scatter: the most
      of one device's selection that can fall in one range, ``max_j sum_l
      min(k_l, |leaf_l in range_j|)`` (nothing can overflow it).
    scatter: ``"sparse"``, or ``"dense"`` where ``c1`` pairs take as many
      words as the range's ``m`` values.
    c2: pairs per owner in the sparse all-gather: the largest union that
      can occur, capped at the break-even (pairs in fewer words than
      ``m`` values).
    gather: ``"sparse"`` (the union always fits ``c2``), ``"dense"`` (no
      pair fits under the break-even, or the reduce-scatter is dense:
      once dense, the exchange stays dense, as the paper's DSAR) or
      ``"switch"`` (decided each step on the measured union).
  """

  m: int
  c1: int
  scatter: str
  c2: int
  gather: str


def _leaves(layout):
  """Static ``(start, size)`` of every leaf of the bucket."""
  out = []
  for g in layout.groups:
    for r in range(g.count):
      out.append((g.offset + r * g.leaf_size, g.leaf_size))
  return out


def _break_even(m: int) -> int:
  """The most pairs whose message is smaller than ``m`` float32 values."""
  c = m
  while c > 0 and _sparse.message_words(c, m) >= m:
    c -= 1
  return c


def plan(layout, n: int, ratio: float) -> Plan:
  """The exchange of ``layout``'s bucket on ``n`` devices (static)."""
  size = layout.size
  m = -(-size // n)
  lo = np.arange(n, dtype=np.int64) * m
  hi = lo + m
  cap = np.zeros(n, np.int64)
  for start, length in _leaves(layout):
    k = _sp.num_selected(ratio, length)
    inside = np.clip(np.minimum(hi, start + length) - np.maximum(lo, start),
                     0, None)
    cap += np.minimum(k, inside)
  c1 = max(1, int(cap.max()))
  scatter = SPARSE if _sparse.message_words(c1, m) < m else DENSE
  worst = int(min(m, n * cap.max()))
  best = _break_even(m)
  c2 = max(1, min(worst, best))
  if best < 1 or scatter == DENSE:
    gather = DENSE
  elif worst <= best:
    gather = SPARSE
  else:
    gather = SWITCH
  return Plan(m, c1, scatter, c2, gather)


def _route(vals, pos, p: Plan, n: int):
  """Each selected pair into its owner's row: ``[n, c1]`` values and
  in-range positions (``m``: an empty slot)."""
  pos, vals = jax.lax.sort((pos, vals), num_keys=1)
  owner = pos // p.m
  first = jnp.searchsorted(owner, owner, side="left").astype(jnp.int32)
  slot = owner * p.c1 + jnp.arange(pos.shape[0], dtype=jnp.int32) - first
  v = _core.zeros_after(n * p.c1, pos).at[slot].set(vals)
  i = (_core.zeros_after(n * p.c1, pos, jnp.int32) + p.m).at[slot].set(
    pos - owner * p.m)
  return v.reshape(n, p.c1), i.reshape(n, p.c1)


@dataclasses.dataclass(frozen=True)
class SparcmlCodec(_codec.CodecBase):
  """Top-k per leaf, summed by SparCML's split-allgather sparse
  all-reduce (sparse reduce-scatter; sparse or dense all-gather by the
  measured union).

  Attributes:
    ratio: fraction of each leaf's coordinates selected, in ``(0, 1]``.
  """

  ratio: float
  granularity: ClassVar[str] = "leaf"

  @property
  def name(self):
    return f"sparcml({self.ratio})"

  check_layouts = _sp._check_selects_one("sparcml")

  def init(self, layout):
    return SparcmlState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

  def apply(self, x, state, ctx):
    lay, n, axis = ctx.layout, ctx.num_devices, ctx.axis_name
    p = plan(lay, n, self.ratio)
    vals, pos = _sp._local_topk(x, _sp._segments(lay), self.ratio)
    sent = _core.zeros_after(lay.size, pos).at[pos].set(vals)
    # 1. Reduce-scatter: my pairs (or values) of range j to device j.
    if p.scatter == SPARSE:
      v, i = _route(vals, pos, p, n)
      words = jax.vmap(lambda a, b: _sparse.pack_pairs(a, b, p.m))(v, i)
      got = _core.all_to_all(words, axis, 0, 0)
      gv, gi = _sparse.unpack_pairs(got, p.c1, p.m)
      gi = gi.reshape(-1)
      acc = _core.zeros_after(p.m, gi).at[gi].add(gv.reshape(-1),
                                                   mode="drop")
    else:
      rows = jnp.pad(sent, (0, n * p.m - lay.size)).reshape(n, p.m)
      acc = jnp.sum(_core.all_to_all(rows, axis, 0, 0), axis=0)
    # 2. All-gather of the owners' sums: pairs while the union is small.
    # The union of the supports in my range, from the positions received
    # (sorted, repeats and empty slots last): no pass over the range.
    if p.scatter == SPARSE:
      got_at = jnp.sort(gi)
      fresh = jnp.concatenate([jnp.ones((1,), bool),
                               got_at[1:] != got_at[:-1]]) & (got_at < p.m)
      nnz = jnp.sum(fresh.astype(jnp.int32))
      union_at = jnp.sort(jnp.where(fresh, got_at, p.m))[:p.c2]
    else:
      nnz = jnp.sum((acc != 0).astype(jnp.int32))
      union_at = None
    union = _core.pmax(nnz, axis)

    def sparse(a):
      idx = union_at
      val = jnp.where(idx < p.m, a[jnp.minimum(idx, p.m - 1)], 0.0)
      words = _core.all_gather(_sparse.pack_pairs(val, idx, p.m), axis,
                               tiled=True).reshape(n, -1)
      gv, gi = _sparse.unpack_pairs(words, p.c2, p.m)
      base = jnp.arange(n, dtype=jnp.int32)[:, None] * p.m
      at = jnp.where(gi < p.m, gi + base, n * p.m).reshape(-1)
      total = _core.zeros_after(n * p.m, at).at[at].set(gv.reshape(-1),
                                                        mode="drop")
      return total[:lay.size]

    def dense(a):
      return _core.all_gather(a, axis, tiled=True)[:lay.size]

    if p.gather == SPARSE:
      total, went_dense = sparse(acc), jnp.zeros([], bool)
    elif p.gather == DENSE:
      total, went_dense = dense(acc), jnp.ones([], bool)
    else:
      went_dense = union > p.c2
      total = jax.lax.cond(went_dense, dense, sparse, acc)
    new = SparcmlState(union.astype(jnp.int32),
                       state.dense_steps + went_dense.astype(jnp.int32))
    return _codec.CodecResult(mean=total / n, sent=sent, state=new)

  def wire(self, layout, n):
    p = plan(layout, n, self.ratio)
    out = [("all-to-all", 4 * n * (_sparse.message_words(p.c1, p.m)
                                   if p.scatter == SPARSE else p.m)),
           ("all-reduce", 4)]
    if p.gather != DENSE:
      out.append(("all-gather", 4 * n * _sparse.message_words(p.c2, p.m)))
    if p.gather != SPARSE:
      out.append(("all-gather", 4 * n * p.m))
    return out


@_registry.method(
    gap=(
      "top-k 1% with a sparse reduce-scatter: as top-k"),
    paper="Renggli et al. 2019 (SparCML)",
    summary="top-k, sparse reduce-scatter, all-gather of pairs or dense "
    "values by the measured union (never above dense), EF",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def sparcml(ratio: float, *, axis_name="data", error_feedback: bool = True,
            policy=None, seed: int = 0, **options):
  """SparCML: top-k summed by a sparse all-reduce that goes dense when full.

  Top-k with error feedback, summed by a sparse all-reduce that goes dense
  when the union of the devices' supports fills.

  .. math::
    s_i = \\mathrm{top}_k(g_i + e_i), \\quad u = \\frac{1}{n} \\sum_i s_i,
    \\quad e_i \\leftarrow g_i + e_i - s_i

  The sum is SparCML's split allgather (``SSAR_Split_allgather``): the
  bucket's ``L`` positions are cut into ``n`` ranges of ``m = ceil(L /
  n)``, device ``j`` owning range ``j``. (1) Each device sends owner ``j``
  its pairs in range ``j`` (one all-to-all) and the owner adds them. (2)
  The owners' sums are all-gathered: as (index, value) pairs while every
  owner's union of supports is under the break-even density (pairs in
  fewer words than the range's ``m`` float32 values), as the dense range
  once one is not (``DSAR_Split_allgather``). The largest union is one
  4-byte all-reduce; the decision is the same on every device.
  The codec state, a ``SparcmlState`` per bucket, keeps the last union and
  the steps that went dense.

  Never more than the dense all-reduce: each phase's message is smaller
  than the matching phase of a dense reduce-scatter + all-gather (the
  ring all-reduce), or is that dense message; plus 4 bytes.

  Departures (static shapes): messages have fixed capacities where the
  paper sends variable-length ones. The reduce-scatter's per-owner
  message holds the most of one device's selection that can fall in that
  range (``sum_l min(k_l, |leaf_l in range|)``, the largest over ranges),
  so no pair ever overflows, and it is dense from the start where that
  capacity reaches the range's size (the all-gather is then dense
  too). The union is counted from the positions an owner received
  (sorted once; no pass over its range), so a position whose values
  cancel to 0 still counts and travels as a 0. The all-gather's sparse
  message holds the largest union possible, capped at the break-even; where the
  cap binds, both programs are compiled and a ``lax.cond`` on the
  measured union picks one (the claim lists both, as :func:`jaxcomm.lag`
  lists its conditional all-reduce). The paper's recursive-doubling
  variant (``SSAR_Recursive_double``) is not built: its result would
  need one more broadcast to be the same typed value on every device.

  Args:
    ratio: fraction of coordinates selected per leaf, in ``(0, 1]``
      (static); one below ``1 / L`` for every leaf is refused at init.
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unselected coordinates (the paper's top-k
      SGD with error accumulation), or False.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet; its
    ``codec`` holds a ``SparcmlState`` per bucket).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), or an ``axis_name``, ``error_feedback``, ``policy`` or
      option that :func:`jaxcomm.compressed` refuses. ``tx.init`` raises
      one when ``ratio`` keeps fewer than one element of every compressed
      leaf.

  Examples:
    ``k = 2`` of 64 values: device ``d`` (0 to 7) has ``d + 1`` and
    ``-(d + 1)`` at coordinates ``4d`` and ``4d + 1``. The 8 ranges of 8
    positions each receive two devices' pairs, a union of 4, under the
    break-even: the all-gather stays sparse, and the update is the exact
    mean at all 16 coordinates sent:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.sparcml(1 / 32, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 64]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.codec[0]
    >>> d = np.arange(8)
    >>> grads = np.zeros((8, 64))
    >>> grads[d, 4 * d], grads[d, 4 * d + 1] = d + 1.0, -(d + 1.0)
    >>> update, info = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> update = np.asarray(update)
    >>> print(np.count_nonzero(update), np.allclose(update, grads.mean(0)))
    16 True
    >>> print(int(info.union), int(info.dense_steps))
    4 0

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.sparcml(0.01), optax.sgd(0.1))

  References:
    Renggli et al, `SparCML: High-Performance Sparse Communication for
    Machine Learning <https://arxiv.org/abs/1802.08021>`_, 2019.
  """
  ratio = _checks.ratio("ratio", ratio)
  return _compressor.compressed(SparcmlCodec(ratio), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["sparcml"]
