"""Collectives for sparse tensors: sparse psum, gTop-k tree, chunk psum.

* :func:`sparse_psum` -- the sum over devices of fixed-capacity
  ``(values, indices)`` messages: one invariant all-gather of every device's
  message, then a scatter-add into the dense result on every device.
* :func:`gtopk_psum` -- global top-k (Shi et al. 2019): a recursive-doubling
  exchange of ``k`` pairs in ``log2 n`` rounds, re-sparsified to ``k`` after
  every merge, so each device sends ``O(k log n)`` instead of ``O(k n)``.
  All segments share one list and one sort per merge, whatever their
  number.
* :func:`chunk_psum` -- coarse-grained sparsification (CSC, GradientFlow):
  psum of per-chunk L1 norms, the same top chunks chosen on every device,
  psum of only those chunks; the traffic does not depend on ``n``.

Messages travel as ``uint32`` words (:func:`pack_pairs`): values bitcast,
indices in the smallest unsigned dtype that holds ``size`` (the sentinel of
unused slots), narrow indices packed several to a word, because XLA's CPU
backend widens sub-32-bit collectives. Each function has a ``*_wire``
companion that states its collectives in the accounting convention of
:mod:`jaxcomm.wire`.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.collectives import _core


def index_dtype(size: int):
  """The smallest unsigned dtype holding every index in ``[0, size]``.

  ``size`` itself is the sentinel of an unused slot, so it must fit too.

  Args:
    size: the length of the dense vector the indices point into.

  Returns:
    ``jnp.uint8``, ``jnp.uint16`` or ``jnp.uint32``.

  Raises:
    ValueError: when ``size`` does not fit 32-bit indices.

  Examples:
    >>> from jaxcomm import collectives
    >>> collectives.index_dtype(255).__name__
    'uint8'
    >>> collectives.index_dtype(256).__name__
    'uint16'
  """
  for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
    if size <= np.iinfo(dtype).max:
      return dtype
  raise ValueError(f"size {size} does not fit 32-bit indices")


def _per_word(size: int) -> int:
  return 4 // jnp.dtype(index_dtype(size)).itemsize


def message_words(capacity: int, size: int) -> int:
  """uint32 words of one packed message of ``capacity`` pairs."""
  per = _per_word(size)
  return capacity + _core.padded_length(capacity, per) // per


def pack_pairs(values: jax.Array, indices: jax.Array, size: int
               ) -> jax.Array:
  """Packs ``(values, indices)`` into ``uint32`` words for a collective
  (the order of ``lax.top_k``'s results, as everywhere in jaxcomm).

  Args:
    values: ``float32[capacity]``.
    indices: ``int32[capacity]`` in ``[0, size]`` (``size``: unused slot).
    size: the length of the dense vector.

  Returns:
    ``uint32[message_words(capacity, size)]``: the values' bits, then the
    indices in :func:`index_dtype` ``(size)``, padded with the sentinel and
    packed ``4 // itemsize`` to a word.
  """
  capacity = values.shape[0]
  per = _per_word(size)
  idx = jnp.pad(indices.astype(jnp.int32),
                (0, _core.padded_length(capacity, per) - capacity),
                constant_values=size).astype(index_dtype(size))
  return jnp.concatenate([_core.to_words(values.astype(jnp.float32)),
                          _core.to_words(idx)], axis=-1)


def unpack_pairs(words: jax.Array, capacity: int, size: int
                 ) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`pack_pairs` along the last axis: ``(values,
  indices)``, int32 indices."""
  values = _core.from_words(words[..., :capacity], jnp.float32)
  idx = _core.from_words(words[..., capacity:], index_dtype(size))
  return values, idx[..., :capacity].astype(jnp.int32)


def sparse_psum(values: jax.Array, indices: jax.Array, size: int,
                axis_name) -> jax.Array:
  """Sum over devices of sparse vectors given as fixed-capacity pairs.

  .. math::
    s = \\sum_{i=1}^{n} \\sum_{c} v_{i,c} \\, e_{j_{i,c}}

  Every device's message is gathered (one invariant all-gather of
  ``uint32`` words), then scatter-added into a dense vector on every device:
  indices that several devices (or one device twice) send add up; unused
  slots carry the sentinel index ``size`` and are dropped.

  Args:
    values: ``float32[capacity]``.
    indices: ``int32[capacity]`` indices in ``[0, size)``, or ``size`` for an
      unused slot.
    size: length of the dense vector (static).
    axis_name: the axis to sum over, or None.

  Returns:
    ``float32[size]``, identical (and typed invariant) on every device.

  Examples:
    Device ``i`` sends one pair, ``i + 1`` at index ``i % 4``; devices
    ``i`` and ``i + 4`` add up at the same index, the second slot is
    unused (the sentinel 8):

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> def f(i):
    ...   values = jnp.stack([i[0] + 1.0, 0.0])
    ...   indices = jnp.stack([i[0] % 4, 8]).astype(jnp.int32)
    ...   return jaxcomm.collectives.sparse_psum(values, indices, 8, "data")
    >>> jax.shard_map(f, mesh=mesh, in_specs=P("data"),
    ...               out_specs=P())(jnp.arange(8)).tolist()
    [6.0, 8.0, 10.0, 12.0, 0.0, 0.0, 0.0, 0.0]
  """
  capacity = values.shape[0]
  words = _core.all_gather(pack_pairs(values, indices, size), axis_name)
  vals, idx = unpack_pairs(words, capacity, size)
  idx = idx.reshape(-1)
  return _core.zeros_after(size, idx).at[idx].add(vals.reshape(-1),
                                                  mode="drop")


def sparse_psum_wire(capacity: int, size: int, n: int) -> list:
  """Collectives of :func:`sparse_psum`: one all-gather of n messages."""
  return [("all-gather", 4 * n * message_words(capacity, size))]


# ------------------------------------------------- low-bit values --------

VALUE_BITS = (1, 2, 4, 8)


def quantize_values(values: jax.Array, scale: jax.Array, bits: int
                    ) -> jax.Array:
  """Codes in ``[0, 2^bits)`` of ``values`` on ``2^bits`` evenly spaced
  levels over ``[-scale, scale]`` (nearest level; ``scale`` broadcasts)."""
  top = 2 ** bits - 1
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.round((values / safe + 1.0) * 0.5 * top)
  return jnp.clip(q, 0, top).astype(jnp.uint32)


def dequantize_values(codes: jax.Array, scale: jax.Array, bits: int
                      ) -> jax.Array:
  """The levels :func:`quantize_values` codes stand for (0 where the scale
  is 0)."""
  top = 2 ** bits - 1
  level = codes.astype(jnp.float32) * (2.0 / top) - 1.0
  return jnp.where(scale > 0, level * scale, 0.0)


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
  """``uint32`` codes of ``bits`` bits each -> ``32 // bits`` per word."""
  per = 32 // bits
  n = codes.shape[-1]
  c = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1)
              + [(0, _core.padded_length(n, per) - n)])
  return _core.pack_fields(c, bits)


