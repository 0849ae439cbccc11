"""AdaComp (Chen et al., AAAI 2018): adaptive residual gradient compression,
a per-bin selection whose count follows the gradient.

Per leaf, with ``G = e + dW`` (the residue plus the latest gradient: what
:func:`jaxcomm.compressed` hands the codec as ``x``) and ``H = G + dW`` (the
latest gradient counted twice), the leaf is cut into bins of ``L_T =
bin_size`` consecutive elements; element ``j`` is sent iff ``|H_j| >=
g_max(bin(j))``, the bin's largest ``|G|``, and it sends ``G_j``. The
residue keeps ``G - sent``.

The maxima are one reduction per group of equal shapes (``[G, bins,
L_T]`` views); the selection is one packed-mask compaction
(:func:`jaxcomm.kernels.threshold.compact_segments`) into a static capacity
per bucket, sent as top-k's ``(index, value)`` pairs. When the rule selects
more than the capacity, the largest ``|G|`` of the selection travel (a
bisection on their float32 bits, behind a ``lax.cond`` that only such a
step takes) and the rest stays in the residue.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import _rows
from jaxcomm import _vma
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import threshold as _kthreshold
from jaxcomm.kernels import topk as _topk
from jaxcomm.transforms.sparsify._sparsification import _sparse_exchange


class AdaCompState(NamedTuple):
  """AdaComp's per-device statistics, one per bucket (in
  ``CompressState.codec``).

  Attributes:
    selected: int32, coordinates the rule chose at the last step (may
      exceed the capacity: the excess stayed in the residual).
    sent: int32, coordinates this device sent at the last step (each a
      nonzero ``(index, value)`` pair; at most the capacity).
    total_sent: float32, ``sent`` summed over the steps taken (exact up
      to ``2**24``).
  """

  selected: jax.Array
  sent: jax.Array
  total_sent: jax.Array


# The default capacity, in slots per bin of the bucket: the paper's rule,
# run without a capacity on ordinary gradients (batch 8, 200 steps, bins
# of 50, momentum SGD 0.1), selected over the whole bucket 1.50 per bin on
# average on the digits MLP (90th percentile of the steps 3.05) and 1.04
# on the digits CNN (1.77); the first steps, with no residue yet (``H =
# 2G``), select 4-7. Three per bin holds the average with 2-3x headroom
# and sends half the dense bytes or less at 8 devices; the first steps and
# the peaks keep their largest ``|G|``, the rest waits in the residue.
# (The former defaults: 2 per bin of each leaf, cut by index, and a
# quarter of each bin, 12.5 of 50, which never bound but moved 2x the
# dense bytes.)
DEFAULT_CAPACITY = 3.0


def num_bins(sizes, bin_size: int) -> int:
  """Bins of a bucket: ``ceil(L / bin_size)`` per leaf of ``L``."""
  return sum(-(-int(s) // bin_size) for s in sizes)


def capacity(sizes, bin_size: int, capacity_factor: float) -> int:
  """Static slots of a bucket's message: ``ceil(capacity_factor * bins)``
  over the bucket's bins, at most its size."""
  total = sum(int(s) for s in sizes)
  return min(total, max(1, math.ceil(capacity_factor
                                     * num_bins(sizes, bin_size))))


