"""Collectives for sparse tensors: sparse psum, gTop-k tree, chunk psum.

* :func:`sparse_psum` -- the sum over devices of fixed-capacity
  ``(indices, values)`` messages: one invariant all-gather of every device's
  message, then a scatter-add into the dense result on every device.
* :func:`gtopk_psum` -- global top-k (Shi et al. 2019): a recursive-doubling
  exchange of ``k`` pairs in ``log2 n`` rounds, re-sparsified to ``k`` after
  every merge, so each device sends ``O(k log n)`` instead of ``O(k n)``.
  Segments of equal size come batched (``[G, k]``, one row per segment):
  one op per group, whatever the number of segments.
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


def pack_pairs(indices: jax.Array, values: jax.Array, size: int
               ) -> jax.Array:
  """Packs ``(indices, values)`` into ``uint32`` words for a collective.

  Args:
    indices: ``int32[capacity]`` in ``[0, size]`` (``size``: unused slot).
    values: ``float32[capacity]``.
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
  """Inverse of :func:`pack_pairs` along the last axis (int32 indices)."""
  values = _core.from_words(words[..., :capacity], jnp.float32)
  idx = _core.from_words(words[..., capacity:], index_dtype(size))
  return idx[..., :capacity].astype(jnp.int32), values


def sparse_psum(indices: jax.Array, values: jax.Array, size: int,
                axis_name) -> jax.Array:
  """Sum over devices of sparse vectors given as fixed-capacity pairs.

  .. math::
    s = \\sum_{i=1}^{n} \\sum_{c} v_{i,c} \\, e_{j_{i,c}}

  Every device's message is gathered (one invariant all-gather of
  ``uint32`` words), then scatter-added into a dense vector on every device:
  indices that several devices (or one device twice) send add up; unused
  slots carry the sentinel index ``size`` and are dropped.

  Args:
    indices: ``int32[capacity]`` indices in ``[0, size)``, or ``size`` for an
      unused slot.
    values: ``float32[capacity]``.
    size: length of the dense vector (static).
    axis_name: the axis to sum over, or None.

  Returns:
    ``float32[size]``, identical (and typed invariant) on every device.

  Example::

    total = sparse_psum(idx, vals, x.size, "data")   # inside shard_map
  """
  capacity = values.shape[0]
  words = _core.all_gather(pack_pairs(indices, values, size), axis_name)
  idx, vals = unpack_pairs(words, capacity, size)
  return jnp.zeros((size,), jnp.float32).at[idx.reshape(-1)].add(
    vals.reshape(-1), mode="drop")


def sparse_psum_wire(capacity: int, size: int, n: int) -> list:
  """Collectives of :func:`sparse_psum`: one all-gather of n messages."""
  return [("all-gather", 4 * n * message_words(capacity, size))]


# ------------------------------------------------------------- gTop-k ----

def _merge_topk(idx: jax.Array, val: jax.Array, k: int, size: int
                ) -> tuple[jax.Array, jax.Array]:
  """Adds two sparse lists (each without repeated indices) and keeps the k
  entries of largest magnitude.

  ``idx``/``val`` hold both lists concatenated. The result does not depend
  on the order of the two lists: entries are sorted by index first, a
  repeated index is the sum of its two values (``a + b == b + a`` in IEEE
  arithmetic), and among equal magnitudes the lower index wins; so both
  partners of an exchange compute bitwise the same list.
  """
  order = jnp.argsort(idx, stable=True)
  idx, val = idx[order], val[order]
  dup = idx[1:] == idx[:-1]                        # pairs (p, p + 1)
  nxt = jnp.concatenate([val[1:], jnp.zeros((1,), val.dtype)])
  head = jnp.concatenate([dup, jnp.zeros((1,), bool)])
  val = jnp.where(head, val + nxt, val)
  tail = jnp.concatenate([jnp.zeros((1,), bool), dup])
  valid = (~tail) & (idx < size)
  mag = jnp.where(valid, jnp.abs(val), -1.0)
  _, pos = jax.lax.top_k(mag, k)
  keep = valid[pos]
  idx = jnp.where(keep, idx[pos], size)
  val = jnp.where(keep, val[pos], 0.0)
  order = jnp.argsort(idx, stable=True)             # back to index order
  return idx[order], val[order]


def _member(query: jax.Array, sorted_idx: jax.Array) -> jax.Array:
  """Whether each ``query`` index occurs in the sorted ``sorted_idx``."""
  pos = jnp.searchsorted(sorted_idx, query)
  pos = jnp.minimum(pos, sorted_idx.shape[0] - 1)
  return sorted_idx[pos] == query


def _rows(a: jax.Array) -> jax.Array:
  """A per-row index column ``[G, 1]`` for ``a`` of shape ``[G, k]``."""
  return jnp.arange(a.shape[0], dtype=jnp.int32)[:, None]


