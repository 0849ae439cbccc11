"""Sparsifying compressors: top-k, random-k and threshold, and the helpers
every sparsifier shares (DGC: :mod:`._dgc`; gTop-k and CSC:
:mod:`._global_topk`).

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

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import topk as _topk
from jaxcomm.transforms.sparsify._sparse_helpers import _GRANULARITIES  # noqa: F401
from jaxcomm.transforms.sparsify._sparse_helpers import _check_selects_one
from jaxcomm.transforms.sparsify._sparse_helpers import _checked_codec
from jaxcomm.transforms.sparsify._sparse_helpers import _leaf_rows  # noqa: F401
from jaxcomm.transforms.sparsify._sparse_helpers import _local_topk
from jaxcomm.transforms.sparsify._sparse_helpers import _num_pairs
from jaxcomm.transforms.sparsify._sparse_helpers import _row_keys
from jaxcomm.transforms.sparsify._sparse_helpers import _segments
from jaxcomm.transforms.sparsify._sparse_helpers import _Segs  # noqa: F401
from jaxcomm.transforms.sparsify._sparse_helpers import _sparse_exchange
from jaxcomm.transforms.sparsify._sparse_helpers import num_selected

DGC_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)


# -------------------------------------------------------------- top-k ----

def _slot_rows(segs, ratio) -> np.ndarray:
  """Per selected slot (in :func:`_local_topk`'s order), its row (leaf)
  among all segments' rows."""
  out, base = [], 0
  for s in segs:
    k = num_selected(ratio, s.size)
    out.append(base + np.repeat(np.arange(s.count), k))
    base += s.count
  return np.concatenate(out).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class TopkCodec(_codec.CodecBase):
  """Top-k: each segment's k largest ``|x|`` as (index, value) pairs,
  summed by a sparse psum (quantized values with ``value_bits``). Cannot
  gossip (see :class:`GossipTopkCodec`, float32 values).

  Attributes:
    ratio: fraction of each segment's coordinates sent, in ``(0, 1]``.
    granularity: ``"leaf"`` (k per leaf) or ``"model"`` (one k over the
      whole bucket).
    value_bits: None (float32 values) or 1, 2, 4, 8 bits per value.
  """

  ratio: float
  granularity: str = "leaf"
  value_bits: int | None = None

  @property
  def name(self):
    return f"topk({self.ratio})" if self.value_bits is None else (
      f"topk({self.ratio}, {self.value_bits}-bit)")

  check_layouts = _check_selects_one("topk")

  def apply(self, x, state, ctx):
    segs = _segments(ctx.layout, self.granularity)
    vals, idx = _local_topk(x, segs, self.ratio)
    if self.value_bits is None:
      mean, sent = _sparse_exchange(vals, idx, ctx)
    else:
      rows = _slot_rows(segs, self.ratio)
      total, own = _sparse.sparse_psum_quantized(
        vals, idx, jnp.asarray(rows), sum(s.count for s in segs),
        ctx.layout.size, self.value_bits, ctx.axis_name)
      mean = total / ctx.num_devices
      sent = _core.zeros_after(ctx.layout.size, idx).at[idx].set(
        own, mode="drop")
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    segs = _segments(layout, self.granularity)
    k = _num_pairs(segs, self.ratio)
    if self.value_bits is None:
      return _sparse.sparse_psum_wire(k, layout.size, n)
    return _sparse.sparse_psum_quantized_wire(
      k, layout.size, sum(s.count for s in segs), self.value_bits, n)


@dataclasses.dataclass(frozen=True)
class GossipTopkCodec(TopkCodec):
  """:class:`TopkCodec` with float32 values (``value_bits`` None), whose
  packed (index, value) pairs can travel whole to a neighbour.

  Attributes:
    ratio: fraction of each segment's coordinates sent, in ``(0, 1]``.
    granularity: ``"leaf"`` or ``"model"`` (as :class:`TopkCodec`).
    value_bits: None (the only value: the pairs carry float32 values).
  """

  def __post_init__(self):
    if self.value_bits is not None:
      raise ValueError(f"GossipTopkCodec sends float32 values: value_bits "
                       f"must be None, got {self.value_bits!r}")

  def message(self, x, ctx):
    vals, idx = _local_topk(x, _segments(ctx.layout, self.granularity),
                            self.ratio)
    sent = _core.zeros_after(ctx.layout.size, idx).at[idx].set(
      vals, mode="drop")
    return _sparse.pack_pairs(vals, idx, ctx.layout.size), sent

  def decode(self, words, ctx):
    k = _num_pairs(_segments(ctx.layout, self.granularity), self.ratio)
    vals, idx = _sparse.unpack_pairs(words, k, ctx.layout.size)
    return _core.zeros_after(ctx.layout.size, idx).at[idx].set(
      vals, mode="drop")


@_registry.method(
    gap=(
      "1% of coordinates a step, the rest delayed in the residual: short "
      "on the char-LSTM in 300 steps"),
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
    ratio: fraction of coordinates sent, in ``(0, 1]`` (static); one
      below ``1 / L`` for every leaf (bucket, with ``granularity=
      "model"``) is refused at init.
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
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), a ``granularity`` other than ``"leaf"`` or
      ``"model"``, a ``value_bits`` not among 1, 2, 4, 8 and None, or an
      ``axis_name``, ``error_feedback``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses. ``tx.init`` raises one when
      ``ratio`` keeps fewer than one element of every compressed leaf
      (bucket, with ``granularity="model"``).

  Examples:
    On the 8 devices, with a leaf policy that compresses even a 4-value
    leaf: device ``i`` (1 to 8) has the gradient ``[i, -i, 0.1, 0.2]``.
    Each sends its two largest values, so the first update is their mean;
    error feedback keeps ``[0.1, 0.2]``, sent at the next step (here with
    a zero gradient):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.topk(0.5, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   second, state = tx.update(jnp.zeros_like(g[0]), state)
    ...   return first, second
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i, 0 * i + 0.1, 0 * i + 0.2], axis=1)
    >>> first, second = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(first).round(3), np.asarray(second).round(3))
    [ 4.5 -4.5  0.   0. ] [0.  0.  0.1 0.2]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.topk(0.01), optax.sgd(0.1))

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
    _checked_codec(GossipTopkCodec if value_bits is None else TopkCodec,
                   ratio, granularity, value_bits),
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


