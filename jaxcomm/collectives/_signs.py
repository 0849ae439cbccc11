"""Bit-packed sign exchanges: majority vote, compressed allreduce, gather.

Signs travel 32 to a ``uint32`` word (:mod:`jaxcomm.kernels.bitpack`: the
Pallas kernel on GPU/TPU, jnp on CPU), with sign(0) = +1. Each function
works on one flat float32 vector (the compressors concatenate their leaves)
and accepts ``axis_name=None`` (one device, no collective).

* :func:`majority_vote`: signSGD/Signum with majority vote. Two phases, so
  that each device sends about 2 bits per element whatever the number of
  devices ``n``: an all-to-all of packed chunks (device ``j`` receives chunk
  ``j`` of every device's signs), a local vote on that chunk, and an
  all-gather of the packed voted chunks. A plain all-gather of every
  device's signs would send ``n - 1`` bits per element.
* :func:`compressed_allreduce`: DeepSpeed's 1-bit compressed allreduce.
  Worker stage: signs and one scale per leaf (the worker error is the
  caller's error feedback). All-to-all of packed chunks with the scales
  appended; the chunk owner decodes and averages the ``n`` chunks, adds its
  server error, recompresses to ``scale * sign`` and keeps the new server
  error; all-gather of the packed chunks, each with its scale appended.
* :func:`gather_signs`: every device's packed signs and per-leaf scales
  all-gathered and averaged (EF-signSGD: a linear average of scaled signs).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _buckets
from jaxcomm import _vma
from jaxcomm.collectives import _core
from jaxcomm.kernels import bitpack

WORD_BITS = 32


def _check_flat(x, name="x"):
  return _core.vector(x, name, jnp.floating, jnp.float32)


def chunk_length(length: int, n: int) -> int:
  """Elements per device chunk: ``ceil(length / n)`` rounded up to 32, and
  for long vectors to a larger power of two (``collectives._core.
  chunk_length``)."""
  return _core.chunk_length(length, n)


def _sign(x):
  return jnp.where(x >= 0, 1.0, -1.0).astype(jnp.float32)


def _f32_words(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _words_f32(w):
  return jax.lax.bitcast_convert_type(w, jnp.float32)


# -------------------------------------------------------------- majority --


def majority_vote(x: jax.Array, axis_name) -> jax.Array:
  """Elementwise majority of the devices' signs, 2 bits per element sent.

  .. math::
    v_e = \\operatorname{sign}\\Big(\\sum_{i=1}^{n} \\operatorname{sign}
    (x_{i,e})\\Big), \\quad \\operatorname{sign}(0) = +1

  Args:
    x: ``float[L]``, this device's vector (its signs are voted).
    axis_name: the axis, or None (the vote of one device is its sign).

  Returns:
    ``float32[L]`` of +1/-1, identical (typed invariant) on every device.
    Ties (even ``n``) give +1.

  Raises:
    ValueError: when ``x`` is not a 1-D floating array.

  Examples:
    Eight devices vote on three signs: all positive, five of eight
    negative, a tie:

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> def f(i):
    ...   x = jnp.stack([1.0, jnp.where(i[0] < 5, -1.0, 1.0),
    ...                  jnp.where(i[0] % 2 == 0, -1.0, 1.0)])
    ...   return jaxcomm.collectives.majority_vote(x, "data")
    >>> jax.shard_map(f, mesh=mesh, in_specs=P("data"),
    ...               out_specs=P())(jnp.arange(8)).tolist()
    [1.0, -1.0, 1.0]

  References:
    Bernstein et al, `signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant <https://arxiv.org/abs/1810.05291>`_, 2019.
  """
  x = _check_flat(x)
  n = _core.axis_size(axis_name)
  length = x.shape[0]
  c = chunk_length(length, n)
  words = bitpack.pack_signs(jnp.pad(x, (0, n * c - length)))
  got = _core.all_to_all(words.reshape(n, c // WORD_BITS), axis_name, 0, 0)
  voted = bitpack.vote(got, c)                          # my chunk, packed
  everything = _core.all_gather(voted, axis_name, tiled=True)
  return bitpack.unpack_signs(everything, length)


def majority_vote_wire(length: int, n: int) -> list:
  """The collectives of :func:`majority_vote` (HLO kind, payload bytes)."""
  words = n * chunk_length(length, n) // WORD_BITS
  return [("all-to-all", 4 * words), ("all-gather", 4 * words)]


# -------------------------------------------------- compressed allreduce --


def _leaf_index(positions, sizes: Sequence[int]):
  """Leaf of each flat position (``len(sizes)`` past the end)."""
  ends = jnp.asarray(np.cumsum(sizes), jnp.int32)
  return jnp.searchsorted(ends, positions, side="right").astype(jnp.int32)


def _blocks(sizes: Sequence[int]):
  """``(B, leaf id of each block)`` when every leaf is a whole number of
  blocks of one width and there is more than one run of sizes
  (:func:`jaxcomm._buckets.leaf_blocks`), else None: per-leaf work then
  runs once per run of equal sizes."""
  block = _buckets.leaf_blocks(sizes)
  if block is None or len(_buckets.runs(sizes)) <= 1:
    return None
  return block, _buckets.block_leaf_ids(sizes, block)


def _per_leaf(values, scales, sizes: Sequence[int], blocks=None):
  """``values[..., leaf l] * scales[..., l]``: one broadcast on leaf blocks
  (``blocks`` from :func:`_blocks`), or one per run of equal sizes
  (:func:`jaxcomm._buckets.runs`); never one per leaf.

  Slices and broadcasts rather than ``jnp.repeat`` with per-leaf counts,
  whose index computation XLA constant-folds (minutes for 10M elements).
  """
  lead = values.shape[:-1]
  if blocks is not None:
    block, ids = blocks
    v = values.reshape(lead + (-1, block))
    return (v * scales[..., ids][..., None]).reshape(values.shape)
  out, first = [], 0
  for off, count, d in _buckets.runs(sizes):
    v = values[..., off:off + count * d].reshape(lead + (count, d))
    s = scales[..., first:first + count, None]
    out.append((v * s).reshape(lead + (count * d,)))
    first += count
  return out[0] if len(out) == 1 else jnp.concatenate(out, axis=-1)


NORMS = ("l2", "l1")


def _mass(v, norm: str):
  """What a scale sums: ``v^2`` (``"l2"``) or ``|v|`` (``"l1"``)."""
  return v * v if norm == "l2" else jnp.abs(v)


def _scale(total, count, norm: str):
  """``sqrt(sum v^2 / d)`` (``"l2"``) or ``sum |v| / d`` (``"l1"``)."""
  return jnp.sqrt(total / count) if norm == "l2" else total / count


def worker_scales(x: jax.Array, sizes: Sequence[int],
                  blocks=None, norm: str = "l2") -> jax.Array:
  """Per-leaf scale of a flat concatenation, ``||x_l||_2 / sqrt(d_l)``
  (``norm="l2"``) or ``||x_l||_1 / d_l`` (``"l1"``): block sums added up
  per leaf (``blocks`` from :func:`_blocks`), or one batched reduction
  per run of equal sizes."""
  if blocks is not None:
    block, ids = blocks
    xb = x.reshape(-1, block)
    ss = jax.ops.segment_sum(jnp.sum(_mass(xb, norm), axis=1), ids,
                             num_segments=len(sizes), indices_are_sorted=True)
    return _scale(ss, jnp.asarray(np.asarray(sizes, np.float32)), norm)
  out = []
  for off, count, d in _buckets.runs(sizes):
    seg = x[off:off + count * d].reshape(count, d)
    out.append(_scale(jnp.sum(_mass(seg, norm), axis=1), d, norm))
  return out[0] if len(out) == 1 else jnp.concatenate(out)


def compressed_allreduce(x: jax.Array, sizes: Sequence[int],
                         server_error: jax.Array, axis_name,
                         norm: str = "l2"):
  """DeepSpeed-style 1-bit allreduce with server-side error feedback.

  Worker stage, per leaf ``l`` of the flat vector (error feedback already
  added by the caller):

  .. math::
    w = s_l \\operatorname{sign}(x), \\qquad s_l = \\|x_l\\|_2 / \\sqrt{d_l}

  Server stage, on the chunk ``k`` this device owns, one scale per leaf
  segment ``S`` of the chunk (the part of a leaf that falls in it):

  .. math::
    y = \\frac{1}{n}\\sum_i w_{i,k} + \\frac{e_k}{n}, \\quad
    z_S = \\frac{\\|y_S\\|_2}{\\sqrt{|S|}} \\operatorname{sign}(y_S),
    \\quad e_k' = n (y - z)

  (DeepSpeed scales a whole chunk at once; a chunk spanning a large and a
  small leaf then gives the small one sign noise at the large one's scale,
  8-16x its own gradient measured on the battery's leaves. Per segment it
  costs one float per leaf of the bucket in the all-gather.)

  and the result is the all-gather of every chunk's ``z``. The server error
  is kept in *gradient-sum units* (``n`` times the error of the mean), so
  that ``n * mean + n * ...`` bookkeeping reduces to: over any number of
  steps, ``n * sum_t z_t + sum_i e_i + sum_devices server_error`` equals the
  sum of every gradient ever fed (with ``e_i`` the workers' residuals).

  Args:
    x: ``float[L]``, this device's vector (leaves flattened and concatenated).
    sizes: the leaves' sizes (static), summing to ``L``.
    server_error: ``float32[S]``, ``S >= L`` (a state buffer stored in
      whole tiles, zeros past ``L``; see
      ``Layout.stored_size``); the chunks are those of its width, ``C =
      ceil(S / n)`` rounded up for alignment, and this device reads and
      writes only its own chunk ``[k C, (k + 1) C)`` (zero elsewhere).
    axis_name: the axis, or None.
    norm: ``"l2"`` (default, DeepSpeed's ``||v||_2 / sqrt(d)``) or
      ``"l1"`` (``||v||_1 / d``, the scaled sign of Karimireddy et al.
      2019 and Zheng et al. 2019), for both stages' scales.

  Returns:
    ``(mean, sent, server_error)``: ``mean`` ``float32[L]`` identical and
    invariant on every device; ``sent`` the worker's decoded message ``w``;
    the new server error.

  Raises:
    ValueError: when ``x`` is not a 1-D floating array, ``sizes`` do not
      sum to its length, or ``norm`` is unknown.

  References:
    Tang et al, `1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, 2021.
  """
  x = _check_flat(x)
  sizes = [int(s) for s in sizes]
  length = x.shape[0]
  if sum(sizes) != length:
    raise ValueError(f"sizes {sizes} do not sum to the length {length}")
  if norm not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
  # At least L wide: a state buffer stored in whole tiles is wider.
  server_error = _core.vector(server_error, "server_error", jnp.floating,
                              jnp.float32, min_length=length)
  width = server_error.shape[0]
  k = len(sizes)
  n = _core.axis_size(axis_name)
  c = chunk_length(width, n)
  cw = c // WORD_BITS
  idx = _core.axis_index(axis_name)

  # Worker stage.
  blocks = _blocks(sizes)            # leaf ids built once for both uses
  scales = worker_scales(x, sizes, blocks, norm)                    # [k]
  sent = _per_leaf(_sign(x), scales, sizes, blocks)
  words = bitpack.pack_signs(jnp.pad(x, (0, n * c - length)))
  msg = jnp.concatenate(
    [words.reshape(n, cw), jnp.broadcast_to(_f32_words(scales), (n, k))],
    axis=1)
  got = _core.all_to_all(msg, axis_name, 0, 0)                      # [n, cw+k]
  signs = bitpack.unpack_signs(got[:, :cw].reshape(-1), n * c).reshape(n, c)
  their = jnp.concatenate(
    [_words_f32(got[:, cw:]), jnp.zeros((n, 1), jnp.float32)], axis=1)
  err_pad = jnp.pad(server_error, (0, n * c - width))
  mine = jax.lax.dynamic_slice(err_pad, (idx * c,), (c,))
  tiles = _chunk_blocks(sizes, n * c - length, c)
  if tiles is not None:
    # Every leaf, the padding and the chunk length are whole blocks of one
    # width B: scales are read per block, never per element (no index or
    # scale array the size of the bucket; issue: memory under FSDP).
    mean, z, y = _server_on_blocks(signs, their, mine, tiles, idx, n, c, k,
                                   axis_name, cw, norm)
  else:
    mean, z, y = _server_per_element(signs, their, mine, sizes, idx, n, c,
                                     k, length, axis_name, cw, norm)
  new_err = jax.lax.dynamic_update_slice(err_pad, n * (y - z), (idx * c,))
  return mean[:length], sent, new_err[:width]


def _chunk_blocks(sizes, pad: int, c: int):
  """``(B, leaf id of each block)`` over the padded vector (padding is leaf
  ``len(sizes)``) when the leaves, the padding and the chunk length ``c``
  share a block width of at least :data:`jaxcomm._buckets.LEAF_BLOCK_MIN`,
  else None."""
  parts = list(sizes) + ([pad] if pad else [])
  block = _buckets.leaf_blocks(parts + [c])
  if block is None:
    return None
  return block, _buckets.block_leaf_ids(parts, block)


def _server_on_blocks(signs, their, mine, tiles, idx, n, c, k, axis_name,
                      cw, norm="l2"):
  """The server stage and the decode with one scale per block of B."""
  block, ids = tiles
  per = c // block
  lb = jax.lax.dynamic_slice(ids, (idx * per,), (per,))             # [c/B]
  avg = jnp.sum(signs.reshape(n, per, block) * their[:, lb][..., None],
                axis=0).reshape(c) / n
  valid = (lb < k)[:, None]
  y = jnp.where(valid, (avg + mine / n).reshape(per, block), 0.0)
  seg_sq = jax.ops.segment_sum(jnp.sum(_mass(y, norm), axis=1), lb,
                               num_segments=k + 1)
  seg_n = jax.ops.segment_sum(jnp.full((per,), float(block)), lb,
                              num_segments=k + 1)
  s = _scale(seg_sq, jnp.maximum(seg_n, 1.0), norm)                 # [k+1]
  z = jnp.where(valid, s[lb][:, None] * _sign(y), 0.0).reshape(c)
  y = y.reshape(c)
  out = jnp.concatenate([bitpack.pack_signs(y), _f32_words(s[:k])])
  rows = _core.all_gather(out, axis_name).reshape(n, cw + k)
  all_signs = bitpack.unpack_signs(rows[:, :cw].reshape(-1), n * c)
  scales = jnp.concatenate(
    [_words_f32(rows[:, cw:]), jnp.zeros((n, 1), jnp.float32)], axis=1)
  # Block b lies in chunk b // per: its scale is that chunk's for its leaf.
  chunk = jax.lax.optimization_barrier(
    jnp.arange(n * per, dtype=jnp.int32)) // per
  mean = (all_signs.reshape(n * per, block)
          * scales[chunk, ids][:, None]).reshape(-1)
  return mean, z, y


def _fill(values, starts, length: int):
  """``out[..., j] = values[..., s]`` for the last segment ``s`` whose
  start ``starts[s] <= j``: a float32 value per segment spread over its
  elements. ``starts`` (int32, possibly known only at run time) is
  nondecreasing, clipped at 0 below; starts at ``length`` or past it are
  dropped.

  Exact, by a telescoping sum: each segment adds the difference of its
  value's bits and the previous segment's (uint32, wrapping) at its start,
  and a cumulative sum leaves at ``j`` the bits of its segment's value.
  No index per element: a gather of a value per element held an ``[L,
  2]`` index whose minor 2 a TPU pads to 128 lanes (64x its data)."""
  bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32),
                                      jnp.uint32)
  delta = bits - jnp.concatenate(
    [jnp.zeros_like(bits[..., :1]), bits[..., :-1]], axis=-1)
  spread = jnp.zeros(values.shape[:-1] + (length,), jnp.uint32).at[
    ..., jnp.maximum(starts, 0)].add(delta, mode="drop")
  return jax.lax.bitcast_convert_type(
    jnp.cumsum(spread, axis=-1, dtype=jnp.uint32), jnp.float32)


def _server_per_element(signs, their, mine, sizes, idx, n, c, k, length,
                        axis_name, cw, norm="l2"):
  """The server stage and the decode with a leaf index per element (leaves
  without a common block width); the per-leaf scales spread over their
  segments by :func:`_fill`."""
  ends = np.cumsum(sizes)
  first = np.concatenate([[0], ends]).astype(np.int32)  # leaf l's start;
  # leaf k (the padding) starts at ``length``.
  pos0 = idx * c
  pos = pos0 + jnp.arange(c, dtype=jnp.int32)
  leaf = _leaf_index(pos, sizes)                                    # [c]
  # Segments of my chunk: every leaf's start, those before it at 0 (their
  # differences add up to the first element's leaf's value there).
  starts = jnp.asarray(first) - pos0
  avg = jnp.sum(signs * _fill(their, starts, c), axis=0) / n

  # Server stage on my chunk: one scale per leaf segment (padding is the
  # extra segment k, all zeros).
  valid = pos < length
  y = jnp.where(valid, avg + mine / n, 0.0)
  seg_sq = jax.ops.segment_sum(_mass(y, norm), leaf, num_segments=k + 1)
  seg_n = jax.ops.segment_sum(valid.astype(jnp.float32), leaf,
                              num_segments=k + 1)
  s = _scale(seg_sq, jnp.maximum(seg_n, 1.0), norm)                 # [k+1]
  z = jnp.where(valid, _fill(s, starts, c) * _sign(y), 0.0)
  out = jnp.concatenate([bitpack.pack_signs(y), _f32_words(s[:k])])
  rows = _core.all_gather(out, axis_name).reshape(n, cw + k)
  all_signs = bitpack.unpack_signs(rows[:, :cw].reshape(-1), n * c)
  scales = jnp.concatenate(
    [_words_f32(rows[:, cw:]), jnp.zeros((n, 1), jnp.float32)], axis=1)
  # The decode's segments are static: every chunk's start and every leaf
  # start, each read from its chunk's scale for its leaf.
  seg = np.unique(np.concatenate([np.arange(n) * c, first[first < n * c]]))
  table = (seg // c) * (k + 1) + np.minimum(
    np.searchsorted(ends, seg, side="right"), k)
  mean = all_signs * _fill(scales.reshape(-1)[jnp.asarray(table)],
                           jnp.asarray(seg, jnp.int32), n * c)
  return mean, z, y


def compressed_allreduce_wire(sizes: Sequence[int], n: int,
                              width: int | None = None) -> list:
  """The collectives of :func:`compressed_allreduce` (kind, payload);
  ``width``: the server error's (default: the leaves' total)."""
  length = int(sum(sizes)) if width is None else int(width)
  cw = chunk_length(length, n) // WORD_BITS
  return [("all-to-all", 4 * n * (cw + len(sizes))),
          ("all-gather", 4 * n * (cw + len(sizes)))]


# ------------------------------------------------------------- gather --


def gather_signs(x: jax.Array, scales: jax.Array, sizes: Sequence[int],
                 axis_name) -> jax.Array:
  """Average over devices of ``scale_l * sign(x)``, moving packed signs.

  .. math::
    u = \\frac{1}{n} \\sum_{i=1}^{n} s_{i,l} \\operatorname{sign}(x_i)

  Every device's packed signs and its per-leaf scales (as words) are
  all-gathered: each device sends ``n - 1`` bits per element (plus scales).
  Used when the average must be the exact linear average of what every
  device sent (EF-signSGD); :func:`compressed_allreduce` is the scalable
  alternative.

  Args:
    x: ``float[L]``; only its signs travel.
    scales: ``float32[len(sizes)]``, this device's per-leaf scales.
    sizes: leaf sizes (static), summing to ``L``.
    axis_name: the axis, or None.

  Returns:
    ``float32[L]``, identical and invariant on every device.

  Raises:
    ValueError: when ``x`` is not a 1-D floating array.
  """
  x = _check_flat(x)
  sizes = [int(s) for s in sizes]
  length = x.shape[0]
  words = bitpack.pack_signs(x)
  w = words.shape[0]
  rows = _core.all_gather(jnp.concatenate([words, _f32_words(scales)]),
                          axis_name)                                # [n, w+k]
  n = rows.shape[0]
  blocks = _blocks(sizes)

  # One device's row at a time: the decoded signs of all n devices at once
  # are n times the vector (2 slices, a 6.1M MLP of odd sizes on v5e: 3.09x
  # the plain step's memory per chip).
  def add_row(i, total):
    row = jax.lax.dynamic_index_in_dim(rows, i, keepdims=False)
    signs = bitpack.unpack_signs(row[:w], w * WORD_BITS)[:length]
    return total + _per_leaf(signs, _words_f32(row[w:]), sizes, blocks)

  total = _vma.match_varying(jnp.zeros((length,), jnp.float32), rows)
  return jax.lax.fori_loop(0, n, add_row, total) / n


def sign_message(x: jax.Array, scales: jax.Array) -> jax.Array:
  """One device's scaled-sign message as ``uint32`` words: the packed
  signs of ``x``, then the per-leaf ``scales`` (float32 bits); what
  :func:`gather_signs` gathers, for a point-to-point exchange."""
  x = _check_flat(x)
  return jnp.concatenate([bitpack.pack_signs(x), _f32_words(scales)])


def decode_sign_message(words: jax.Array, sizes: Sequence[int]
                        ) -> jax.Array:
  """Inverse of :func:`sign_message`: ``float32[sum(sizes)]``, each leaf's
  signs times its scale."""
  sizes = [int(s) for s in sizes]
  length = int(sum(sizes))
  w = bitpack.num_words(length)
  signs = bitpack.unpack_signs(words[:w], w * WORD_BITS)[:length]
  return _per_leaf(signs, _words_f32(words[w:]), sizes, _blocks(sizes))


def gather_signs_wire(sizes: Sequence[int], n: int) -> list:
  """The collectives of :func:`gather_signs` (kind, payload)."""
  w = bitpack.num_words(int(sum(sizes)))
  return [("all-gather", 4 * n * (w + len(sizes)))]


__all__ = ["chunk_length", "majority_vote", "majority_vote_wire",
           "compressed_allreduce", "compressed_allreduce_wire",
           "gather_signs", "gather_signs_wire", "worker_scales"]
