"""Golomb-coded positions: sparse messages whose indices cost about
``log2(1/p) + 2`` bits each instead of 8, 16 or 32.

Sattler et al. (2019, STC, eq. 7-8) send the positions of a sparse tensor
of density ``p`` as Golomb-Rice codes of the gaps between consecutive
positions, with the parameter

.. math::
  b^* = 1 + \\left\\lfloor \\log_2 \\frac{\\log(\\phi - 1)}{\\log(1 - p)}
  \\right\\rfloor, \\qquad \\phi = \\tfrac{1 + \\sqrt 5}{2},

for an average of ``b* + 1 / (1 - (1 - p)^(2^b*))`` bits per position
(:func:`expected_bits`). Gap ``d`` is sent as ``q = d >> b`` in unary (``q``
ones and a zero) and ``r = d mod 2^b`` in ``b`` bits.

Collectives move static shapes, so the code lives in a fixed-capacity
buffer: the ``k`` remainders first (``k b`` bits, in bit planes: bit 0 of
every remainder, then bit 1, ...), then the ``k`` unary quotients
(:func:`encode`). The same bits as the interleaved code, only
reordered, and the reorder makes both directions parallel: the quotients
decode as the distances between consecutive zeros of the unary section (a
cumulative sum, no sequential scan). The capacity is exact, never an
estimate: gaps between ``k`` distinct positions of ``[0, L)`` sum to at most
``L - k``, so the quotients sum to at most ``(L - k) >> b`` and the unary
section holds ``k + ((L - k) >> b)`` bits (:func:`capacity_bits`). It costs
4-7% more than the paper's average at densities 0.1-5% (measured in
``tests/test_sparsification.py``): the paper's average assumes geometric
gaps, the capacity the worst case.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxcomm import _prefix

_PHI = (1 + math.sqrt(5)) / 2


def rice_parameter(k: int, size: int) -> int:
  """The paper's ``b*`` for ``k`` positions out of ``size`` (clamped to
  ``[0, 30]``; density 1 gives 0)."""
  p = k / size
  if p >= 1:
    return 0
  b = 1 + math.floor(math.log2(math.log(_PHI - 1) / math.log1p(-p)))
  return int(min(30, max(0, b)))


def expected_bits(k: int, size: int) -> float:
  """The paper's average bits per position at density ``k / size``."""
  p = k / size
  b = rice_parameter(k, size)
  if p >= 1:
    return 1.0
  return b + 1 / (1 - (1 - p) ** (2 ** b))


def capacity_bits(k: int, size: int, padding: int = 0) -> int:
  """Bits of the coded positions of one row: ``k b`` remainder bits and
  ``k + (size + padding - k) >> b`` unary bits (exact upper bound).

  ``padding`` lets positions reach ``size + padding - 1``: slots past the
  row that carry nothing (STC's selected zeros, which a sign bit cannot
  say); ``b`` stays the paper's for ``k`` of ``size``."""
  b = rice_parameter(k, size)
  return k * b + k + ((size + padding - k) >> b)