@dataclasses.dataclass(frozen=True)
class RandomkCodec(_codec.CodecBase):
  """Random-k: k coordinates per segment drawn from the step key shared by
  every device (:func:`randomk_indices`), their values summed by one psum;
  no index travels.

  Attributes:
    ratio: fraction of each segment's coordinates sent, in ``(0, 1]``.
    granularity: ``"leaf"`` (k per leaf) or ``"model"`` (one k over the
      whole bucket).
  """

  ratio: float
  granularity: str = "leaf"

  @property
  def name(self):
    return f"randomk({self.ratio})"

  check_layouts = _check_selects_one("randomk")

  def _indices(self, ctx):
    segs = _segments(ctx.layout, self.granularity)
    rows = [(s.offset + r * s.size, s.size, s.ids[r])
            for s in segs for r in range(s.count)]
    return _randomk_flat(ctx.key, self.ratio, rows)

  def apply(self, x, state, ctx):
    gi = self._indices(ctx)
    vals = x[gi]
    summed = _core.psum(vals, ctx.axis_name)
    # The indices come from the shared key, known at the top of the step:
    # the zeros hang on the values, which come late.
    size = ctx.layout.size
    mean = _core.zeros_after(size, summed).at[gi].set(summed / ctx.num_devices)
    sent = _core.zeros_after(size, vals).at[gi].set(vals)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    del n
    return [("all-reduce", 4 * _num_pairs(
      _segments(layout, self.granularity), self.ratio))]

  def message(self, x, ctx):
    gi = self._indices(ctx)  # from the shared key: the same on every device
    vals = x[gi]
    sent = _core.zeros_after(ctx.layout.size, gi).at[gi].set(vals)
    return _core.to_words(vals), sent

  def decode(self, words, ctx):
    vals = _core.from_words(words, jnp.float32)
    gi = self._indices(ctx)
    return _core.zeros_after(ctx.layout.size, gi).at[gi].set(vals)


