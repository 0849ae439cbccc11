"""Top-k by magnitude and threshold selection: Pallas kernels, jnp references.

The selection step of the sparsifying compressors (top-k, DGC, gTop-k):

* :func:`topk_abs` -- the ``k`` entries of largest ``|x|``, exact
  (:func:`topk_abs_bracketed`: the same result through a threshold search,
  faster on a GPU for large ``k``).
* :func:`~jaxcomm.kernels.threshold_select` -- every entry with
  ``|x| >= threshold``, in index order, compacted into a buffer of static
  ``capacity``.
* :func:`sampled_threshold` -- a DGC-style estimate of the threshold that
  keeps about ``k`` entries, from a sample of ``|x|``.

Conventions:

* **Values** are the signed entries of ``x`` (not ``|x|``); **indices** are
  ``int32`` positions in the flattened ``x``.
* **Ties** in :func:`topk_abs`: among equal ``|x|`` the lower index wins (the
  rule of ``lax.top_k``), and results come in decreasing ``|x|`` order. The
  kernel path keeps that rule, so it matches the reference index for index.
  NaN inputs give unspecified results.
* **Sentinel** in :func:`~jaxcomm.kernels.threshold_select`: unused
  slots of the buffer hold index ``len(x)`` (one past the end) and value
  0, so
  ``zeros(n).at[indices].add(values, mode="drop")`` ignores them. ``count`` is
  the number of entries above the threshold; when it exceeds ``capacity`` the
  ``capacity`` lowest indices are kept and ``count > capacity`` tells the
  caller. The comparison is ``|x| >= threshold`` in float32; NaN entries are
  never selected.

Kernels (each beside its ``*_reference``, keyword-only ``interpret``):

* ``topk_abs_pallas``: each block of ``block_size`` entries (an ``(R, 128)``
  tile) picks its top ``min(k, block_size)`` by iterated max-and-mask (one
  max and one min reduction per pick, lowest index first among equals), then
  the wrapper merges the candidates with ``lax.top_k``. That is exact, but a
  block costs ``O(min(k, block_size) * block_size)``, so the kernel pays only
  for small ``k``; once ``k >= block_size`` every block would keep everything
  and the wrapper skips the kernel (the result is then ``lax.top_k``'s).
  ``candidates_per_block`` below ``min(k, block_size)`` trades exactness for
  speed (approximate, like ``lax.approx_max_k``).
* ``threshold_mask_pallas``: packs the predicate ``|x| >= threshold`` into
  ``uint32`` words (the bit order of :mod:`jaxcomm.kernels.bitpack`): the one
  pass over ``x``. Compaction then runs on the 32x smaller words in XLA: a
  popcount prefix sum over words, a binary search of each output slot's word
  (``searchsorted``), a 5-step select-the-r-th-set-bit inside the word, and a
  gather of ``capacity`` values. That replaces the reference's ``cumsum`` and
  scatter over all ``len(x)`` entries: about 5x faster on CPU for 25M
  float32 at k = 0.1% and 1%, where the same path runs with a jnp packer.
  A fully in-kernel compaction (a prefix sum and a data-dependent scatter
  inside the kernel) is not portable between Mosaic TPU and GPU, so it is
  not attempted. The prefix sum is ``jnp.cumsum`` (a reduce-window that XLA
  rewrites into a scan) and the search ``searchsorted(method="scan")`` (a
  ``log2(words)``-step loop): on CPU for ResNet-18's 11M-element bucket
  they compile in 0.12 s and 0.16 s where ``lax.associative_scan`` took
  0.78 s and the unrolled search 0.51 s (a third of threshold's whole
  compile); their GPU run time is not yet re-measured.

Dispatch (``use_kernel=None``) follows ``JAXCOMM_KERNELS``
(:mod:`jaxcomm.kernels` has the table and the figures); ``True``
forces the kernel (interpreted on CPU), ``False`` the jnp path. Under
``auto``: on GPU the top-k kernel for ``k <= 64``, and above it the jnp
path, which on GPU is :func:`topk_abs_bracketed` from ``k = 512`` (where
it pays) and ``lax.top_k`` below (one H100, 25M float32, time as a
multiple of ``x + 0``: kernel 3.6x at k=16 against ``lax.top_k``'s 214x;
at k=128 ``lax.top_k`` 7.3x, bracketed 8.4x; at k=1024 bracketed 4.2x,
``lax.top_k`` 6.6x; at k=25,000 bracketed 3.4x, ``torch.topk`` 3.8x); on
TPU the kernel rule, unmeasured, and ``lax.top_k`` above (the radix
search of :func:`topk_abs_radix_segments` with
``JAXCOMM_TOPK_SEARCH=radix``: a faster compile, a slower step by the
compiler's estimate, see :func:`jaxcomm.kernels._dispatch.topk_search`);
``threshold_select`` takes the jnp-packed mask on every backend. On CPU,
``lax.approx_max_k`` falls back to an exact sort and measured no faster
than ``lax.top_k``, and ``lax.top_k`` beat the bracketed search at
ResNet-18 leaf sizes, so the CPU top-k is ``lax.top_k``.
GPU lowering uses the Triton backend, TPU lowering Mosaic (see
:mod:`jaxcomm.kernels.bitpack`); both lowerings are checked on a CPU host.

References:
  Lin et al, `Deep Gradient Compression: Reducing the Communication
  Bandwidth for Distributed Training <https://arxiv.org/abs/1712.01887>`_,
  2018 (sampled threshold selection).
  Chern et al, `TPU-KNN: K Nearest Neighbor Search at Peak FLOP/s
  <https://arxiv.org/abs/2206.14286>`_, 2022 (``lax.approx_max_k``).

Threshold selection and compaction live in ``jaxcomm.kernels.threshold``
(re-exported here).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxcomm import _rows
from jaxcomm.kernels import _dispatch
from jaxcomm.kernels import bitpack
from jaxcomm.kernels.threshold import _flat
from jaxcomm.kernels.threshold import compact_from_mask  # noqa: F401
from jaxcomm.kernels.threshold import compact_segments
from jaxcomm.kernels.threshold import pack_bits
from jaxcomm.kernels.threshold import segment_counts
from jaxcomm.kernels.threshold import segment_ids
from jaxcomm.kernels.threshold import threshold_mask  # noqa: F401
from jaxcomm.kernels.threshold import threshold_mask_pallas  # noqa: F401
from jaxcomm.kernels.threshold import threshold_mask_reference  # noqa: F401
from jaxcomm.kernels.threshold import threshold_select  # noqa: F401
from jaxcomm.kernels.threshold import threshold_select_packed  # noqa: F401
from jaxcomm.kernels.threshold import threshold_select_pallas  # noqa: F401
from jaxcomm.kernels.threshold import threshold_select_reference  # noqa: F401

_LANES = 128


def _check_k(k: int, length: int) -> int:
  k = int(k)
  if not 0 < k <= length:
    raise ValueError(f"k must be in [1, {length}], got {k}")
  return k


# --------------------------------------------------------------------------
# topk_abs
# --------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("k", "nonnegative"))
def topk_abs_reference(x: jax.Array, k: int, *,
                       nonnegative: bool = False) -> tuple[jax.Array,
                                                           jax.Array]:
  """The ``k`` entries of largest ``|x|`` via ``lax.top_k(jnp.abs(x), k)``.

  Args:
    x: a floating array of any shape, read flattened.
    k: how many entries (static, ``1 <= k <= x.size``).
    nonnegative: ``x`` holds magnitudes already: ``lax.top_k(x, k)``, with
      no ``|x|`` buffer beside ``x``.

  Returns:
    ``(values, indices)``: ``values = x[indices]`` (signed), ``indices``
    ``int32``, in decreasing ``|x|`` order, lower index first among ties.
  """
  x = _flat(x)
  k = _check_k(k, x.shape[0])
  _, idx = lax.top_k(x if nonnegative else jnp.abs(x), k)
  # The indices as they come out of the top-k: on CPU, XLA fused their
  # consumers (FetchSGD's scatter and re-estimate) across it and then
  # compiled the top-k as a full sort, 2.6 s instead of 50 ms on 11M
  # values.
  idx = lax.optimization_barrier(idx.astype(jnp.int32))
  return x[idx], idx


def _block_topk_kernel(x_ref, val_ref, idx_ref, *, picks, length, block):
  """Top ``picks`` of ``|x|`` in one ``(R, 128)`` block, by max-and-mask."""
  base = pl.program_id(0) * block
  a = jnp.abs(x_ref[...]).astype(jnp.float32)
  rows, cols = a.shape
  flat = (lax.broadcasted_iota(jnp.int32, a.shape, 0) * cols
          + lax.broadcasted_iota(jnp.int32, a.shape, 1))
  # Padding (past the end of x) and picked entries are set to -1 < |x|.
  a = jnp.where(flat < length - base, a, -1.0)
  slot = lax.broadcasted_iota(jnp.int32, val_ref.shape, 1)

  def pick(t, carry):
    a, vals, idxs = carry
    m = jnp.max(jnp.max(a, axis=1, keepdims=True), axis=0, keepdims=True)
    j = jnp.where(a == m, flat, block)
    j = jnp.min(jnp.min(j, axis=1, keepdims=True), axis=0, keepdims=True)
    vals = jnp.where(slot == t, m, vals)
    idxs = jnp.where(slot == t, base + j, idxs)
    a = jnp.where(flat == j, -1.0, a)
    return a, vals, idxs

  vals = jnp.full(val_ref.shape, -1.0, jnp.float32)
  idxs = jnp.full(idx_ref.shape, length, jnp.int32)
  _, vals, idxs = lax.fori_loop(0, picks, pick, (a, vals, idxs))
  val_ref[...] = vals
  idx_ref[...] = idxs


@functools.partial(
  jax.jit,
  static_argnames=("k", "block_size", "candidates_per_block", "interpret",
                   "platform"))
def topk_abs_pallas(x: jax.Array, k: int, *, block_size: int = 4096,
                    candidates_per_block: int | None = None,
                    interpret: bool = False,
                    platform: str | None = None
                    ) -> tuple[jax.Array, jax.Array]:
  """Internal: a block-wise candidate kernel and a ``lax.top_k`` merge.

  Call :func:`topk_abs`, which dispatches.

  Args:
    x: a floating array of any shape, read flattened.
    k: how many entries (static).
    block_size: entries per block, rounded to a power of two >= 2048.
    candidates_per_block: picks per block; ``None`` is ``min(k, block)``,
      which makes the result exact. Fewer is approximate; it is raised to
      ``ceil(k / full_blocks)`` so that there are always ``k`` candidates.
    interpret: run the kernel in the Pallas interpreter (needed on CPU).
    platform: lowering target for the compiler params (see
      :func:`jaxcomm.kernels.bitpack.pack_signs_pallas`).

  Returns:
    As :func:`topk_abs_reference` (identical when exact).
  """
  x = _flat(x)
  length = x.shape[0]
  k = _check_k(k, length)
  rows = bitpack._next_pow2(
    min(max(block_size, 16 * _LANES), max(length, 16 * _LANES))) // _LANES
  block = rows * _LANES
  full_blocks = length // block
  picks = min(k, block)
  if candidates_per_block is not None and full_blocks:
    # At least k real candidates: ceil(k / full_blocks) per block.
    picks = min(picks, max(int(candidates_per_block), -(-k // full_blocks)))
  if picks >= block:
    # Every block would keep all its entries: no selection to do.
    return topk_abs_reference(x, k)
  width = bitpack._next_pow2(picks)
  n_blocks = -(-length // block)
  x = jnp.pad(x, (0, n_blocks * block - length))
  cand_shape = jax.ShapeDtypeStruct((n_blocks, 1, width), jnp.float32)
  vals, idxs = _dispatch.pallas_call(
    functools.partial(_block_topk_kernel, picks=picks, length=length,
                      block=block),
    out_shape=(cand_shape, cand_shape.update(dtype=jnp.int32)),
    grid=(n_blocks,),
    in_specs=[pl.BlockSpec((None, rows, _LANES), lambda i: (i, 0, 0))],
    out_specs=(pl.BlockSpec((None, 1, width), lambda i: (i, 0, 0)),
               pl.BlockSpec((None, 1, width), lambda i: (i, 0, 0))),
    interpret=interpret,
    compiler_params=bitpack._compiler_params(platform, interpret),
    name="block_topk_abs",
  )(x.reshape(n_blocks, rows, _LANES))
  # Candidates are block-major and, within a block, in decreasing |x| with
  # lower index first among equals, so lax.top_k's lower-position-first tie
  # rule is the lower-index-first rule of the reference.
  _, pos = lax.top_k(vals.reshape(-1), k)
  idx = idxs.reshape(-1)[pos]
  return x[idx], idx


# Candidates kept by the bracketed top-k: 2k + 64 (the bracket's width).
_BRACKET_SLACK = 64
# |x| bit patterns are at most this (sign cleared; NaN patterns included).
_ABS_BITS_END = 0x80000000


def bracket_capacity(k: int) -> int:
  """Candidates :func:`topk_abs_bracketed` compacts: ``2 k + 64``."""
  return 2 * int(k) + _BRACKET_SLACK


def bracket_pays(k: int, length: int) -> bool:
  """Whether :func:`topk_abs_bracketed` selects rather than falls back to
  ``lax.top_k``: its ``2 k + 64`` candidates are under a quarter of ``x``."""
  return 4 * bracket_capacity(k) < int(length)


@functools.partial(jax.jit, static_argnames=("k",))
def topk_abs_bracketed(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of ``|x|`` through a threshold: bracket, compact, top-k.

  The order of ``|x|`` is the order of its float32 bit patterns (sign
  cleared), so the search runs on integers:

  1. From a sample of ``s`` entries (``~128 L / (1.5 k)``, drawn with a
     fixed key) the threshold ``t`` expected to keep ``1.5 k`` entries.
  2. While the count ``c = #{|x| >= t}`` is outside ``[k, 2k + 64]``: an
     exponential search (steps of ``2^20`` ulps, doubling) until ``t`` is
     bracketed, then bisection of the bit patterns. With ~128 expected
     sample hits (a standard deviation of ~9% of the count) the first
     ``t`` is almost always inside: one pass.
  3. The entries ``>= t`` compacted in index order
     (``threshold.compact_segments``, capacity ``2k + 64``) and
     ``lax.top_k`` of those few candidates.

  Ties that no threshold can split (say, more than ``k + 64`` zeros when
  fewer than ``k`` entries are nonzero) end the bisection at two adjacent
  patterns ``lo < hi``: every entry ``>= hi`` (fewer than ``k``) and the
  first entries equal to ``lo`` by index are the candidates. Either way
  the result is :func:`topk_abs_reference`'s, index for index: decreasing
  ``|x|``, lower index first among ties. Without selection to gain
  (:func:`bracket_pays` false) it is ``lax.top_k``. This is
  :func:`topk_abs_segments` with one segment.

  Works under ``vmap``. NaN inputs give unspecified results (as the
  reference).

  Args:
    x: a floating array of any shape, read flattened (length ``L``).
    k: how many entries (static, ``1 <= k <= L``).

  Returns:
    As :func:`topk_abs_reference`.
  """
  x = _flat(x)
  length = x.shape[0]
  k = _check_k(k, length)
  if not bracket_pays(k, length):
    return topk_abs_reference(x, k)
  values, indices = topk_abs_segments(x, [(0, 1, length, k)])[0]
  return values[0], indices[0]


