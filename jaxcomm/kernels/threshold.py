"""Threshold selection and compaction: a packed mask of ``|x| >= t``
(a Pallas kernel beside its jnp reference), and the compaction of the
selected entries, whole or per segment (leaf), from one popcount prefix
sum. Top-k (:mod:`jaxcomm.kernels.topk`) and the sparsifiers build on it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxcomm import _prefix
from jaxcomm.kernels import _dispatch
from jaxcomm.kernels import bitpack


def _flat(x: jax.Array) -> jax.Array:
  return bitpack._flat(x)


# --------------------------------------------------------------------------
# threshold_select
# --------------------------------------------------------------------------


def _above(x: jax.Array, threshold) -> jax.Array:
  return jnp.abs(x).astype(jnp.float32) >= jnp.asarray(threshold, jnp.float32)


@functools.partial(jax.jit, static_argnames=("capacity",))
def threshold_select_reference(x: jax.Array, threshold, capacity: int
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Entries with ``|x| >= threshold``, compacted (cumsum + scatter, jnp).

  Args:
    x: a floating array of any shape, read flattened (length ``L``).
    threshold: a scalar (may be traced).
    capacity: the static size of the output buffer.

  Returns:
    ``(values, indices, count)``: ``values[capacity]`` (signed, 0 in unused
    slots), ``indices int32[capacity]`` (in increasing order, ``L`` in unused
    slots), ``count`` (``int32`` scalar, may exceed ``capacity``).
  """
  x = _flat(x)
  length = x.shape[0]
  mask = _above(x, threshold)
  count = jnp.sum(mask, dtype=jnp.int32)
  pos = _prefix.prefix_sum(mask, jnp.int32) - 1
  dest = jnp.where(mask & (pos < capacity), pos, capacity)
  values = jnp.zeros((capacity,), x.dtype).at[dest].set(x, mode="drop")
  indices = jnp.full((capacity,), length, jnp.int32).at[dest].set(
    jnp.arange(length, dtype=jnp.int32), mode="drop")
  return values, indices, count


def pack_bits(mask: jax.Array) -> jax.Array:
  """A flat bool mask packed into ``uint32`` words in bitpack's bit order
  (bit ``j`` of word ``w`` is element ``32 w + j``; zero padding bits).

  The 32 neighbours of a word are gathered as the rows of a ``[32, W]``
  byte array (words in the minor dimension) from a mask held as bytes
  behind an optimization barrier. Reshaped to ``[W, 32]`` instead, the
  compiler moves the reshape into the mask's producers, and the TPU tiles
  their minor dimension of 32 to 128 lanes: DGC's step on the 8.4M MLP
  (v5e, 2 slices) held three ``f32[65568, 32]`` arrays, 132.4 MiB of
  temporaries against 20.9 MiB this way (the plain step: 12.9).
  """
  m = jnp.pad(mask.astype(jnp.uint8), (0, (-mask.shape[0]) % 32))
  cols = lax.optimization_barrier(m).reshape(-1, 32).T.astype(jnp.uint32)
  shifts = jnp.arange(32, dtype=jnp.uint32)[:, None]
  return lax.reduce(cols << shifts, jnp.uint32(0), lax.bitwise_or, (0,))


@jax.jit
def threshold_mask_reference(x: jax.Array, threshold) -> jax.Array:
  """``|x| >= threshold`` packed into ``uint32`` words (bitpack bit order)."""
  return pack_bits(_above(_flat(x), threshold))


def _threshold_mask_kernel(t_ref, x_ref, o_ref):
  a = jnp.abs(x_ref[...]).astype(jnp.float32)     # (block_words, 32)
  bits = (a >= t_ref[...]).astype(jnp.int32)      # t: (1, 1) broadcasts
  shifts = lax.broadcasted_iota(jnp.int32, a.shape, 1)
  o_ref[...] = jnp.sum(lax.shift_left(bits, shifts), axis=1, keepdims=True)


