"""Sparsifying compressors: top-k, random-k, threshold, DGC, gTop-k, CSC.

Each is a :class:`jaxcomm.Codec` wrapped by :func:`jaxcomm.compressed`, which
adds error feedback (on by default: the unsent coordinates stay in the
residual), momentum correction, clipping and non-finite handling; the codecs
here only select coordinates and exchange them.

========= ============================== ==================================
name      selection                      exchange (per device, n devices)
========= ============================== ==================================
topk      k largest ``|x|``              all-gather of n (index, value)
                                         messages: ``n k (4 + b)`` bytes
randomk   k coordinates from a key       psum of k values, no indices:
          shared by all devices          ``4 k`` bytes
threshold ``|x| >= value``, at most      all-gather as top-k, capacity
          ``capacity`` (static)          ``ceil(capacity_ratio * L)``
dgc       sampled threshold + warm-up    all-gather as top-k (per stage)
          of the density
gtopk     k largest ``|x|``, globally    ``log2 n`` permutes of k pairs
          re-sparsified to k             and one broadcast of k pairs
csc       top chunks by global L1 norm   psum of chunk norms + psum of
                                         the chosen chunks (no n in it)
========= ============================== ==================================

``b`` is the index width: the smallest unsigned dtype that holds the total
number of compressed elements (:func:`jaxcomm.collectives.index_dtype`).
``k = max(1, ceil(ratio * L))`` per leaf of ``L`` elements
(``granularity="leaf"``, as DGC), or over all compressed leaves flattened
together (``granularity="model"``); ``k`` never exceeds ``L``.
"""

from __future__ import annotations

import math
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import topk as _topk

_GRANULARITIES = ("leaf", "model")
DGC_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)


def _checked_codec(make_codec, ratio, granularity, *args):
  """``make_codec(ratio, granularity, *args)`` after the checks every
  k-of-n factory shares (``ratio`` in ``(0, 1]``, a known granularity)."""
  ratio = _checks.ratio("ratio", ratio)
  _checks.choice("granularity", granularity, _GRANULARITIES)
  return make_codec(ratio, granularity, *args)


# ------------------------------------------------------------- helpers ----

def num_selected(ratio: float, size: int) -> int:
  """``k = max(1, ceil(ratio * size))``, at most ``size``.

  A relative slack of 1e-9 keeps ``0.1 * 30`` at 3 (not 4).
  """
  return max(1, min(size, math.ceil(ratio * size * (1 - 1e-9))))


class _Segs(NamedTuple):
  """Equal-length segments side by side in a bucket, one per row of a
  ``[count, size]`` view: one batched selection for all of them.

  Attributes:
    offset: element offset of the first segment in the bucket.
    count: how many segments (rows).
    size: elements per segment.
    ids: per row, the id its PRNG key is folded with (the leaf's index
      among the compressed leaves, in ``jax.tree.leaves`` order).
  """

  offset: int
  count: int
  size: int
  ids: tuple[int, ...]


def _segments(layout, granularity: str = "leaf") -> list[_Segs]:
  """The bucket's segments: one group of rows per shape (``"leaf"``), or
  the whole bucket as one segment (``"model"``)."""
  if granularity == "model":
    return [_Segs(0, 1, layout.size, (min(layout.leaves),))]
  return [_Segs(g.offset, g.count, g.leaf_size, tuple(g.leaves))
          for g in layout.groups]


def _num_pairs(segs, ratio) -> int:
  return sum(s.count * num_selected(ratio, s.size) for s in segs)


def _row_keys(key, ids) -> jax.Array:
  """Per row, ``fold_in(key, id)``."""
  return jax.vmap(lambda j: jax.random.fold_in(key, j))(
    jnp.asarray(ids, jnp.int32))


def _sparse_exchange(gv, gi, ctx):
  """sparse psum of values ``gv`` at bucket positions ``gi``
  (``layout.size``: unused slot); returns flat (mean, sent)."""
  total = ctx.layout.size
  summed = _sparse.sparse_psum(gv, gi, total, ctx.axis_name)
  sent = jnp.zeros((total,), jnp.float32).at[gi].set(gv, mode="drop")
  return summed / ctx.num_devices, sent


# -------------------------------------------------------------- top-k ----

def _local_topk(x, segs, ratio):
  """Each segment's k largest ``|x|``, all segments through
  :func:`jaxcomm.kernels.topk.topk_abs_groups`: flat (values, bucket
  positions), segment by segment."""
  sel = _topk.topk_abs_groups(
    x, [(s.offset, s.count, s.size, num_selected(ratio, s.size))
        for s in segs])
  return (jnp.concatenate([v.reshape(-1) for v, _ in sel]),
          jnp.concatenate([i.reshape(-1) for _, i in sel]))


def _slot_rows(segs, ratio) -> np.ndarray:
  """Per selected slot (in :func:`_local_topk`'s order), its row (leaf)
  among all segments' rows."""
  out, base = [], 0
  for s in segs:
    k = num_selected(ratio, s.size)
    out.append(base + np.repeat(np.arange(s.count), k))
    base += s.count
  return np.concatenate(out).astype(np.int32)