def gtopk_psum(indices: Sequence[jax.Array], values: Sequence[jax.Array],
               sizes: Sequence[int], axis_name
               ) -> tuple[list, list, list]:
  """Global top-k sum by recursive doubling (Shi et al. 2019).

  Each device starts from its local top-k list of every segment (a leaf, or
  the whole model). Segments come in groups: ``indices[j]`` of shape
  ``[G_j, k_j]`` holds ``G_j`` segments of ``sizes[j]`` elements each, one
  per row (a ``[k_j]`` array is one segment); every op below is one batched
  op per group, so the program does not grow with the number of segments.
  In round ``r = 0 .. log2(n) - 1`` a device swaps its current lists with
  device ``i XOR 2^r`` (one collective-permute of all segments' ``k`` pairs
  in one message), adds the two lists of each segment and keeps its ``k``
  largest magnitudes. After the last round every device holds the same
  lists: the global top-k of the (tree-)summed sparse vectors. A final
  broadcast from device 0 (an all-reduce in which the other devices add
  zero words, exact) makes the result typed invariant; it costs one more
  message of ``k`` pairs, so each device sends ``k (4 + b) (log2 n + 2)``
  bytes in all (``b`` index bytes; the all-reduce counts twice by the ring
  formula) -- ``O(k log n)``.

  A device's contribution at an index reaches the result only if that index
  survived every merge on its way up the tree; once dropped it cannot come
  back (the index may come back carrying other devices' values). Each device
  therefore tracks which of its own indices are still in its list after
  every round: those it has actually sent.

  On the wire, segment rows are laid end to end (group by group, row by
  row) in one global index space of ``sum_j G_j sizes[j]`` elements.

  Args:
    indices: per group, ``int32[G, k]`` (or ``[k]``) local indices in
      ``[0, size)``, distinct within a row.
    values: per group, ``float32`` of the same shape.
    sizes: per group, the dense length of one segment.
    axis_name: the axis, or None.

  Returns:
    ``(indices, values, delivered)``: per group, the global lists (each row
    sorted by index, ``k`` entries, identical and invariant on every device)
    and a bool mask over this device's input pairs: True where its value is
    part of the global sum. Each of the shape of the input.

  Raises:
    ValueError: if the number of devices is not a power of two.
  """
  n = _core.axis_size(axis_name)
  if n & (n - 1):
    raise ValueError(
      f"gtopk needs a power-of-two number of devices, got {n}")
  flat_in = [jnp.ndim(i) == 1 for i in indices]
  indices = [jnp.reshape(i, (-1, jnp.shape(i)[-1])).astype(jnp.int32)
             for i in indices]
  values = [jnp.reshape(v, i.shape) for v, i in zip(values, indices)]
  sizes = [int(s) for s in sizes]
  counts = [int(i.shape[0]) for i in indices]
  ks = [int(i.shape[1]) for i in indices]
  cur_idx = [jnp.sort(i, axis=-1) for i in indices]
  orders = [jnp.argsort(i, axis=-1) for i in indices]
  cur_val = [jnp.take_along_axis(v, o, axis=-1)
             for v, o in zip(values, orders)]
  mine = list(cur_idx)                      # my indices, sorted
  alive = [jnp.ones(i.shape, bool) for i in indices]
  total = sum(g * s for g, s in zip(counts, sizes))
  offsets = [int(o) for o in np.cumsum(
    [0] + [g * s for g, s in zip(counts, sizes)])[:-1]]
  merge = jax.vmap(_merge_topk, in_axes=(0, 0, None, None))
  member = jax.vmap(_member)

  def pack(idx_list, val_list):
    # Global index space over all segments: one message per round.
    gi = [jnp.where(i < s, o + _rows(i) * s + i, total).reshape(-1)
          for i, s, o in zip(idx_list, sizes, offsets)]
    gv = [v.reshape(-1) for v in val_list]
    return pack_pairs(jnp.concatenate(gi), jnp.concatenate(gv), total)

  def unpack(words):
    gi, gv = unpack_pairs(words, sum(g * k for g, k in zip(counts, ks)),
                          total)
    out_i, out_v, start = [], [], 0
    for g, k, s, o in zip(counts, ks, sizes, offsets):
      i = gi[start:start + g * k].reshape(g, k)
      out_i.append(jnp.where(i < total, i - o - _rows(i) * s, s))
      out_v.append(gv[start:start + g * k].reshape(g, k))
      start += g * k
    return out_i, out_v

  for r in range(int(math.log2(n))):
    perm = [(i, i ^ (1 << r)) for i in range(n)]
    got = _core.ppermute(pack(cur_idx, cur_val), axis_name, perm)
    other_idx, other_val = unpack(got)
    new_idx, new_val = [], []
    for j, k in enumerate(ks):
      i, v = merge(jnp.concatenate([cur_idx[j], other_idx[j]], axis=-1),
                   jnp.concatenate([cur_val[j], other_val[j]], axis=-1),
                   k, sizes[j])
      new_idx.append(i)
      new_val.append(v)
      alive[j] = alive[j] & member(mine[j], i)
    cur_idx, cur_val = new_idx, new_val

  if axis_name is not None:
    # Every device holds the same lists now; device 0's copy is broadcast
    # through an exact all-reduce (the others add zero words) so that the
    # result is typed invariant.
    words = pack(cur_idx, cur_val)
    first = _core.axis_index(axis_name) == 0
    words = _core.psum(jnp.where(first, words, jnp.zeros_like(words)),
                       axis_name)
    cur_idx, cur_val = unpack(words)
  # Back from sorted order to the caller's order of its own pairs.
  delivered = [jnp.zeros(a.shape, bool).at[_rows(o), o].set(a)
               for o, a in zip(orders, alive)]
  unbatch = lambda arrays: [a[0] if f else a
                            for a, f in zip(arrays, flat_in)]
  return unbatch(cur_idx), unbatch(cur_val), unbatch(delivered)


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