def keep_largest(x, mask, count, cap):
  """``mask`` when it holds at most ``cap`` entries, else its ``cap``
  largest ``|x|`` (equal magnitudes first by index).

  The ``cap``-th largest magnitude is found by bisection on the float32
  bits of ``|x|`` (monotone for non-negative floats): 31 masked counts,
  run only where ``count > cap`` (a ``lax.cond``)."""
  def cut(_):
    bits = lax.bitcast_convert_type(jnp.abs(x), jnp.int32)

    def at_least(t):
      return jnp.sum(mask & (bits >= t), dtype=jnp.int32)

    def body(_, lohi):
      lo, hi = lohi
      mid = lo + (hi - lo) // 2
      ok = at_least(mid) >= cap
      return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    # at_least(lo) >= cap > at_least(hi); 2**31 values: 31 halvings. The
    # bounds vary over devices as the counts do.
    lo, _ = lax.fori_loop(0, 31, body, (
      _vma.match_varying(jnp.int32(0), count),
      _vma.match_varying(jnp.int32(0x7FFFFFFF), count)))
    above = mask & (bits > lo)
    ties = mask & (bits == lo)
    room = cap - jnp.sum(above, dtype=jnp.int32)
    # The first `room` ties by position: ties before the largest position
    # J with #ties[:J] <= room, J found by bisection too (masked counts,
    # no prefix sum: a cumsum over the bucket cost the TPU compiler 27 s on
    # the mixed model, a blocked one 1.7x the plain step's CPU memory).
    flat = ties.reshape(-1)
    where = lax.iota(jnp.int32, flat.shape[0])

    def body_j(_, lohi):
      lo_j, hi_j = lohi
      mid = lo_j + (hi_j - lo_j) // 2
      ok = jnp.sum(flat & (where < mid), dtype=jnp.int32) <= room
      return jnp.where(ok, mid, lo_j), jnp.where(ok, hi_j, mid)

    # #ties[:lo_j] <= room < #ties[:hi_j] (hi_j = L + 1: past every tie).
    rounds = max(1, int(flat.shape[0] + 1).bit_length())
    cut_at, _ = lax.fori_loop(0, rounds, body_j, (
      _vma.match_varying(jnp.int32(0), count),
      _vma.match_varying(jnp.int32(flat.shape[0] + 1), count)))
    return above | (ties & (where < cut_at).reshape(ties.shape))

  return lax.cond(count > cap, cut, lambda _: mask, None)