def _topk_codec(ratio, granularity, value_bits=None) -> _compressor.Codec:

  def apply(x, state, ctx):
    segs = _segments(ctx.layout, granularity)
    vals, idx = _local_topk(x, segs, ratio)
    if value_bits is None:
      mean, sent = _sparse_exchange(vals, idx, ctx)
    else:
      rows = _slot_rows(segs, ratio)
      total, own = _sparse.sparse_psum_quantized(
        vals, idx, jnp.asarray(rows), sum(s.count for s in segs),
        ctx.layout.size, value_bits, ctx.axis_name)
      mean = total / ctx.num_devices
      sent = jnp.zeros((ctx.layout.size,), jnp.float32).at[idx].set(
        own, mode="drop")
    return _compressor.CodecResult(mean=mean, sent=sent, state=state)

  def wire(layout, n):
    segs = _segments(layout, granularity)
    k = _num_pairs(segs, ratio)
    if value_bits is None:
      return _sparse.sparse_psum_wire(k, layout.size, n)
    return _sparse.sparse_psum_quantized_wire(
      k, layout.size, sum(s.count for s in segs), value_bits, n)

  def message(x, ctx):
    vals, idx = _local_topk(x, _segments(ctx.layout, granularity), ratio)
    sent = jnp.zeros((ctx.layout.size,), jnp.float32).at[idx].set(
      vals, mode="drop")
    return _sparse.pack_pairs(vals, idx, ctx.layout.size), sent

  def decode(words, ctx):
    k = _num_pairs(_segments(ctx.layout, granularity), ratio)
    vals, idx = _sparse.unpack_pairs(words, k, ctx.layout.size)
    return jnp.zeros((ctx.layout.size,), jnp.float32).at[idx].set(
      vals, mode="drop")

  name = f"topk({ratio})" if value_bits is None else (
    f"topk({ratio}, {value_bits}-bit)")
  gossip = value_bits is None
  return _compressor.Codec(name=name, init=lambda layout: (),
                           apply=apply, wire=wire, flat=True,
                           message=message if gossip else None,
                           decode=decode if gossip else None)