@functools.partial(
  jax.jit, static_argnames=("block_words", "interpret", "platform"))
def threshold_mask_pallas(x: jax.Array, threshold, *, block_words: int = 1024,
                          interpret: bool = False,
                          platform: str | None = None) -> jax.Array:
  """Internal: the Pallas version of :func:`threshold_mask_reference`.

  Call :func:`threshold_mask`, which dispatches.
  """
  x = _flat(x)
  length = x.shape[0]
  words = bitpack.num_words(length)
  bw = bitpack._next_pow2(min(max(block_words, 32), max(words, 32)))
  padded_words = -(-words // bw) * bw
  # NaN padding: |NaN| >= t is false, so padding bits are 0.
  x = jnp.pad(x, (0, padded_words * 32 - length), constant_values=jnp.nan)
  t = jnp.asarray(threshold, jnp.float32).reshape(1, 1)
  out = _dispatch.pallas_call(
    _threshold_mask_kernel,
    out_shape=jax.ShapeDtypeStruct((padded_words, 1), jnp.int32),
    grid=(padded_words // bw,),
    in_specs=[pl.BlockSpec((1, 1), lambda i: (0, 0)),
              pl.BlockSpec((bw, 32), lambda i: (i, 0))],
    out_specs=pl.BlockSpec((bw, 1), lambda i: (i, 0)),
    interpret=interpret,
    compiler_params=bitpack._compiler_params(platform, interpret),
    name="threshold_mask",
  )(t, x.reshape(padded_words, 32))
  return bitpack._as_uint32(out[:words, 0])


def _select_bit(word: jax.Array, rank: jax.Array) -> jax.Array:
  """Position of the ``rank``-th (0-based) set bit of each ``uint32`` word."""
  pos = jnp.zeros(word.shape, jnp.uint32)
  rank = rank.astype(jnp.uint32)
  for width in (16, 8, 4, 2, 1):
    low = (word >> pos) & jnp.uint32((1 << width) - 1)
    c = lax.population_count(low)
    go = rank >= c
    rank = jnp.where(go, rank - c, rank)
    pos = jnp.where(go, pos + width, pos)
  return pos.astype(jnp.int32)


def compact_from_mask(x: jax.Array, mask_words: jax.Array, capacity: int
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Compacts the entries of ``x`` whose bit is set in ``mask_words``.

  Work is ``O(len(x) / 32 + capacity * log(len(x)))``: a prefix sum of the
  words' popcounts, then per output slot a binary search for its word and a
  select-the-r-th-set-bit in it.

  Args:
    x: the flat array (length ``L``).
    mask_words: ``uint32[ceil(L / 32)]`` with zero padding bits.
    capacity: static buffer size.

  Returns:
    As :func:`threshold_select_reference`.
  """
  length = x.shape[0]
  popc = lax.population_count(mask_words).astype(jnp.int32)
  incl = _prefix.prefix_sum(popc, jnp.int32)
  count = incl[-1]
  slots = jnp.arange(capacity, dtype=jnp.int32)
  word = jnp.searchsorted(incl, slots + 1, side="left",
                          method="scan").astype(jnp.int32)
  word = jnp.minimum(word, mask_words.shape[0] - 1)
  rank = slots - (incl[word] - popc[word])
  idx = 32 * word + _select_bit(mask_words[word], rank)
  valid = slots < count
  idx = jnp.where(valid, idx, length)
  values = jnp.where(valid, x[jnp.minimum(idx, length - 1)],
                     jnp.zeros((), x.dtype))
  return values, idx, count


def segment_ids(bounds, dtype=jnp.int32) -> jax.Array:
  """``dtype[bounds[-1]]``: the segment ``j`` of each position, for static
  boundaries ``0 = b_0 <= ... <= b_R`` (segment ``j`` is ``[b_j,
  b_{j+1})``). A cumulative sum of segment starts: one pass whatever the
  number of segments, built behind an optimization barrier (XLA would
  otherwise fold the constant array at compile time: a minute for 11M
  positions). ``dtype``: an integer type that holds ``R - 1``
  (:func:`narrowest_ids` picks one: int8 ids are a quarter of int32's
  memory).
  """
  b = np.asarray(bounds, np.int64)
  if b.ndim != 1 or b.size < 2 or b[0] != 0 or np.any(np.diff(b) < 0):
    raise ValueError(
      "bounds must be non-decreasing static boundaries starting at 0, got "
      f"{tuple(int(v) for v in b)}")
  if b.size - 2 > jnp.iinfo(dtype).max:
    raise ValueError(f"segment_ids: {b.size - 1} segments do not fit "
                     f"dtype {jnp.dtype(dtype).name}")
  zeros = lax.optimization_barrier(jnp.zeros((int(b[-1]),), dtype))
  starts = zeros.at[jnp.asarray(b[1:-1], jnp.int32)].add(
    jnp.ones((), dtype), mode="drop")
  return _prefix.prefix_sum(starts, dtype)


def narrowest_ids(segments: int):
  """The narrowest signed integer type holding ids ``0 .. segments - 1``."""
  for dtype in (jnp.int8, jnp.int16):
    if segments - 1 <= jnp.iinfo(dtype).max:
      return dtype
  return jnp.int32


def _set_bits_before(mask_words, incl, bounds) -> jax.Array:
  """Set bits of the mask before each static position of ``bounds``:
  whole words from the inclusive popcount prefix ``incl``, then the low
  bits of one word."""
  b = np.asarray(bounds, np.int64)
  w = jnp.asarray(b // 32, jnp.int32)
  low = jnp.asarray(((1 << (b % 32)) - 1).astype(np.uint32))
  incl0 = jnp.concatenate([jnp.zeros((1,), jnp.int32), incl])
  words0 = jnp.concatenate([mask_words, jnp.zeros((1,), jnp.uint32)])
  return incl0[w] + lax.population_count(words0[w] & low).astype(jnp.int32)


def segment_counts(mask_words: jax.Array, bounds: tuple[int, ...]
                   ) -> jax.Array:
  """Set bits of a packed mask in each segment ``[bounds[j], bounds[j+1])``
  (one popcount prefix sum, whatever the number of segments)."""
  popc = lax.population_count(mask_words).astype(jnp.int32)
  before = _set_bits_before(mask_words, _prefix.prefix_sum(popc, jnp.int32),
                            bounds)
  return before[1:] - before[:-1]


def compact_segments(x: jax.Array, mask_words: jax.Array,
                     bounds: tuple[int, ...], capacities: tuple[int, ...]
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`compact_from_mask` per segment, for all segments at once.

  ``x`` is cut into contiguous segments ``[bounds[j], bounds[j + 1])``;
  segment ``j`` keeps its first ``capacities[j]`` set entries by index, in
  output slots ``[C_j, C_j + capacities[j])`` (``C_j`` the capacities
  before it). The work is that of one compaction, and the program does not
  grow with the number of segments (their bounds are a static array).

  Args:
    x: the flat array (length ``L = bounds[-1]``).
    mask_words: ``uint32[ceil(L / 32)]``, zero padding bits.
    bounds: static segment boundaries, ``0 = b_0 < ... < b_R = L``.
    capacities: static slots per segment.

  Returns:
    ``(values, indices, counts)``: ``values`` and ``indices`` (positions in
    ``x``; ``L`` and 0 in unused slots) of length ``sum(capacities)``;
    ``counts`` per segment (may exceed its capacity).
  """
  length = x.shape[0]
  if tuple(bounds)[-1:] != (length,):
    raise ValueError(
      f"bounds must end at len(x) = {length}, got {tuple(bounds)}")
  nw = mask_words.shape[0]
  popc = lax.population_count(mask_words).astype(jnp.int32)
  incl = _prefix.prefix_sum(popc, jnp.int32)
  before = _set_bits_before(mask_words, incl, bounds)
  counts = before[1:] - before[:-1]
  caps = np.asarray(capacities, np.int64)
  if caps.shape != (len(bounds) - 1,) or np.any(caps < 1):
    raise ValueError(
      f"capacities must hold one int >= 1 per segment ({len(bounds) - 1}), "
      f"got {tuple(capacities)}")
  cap_ends = np.cumsum(caps)
  total = int(cap_ends[-1])
  slots = jnp.arange(total, dtype=jnp.int32)
  seg = segment_ids((0,) + tuple(int(c) for c in cap_ends))
  local = slots - jnp.asarray(cap_ends - caps, jnp.int32)[seg]
  valid = local < counts[seg]
  rank = before[:-1][seg] + local
  word = jnp.searchsorted(incl, rank + 1, side="left",
                          method="scan").astype(jnp.int32)
  word = jnp.minimum(word, nw - 1)
  r_in = rank - (incl[word] - popc[word])
  idx = 32 * word + _select_bit(mask_words[word], r_in)
  idx = jnp.where(valid, idx, length)
  values = jnp.where(valid, x[jnp.minimum(idx, length - 1)],
                     jnp.zeros((), x.dtype))
  return values, idx, counts


def threshold_mask(x: jax.Array, threshold, *, interpret: bool = False,
                   use_kernel: bool | None = None) -> jax.Array:
  """``|x| >= threshold`` packed into ``uint32`` words: the mask kernel or
  jnp, dispatched as :func:`threshold_select`."""
  run_kernel, interpret = _dispatch.resolve("threshold_select", use_kernel,
                                            interpret)
  if run_kernel:
    return threshold_mask_pallas(x, threshold, interpret=interpret)
  return threshold_mask_reference(x, threshold)


@functools.partial(jax.jit, static_argnames=("capacity",))
def threshold_select_packed(x: jax.Array, threshold, capacity: int
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`threshold_select_reference` via a jnp-packed mask (CPU path)."""
  x = _flat(x)
  return compact_from_mask(x, threshold_mask_reference(x, threshold),
                           capacity)


@functools.partial(
  jax.jit, static_argnames=("capacity", "interpret", "platform"))
def threshold_select_pallas(x: jax.Array, threshold, capacity: int, *,
                            interpret: bool = False,
                            platform: str | None = None
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Internal: :func:`threshold_select_reference`, mask packed by a kernel.

  Call :func:`threshold_select`, which dispatches.
  """
  x = _flat(x)
  words = threshold_mask_pallas(x, threshold, interpret=interpret,
                                platform=platform)
  return compact_from_mask(x, words, capacity)


def threshold_select(x: jax.Array, threshold, capacity: int, *,
                     interpret: bool = False, use_kernel: bool | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Entries with ``|x| >= threshold``, in index order, fixed capacity.

  Args:
    x: a floating array of any shape, read flattened (length ``L``).
    threshold: a scalar, may be traced (e.g. from :func:`sampled_threshold`).
    capacity: the static buffer size.
    interpret: run the Pallas kernel in interpret mode.
    use_kernel: as in :func:`jaxcomm.kernels.pack_signs`.

  Returns:
    ``(values, indices, count)``: the first ``capacity`` selected entries by
    index (signed values, ``int32`` indices), unused slots holding value 0
    and the sentinel index ``L``; ``count`` is the number of entries above
    the threshold (``count > capacity`` means some were dropped).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxcomm.kernels import topk
    >>> topk.threshold_select(jnp.array([0.5, -3.0, 2.0]), 1.0, 4)
    (Array([-3.,  2.,  0.,  0.], dtype=float32), Array([1, 2, 3, 3], \
dtype=int32), Array(2, dtype=int32))
  """
  run_kernel, interpret = _dispatch.resolve("threshold_select", use_kernel,
                                            interpret)
  if run_kernel:
    return threshold_select_pallas(x, threshold, capacity,
                                   interpret=interpret)
  return threshold_select_packed(x, threshold, capacity)