def unpack_codes(words: jax.Array, count: int, bits: int) -> jax.Array:
  """Inverse of :func:`pack_codes`: the first ``count`` codes."""
  return _core.unpack_fields(words, bits, count)


def quantized_message_words(capacity: int, size: int, rows: int,
                            bits: int) -> int:
  """uint32 words of a :func:`sparse_psum_quantized` message."""
  per = _per_word(size)
  return (rows + _core.padded_length(capacity, 32 // bits) * bits // 32
          + _core.padded_length(capacity, per) // per)


def sparse_psum_quantized(values: jax.Array, indices: jax.Array,
                          rows: jax.Array, num_rows: int, size: int,
                          bits: int, axis_name
                          ) -> tuple[jax.Array, jax.Array]:
  """:func:`sparse_psum` with each value sent in ``bits`` bits.

  Slot ``c`` belongs to row ``rows[c]`` (a leaf); each row's values are
  coded on ``2^bits`` levels over ``[-s, s]``, ``s`` the row's largest
  ``|value|`` (one float32 per row on the wire), codes packed ``32 //
  bits`` to a word. Every device's message is gathered and decoded, then
  scatter-added as in :func:`sparse_psum`.

  Returns:
    ``(sum, own)``: the ``float32[capacity]`` values this device's message
    decodes to (what it sent, for error feedback) and the
    ``float32[size]`` sum over devices (typed invariant).
  """
  capacity = values.shape[0]
  scale = jax.ops.segment_max(jnp.abs(values), rows, num_segments=num_rows)
  scale = jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 0.0)
  codes = quantize_values(values, scale[rows], bits)
  own = dequantize_values(codes, scale[rows], bits)
  per = _per_word(size)
  idx = jnp.pad(indices.astype(jnp.int32),
                (0, _core.padded_length(capacity, per) - capacity),
                constant_values=size).astype(index_dtype(size))
  msg = jnp.concatenate([_core.to_words(scale), pack_codes(codes, bits),
                         _core.to_words(idx)], axis=-1)
  words = _core.all_gather(msg, axis_name)
  n_code = _core.padded_length(capacity, 32 // bits) * bits // 32
  scales = _core.from_words(words[..., :num_rows], jnp.float32)
  got = unpack_codes(words[..., num_rows:num_rows + n_code], capacity, bits)
  gidx = _core.from_words(words[..., num_rows + n_code:], index_dtype(size))
  gidx = gidx[..., :capacity].astype(jnp.int32)
  vals = dequantize_values(got, jnp.take(scales, rows, axis=-1), bits)
  gidx = gidx.reshape(-1)
  total = _core.zeros_after(size, gidx).at[gidx].add(vals.reshape(-1),
                                                     mode="drop")
  return total, own


def sparse_psum_quantized_wire(capacity: int, size: int, rows: int,
                               bits: int, n: int) -> list:
  """Collectives of :func:`sparse_psum_quantized`: one all-gather."""
  return [("all-gather",
           4 * n * quantized_message_words(capacity, size, rows, bits))]


# ------------------------------------------------------------- gTop-k ----

def _merge_segments(idx: jax.Array, val: jax.Array, bounds, ks
                    ) -> tuple[jax.Array, jax.Array]:
  """Adds two sparse lists (each without repeated indices) and keeps, in
  every segment ``[bounds[j], bounds[j + 1])``, its ``ks[j]`` entries of
  largest magnitude; ``sum(ks)`` slots, sorted by index (``bounds[-1]``:
  unused slot, value 0).

  ``idx``/``val`` hold both lists concatenated. The result does not depend
  on the order of the two lists: entries are sorted by index first, a
  repeated index is the sum of its two values (``a + b == b + a`` in IEEE
  arithmetic), and among equal magnitudes the lower index wins; so both
  partners of an exchange compute bitwise the same list. One sort by
  (segment, magnitude, index) serves every segment: the program does not
  grow with the number of segments.
  """
  total = int(bounds[-1])
  nseg = len(ks)
  cap = int(sum(ks))
  order = jnp.argsort(idx, stable=True)
  idx, val = idx[order], val[order]
  dup = idx[1:] == idx[:-1]                        # pairs (p, p + 1)
  nxt = jnp.concatenate([val[1:], jnp.zeros((1,), val.dtype)])
  head = jnp.concatenate([dup, jnp.zeros((1,), bool)])
  val = jnp.where(head, val + nxt, val)
  tail = jnp.concatenate([jnp.zeros((1,), bool), dup])
  valid = (~tail) & (idx < total)
  ends = jnp.asarray(np.asarray(bounds[1:], np.int64), jnp.int32)
  seg = jnp.searchsorted(ends, idx, side="right").astype(jnp.int32)
  seg = jnp.where(valid, seg, nseg)                # invalid entries last
  neg = jnp.where(valid, -jnp.abs(val), 0.0)
  seg, _, idx, val = jax.lax.sort((seg, neg, idx, val), num_keys=3)
  first = jnp.searchsorted(seg, seg, side="left").astype(jnp.int32)
  rank = jnp.arange(seg.shape[0], dtype=jnp.int32) - first
  quota = jnp.asarray(np.asarray(list(ks) + [0], np.int64), jnp.int32)
  keep = (seg < nseg) & (rank < quota[seg])
  key = jnp.where(keep, idx, total)
  key, val = jax.lax.sort((key, jnp.where(keep, val, 0.0)), num_keys=1)
  return key[:cap], val[:cap]


def _member(query: jax.Array, sorted_idx: jax.Array) -> jax.Array:
  """Whether each ``query`` index occurs in the sorted ``sorted_idx``."""
  pos = jnp.searchsorted(sorted_idx, query)
  pos = jnp.minimum(pos, sorted_idx.shape[0] - 1)
  return sorted_idx[pos] == query


def gtopk_psum(values: jax.Array, indices: jax.Array,
               bounds: Sequence[int], ks: Sequence[int], axis_name
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Global top-k sum by recursive doubling (Shi et al. 2019).

  Segments (a leaf each, or the whole model) are contiguous ranges
  ``[bounds[j], bounds[j + 1])`` of one index space; each device starts
  from its local top-``ks[j]`` pairs of every segment, all in one list. In
  round ``r = 0 .. log2(n) - 1`` it swaps its current list with device
  ``i XOR 2^r`` (one collective-permute of all ``sum(ks)`` pairs), adds
  the two lists and keeps each segment's ``ks[j]`` largest magnitudes
  (one sort for all segments). After the last round every device holds
  the same list: the global top-k of the (tree-)summed sparse vectors. A
  final broadcast from device 0 (an all-reduce in which the other devices
  add zero words, exact) makes the result typed invariant; it costs one
  more message of the same size.

  The merge is commutative (see ``_merge_segments``), so the two partners
  of a round compute bitwise identical lists. A device's own pair is part
  of the global sum only if it survived every merge on the way: a value
  dropped in round r is gone from every later list. Each device
  therefore tracks which of its own indices are still in its list after
  every round: those it has actually sent.

  Args:
    values: ``float32[K]``, ``K = sum(ks)``.
    indices: ``int32[K]``: positions in ``[0, L)`` (``L = bounds[-1]``),
      distinct, at most ``ks[j]`` in segment ``j``; ``L`` marks an unused
      slot.
    bounds: static segment boundaries ``0 = b_0 < ... < b_R = L``.
    ks: static pairs kept per segment.
    axis_name: the axis, or None.

  Returns:
    ``(values, indices, delivered)``: the global list (``K`` slots sorted
    by index, ``L`` and 0 in unused slots; identical and invariant on
    every device) and a bool[K] mask over this device's input pairs: True
    where its value is part of the global sum.

  Raises:
    ValueError: if the number of devices is not a power of two.
  """
  n = _core.axis_size(axis_name)
  if n & (n - 1):
    raise ValueError(
      f"gtopk needs a power-of-two number of devices, got {n}")
  bounds = tuple(int(b) for b in bounds)
  ks = tuple(int(k) for k in ks)
  total, cap = bounds[-1], sum(ks)
  indices = jnp.asarray(indices, jnp.int32).reshape(-1)
  values = jnp.asarray(values, jnp.float32).reshape(-1)
  if indices.shape[0] != cap or values.shape[0] != cap:
    raise ValueError(
      f"indices and values must hold sum(ks) = {cap} pairs, got "
      f"{indices.shape[0]} and {values.shape[0]}")
  order = jnp.argsort(indices, stable=True)
  cur_idx, cur_val = indices[order], values[order]
  mine = cur_idx                            # my indices, sorted
  alive = jnp.ones((cap,), bool)

  for r in range(int(math.log2(n))):
    perm = [(i, i ^ (1 << r)) for i in range(n)]
    got = _core.ppermute(pack_pairs(cur_val, cur_idx, total), axis_name,
                         perm)
    other_val, other_idx = unpack_pairs(got, cap, total)
    cur_idx, cur_val = _merge_segments(
      jnp.concatenate([cur_idx, other_idx]),
      jnp.concatenate([cur_val, other_val]), bounds, ks)
    alive = alive & _member(mine, cur_idx)

  if axis_name is not None:
    # Every device holds the same list now; device 0's copy is broadcast
    # through an exact all-reduce (the others add zero words) so that the
    # result is typed invariant.
    words = pack_pairs(cur_val, cur_idx, total)
    first = _core.axis_index(axis_name) == 0
    words = _core.psum(jnp.where(first, words, jnp.zeros_like(words)),
                       axis_name)
    cur_val, cur_idx = unpack_pairs(words, cap, total)
  # Back from sorted order to the caller's order of its own pairs.
  delivered = jnp.zeros((cap,), bool).at[order].set(alive)
  return cur_val, cur_idx, delivered


def gtopk_psum_wire(ks: Sequence[int], sizes: Sequence[int], n: int) -> list:
  """Collectives of :func:`gtopk_psum`: log2(n) permutes and a broadcast.

  ``ks`` and ``sizes``: per segment (or any split with the same sums), the
  pairs sent and the dense length.
  """
  words = message_words(sum(ks), sum(sizes))
  rounds = int(math.log2(n))
  return [("collective-permute", 4 * words)] * rounds + [
    ("all-reduce", 4 * words)]


# ---------------------------------------------------------------- CSC ----

def chunk_psum(flat: jax.Array, chunk_size: int, num_chunks: int, axis_name
               ) -> tuple[jax.Array, jax.Array]:
  """Sum over devices of the chunks with the largest global L1 norm.

  .. math::
    \\nu_c = \\sum_i \\lVert x_{i,c} \\rVert_1, \\quad
    C = \\operatorname{top}_m(\\nu), \\quad
    s_c = \\sum_i x_{i,c} \\ (c \\in C), \\ 0 \\text{ otherwise}

  ``flat`` is zero-padded to a multiple of ``chunk_size``. The chunk norms
  are summed (one all-reduce of ``ceil(L / chunk_size)`` floats), every
  device picks the same ``num_chunks`` chunks (lower chunk index first among
  equal norms), and only those chunks are summed (one all-reduce of
  ``num_chunks * chunk_size`` floats). Neither message grows with ``n``.

  Args:
    flat: ``float32[L]``, this device's vector.
    chunk_size: elements per chunk (static; need not divide ``L``).
    num_chunks: how many chunks to exchange (static).
    axis_name: the axis, or None.

  Returns:
    ``(total, chosen)``: ``total float32[L]``, the sum over devices of the
    chosen chunks (zero elsewhere), invariant; ``chosen bool[L]``, the
    elements exchanged (identical on every device).
  """
  length = flat.shape[0]
  chunks = -(-length // chunk_size)
  x = jnp.pad(flat, (0, chunks * chunk_size - length)).reshape(
    chunks, chunk_size)
  norms = _core.psum(jnp.sum(jnp.abs(x), axis=1), axis_name)
  _, top = jax.lax.top_k(norms, num_chunks)
  top = jnp.sort(top)
  summed = _core.psum(x[top], axis_name)
  total = jnp.zeros(x.shape, jnp.float32).at[top].set(summed)
  total = total.reshape(-1)[:length]
  chosen = jnp.zeros((chunks,), bool).at[top].set(True)
  chosen = jnp.repeat(chosen, chunk_size)[:length]
  return total, chosen


def chunk_psum_wire(length: int, chunk_size: int, num_chunks: int) -> list:
  """Collectives of :func:`chunk_psum`: two all-reduces, independent of n."""
  chunks = -(-length // chunk_size)
  return [("all-reduce", 4 * chunks),
          ("all-reduce", 4 * num_chunks * chunk_size)]