@_registry.method(
    gap=(
      "1% of coordinates at random: each waits about 100 steps in the "
      "residual, a delay 300 steps do not absorb"),
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
  state (``randomk_indices`` in
  ``jaxcomm/transforms/sparsify/_sparsification.py``: 24 rounds of a
  keyed swap-or-not permutation), so no index travels: the ``k`` values
  are summed with one plain psum (``4 k`` bytes, independent of ``n``).
  Values are not rescaled by ``L / k``: with error feedback (the default)
  the unsent coordinates are sent later, as in Stich et al.

  Args:
    ratio: fraction of coordinates sent, in ``(0, 1]`` (static); one
      below ``1 / L`` for every leaf (bucket, with ``granularity=
      "model"``) is refused at init.
    granularity: ``"leaf"`` or ``"model"`` (as :func:`jaxcomm.topk`).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the shared PRNG key.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), a ``granularity`` other than ``"leaf"`` or
      ``"model"``, or an ``axis_name``, ``error_feedback``, ``policy`` or
      option that :func:`jaxcomm.compressed` refuses. ``tx.init`` raises
      one when ``ratio`` keeps fewer than one element of every compressed
      leaf (bucket, with ``granularity="model"``).

  Examples:
    Device ``i`` (1 to 8) has the gradient ``i * [1, 2, ..., 8]``. All
    devices send the values at the same 4 coordinates, drawn from the
    shared key: the update there is the exact mean, and zero elsewhere,
    where each device keeps its values in its residual:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.randomk(0.5, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.arange(1.0, 9.0)
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> update, residual = np.asarray(update), np.asarray(residual)
    >>> sent = update != 0
    >>> print(sent.sum(), np.allclose(update[sent], grads.mean(0)[sent]))
    4 True
    >>> print(bool(((residual != 0) == ~sent).all()))
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.randomk(0.01), optax.sgd(0.1))

  References:
    Stich et al, `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, 2018.
  """
  return _compressor.compressed(
    _checked_codec(RandomkCodec, ratio, granularity), axis_name=axis_name,
    error_feedback=error_feedback, policy=policy, seed=seed, **options)


# ----------------------------------------------------------- threshold ----

@dataclasses.dataclass(frozen=True)
class ThresholdCodec(_codec.CodecBase):
  """Threshold: each leaf's coordinates with ``|x| >= value``, at most its
  ``capacity_ratio`` share (the largest first), as (index, value) pairs
  summed by a sparse psum.

  Attributes:
    value: the threshold ``tau > 0`` (a float, or a traced scalar under
      ``optax.inject_hyperparams``: it sets no message size).
    capacity_ratio: each leaf's message capacity as a fraction of the
      leaf, in ``(0, 1]``.
  """

  value: float
  capacity_ratio: float = 0.01
  name = "threshold"

  def apply(self, x, state, ctx):
    # Each leaf's c largest |x| (the capacity), then those under the
    # threshold dropped: when more than c qualify, the largest travel.
    vals, gi = _local_topk(x, _segments(ctx.layout), self.capacity_ratio)
    keep = jnp.abs(vals) >= self.value
    vals = jnp.where(keep, vals, 0.0)
    gi = jnp.where(keep, gi, ctx.layout.size)      # the unused slot
    mean, sent = _sparse_exchange(vals, gi, ctx)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    cap = _num_pairs(_segments(layout), self.capacity_ratio)
    return _sparse.sparse_psum_wire(cap, layout.size, n)


@_registry.method(
    gap=(
      "as top-k: the few coordinates above the threshold a step, the rest "
      "delayed in the residual"),
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
    s_i = x_i \\odot \\mathbb{1}[\\,|x_i| \\geq \\tau\\,] \\text{ (the } c
    \\text{ largest)}, \\quad e_i \\leftarrow x_i - s_i

  Every coordinate with ``|x| >= value`` is sent, up to a static capacity
  of ``c = max(1, ceil(capacity_ratio * L))`` per leaf.
  When more qualify, the ``c`` largest ``|x|`` are sent (ties: lower
  index first) and the overflow stays in the residual (with error feedback
  it is sent later; nothing is dropped): late coordinates of a leaf do not
  wait behind early ones. ``value`` may be a
  traced array (``optax.inject_hyperparams``).

  Departs from Strom, who sends each selected coordinate as ``+-value``
  (one sign bit beside the index): here the exact value travels (as GRACE's
  ``threshold``), so nothing beyond the unsent coordinates enters the
  residual; the exchange is the all-gather of :func:`jaxcomm.topk`.

  Args:
    value: the threshold ``tau > 0`` (finite; may be traced under
      ``optax.inject_hyperparams``).
    capacity_ratio: the message capacity as a fraction of each leaf, in
      ``(0, 1]`` (static; default 0.01).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates (Strom's residual).
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
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``value`` that is not a
      finite number above 0, a ``capacity_ratio`` outside ``(0, 1]``, or
      an ``axis_name``, ``error_feedback``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses.

  Examples:
    Threshold 2 and room for 4 of the 8 values per device: device ``i``
    (1 to 8) has the gradient ``[i, -i / 2, 0.3, 0, ...]``, so it sends
    ``i`` once ``i >= 2`` and ``-i / 2`` once ``i >= 4``; the counts
    sent are read from the residuals:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.threshold(2.0, capacity_ratio=0.5,
    ...                        policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, jnp.sum(state.residual[0] != g[0])[None]
    >>> i = np.arange(1.0, 9.0)                   # device i = 1 .. 8
    >>> grads = np.zeros((8, 8))
    >>> grads[:, 0], grads[:, 1], grads[:, 2] = i, -i / 2, 0.3
    >>> update, sent = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(update)[:3].round(4), np.asarray(sent))
    [ 4.375 -1.875  0.   ] [0 1 1 2 2 2 2 2]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.threshold(1e-3), optax.sgd(0.1))

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
  return _compressor.compressed(ThresholdCodec(value, capacity_ratio),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = [
  "randomk",
  "threshold",
  "topk",
]