@_registry.method(
    family="compressor",
    paper="Aji & Heafield 2017; Stich et al. 2018",
    summary="(index, value) pairs, sparse psum, EF",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def topk(ratio: float, *, granularity: str = "leaf",
         value_bits: int | None = None, axis_name="data",
         error_feedback: bool = True, policy=None, seed: int = 0,
         **options):
  """Top-k sparsification: each device sends its k largest coordinates.

  .. math::
    x_i = g_i + e_i, \\quad s_i = x_i \\odot \\mathbb{1}[\\,|x_i|
    \\geq |x_i|_{(k)}], \\quad u = \\frac{1}{n}\\sum_i s_i, \\quad
    e_i \\leftarrow x_i - s_i

  Every device selects the ``k = max(1, ceil(ratio * L))`` entries of
  largest magnitude (exact, :func:`jaxcomm.kernels.topk_abs`; ties: lower
  index first), sends ``(index, value)`` pairs with indices in the smallest
  unsigned dtype that fits, and the sum is rebuilt from an all-gather of all
  messages (:func:`jaxcomm.collectives.sparse_psum`): ``n k (4 + b)`` bytes
  gathered per device, which grows with ``n``. With error feedback (the
  default) what was not sent is kept and added to the next gradient.

  Args:
    ratio: fraction of coordinates sent, in ``(0, 1]`` (static).
    granularity: ``"leaf"`` (k per leaf) or ``"model"`` (one k over all
      compressed leaves flattened together).
    value_bits: None (values in float32) or 1, 2, 4, 8: each selected value
      is sent as the nearest of ``2^b`` evenly spaced levels over ``[-s,
      s]``, ``s`` its leaf's largest selected ``|value|`` (one float32 per
      leaf), codes packed ``32 / b`` to a word; error feedback keeps the
      rounding error too. ``value_bits=2`` with error feedback is
      SparseLoCo's message (Sarfi et al. 2025).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates (Stich et al. 2018).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused by top-k itself).

  Example::

    tx = optax.chain(jaxcomm.topk(0.01), optax.sgd(0.1))

  References:
    Aji et al, `Sparse Communication for Distributed Gradient Descent
    <https://arxiv.org/abs/1704.05021>`_, 2017.
    Stich et al, `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, 2018.
  """
  if value_bits is not None:
    if isinstance(value_bits, bool):   # True == 1 would pass the choice
      raise ValueError(f"value_bits must be one of {_sparse.VALUE_BITS} or "
                       f"None, got {value_bits!r}")
    _checks.choice("value_bits", value_bits, _sparse.VALUE_BITS)
  return _compressor.compressed(
    _checked_codec(_topk_codec, ratio, granularity, value_bits),
    axis_name=axis_name, error_feedback=error_feedback, policy=policy,
    seed=seed, **options)


# ------------------------------------------------------------ random-k ----

# Rounds of the keyed swap-or-not permutation behind random-k's coordinates.
RANDOMK_ROUNDS = 24


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer (a bijective mix of uint32)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _swap_or_not(v, sizes, shifts, salts):
  """``RANDOMK_ROUNDS`` swap-or-not rounds on ``v`` (int32, per element),
  each element in its own domain ``[0, sizes)`` with its own round shifts
  and salts (``[T, RANDOMK_ROUNDS]``): one loop for every segment."""
  def round_(r, v):
    shift = jax.lax.dynamic_index_in_dim(shifts, r, axis=1, keepdims=False)
    salt = jax.lax.dynamic_index_in_dim(salts, r, axis=1, keepdims=False)
    partner = shift - v
    partner = jnp.where(partner < 0, partner + sizes, partner)
    top = jnp.maximum(v, partner).astype(jnp.uint32)
    swap = (_fmix32(top ^ salt) & jnp.uint32(1)) == 1
    return jnp.where(swap, partner, v)
  return jax.lax.fori_loop(0, RANDOMK_ROUNDS, round_, v)


def _randomk_flat(key, ratio: float, rows) -> jax.Array:
  """The coordinates of every row at once, as positions in the bucket.

  ``rows``: static ``(offset, size, id)`` per row (a leaf, or the whole
  bucket); row ``r`` takes ``k_r = num_selected(ratio, size_r)``
  coordinates, the images of ``0 .. k_r - 1`` under the permutation keyed
  by ``fold_in(key, id_r)`` (see :func:`randomk_indices`). The program does
  not grow with the number of rows: per-row keys, shifts and salts are one
  batched draw, and every element runs the same rounds.
  """
  offsets = np.asarray([o for o, _, _ in rows], np.int32)
  sizes = np.asarray([sz for _, sz, _ in rows], np.int32)
  ks = np.asarray([num_selected(ratio, int(sz)) for sz in sizes], np.int32)
  ends = np.cumsum(ks).astype(np.int32)
  total = int(ends[-1])

  def draws(row_key, size):
    ka, kb = jax.random.split(row_key)
    return (jax.random.randint(ka, (RANDOMK_ROUNDS,), 0, size, jnp.int32),
            jax.random.bits(kb, (RANDOMK_ROUNDS,), jnp.uint32))

  keys = _row_keys(key, [i for _, _, i in rows])
  shifts, salts = jax.vmap(draws)(keys, jnp.asarray(sizes))
  pos = jnp.arange(total, dtype=jnp.int32)
  row = _topk.segment_ids((0,) + tuple(int(e) for e in ends))
  v = pos - (jnp.asarray(ends) - jnp.asarray(ks))[row]
  v = _swap_or_not(v, jnp.asarray(sizes)[row], shifts[row], salts[row])
  return jnp.asarray(offsets)[row] + v


def _randomk_rows(key, ratio: float, size: int, ids) -> jax.Array:
  """``[len(ids), k]``: row ``r`` takes ``k`` distinct indices of ``size``
  with the permutation keyed by ``fold_in(key, ids[r])``."""
  k = num_selected(ratio, size)
  rows = [(0, size, j) for j in ids]
  return _randomk_flat(key, ratio, rows).reshape(len(ids), k)


def randomk_indices(key, ratio: float, sizes: Sequence[int],
                    ids: Sequence[int] | None = None) -> list:
  """The coordinates random-k sends for a step key (same on every device).

  Segment ``j`` of ``L_j`` elements sends ``k_j`` distinct coordinates:
  the images of ``0, ..., k_j - 1`` under a pseudo-random permutation of
  ``[0, L_j)`` keyed by ``c = jax.random.fold_in(key, ids[j])``. The
  permutation is 24 rounds of swap-or-not (Hoang, Morris and Rogaway 2012),
  which permutes a domain of any size: with ``(ka, kb) =
  jax.random.split(c)``, round ``r`` has a shift ``K_r`` (``randint(ka,
  (24,), 0, L_j)``) and a salt ``s_r`` (``bits(kb, (24,), uint32)``); it
  maps ``v`` to its partner ``v' = (K_r - v) mod L_j`` when bit 0 of
  MurmurHash3's finalizer of ``max(v, v') XOR s_r`` is 1 and leaves it
  otherwise (an involution, so a bijection). Every coordinate is equally
  likely over keys. The work is ``O(k)`` per segment, elementwise, with no
  loop on data: ``jax.random.choice`` without replacement permutes all
  ``L_j`` (a sort: over half of random-k's 10.7 ms update on ResNet-18
  shapes on an H100), and cycle-walking a power-of-two permutation needs a
  data-dependent loop. ``ids`` defaults to ``0, 1, ...``; the compressor
  uses the leaves' indices among the compressed leaves in
  ``jax.tree.leaves`` order (with ``granularity="model"``, a bucket's
  first leaf), drawing for all leaves of one shape in one batched op.
  """
  ids = range(len(sizes)) if ids is None else ids
  return [_randomk_rows(key, ratio, int(size), (j,))[0]
          for size, j in zip(sizes, ids)]


def _randomk_codec(ratio, granularity) -> _compressor.Codec:

  def apply(x, state, ctx):
    segs = _segments(ctx.layout, granularity)
    rows = [(s.offset + r * s.size, s.size, s.ids[r])
            for s in segs for r in range(s.count)]
    gi = _randomk_flat(ctx.key, ratio, rows)
    vals = x[gi]
    summed = _core.psum(vals, ctx.axis_name)
    zeros = jnp.zeros((ctx.layout.size,), jnp.float32)
    mean = zeros.at[gi].set(summed / ctx.num_devices)
    sent = zeros.at[gi].set(vals)
    return _compressor.CodecResult(mean=mean, sent=sent, state=state)

  def wire(layout, n):
    del n
    return [("all-reduce", 4 * _num_pairs(_segments(layout, granularity),
                                          ratio))]

  def indices(ctx):
    segs = _segments(ctx.layout, granularity)
    rows = [(s.offset + r * s.size, s.size, s.ids[r])
            for s in segs for r in range(s.count)]
    return _randomk_flat(ctx.key, ratio, rows)

  def message(x, ctx):
    gi = indices(ctx)        # from the shared key: the same on every device
    vals = x[gi]
    sent = jnp.zeros((ctx.layout.size,), jnp.float32).at[gi].set(vals)
    return _core.to_words(vals), sent

  def decode(words, ctx):
    vals = _core.from_words(words, jnp.float32)
    return jnp.zeros((ctx.layout.size,), jnp.float32).at[indices(ctx)].set(
      vals)

  return _compressor.Codec(name=f"randomk({ratio})", init=lambda layout: (),
                           apply=apply, wire=wire, flat=True,
                           message=message, decode=decode)


@_registry.method(
    family="compressor",
    paper="Stich et al. 2018",
    summary="values only (shared key, same coordinates everywhere)",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def randomk(ratio: float, *, granularity: str = "leaf", axis_name="data",
            error_feedback: bool = True, policy=None, seed: int = 0,
            **options):
  """Random-k sparsification with a key shared by all devices.

  .. math::
    S \\sim \\mathcal{U}\\binom{[L]}{k}, \\quad
    u_S = \\frac{1}{n}\\sum_i (x_i)_S, \\quad u_{\\bar S} = 0

  All devices draw the same ``k`` coordinates from the step key kept in the
  state (:func:`randomk_indices`), so no index travels: the ``k`` values
  are summed with one plain psum (``4 k`` bytes, independent of ``n``).
  Values are not rescaled by ``L / k``: with error feedback (the default)
  the unsent coordinates are sent later, as in Stich et al.

  Args:
    ratio: fraction of coordinates sent, in ``(0, 1]`` (static).
    granularity: ``"leaf"`` or ``"model"`` (as :func:`topk`).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the shared PRNG key.

  Example::

    tx = optax.chain(jaxcomm.randomk(0.01), optax.sgd(0.1))

  References:
    Stich et al, `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, 2018.
  """
  return _compressor.compressed(
    _checked_codec(_randomk_codec, ratio, granularity), axis_name=axis_name,
    error_feedback=error_feedback, policy=policy, seed=seed, **options)


# ----------------------------------------------------------- threshold ----

def _leaf_rows(layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Static ``(bounds, sizes)`` of the bucket's leaves, in bucket order."""
  sizes = tuple(int(s) for s in layout.sizes)
  bounds = tuple(int(b) for b in np.cumsum((0,) + sizes))
  return bounds, sizes


def _threshold_codec(value, capacity_ratio) -> _compressor.Codec:

  def apply(x, state, ctx):
    # One mask over the bucket, one compaction with a capacity per leaf.
    bounds, sizes = _leaf_rows(ctx.layout)
    caps = tuple(num_selected(capacity_ratio, s) for s in sizes)
    words = _topk.threshold_mask(x, value)
    vals, gi, _ = _topk.compact_segments(x, words, bounds, caps)
    mean, sent = _sparse_exchange(vals, gi, ctx)
    return _compressor.CodecResult(mean=mean, sent=sent, state=state)

  def wire(layout, n):
    cap = _num_pairs(_segments(layout), capacity_ratio)
    return _sparse.sparse_psum_wire(cap, layout.size, n)

  return _compressor.Codec(name="threshold", init=lambda layout: (),
                           apply=apply, wire=wire, flat=True)


@_registry.method(
    family="compressor",
    paper="Strom 2015",
    summary="pairs above a threshold, bounded capacity",
    defaults={"value": 0.001},
    static=("capacity_ratio",))
@_compressor.shared_options
def threshold(value: float, *, capacity_ratio: float | None = None,
              axis_name="data", error_feedback: bool = True, policy=None,
              seed: int = 0,
              **options):
  """Threshold sparsification with a bounded message (Strom 2015).

  .. math::
    s_i = x_i \\odot \\mathbb{1}[\\,|x_i| \\geq \\tau\\,] \\text{ (first
    } c \\text{ by index)}, \\quad e_i \\leftarrow x_i - s_i

  Every coordinate with ``|x| >= value`` is sent, up to a static capacity
  of ``c = max(1, ceil(capacity_ratio * L))`` per leaf
  (:func:`jaxcomm.kernels.threshold_select`). When more qualify, the ``c``
  lowest indices are sent and the overflow stays in the residual (with
  error feedback it is sent later; nothing is dropped). ``value`` may be a
  traced array (``optax.inject_hyperparams``).

  Departs from Strom, who sends each selected coordinate as ``+-value``
  (one sign bit beside the index): here the exact value travels (as GRACE's
  ``threshold``), so nothing beyond the unsent coordinates enters the
  residual; the exchange is the all-gather of :func:`topk`.

  Args:
    value: the threshold ``tau > 0``.
    capacity_ratio: the message capacity as a fraction of each leaf, in
      ``(0, 1]`` (static; default 0.01).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates (Strom's residual).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).

  Example::

    tx = optax.chain(jaxcomm.threshold(1e-3), optax.sgd(0.1))

  References:
    Strom, `Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing <https://www.isca-archive.org/interspeech_2015/strom15_interspeech.html>`_,
    2015.
  """
  _checks.number("value", value, 0.0, None, lo_open=True)  # noqa
  if not isinstance(value, jax.core.Tracer) and not math.isfinite(value):
    raise ValueError(f"value must be finite, got {value!r}")
  # Static arguments default to None: optax.inject_hyperparams then keeps
  # them out of the traced hyperparameters unless the caller passes them.
  capacity_ratio = _checks.ratio(
    "capacity_ratio", 0.01 if capacity_ratio is None else capacity_ratio)
  return _compressor.compressed(_threshold_codec(value, capacity_ratio),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


# ----------------------------------------------------------------- DGC ----

def dgc_densities(ratio: float, warmup_densities=DGC_WARMUP_DENSITIES
                  ) -> tuple[float, ...]:
  """The density of each warm-up stage, then ``ratio`` (the last stage)."""
  return tuple(float(d) for d in warmup_densities if d > ratio) + (ratio,)


def dgc_sample_size(density: float, size: int, sample_ratio: float) -> int:
  """Sample size for the threshold estimate.

  ``ceil(sample_ratio * L)`` (DGC's code samples 1%), at least
  ``ceil(2 / density)`` (two expected entries above the threshold) and, a
  departure, at most ``ceil(100 / density)``: a hundred expected entries
  above the threshold already put the count within about 10% (one standard
  deviation) of the target, and a larger random sample costs more than the
  pass over ``x`` it serves (measured: 250k samples of a 25M vector take
  longer than one memory copy of it). Never more than ``L``.
  """
  s = min(math.ceil(sample_ratio * size), math.ceil(100.0 / density))
  return min(size, max(s, math.ceil(2.0 / density)))


def dgc_capacity(k: int, size: int) -> int:
  """Buffer of the threshold selection before the cut to ``k``."""
  return min(size, math.ceil(1.3 * k))


def sampled_select(x: jax.Array, k: int, key, sample_size: int,
                   max_rounds: int = 10):
  """DGC's threshold selection: estimate, adjust, cut to ``k``.

  1. ``t`` = the ``ceil(k s / L)``-th largest ``|x|`` in a uniform sample of
     ``s`` entries (:func:`jaxcomm.kernels.sampled_threshold`; with
     ``s = L`` the exact k-th largest).
  2. While the count ``c = #{|x| >= t}`` is above ``1.3 k`` or below
     ``0.8 k`` (at most ``max_rounds`` times): raise ``t`` by 1.3x / lower
     it by 0.8x until the target is bracketed, then bisect geometrically
     between the closest thresholds known to be too low and too high.
  3. Keep the first ``ceil(1.3 k)`` entries above ``t`` (by index), and of
     those the ``k`` of largest magnitude (lower index first among ties).

  Args:
    x: flat float32 array of length ``L``.
    k: the target count (static).
    key: PRNG key of the sample.
    sample_size: ``s`` (static).
    max_rounds: bound on the adjustment rounds (static).

  Returns:
    ``(values, indices, count, threshold)``: ``k`` pairs (slots beyond the
    count hold index ``L`` and value 0), the count above the final
    threshold before the cut, and that threshold.
  """
  length = x.shape[0]
  t0 = _topk.sampled_threshold(x, k, key, sample_size)
  hi_bound, lo_bound = 1.3 * k, 0.8 * k

  def count(t):
    # One fused pass over x (the predicate of threshold_select).
    above = jnp.abs(x).astype(jnp.float32) >= t
    return jnp.sum(above, dtype=jnp.int32)

  def cond(c):
    _, _, _, n_sel, r = c
    return ((n_sel > hi_bound) | (n_sel < lo_bound)) & (r < max_rounds)

  def body(c):
    t, lo, hi, n_sel, r = c
    many = n_sel > hi_bound
    lo = jnp.where(many, t, lo)           # t too low: too many selected
    hi = jnp.where(many, hi, t)           # t too high: too few
    bracketed = (lo > 0) & jnp.isfinite(hi)
    t = jnp.where(bracketed, jnp.sqrt(lo * hi),
                  jnp.where(many, t * 1.3, t * 0.8))
    return t, lo, hi, count(t), r + 1

  zero = t0 * 0.0                           # (typed as t0 under shard_map)
  init = (t0, zero, zero + jnp.inf, count(t0), zero.astype(jnp.int32))
  t, _, _, _, _ = jax.lax.while_loop(cond, body, init)
  cap = dgc_capacity(k, length)
  vals, idx, n_sel = _topk.threshold_select(x, t, cap)
  if cap > k:
    # Unused slots hold value 0 and index L: they rank last.
    _, pos = jax.lax.top_k(jnp.where(idx < length, jnp.abs(vals), -1.0), k)
    pos = jnp.sort(pos)
    vals, idx = vals[pos], idx[pos]
  return vals, idx, n_sel, t


def dgc_bucket_sample(key, sizes, density: float, sample_ratio: float):
  """Where DGC's bucket selection samples: per leaf, ``s_j =
  dgc_sample_size(density, L_j, sample_ratio)`` positions, all leaves in
  one draw.

  Leaf ``j`` takes slots ``[S_j, S_j + s_j)`` of ``jax.random.randint(key,
  (S,), 0, m)`` (``S = sum_j s_j``, ``m`` the slot's leaf size ``L_j``:
  uniform positions with replacement), or, where ``s_j = L_j``, its own
  positions ``0 .. L_j - 1`` (the whole leaf). Static ``sizes`` (bucket
  order); returns ``(positions int32[S], sample sizes)``.
  """
  ss = [dgc_sample_size(density, int(n), sample_ratio) for n in sizes]
  ends = np.cumsum(ss)
  total = int(ends[-1])
  slot = jnp.arange(total, dtype=jnp.int32)
  row = _topk.segment_ids((0,) + tuple(int(e) for e in ends))
  size = jnp.asarray(np.asarray(sizes, np.int64), jnp.int32)[row]
  local = slot - jnp.asarray(ends - np.asarray(ss), jnp.int32)[row]
  full = jnp.asarray(np.asarray([s == n for s, n in zip(ss, sizes)]))[row]
  drawn = jax.random.randint(key, (total,), 0, size, jnp.int32)
  return jnp.where(full, local, drawn), ss


def _sampled_select_bucket(x, layout, density, key, sample_ratio,
                           max_rounds):
  """DGC's sampled selection (:func:`sampled_select`) of every leaf of the
  bucket, in one program whatever the number of leaves.

  Per leaf: the threshold ``t`` = the ``ceil(k s / L)``-th largest ``|x|``
  of its sample (:func:`dgc_bucket_sample`: one draw for all leaves); the
  adjustment rounds of :func:`sampled_select` (all leaves in one loop; a
  leaf whose count is within bounds stops changing); its first
  ``ceil(1.3 k)`` entries ``>= t`` by index (one
  :func:`jaxcomm.kernels.topk.compact_segments`), cut to the ``k`` of
  largest magnitude (lower index first among ties), in index order. The
  sample's order statistics and the cut are one sort each over all
  leaves.

  Returns:
    ``(values, indices)``: values and bucket positions (``layout.size``:
    unused), ``sum_j k_j`` pairs, leaf by leaf.
  """
  bounds, sizes = _leaf_rows(layout)
  nrows = len(sizes)
  ks = [num_selected(density, n) for n in sizes]
  starts = np.asarray(bounds[:-1], np.int64)
  mag = jnp.abs(x).astype(jnp.float32)
  # Thresholds: each leaf's sample sorted by (leaf, -|x|) in one sort.
  pos, ss = dgc_bucket_sample(key, sizes, density, sample_ratio)
  send = np.cumsum(ss)
  srow = _topk.segment_ids((0,) + tuple(int(e) for e in send))
  svals = mag[jnp.asarray(starts, jnp.int32)[srow] + pos]
  _, svals = jax.lax.sort((srow, -svals), num_keys=2)
  kps = [min(s, max(1, math.ceil(k * s / n))) for s, k, n in
         zip(ss, ks, sizes)]
  t0 = -svals[jnp.asarray(send - np.asarray(ss) + np.asarray(kps) - 1,
                          jnp.int32)]
  rows_k = np.asarray(ks, np.float64)
  hi_bound = jnp.asarray(1.3 * rows_k, jnp.float32)
  lo_bound = jnp.asarray(0.8 * rows_k, jnp.float32)
  # Each element's row, once: every round is then one pass over the bucket
  # whatever the number of rows.
  row = _topk.segment_ids(bounds)

  def above(t):
    return mag >= t[row]

  def count(t):
    return _topk.segment_counts(_topk.pack_mask(above(t)), bounds)

  def active(c):
    _, _, _, n_sel, r = c
    return (((n_sel > hi_bound) | (n_sel < lo_bound))
            & (r < max_rounds))

  def body(c):
    t, lo, hi, n_sel, r = c
    on = active(c)
    many = n_sel > hi_bound
    lo2 = jnp.where(many, t, lo)
    hi2 = jnp.where(many, hi, t)
    bracketed = (lo2 > 0) & jnp.isfinite(hi2)
    t2 = jnp.where(bracketed, jnp.sqrt(lo2 * hi2),
                   jnp.where(many, t * 1.3, t * 0.8))
    new = (t2, lo2, hi2, count(t2), r + 1)
    return tuple(jnp.where(on, a, b) for a, b in zip(new, c))

  zero = t0 * 0.0                           # (typed as t0 under shard_map)
  init = (t0, zero, zero + jnp.inf, count(t0), zero.astype(jnp.int32))
  t = jax.lax.while_loop(lambda c: jnp.any(active(c)), body, init)[0]
  caps = [dgc_capacity(k, n) for k, n in zip(ks, sizes)]
  vals, gi, _ = _topk.compact_segments(x, _topk.pack_mask(above(t)),
                                       bounds, tuple(caps))
  # The cut, every leaf at once: sort the candidates by (leaf, -|v|,
  # index), keep each leaf's first k, sort the kept back by (leaf, index)
  # and read each leaf's first k slots.
  total = layout.size
  cend = np.cumsum(caps)
  crow = _topk.segment_ids((0,) + tuple(int(e) for e in cend))
  real = gi < total
  neg = jnp.where(real, -jnp.abs(vals), 1.0)    # unused slots rank last
  crow, _, gi, vals = jax.lax.sort((crow, neg, gi, vals), num_keys=3)
  rank = jnp.arange(int(cend[-1]), dtype=jnp.int32) - jnp.asarray(
    cend - np.asarray(caps), jnp.int32)[crow]
  keep = rank < jnp.asarray(np.asarray(ks, np.int64), jnp.int32)[crow]
  order_key = jnp.where(keep, gi, total + 1)
  _, gi, vals = jax.lax.sort((crow, order_key, vals), num_keys=2)
  take = np.concatenate([c0 + np.arange(k) for c0, k in
                         zip(cend - np.asarray(caps), ks)]) if nrows else \
    np.zeros((0,), np.int64)
  take = jnp.asarray(take, jnp.int32)
  return vals[take], gi[take]


def _dgc_codec(ratio, densities, steps_per_stage, sample_ratio, exact,
               max_rounds) -> _compressor.Codec:

  def stage_fn(density):
    def run(x, ctx):
      if exact:
        gv, gi = _local_topk(x, _segments(ctx.layout), density)
      else:
        gv, gi = _sampled_select_bucket(x, ctx.layout, density, ctx.key,
                                        sample_ratio, max_rounds)
      return _sparse_exchange(gv, gi, ctx)
    return run

  def apply(x, state, ctx):
    if len(densities) == 1:
      mean, sent = stage_fn(densities[0])(x, ctx)
    else:
      stage = jnp.minimum(ctx.step // steps_per_stage, len(densities) - 1)
      branches = [lambda x, f=stage_fn(d): f(x, ctx) for d in densities]
      mean, sent = jax.lax.switch(stage, branches, x)
    return _compressor.CodecResult(mean=mean, sent=sent, state=state)

  def wire(layout, n):
    segs = _segments(layout)
    out = []
    for d in densities:
      out += _sparse.sparse_psum_wire(_num_pairs(segs, d), layout.size, n)
    return out

  def wire_at(layout, n, step):
    # ``step`` is the global step count, as ``ctx.step``.
    stage = min(max(step, 0) // steps_per_stage, len(densities) - 1) if (
      len(densities) > 1) else 0
    return _sparse.sparse_psum_wire(
      _num_pairs(_segments(layout), densities[stage]), layout.size, n)

  return _compressor.Codec(name=f"dgc({ratio})", init=lambda layout: (),
                           apply=apply, wire=wire, flat=True,
                           wire_at=wire_at)


@_registry.method(
    family="compressor",
    paper="Lin et al. 2018",
    summary=(
      "DGC: momentum correction, masking, local clipping, warm-up, "
      "sampled threshold"),
    defaults={"ratio": 0.001},
    static=("ratio", "sample_ratio"))
@_compressor.shared_options
def dgc(ratio: float | None = None, *, momentum: float | None = 0.9,
        clip_norm: float | None = None,
        warmup_steps_per_stage: int | None = None,
        warmup_densities: Sequence[float] = DGC_WARMUP_DENSITIES,
        sample_ratio: float | None = None, exact: bool = False,
        max_rounds: int | None = None,
        axis_name="data", error_feedback: bool = True, policy=None,
        seed: int = 0, **options):
  """Deep Gradient Compression (Lin et al. 2018).

  .. math::
    u_i \\leftarrow m u_i + \\mathrm{clip}(g_i), \\quad v_i \\leftarrow
    v_i + u_i, \\quad s_i = \\mathrm{sparse}(v_i), \\quad
    u = \\frac{1}{n}\\sum_i s_i, \\quad
    v_i, u_i \\leftarrow 0 \\text{ where } s_i \\neq 0

  The four techniques of the paper, the first three through
  :func:`jaxcomm.compressed`:

  * **momentum correction**: the accumulated velocity ``v`` is sparsified
    (``momentum``; use a downstream optimizer *without* momentum, e.g.
    ``optax.sgd(lr)``);
  * **momentum factor masking**: sent coordinates are zeroed in ``u`` (and
    in ``v``, as the residual);
  * **local gradient clipping** (``clip_norm``): each device clips its
    gradient to ``clip_norm * n^(-1/2)`` by global norm before accumulating;
  * **warm-up**: the density goes through ``warmup_densities`` (those above
    ``ratio``), each held for ``warmup_steps_per_stage`` steps, then stays at
    ``ratio`` (0: no warm-up).

  Selection per leaf (``k = max(1, ceil(density * L))``) uses the sampled
  threshold of :func:`sampled_select` (``exact=False``; the samples of all
  leaves come from one draw, :func:`dgc_bucket_sample`, and all leaves are
  selected together) or exact top-k.

  Departs from the paper in the exchange of the warm-up: message sizes must
  be static, so each stage has its own exchange (capacity sized for that
  stage's density) behind a ``lax.switch`` on the step. Every step moves only
  its stage's message, but the compiled step holds all stages' all-gathers,
  and ``wire`` (like the HLO) lists them all: the steady-state cost is the
  last entry. With warm-up on 8 devices the first stage (density 0.25) moves
  ``8 * 0.25 * (4 + b)`` bytes per element, more than a dense psum: warm-up
  trades bytes for accuracy early in training.

  Args:
    ratio: target density in ``(0, 1]`` (static; default 0.001, the
      paper's).
    momentum: momentum ``m`` of the correction (None: plain error feedback).
    clip_norm: local clipping norm (None: no clipping).
    warmup_steps_per_stage: steps per warm-up stage (static int >= 0;
      default 0, no warm-up).
    warmup_densities: warm-up densities (static, decreasing).
    sample_ratio: fraction of each leaf sampled for the threshold (static;
      default 0.01).
    exact: exact top-k instead of the sampled threshold (static).
    max_rounds: bound on the threshold adjustment rounds (static; default
      10).
    error_feedback: keep what was not sent (the paper's accumulation).
      ``False`` needs ``momentum=None``: momentum correction accumulates
      the velocity in the residual.

  The static arguments default to None (meaning the values above), so that
  ``optax.inject_hyperparams(jaxcomm.dgc)`` injects only what it is given.
    axis_name: the data axis (a name, a tuple of names, or None).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the PRNG key (the threshold's samples).

  Example::

    tx = optax.chain(jaxcomm.dgc(0.001, momentum=0.9), optax.sgd(0.1))

  References:
    Lin et al, `Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training <https://arxiv.org/abs/1712.01887>`_,
    2018.
  """
  pick = lambda v, d: d if v is None else v
  ratio = _checks.ratio("ratio", pick(ratio, 0.001))
  sample_ratio = _checks.ratio("sample_ratio", pick(sample_ratio, 0.01))
  warmup_steps_per_stage = _checks.integer(
    "warmup_steps_per_stage", pick(warmup_steps_per_stage, 0), 0)
  max_rounds = _checks.integer("max_rounds", pick(max_rounds, 10), 0)
  try:
    warm = tuple(_checks.ratio("warmup_densities", d)
                 for d in warmup_densities)
  except TypeError:
    raise ValueError(
      f"warmup_densities must be a sequence of numbers in (0, 1], got "
      f"{warmup_densities!r}") from None
  if not isinstance(exact, bool):
    raise ValueError(f"exact must be a bool, got {exact!r}")
  _checks.error_feedback(error_feedback)
  if error_feedback is not True and momentum is not None:
    raise ValueError(
      f"error_feedback={error_feedback!r} needs momentum=None: DGC's "
      "momentum correction accumulates the velocity in the classic residual "
      f"(got momentum={momentum!r})")
  densities = (dgc_densities(ratio, warm) if warmup_steps_per_stage
               else (ratio,))
  codec = _dgc_codec(ratio, densities, max(warmup_steps_per_stage, 1),
                     sample_ratio, exact, max_rounds)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback,
                                momentum=momentum,
                                clip_norm=clip_norm,
                                policy=policy, seed=seed, **options)


# -------------------------------------------------------------- gTop-k ----

def _gtopk_codec(ratio, granularity) -> _compressor.Codec:

  def apply(x, state, ctx):
    segs = _segments(ctx.layout, granularity)
    gv, gi = _local_topk(x, segs, ratio)
    total = ctx.layout.size
    bounds = [0] + [s.offset + (r + 1) * s.size
                    for s in segs for r in range(s.count)]
    ks = [num_selected(ratio, s.size) for s in segs for _ in range(s.count)]
    g_val, g_idx, delivered = _sparse.gtopk_psum(gv, gi, bounds, ks,
                                                 ctx.axis_name)
    zeros = jnp.zeros((total,), jnp.float32)
    summed = zeros.at[g_idx].set(g_val, mode="drop")
    sent = zeros.at[gi].set(jnp.where(delivered, gv, 0.0), mode="drop")
    return _compressor.CodecResult(mean=summed / ctx.num_devices, sent=sent,
                                   state=state)

  def wire(layout, n):
    segs = _segments(layout, granularity)
    return _sparse.gtopk_psum_wire(
      [s.count * num_selected(ratio, s.size) for s in segs],
      [s.count * s.size for s in segs], n)

  return _compressor.Codec(name=f"gtopk({ratio})", init=lambda layout: (),
                           apply=apply, wire=wire, flat=True)


@_registry.method(
    family="compressor",
    paper="Shi et al. 2019",
    summary="global top-k by recursive doubling, O(k log n)",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def gtopk(ratio: float, *, granularity: str = "leaf", axis_name="data",
          error_feedback: bool = True, policy=None, seed: int = 0,
          **options):
  """Global top-k sparsification (Shi et al. 2019).

  .. math::
    \\tilde g = \\operatorname{top}_k\\Big(\\sum_i
    \\operatorname{top}_k(x_i)\\Big) \\text{ (merged pairwise over a
    tree)}, \\quad u = \\tilde g / n

  Each device selects its local top-k; a recursive-doubling exchange
  (:func:`jaxcomm.collectives.gtopk_psum`) adds the sparse vectors pairwise
  in ``log2 n`` rounds and re-sparsifies to ``k`` after every merge, so a
  device sends ``O(k log n)`` bytes instead of top-k's ``O(k n)``. The
  result has ``k`` nonzeros per segment. With error feedback, a device's
  selected values that did not reach the global result (dropped in some
  merge) go back into its residual: ``sent`` is exactly its part of the
  global sum, so gradient mass is conserved.

  Needs a power-of-two number of devices (as the paper's tree).

  Args:
    ratio: fraction of coordinates kept, in ``(0, 1]`` (static).
    granularity: ``"leaf"`` (one tree per leaf, all leaves in the same
      messages) or ``"model"``.
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what did not reach the global sum.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).

  Example::

    tx = optax.chain(jaxcomm.gtopk(0.001), optax.sgd(0.1))

  References:
    Shi et al, `A Distributed Synchronous SGD Algorithm with Global Top-k
    Sparsification for Low Bandwidth Networks
    <https://arxiv.org/abs/1901.04359>`_, 2019.
  """
  return _compressor.compressed(
    _checked_codec(_gtopk_codec, ratio, granularity), axis_name=axis_name,
    error_feedback=error_feedback, policy=policy, seed=seed, **options)


# ----------------------------------------------------------------- CSC ----

def csc_num_chunks(ratio: float, size: int, chunk_size: int) -> int:
  """Chunks exchanged: ``max(1, ceil(ratio * ceil(size / chunk_size)))``."""
  return num_selected(ratio, -(-size // chunk_size))


def _csc_codec(chunk_size, ratio) -> _compressor.Codec:

  def apply(x, state, ctx):
    m = csc_num_chunks(ratio, x.shape[0], chunk_size)
    total, chosen = _sparse.chunk_psum(x, chunk_size, m, ctx.axis_name)
    sent = jnp.where(chosen, x, 0.0)
    return _compressor.CodecResult(mean=total / ctx.num_devices, sent=sent,
                                   state=state)

  def wire(layout, n):
    del n
    return _sparse.chunk_psum_wire(
      layout.size, chunk_size, csc_num_chunks(ratio, layout.size, chunk_size))

  return _compressor.Codec(name=f"csc({chunk_size}, {ratio})",
                           init=lambda layout: (), apply=apply, wire=wire,
                           flat=True)


@_registry.method(
    family="compressor",
    paper="Sun et al. 2019 (GradientFlow)",
    summary="top chunks by allreduced L1 norm, traffic independent of n",
    defaults={"chunk_size": 64, "ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def csc(chunk_size: int, ratio: float, *, axis_name="data",
        error_feedback: bool = True, policy=None, seed: int = 0,
        **options):
  """Coarse-grained sparsification by chunks (CSC, GradientFlow).

  .. math::
    \\nu_c = \\sum_i \\lVert (x_i)_c \\rVert_1, \\quad
    C = \\operatorname{top}_m(\\nu), \\quad
    u_c = \\frac{1}{n} \\sum_i (x_i)_c \\ (c \\in C)

  All compressed leaves are flattened together and cut into chunks of
  ``chunk_size`` (the last one zero-padded: sizes need not divide). The
  chunks' L1 norms are summed over devices, every device picks the same
  ``m = max(1, ceil(ratio * chunks))`` chunks of largest summed norm, and
  only those are summed (:func:`jaxcomm.collectives.chunk_psum`). No
  all-gather and no index: both messages are independent of ``n``. With
  error feedback the other chunks stay in the residual.

  Args:
    chunk_size: elements per chunk (static int >= 1).
    ratio: fraction of chunks exchanged, in ``(0, 1]`` (static).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent chunks.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).

  Example::

    tx = optax.chain(jaxcomm.csc(chunk_size=1024, ratio=0.01),
                     optax.sgd(0.1))

  References:
    Sun et al, `Optimizing Network Performance for Distributed DNN Training
    on GPU Clusters: ImageNet/AlexNet Training in 1.5 Minutes
    <https://arxiv.org/abs/1902.06855>`_, 2019.
  """
  chunk_size = _checks.integer("chunk_size", chunk_size, 1)
  ratio = _checks.ratio("ratio", ratio)
  return _compressor.compressed(_csc_codec(chunk_size, ratio),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = [
  "csc",
  "dgc",
  "gtopk",
  "randomk",
  "threshold",
  "topk",
]