def _bin_mask(gv, hv, bin_size):
  """``|H| >= g_max`` of rows ``[G, L]`` cut into bins of ``bin_size``
  (the last one shorter where ``bin_size`` does not divide ``L``)."""
  count, size = gv.shape
  nb = -(-size // bin_size)
  pad = ((0, 0), (0, nb * bin_size - size))
  # Padding zeros leave each bin's max |G| (>= 0) unchanged.
  gmax = jnp.max(jnp.abs(jnp.pad(gv, pad)).reshape(count, nb, bin_size),
                 axis=-1)                                       # [G, bins]
  # The comparison on the leaves' own [G, size] layout, each element
  # taking its bin's maximum: a [G, bins, L_T] mask pads L_T (16) to 128
  # lanes on TPU (block mode on two v6e slices: 1.78x -> 1.35x the plain
  # step's memory per chip). The bin comes from an iota, not from
  # jnp.repeat's index array, a constant the size of the leaf (sharded
  # on two v6e slices: 1.42x -> 1.34x).
  which = lax.broadcasted_iota(jnp.int32, (1, size), 1) // bin_size
  gmax = jnp.take_along_axis(gmax, jnp.broadcast_to(which, hv.shape),
                             axis=1, mode="clip")
  return (jnp.abs(hv) >= gmax) & (gv != 0)


def selection_mask(x, grad, layout, bin_size):
  """``|H| >= g_max(bin)`` with ``H = x + grad`` and ``g_max`` the bin's
  largest ``|x|``; bins of ``bin_size`` consecutive elements of each leaf
  (a leaf's last bin is shorter where ``bin_size`` does not divide it).
  Zeros of ``x`` are not selected (they carry nothing)."""
  h = x + grad
  runs = [(g.offset, g.count, g.leaf_size) for g in layout.groups]
  parts = [None] * len(runs)
  # Short leaves of similar sizes as rows of one batch (jaxcomm._rows),
  # each padded with zeros to a whole number of bins: a bin of padding
  # has g_max 0 and its zeros are never selected. A hundred small leaves
  # of their own each left ~30 small buffers to the TPU compiler (one
  # per bin from the gather below): 47 MiB of 16 KiB slots on the mixed
  # model (v5e), 7.2x the plain step's memory per chip.
  batches, alone = _rows.plan(runs, multiple=bin_size)
  for b in batches:
    gx = b.gather(x)
    # H gathered as G + g, not from a sum over the bucket (which the
    # gather would make the compiler hold whole).
    m = _bin_mask(gx, gx + b.gather(grad), bin_size)
    for (i, _, _, _), flat in zip(b.members, b.unpad(m)):
      parts[i] = flat
  views_x, views_h = layout.views(x), layout.views(h)
  for i in alone:
    parts[i] = _bin_mask(views_x[i], views_h[i], bin_size).reshape(-1)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


@dataclasses.dataclass(frozen=True)
class AdaCompCodec(_codec.CodecBase):
  """Per bin, ``|H| >= g_max`` selects exact ``(index, value)`` pairs, at
  most a static capacity per bucket (the largest ``|G|`` when more are
  selected), in :func:`topk`'s all-gather; the state is an
  :class:`AdaCompState` per bucket.

  Attributes:
    bin_size: ``L_T``, elements per bin.
    capacity_factor: message slots per bin of the bucket.
  """

  bin_size: int = 50
  capacity_factor: float = DEFAULT_CAPACITY
  wants_gradient = True

  @property
  def name(self):
    return f"adacomp({self.bin_size})"

  def _cap_of(self, layout):
    return capacity(layout.sizes, self.bin_size, self.capacity_factor)

  def init(self, layout):
    bin_size = self.bin_size
    for shape, size in zip(layout.shapes, layout.sizes):
      if size < bin_size:
        raise ValueError(
          f"adacomp: bin_size={bin_size} exceeds a compressed leaf of shape "
          f"{tuple(shape)} ({size} elements); pass a smaller bin_size, or "
          "keep such leaves out of compression with a jaxcomm.LeafPolicy "
          "(min_size or a mask)")
    return AdaCompState(selected=jnp.zeros([], jnp.int32),
                        sent=jnp.zeros([], jnp.int32),
                        total_sent=jnp.zeros([], jnp.float32))

  def apply(self, x, state, ctx):
    layout = ctx.layout
    cap = self._cap_of(layout)
    mask = selection_mask(x, ctx.grad, layout, self.bin_size)
    count = jnp.sum(mask, dtype=jnp.int32)
    mask = keep_largest(x, mask, count, cap)
    vals, gi, _ = _kthreshold.compact_segments(
      x, _topk.pack_mask(mask), (0, layout.size), (cap,))
    vals = jnp.where(gi < layout.size, vals, 0.0)
    mean, sent = _sparse_exchange(vals, gi, ctx)
    n_sent = jnp.minimum(count, cap)
    new = AdaCompState(
      selected=count,
      sent=n_sent.astype(jnp.int32),
      total_sent=state.total_sent + n_sent.astype(jnp.float32))
    return _codec.CodecResult(mean=mean, sent=sent, state=new)

  def wire(self, layout, n):
    return _sparse.sparse_psum_wire(self._cap_of(layout), layout.size, n)


@_registry.method(
    gap=(
      "per-bin selection on the conv net's small kernels sends little; "
      "-1.3 on the char-LSTM"),
    paper="Chen et al. 2018 (AdaComp)",
    summary="per-bin |H| >= bin max of |G| (pairs), EF",
    defaults={"bin_size": 50},
    static=("capacity_factor",))
@_compressor.shared_options
def adacomp(bin_size: int | None = None, *,
            capacity_factor: float | None = None, axis_name="data",
            error_feedback: bool = True, policy=None, seed: int = 0,
            **options):
  """AdaComp: adaptive residual gradient compression.

  Per leaf, ``G = e + g`` (the residue plus the latest gradient, ``x`` of
  :func:`jaxcomm.compressed`) and ``H = G + g`` (the latest gradient
  counted twice) are cut into bins of ``bin_size`` consecutive elements;
  element ``j`` is sent iff ``|H_j| >= g_max``, its bin's largest ``|G|``,
  as an exact ``(index, value = G_j)`` pair, and the residual keeps ``G -
  sent``. The number selected follows the gradient; the message has a
  static capacity of ``ceil(capacity_factor * bins)`` pairs per bucket
  (``bins``: its leaves' bins, ``ceil(L / bin_size)`` each). When the rule
  selects more, the largest ``|G_j|`` of the selection travel (equal
  magnitudes first by index) and the rest stays in the residual, to
  compete again at the next step (nothing is dropped with error feedback).
  The exchange is the all-gather of :func:`jaxcomm.topk`, sized by the
  capacity.

  The default capacity, 3 slots per bin, is sized to the rule's measured
  rate with headroom: without a capacity (digits MLP and CNN, batch 8, 200
  steps, bins of 50) it selected 1.0-1.5 per bin of the model on average
  (90th percentile of the steps 1.8-3.1); the first steps, with no residue
  yet (``H = 2G``), select 4-7 and are cut to their largest. At 8 devices
  the all-gather moves about half the bytes of a dense mean (with 32-bit
  indices; a third with 16-bit ones). A larger ``capacity_factor`` cuts
  less and sends more: ``AdaCompState.selected`` against ``sent`` shows
  how often it binds.

  The achieved message size is kept per bucket and device in the state's
  codec part (an ``AdaCompState``: the last step's ``selected`` and
  ``sent`` counts, int32, and their float32 sum ``total_sent``), e.g.
  ``jaxcomm.compress_states(state)[0].codec[0].sent``.

  Departs from the paper in stated ways: the sent values travel in float32
  (the paper also quantizes them; its quantizer is not reproduced here); a
  leaf whose size ``bin_size`` does not divide ends in a shorter bin;
  coordinates where ``G`` is exactly 0 are not sent (they carry nothing).
  With ``momentum`` (DGC's correction), ``g`` in ``H`` is the momentum
  ``u`` added to the residual.

  Args:
    bin_size: ``L_T``, elements per bin, at least 1 and at most the size of
      every compressed leaf (static; default 50, the paper's for
      convolutions; it uses 500 for fully connected layers). A larger one
      raises at init.
    capacity_factor: message slots per bin of the bucket, at least 1
      (static; default 3, or ``bin_size`` if smaller).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent (the paper's residue).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`: with error feedback its residual
    holds what each device has not sent yet, and its ``codec`` holds an
    ``AdaCompState`` per bucket.

  Raises:
    ValueError: naming the argument, for a ``bin_size`` that is not an
      int ``>= 1``, a ``capacity_factor`` below 1 (or traced), or an
      ``axis_name``, ``error_feedback``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses. ``tx.init`` raises one when
      ``bin_size`` exceeds a compressed leaf.

  Examples:
    Bins of 4: device ``i`` (1 to 8) has the gradient ``i * [4, 1, 3,
    0.5, -2, 2, 0.5, 1]``. At the first step (no residue, ``H = 2G``) an
    element is sent where ``|G|`` is at least half its bin's largest:
    ``4, 3`` of the first bin and ``-2, 2, 1`` of the second, 5 pairs per
    device, which the state counts:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.adacomp(4, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.codec[0].sent[None]
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array(
    ...   [4.0, 1, 3, 0.5, -2, 2, 0.5, 1])
    >>> update, sent = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(update).round(3), np.asarray(sent))
    [18.   0.  13.5  0.  -9.   9.   0.   4.5] [5 5 5 5 5 5 5 5]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.adacomp(50), optax.sgd(0.1, momentum=0.9))

  References:
    Chen et al, `AdaComp: Adaptive Residual Gradient Compression for
    Data-Parallel Distributed Training <https://arxiv.org/abs/1712.02679>`_,
    AAAI 2018.
  """
  # Static arguments default to None: optax.inject_hyperparams then keeps
  # them out of the traced hyperparameters unless the caller passes them.
  bin_size = _checks.integer("bin_size", 50 if bin_size is None else bin_size,
                             1)
  capacity_factor = _checks.static_number(
    "capacity_factor", capacity_factor,
    float(min(DEFAULT_CAPACITY, bin_size)), 1.0)
  return _compressor.compressed(
    AdaCompCodec(bin_size, capacity_factor),
    axis_name=axis_name, error_feedback=error_feedback, policy=policy,
    seed=seed, **options)


__all__ = ["adacomp"]