def pack_bits(bits: jax.Array) -> jax.Array:
  """``bool[..., B]`` -> ``uint32[..., ceil(B / 32)]`` (bit ``j`` of word
  ``w`` is element ``32 w + j``)."""
  num = bits.shape[-1]
  words = -(-num // 32)
  b = jnp.pad(bits.astype(jnp.uint32),
              [(0, 0)] * (bits.ndim - 1) + [(0, 32 * words - num)])
  b = b.reshape(bits.shape[:-1] + (words, 32))
  return jnp.sum(b << jnp.arange(32, dtype=jnp.uint32), axis=-1,
                 dtype=jnp.uint32)


def unpack_bits(words: jax.Array, num: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``num`` bits, ``bool``."""
  bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  return bits.reshape(words.shape[:-1] + (-1,))[..., :num].astype(bool)


def encode(positions: jax.Array, size: int, padding: int = 0) -> jax.Array:
  """Golomb-Rice code of ``k`` distinct sorted positions in ``[0, size +
  padding)``.

  Args:
    positions: ``int32[..., k]``, strictly increasing along the last axis.
    size: the row length ``L`` (static).
    padding: how far past the row positions may reach (static; see
      :func:`capacity_bits`).

  Returns:
    ``bool[..., capacity_bits(k, size, padding)]``: the ``k`` remainders
    (``b`` bits each, least significant first), then the unary quotients;
    unused trailing bits are ones.
  """
  return encode_many([positions], [size], [padding])[0]


def decode(bits: jax.Array, k: int, size: int) -> jax.Array:
  """Inverse of :func:`encode`: ``bool[..., capacity_bits(k, size,
  padding)]`` -> ``int32[..., k]`` positions (the padding is read from the
  bits' length)."""
  return decode_many([bits], [k], [size])[0]


def encode_many(positions: list, sizes: list, paddings=None) -> list:
  """:func:`encode` of several groups of rows (``positions[i]`` of rows of
  ``sizes[i]``, reaching ``paddings[i]`` past them; default 0) with one
  scatter for every unary section at once: one per call instead of one
  per shape group (a compressor's compile time)."""
  meta, idx, offset = [], [], 0
  paddings = [0] * len(sizes) if paddings is None else paddings
  for pos, size, padding in zip(positions, sizes, paddings):
    k = pos.shape[-1]
    b = rice_parameter(k, size)
    lead = pos.shape[:-1]
    prev = jnp.concatenate(
      [jnp.full(lead + (1,), -1, pos.dtype), pos[..., :-1]], axis=-1)
    gaps = (pos - prev - 1).astype(jnp.uint32)
    # Bit i of every remainder, then bit i + 1 (bit planes side by side):
    # a [k, b] array flattened would put b (2-8) in the TPU's lanes, and
    # its relayout cost the compiler ~20 s a group on the 6M MLP.
    rem = (jnp.concatenate([((gaps >> i) & 1).astype(bool)
                            for i in range(b)], axis=-1) if b
           else jnp.zeros(lead + (0,), bool))
    q = (gaps >> b).astype(jnp.int32)
    ub = k + ((size + padding - k) >> b)
    rows = math.prod(lead)
    # Quotient j ends with a zero at sum_{i<=j} q_i + j of its row.
    zeros = (jnp.cumsum(q, axis=-1) + jnp.arange(k, dtype=jnp.int32)
             ).reshape(rows, k)
    idx.append((zeros + offset + ub * jnp.arange(rows, dtype=jnp.int32)
                [:, None]).reshape(-1))
    meta.append((lead, ub, offset, rows, rem))
    offset += rows * ub
  if not meta:
    return []
  unary = jnp.ones((offset,), bool).at[jnp.concatenate(idx)].set(False)
  return [jnp.concatenate(
    [rem, unary[off:off + rows * ub].reshape(lead + (ub,))], axis=-1)
    for lead, ub, off, rows, rem in meta]


def decode_many(bits: list, ks: list, sizes: list) -> list:
  """:func:`decode` of several groups with one cumulative sum and one
  scatter for every unary section at once (see :func:`encode_many`)."""
  meta, flat, off = [], [], 0
  for bb, k, size in zip(bits, ks, sizes):
    b = rice_parameter(k, size)
    lead = bb.shape[:-1]
    rem = sum((bb[..., i * k:(i + 1) * k].astype(jnp.int32) << i
               for i in range(b)), jnp.zeros(lead + (k,), jnp.int32))
    unary = bb[..., k * b:]
    ub = unary.shape[-1]
    rows = math.prod(lead)
    flat.append(unary.reshape(-1))
    meta.append((lead, k, b, ub, rows, off, rem))
    off += rows * ub
  if not meta:
    return []
  is_zero = ~jnp.concatenate(flat)
  csum = _prefix.prefix_sum(is_zero, jnp.int32)
  total_k = sum(rows * k for _, k, _, _, rows, _, _ in meta)
  slots, vals, koff = [], [], 0
  for _, k, _, ub, rows, off, _ in meta:
    z = is_zero[off:off + rows * ub].reshape(rows, ub)
    c = csum[off:off + rows * ub].reshape(rows, ub)
    rank = c - (c[:, :1] - z[:, :1].astype(jnp.int32))[:, :1] - 1
    keep = z & (rank < k)
    slots.append(jnp.where(
      keep, koff + k * jnp.arange(rows, dtype=jnp.int32)[:, None] + rank,
      total_k).reshape(-1))
    vals.append(jnp.broadcast_to(jnp.arange(ub, dtype=jnp.int32),
                                 (rows, ub)).reshape(-1))
    koff += rows * k
  zeros_all = jnp.zeros((total_k,), jnp.int32).at[
    jnp.concatenate(slots)].set(jnp.concatenate(vals), mode="drop")
  out, koff = [], 0
  for lead, k, b, _, rows, _, rem in meta:
    zeros = zeros_all[koff:koff + rows * k].reshape(lead + (k,))
    koff += rows * k
    prev = jnp.concatenate([jnp.full(lead + (1,), -1, jnp.int32),
                            zeros[..., :-1]], axis=-1)
    gaps = ((zeros - prev - 1) << b) + rem
    out.append(jnp.cumsum(gaps + 1, axis=-1) - 1)
  return out