def pack_mask(mask: jax.Array) -> jax.Array:
  """A flat bool mask packed into ``uint32`` words (bitpack's bit order,
  zero padding bits)."""
  return pack_bits(mask)


def topk_abs_segments(x: jax.Array, groups) -> list:
  """:func:`topk_abs_bracketed` of every segment of a flat buffer at once.

  ``groups``: static ``(offset, count, size, k)`` runs of ``count``
  equal segments of ``size`` elements starting at ``offset`` (contiguous,
  in order, covering ``x``), each keeping its ``k`` largest ``|x|``. The
  program has the same ops for any number of segments and sizes: one
  sample draw for all segments and one sort for their thresholds, one
  threshold search (one loop; each round one pass over ``x`` and a
  per-segment popcount), two compactions
  (``threshold.compact_segments``) and one sort of all candidates by
  ``(segment, -|x|, index)`` for the cut; on a GPU the loop waits on the
  host once per round, not once per round and group.

  Returns:
    Per group ``(values, indices)`` of shape ``[count, k]``: signed values
    and positions in ``x``, each row in decreasing ``|x|``, lower index
    first among ties (exactly :func:`topk_abs_reference` per segment).
  """
  x = _flat(x)
  length = x.shape[0]
  bits = lax.bitcast_convert_type(jnp.abs(x).astype(jnp.float32),
                                  jnp.uint32)
  u32 = lambda v: jnp.asarray(v, jnp.uint32)
  end = u32(_ABS_BITS_END)
  bounds, caps, quota, samples, picks, sizes = [0], [], [], [], [], []
  for off, count, size, k in groups:
    if off != bounds[-1]:
      raise ValueError(
        f"groups must cover x contiguously, in order; got {groups}")
    k = _check_k(k, size)
    cap = min(bracket_capacity(k), size)
    target = max(k, min(cap, (k + cap) // 2))
    s = min(size, max(4096, math.ceil(128 * size / target)))
    kp = min(s, max(1, round(target * s / size)))
    bounds += [off + (r + 1) * size for r in range(count)]
    caps += [cap] * count
    quota += [k] * count
    samples += [s] * count
    picks += [kp] * count
    sizes += [size] * count
  if bounds[-1] != length:
    raise ValueError(
      f"groups must cover x contiguously (len {length}), got {groups}")
  bounds = tuple(bounds)
  starts = np.asarray(bounds[:-1], np.int64)
  # Thresholds expected to keep ~1.5 k per segment: every segment's sample
  # from one draw (fixed key: the sample only guides the search), sorted
  # by (segment, -|x|) in one sort, the kp-th of each read off.
  s_end = np.cumsum(samples)
  srow = segment_ids((0,) + tuple(int(e) for e in s_end))
  pos = jax.random.randint(
    jax.random.PRNGKey(0), (int(s_end[-1]),), 0,
    jnp.asarray(np.asarray(sizes, np.int64), jnp.int32)[srow])
  drawn = bits[jnp.asarray(starts, jnp.int32)[srow] + pos]
  _, drawn = lax.sort((srow, ~drawn), num_keys=2)
  t0 = ~drawn[jnp.asarray(s_end - np.asarray(samples) + np.asarray(picks)
                          - 1, jnp.int32)]
  t0 = jnp.clip(t0, u32(1), end - 1)
  k_row = jnp.asarray(np.asarray(quota, np.int64), jnp.int32)
  cap_row = jnp.asarray(np.asarray(caps, np.int64), jnp.int32)
  row = segment_ids(bounds)

  def count(t):
    return segment_counts(pack_mask(bits >= t[row]), bounds)

  def active(c):
    _, lo, hi, n_sel, _, r = c
    return ((n_sel < k_row) | (n_sel > cap_row)) & (hi - lo > 1) & (r < 80)

  def body(c):
    t, lo, hi, n_sel, step, r = c
    on = active(c)
    many = n_sel > cap_row
    lo2 = jnp.where(many, t, lo)
    hi2 = jnp.where(many, hi, t)
    bracketed = (lo2 > 0) & (hi2 < end)
    up = jnp.minimum(t + step, (t + hi2) // 2 + (hi2 - t) % 2)
    down = jnp.where(t > step, t - step, lo2 + (t - lo2) // 2)
    t2 = jnp.where(bracketed, lo2 + (hi2 - lo2) // 2,
                   jnp.where(many, up, down))
    t2 = jnp.clip(t2, lo2 + 1, hi2 - 1)
    new = (t2, lo2, hi2, count(t2), jnp.minimum(step * 2, u32(1 << 30)),
           r + 1)
    return tuple(jnp.where(on, a, b) for a, b in zip(new, c))

  zero = t0 * u32(0)             # typed like t0 (varying inside shard_map)
  init = (t0, zero, zero + end, count(t0), zero + u32(1 << 20),
          zero.astype(jnp.int32))
  t, lo, hi, n_sel, _, _ = lax.while_loop(lambda c: jnp.any(active(c)),
                                          body, init)
  ok = (n_sel >= k_row) & (n_sel <= cap_row)
  t_above = jnp.where(ok, t, hi)
  t_equal = jnp.where(ok, u32(0xFFFFFFFF), lo)
  va, ia, _ = compact_segments(x, pack_mask(bits >= t_above[row]), bounds,
                               tuple(caps))
  ve, ie, _ = compact_segments(x, pack_mask(bits == t_equal[row]), bounds,
                               tuple(quota))
  # The cut, every segment at once. Candidates above the threshold and
  # those equal to the tie pattern are disjoint; sorted by (segment, -|x|
  # bits, index) with unused slots last, each segment's first k are its
  # top-k in the reference's order.
  c_end = np.cumsum(caps)
  q_end = np.cumsum(quota)
  crow = jnp.concatenate([
    segment_ids((0,) + tuple(int(e) for e in c_end)),
    segment_ids((0,) + tuple(int(e) for e in q_end))])
  vals = jnp.concatenate([va, ve])
  idx = jnp.concatenate([ia, ie])
  key = lax.bitcast_convert_type(jnp.abs(vals).astype(jnp.float32),
                                 jnp.uint32)
  # Unused slots (index L) sort after every candidate of their segment.
  key = jnp.where(idx < length, ~key, u32(0xFFFFFFFF))
  _, _, idx, vals = lax.sort((crow, key, idx, vals), num_keys=3)
  first = np.asarray(c_end - np.asarray(caps)) + np.asarray(
    q_end - np.asarray(quota))     # each segment's first slot once sorted
  out, r0 = [], 0
  for _, count, _, k in groups:
    take = (first[r0:r0 + count, None] + np.arange(k)[None, :]).astype(
      np.int32)
    take = jnp.asarray(take)
    out.append((vals[take], idx[take]))
    r0 += count
  return out


# On TPU under JAXCOMM_TOPK_SEARCH=radix: the radix top-k from this many
# entries (a segment's, or x's). The TPU compiler's code generation of a
# sort grows with its length (libtpu 0.0.42.1, v5e, compile-only,
# benchmarks/bench_topk_compile.py): lax.top_k of 1% or 5% of 4,096
# entries compiles in 0.2 s, of 8,192 in 0.5 s, of 16,384 in 1.2 s, of
# 32,768 in 3.5 s, of 1,048,576 in 5.7-7.6 s; the radix search (its value
# order) in 0.4-0.8 s from 4,096 to 65,536 entries and 1.3 s for k = 1,000
# of 1,048,576. At run time the compiler estimates it slower (v5e,
# 4,194,304 entries: k = 16 in 893 us against lax.top_k's 159 us, k = 1%
# in 4.4-4.8 ms against 160 us).
RADIX_TOPK_MIN_SIZE = 16384


ORDERS = ("value", "any")


def _check_order(order):
  if order not in ORDERS:
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _parse_groups(groups, length):
  """Static segment table of ``groups`` (see :func:`topk_abs_segments`):
  ``(bounds, quota)``, one bound per segment end and one ``k`` each."""
  bounds, quota = [0], []
  for off, count, size, k in groups:
    if off != bounds[-1]:
      raise ValueError(
        f"groups must cover x contiguously, in order; got {groups}")
    k = _check_k(k, size)
    bounds += [off + (r + 1) * size for r in range(count)]
    quota += [k] * count
  if bounds[-1] != length:
    raise ValueError(
      f"groups must cover x contiguously (len {length}), got {groups}")
  return tuple(bounds), quota


def topk_abs_radix_segments(x: jax.Array, groups, *,
                            order: str = "value") -> list:
  """:func:`topk_abs_segments` with no sort of ``x``: a radix search.

  Every segment's ``k``-th largest ``|x|`` is found on the bit patterns of
  ``|x|`` (their order is the order of ``|x|``) by 31 rounds of bisection,
  all segments in each round: one pass over ``x`` and a per-segment
  popcount (a fixed-count loop, so the program is the same for any
  ``k``, number of segments and sizes). With ``T`` that pattern, the
  entries above ``T`` (fewer than ``k``) and the first entries equal to
  ``T`` by index are the top-k; each set is compacted in index order
  (``threshold.compact_segments``), and only the entries above ``T`` are
  sorted, by ``(segment, -|x|)`` (a sort of ``sum(k)`` entries, not of
  ``x``).

  It exists for the TPU compiler, whose code generation of a sort grows
  with its length (``lax.top_k`` of 32,768 entries compiles in 3.5 s, this
  search in 0.6-0.8 s; ``topk.RADIX_TOPK_MIN_SIZE``), taken there under
  ``JAXCOMM_TOPK_SEARCH=radix`` only: the compiler estimates its run time
  above the sort's (see :func:`jaxcomm.kernels._dispatch.topk_search`).
  It runs on any backend and returns exactly
  :func:`topk_abs_reference`'s result per segment.

  Args:
    x: a floating array of any shape, read flattened.
    groups: static ``(offset, count, size, k)`` runs of ``count`` equal
      segments of ``size`` elements from ``offset`` (contiguous, in order,
      covering ``x``), each keeping its ``k`` largest ``|x|``.
    order: ``"value"``: each row in the reference's order (decreasing
      ``|x|``, lower index first among ties); ``"any"``: no sort (the
      entries above ``T`` by index, then those equal to ``T`` by index).

  Returns:
    Per group ``(values, indices)`` of shape ``[count, k]``: signed values
    and positions in ``x``, each row in ``order``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxcomm.kernels import topk
    >>> x = jnp.array([0.5, -3.0, 2.0, 3.0, 1.0, -1.0, 4.0, 0.0])
    >>> (v, i), = topk.topk_abs_radix_segments(x, [(0, 2, 4, 2)])
    >>> v
    Array([[-3.,  3.],
           [ 4.,  1.]], dtype=float32)
    >>> i
    Array([[1, 3],
           [6, 4]], dtype=int32)
  """
  x = _flat(x)
  # Every |x| pattern is below 2^31 (sign cleared): 31 halvings.
  return _radix_segments(x, _abs_keys, groups, order=order,
                         end=_ABS_BITS_END, rounds=31)


def _abs_keys(x: jax.Array) -> jax.Array:
  """uint32 keys in the order of ``|x|``: its float32 bit patterns."""
  return lax.bitcast_convert_type(jnp.abs(x).astype(jnp.float32), jnp.uint32)


def _radix_segments(x, key_of, groups, *, order, end, rounds):
  """The radix search and compaction behind :func:`topk_abs_radix_segments`
  on monotone ``uint32`` keys ``key_of(values)`` (all below ``end``),
  ``rounds`` halvings of ``[0, end)``. Keys are computed where they are
  compared (no buffer of every key), and counts are per-group row sums of
  the comparison (no mask over ``x``, no prefix sum)."""
  length = x.shape[0]
  bounds, quota = _parse_groups(groups, length)
  segments = len(quota)
  _check_order(order)
  k_row = jnp.asarray(np.asarray(quota, np.int64), jnp.int32)
  # Each group a [count, size] view; its segments' thresholds broadcast
  # along the rows (a gather t[segment id] of len(x) indices compiled for
  # TPU in 4.5 s on 430,000 entries).
  views, r0 = [], 0
  for off, cnt, size, _ in groups:
    views.append((x[off:off + cnt * size].reshape(cnt, size), r0, cnt))
    r0 += cnt

  def count(t):
    parts = [jnp.sum(key_of(v) >= t[r:r + c, None], axis=1, dtype=jnp.int32)
             for v, r, c in views]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  def mask(pred):
    """``pred(keys, rows, r0)`` of every group, flattened and packed."""
    parts = [pred(key_of(v), r, c).reshape(-1) for v, r, c in views]
    return pack_mask(parts[0] if len(parts) == 1 else jnp.concatenate(parts))

  # lo: a key at least k entries reach; hi: one fewer than k reach. The
  # halvings end at hi = lo + 1, lo the k-th largest key.
  zero = jnp.zeros((segments,), jnp.uint32) + (
    lax.bitcast_convert_type(x[:1].astype(jnp.float32), jnp.uint32) &
    jnp.uint32(0))

  def body(_, c):
    lo, hi = c
    mid = lo + (hi - lo) // 2
    enough = count(mid) >= k_row
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, hi = lax.fori_loop(0, rounds, body, (zero, zero + jnp.uint32(end)))
  above = count(hi)                          # < k, by the invariant
  caps = tuple(max(k - 1, 1) for k in quota)
  va, ia, _ = compact_segments(
    x, mask(lambda key, r, c: key >= hi[r:r + c, None]), bounds, caps)
  ve, ie, _ = compact_segments(
    x, mask(lambda key, r, c: key == lo[r:r + c, None]), bounds,
    tuple(quota))
  e_start = jnp.asarray(np.cumsum(quota) - np.asarray(quota), jnp.int32)
  # Entries above T in decreasing key (stable: lower index first among
  # ties, as compacted), unused slots (index L) last in their segment.
  c_end = np.cumsum(caps)
  if order == "value":
    crow = segment_ids((0,) + tuple(int(e) for e in c_end))
    key = jnp.where(ia < length, ~key_of(va), jnp.uint32(0xFFFFFFFF))
    _, _, ia, va = lax.sort((crow, key, ia, va), num_keys=2, is_stable=True)
  # Slot j of segment s: the j-th entry above T, else the (j - above)-th
  # entry equal to T.
  a_start = jnp.asarray(c_end - np.asarray(caps), jnp.int32)
  out, r0 = [], 0
  for _, cnt, _, k in groups:
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    seg = r0 + jnp.arange(cnt, dtype=jnp.int32)[:, None]
    n_above = above[seg]
    from_above = j < n_above
    pa = a_start[seg] + jnp.minimum(j, max(k - 1, 1) - 1)
    pe = e_start[seg] + jnp.maximum(j - n_above, 0)
    out.append((jnp.where(from_above, va[pa], ve[pe]),
                jnp.where(from_above, ia[pa], ie[pe])))
    r0 += cnt
  return out


def topk_abs_groups(x: jax.Array, groups, *,
                    nonnegative: bool = False, order: str = "value") -> list:
  """The top-k of every segment of a flat buffer, dispatched.

  ``groups`` as :func:`topk_abs_segments`. Where the jnp top-k is the
  bracketed search (``auto``/``never`` on a GPU) and it pays for some
  segment, all segments are searched together
  (:func:`topk_abs_segments`); otherwise each group takes
  :func:`topk_abs` (kernel or ``lax.top_k`` by the ``auto`` table), batched
  over its rows. On a TPU under ``JAXCOMM_TOPK_SEARCH=radix``, where some
  segment has ``topk.RADIX_TOPK_MIN_SIZE`` entries or more, all segments
  take the radix search (:func:`topk_abs_radix_segments`: no sort of
  ``x``). Either way
  the result is exact. ``nonnegative``: ``x`` holds magnitudes (as
  :func:`topk_abs`). ``order``: ``"value"`` (decreasing ``|x|``, lower
  index first among ties) or ``"any"`` (the caller needs the entries, not
  their order; the radix search then sorts nothing).

  Returns:
    Per group ``(values, indices)`` of shape ``[count, k]``, indices
    positions in ``x``; rows in ``order``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxcomm.kernels import topk
    >>> x = jnp.array([0.5, -3.0, 2.0, 3.0, 1.0, -1.0, 4.0, 0.0, 9.0])
    >>> [(v.tolist(), i.tolist())
    ...  for v, i in topk.topk_abs_groups(x, [(0, 2, 4, 2), (8, 1, 1, 1)])]
    [([[-3.0, 3.0], [4.0, 1.0]], [[1, 3], [6, 4]]), ([[9.0]], [[8]])]
  """
  x = _flat(x)
  _check_order(order)
  backend = _dispatch.platform()
  if _dispatch.mode() != "always" and any(
      _dispatch.auto_radix_topk(backend, size) for _, _, size, _ in groups):
    return topk_abs_radix_segments(x, groups, order=order)
  if _dispatch.mode() != "always" and any(
      _dispatch.auto_bracketed_topk(backend, k) and bracket_pays(k, size)
      for _, _, size, k in groups):
    return topk_abs_segments(x, groups)
  out = [None] * len(groups)
  # Short segments of similar length: one batched top-k per batch
  # (jaxcomm._rows), rows padded with zeros, which rank after every entry
  # of their row (|x| >= 0, the lower index first among ties), so each
  # row's first k are its segment's top-k as the reference orders them.
  batches, alone = _rows.plan([(o, c, s) for o, c, s, _ in groups])
  for b in batches:
    ks = [_check_k(groups[i][3], size) for i, _, _, size in b.members]
    kmax = max(ks)
    vals, idx = jax.vmap(lambda r, k=kmax: topk_abs(
      r, k, nonnegative=nonnegative))(b.gather(x))
    for (i, off, count, size), k, v, j in zip(
        b.members, ks, b.split(vals), b.split(idx)):
      base = off + size * jnp.arange(count, dtype=jnp.int32)[:, None]
      out[i] = (v[:, :k], j[:, :k] + base)
  for i in alone:
    off, count, size, k = groups[i]
    rows = x[off:off + count * size].reshape(count, size)
    if count == 1:
      # One row unbatched: the TPU compiler's batched top-k emitter
      # aborted on f32[1,131072] (libtpu 0.0.42.1, pipeline_emitter.cc
      # CalcSpanSize), the unbatched one compiles.
      vals, idx = topk_abs(rows[0], k, nonnegative=nonnegative)
      vals, idx = vals[None], idx[None]
    else:
      vals, idx = jax.vmap(lambda r, k=k: topk_abs(
        r, k, nonnegative=nonnegative))(rows)
    base = off + size * jnp.arange(count, dtype=jnp.int32)[:, None]
    out[i] = (vals, idx + base)
  return out


def topk_abs(x: jax.Array, k: int, *, interpret: bool = False,
             use_kernel: bool | None = None,
             nonnegative: bool = False) -> tuple[jax.Array, jax.Array]:
  """The ``k`` entries of ``x`` of largest magnitude (exact).

  Args:
    x: a floating array of any shape, read flattened.
    k: how many entries (static, ``1 <= k <= x.size``).
    interpret: run the Pallas kernel in interpret mode.
    use_kernel: ``None``: follow ``JAXCOMM_KERNELS`` (``auto``: the kernel
      on GPU/TPU when ``k <= 64``, else the jnp path); ``True``: always the
      kernel (interpreted on CPU); ``False``: always the jnp path. The jnp
      path is ``lax.top_k``, except on GPU from ``k = 512``
      (:func:`~jaxcomm.kernels.topk.topk_abs_bracketed`) and on TPU under
      ``JAXCOMM_TOPK_SEARCH=radix`` from ``topk.RADIX_TOPK_MIN_SIZE``
      entries (:func:`~jaxcomm.kernels.topk.topk_abs_radix_segments`).
    nonnegative: ``x`` holds magnitudes already (``x >= 0``): ``lax.top_k``
      reads it as is, with no ``|x|`` buffer beside it (the kernel and the
      bracketed search take ``|x|`` in their own passes).

  Returns:
    ``(values, indices)``: signed ``x[indices]`` and ``int32`` indices in
    decreasing ``|x|`` order, lower index first among ties.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxcomm.kernels import topk
    >>> topk.topk_abs(jnp.array([0.5, -3.0, 2.0, 3.0]), 2)
    (Array([-3.,  3.], dtype=float32), Array([1, 3], dtype=int32))
  """
  run_kernel, interpret = _dispatch.resolve("topk_abs", use_kernel, interpret,
                                            k=k)
  if run_kernel:
    return topk_abs_pallas(x, k, interpret=interpret)
  length = math.prod(jnp.shape(x))
  backend = _dispatch.platform()
  if _dispatch.auto_radix_topk(backend, length):
    (values, indices), = topk_abs_radix_segments(x, [(0, 1, length, k)])
    return values[0], indices[0]
  if _dispatch.auto_bracketed_topk(backend, k) and bracket_pays(k, length):
    return topk_abs_bracketed(x, k)
  return topk_abs_reference(x, k, nonnegative=nonnegative)


# --------------------------------------------------------------------------
# sampled_threshold
# --------------------------------------------------------------------------


def sampled_threshold(x: jax.Array, k: int, key: jax.Array | None,
                      sample_size: int, *, interpret: bool = False,
                      use_kernel: bool | None = None) -> jax.Array:
  """DGC-style estimate of the ``k``-th largest ``|x|`` from a sample.

  Takes ``s = min(sample_size, L)`` entries of ``|x|`` (uniformly at random
  with replacement, or, with ``key=None``, a strided sample), keeps the top
  ``k' = ceil(k * s / L)`` of them and returns the smallest of those. With
  ``s == L`` the whole array is used and the result is the exact ``k``-th
  largest ``|x|``, so ``threshold_select`` then keeps ``>= k`` entries (more
  on ties).

  .. math::
    \\hat t = \\min \\operatorname{top}_{k'}(|x_S|), \\quad
    k' = \\lceil k \\, |S| / L \\rceil

  Departs from DGC in that it does not re-select when the count misses
  ``k``; the caller sees the count from
  :func:`~jaxcomm.kernels.threshold_select`.

  The top ``k'`` of the sample is taken as :func:`topk_abs` would take it
  (the same dispatch on ``k'``, the same exact result on either path).

  Args:
    x: a floating array of any shape, read flattened.
    k: the number of entries the threshold should keep (static).
    key: a PRNG key, or ``None`` for a deterministic strided sample.
    sample_size: sample size (static).
    interpret: run the Pallas kernel in interpret mode.
    use_kernel: as in :func:`topk_abs` (decided on ``k'``).

  Returns:
    A float32 scalar threshold.

  Raises:
    ValueError: when ``k`` is not in ``[1, x.size]``, or
      ``JAXCOMM_KERNELS`` holds an unknown mode.
  """
  length = math.prod(jnp.shape(x))
  k = _check_k(k, length)
  s = max(1, min(int(sample_size), length))
  kp = min(s, max(1, math.ceil(k * s / length)))
  run_kernel, interpret = _dispatch.resolve("topk_abs", use_kernel, interpret,
                                            k=kp)
  return _sampled_threshold(x, kp, key, s, run_kernel=run_kernel,
                            interpret=interpret)


@functools.partial(
  jax.jit, static_argnames=("kp", "s", "run_kernel", "interpret"))
def _sampled_threshold(x, kp, key, s, *, run_kernel, interpret):
  x = _flat(x)
  length = x.shape[0]
  if s == length:
    sample = x
  elif key is None:
    stride = length // s
    sample = lax.slice(x, (0,), ((s - 1) * stride + 1,), (stride,))
  else:
    sample = x[jax.random.randint(key, (s,), 0, length)]
  if run_kernel:
    values, _ = topk_abs_pallas(sample, kp, interpret=interpret)
    return jnp.abs(values[-1]).astype(jnp.float32)
  top, _ = lax.top_k(jnp.abs(sample).astype(jnp.float32), kp)
  return top[-1]
