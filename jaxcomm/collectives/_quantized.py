"""Quantized allreduce: integer codes and scales on the wire, never floats.

The multi-level quantizers (QSGD, TernGrad, int8) in
:mod:`jaxcomm.transforms._quantization` quantize every device's vector with
a *shared* scale (the maximum over devices of the local bucket statistic, one
small ``pmax``), so that the sum of the decoded messages is the scale times
the *integer* sum of the codes. That sum is exact, so the average is the
linear average of what each device sent and error feedback conserves mass.

:func:`integer_allreduce` sums integer codes over devices with the codes
packed ``32 / bits`` to a ``uint32`` word, by one of two exchanges, whichever
moves fewer bytes for the number of devices (:func:`plan`):

* ``gather``: one all-gather of every device's packed codes; every device
  adds the ``n`` rows. Payload ``n * L * b`` bits, each device sends
  ``(n - 1) L b`` bits: grows with ``n``.
* ``scatter``: an all-to-all of packed chunks (device ``j`` receives chunk
  ``j`` of everybody's codes), an exact integer sum of the chunk, and an
  all-gather of the packed chunk sums, which need ``b2 = bits(n q)`` bits.
  Each device sends ``(n - 1) / n * L * (b + b2)`` bits: about ``b + b2``
  bits per element whatever ``n``.

:func:`natural_allreduce` exchanges the 9-bit codes of natural compression
(sign bit + float32 exponent byte), which do not add as integers: from
``n = 3`` on the chunk owners round their averaged chunk to powers of two a
second time (unbiased) rather than gather ``9 (n - 1)`` bits per element.
"""

from __future__ import annotations

from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm.collectives import _core

WORD_BITS = 32


def code_bits(bound: int, low: int | None = None) -> int:
  """Bits per code for integers in ``[low, bound]`` (a power of two).

  ``low`` defaults to ``-bound``. Codes are stored offset by ``-low``
  (``0 .. bound - low``) and packed ``32 / bits`` to a word, so ``bits`` is
  rounded up to 1, 2, 4, 8, 16 or 32.
  """
  low = -bound if low is None else low
  if bound < low:
    raise ValueError(f"bound must be >= low ({low}), got {bound}")
  need = max(1, int(bound - low).bit_length())
  bits = 1
  while bits < need:
    bits *= 2
  if bits > WORD_BITS:
    raise ValueError(f"bound {bound} does not fit 32-bit codes")
  return bits


def pack_codes(u: jax.Array, bits: int) -> jax.Array:
  """Packs unsigned codes (< ``2**bits``) ``32 / bits`` to a ``uint32`` word.

  Code ``k`` of word ``i`` sits at bits ``[k * bits, (k + 1) * bits)`` of
  word ``i`` and holds element ``i * (32 / bits) + k`` (little-endian, as
  :func:`jaxcomm.kernels.bitpack.pack_signs`).

  Args:
    u: ``uint32[..., m]`` with ``m`` a multiple of ``32 / bits``.
    bits: 1, 2, 4, 8, 16 or 32.

  Returns:
    ``uint32[..., m * bits / 32]``.
  """
  per = WORD_BITS // bits
  u = jnp.asarray(u, jnp.uint32)
  m = u.shape[-1]
  if m % per:
    raise ValueError(f"pack_codes: last axis {m} must be a multiple of {per}")
  if per == 1:
    return u
  u = u.reshape(u.shape[:-1] + (m // per, per))
  shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
  # Disjoint bit fields: the sum is the bitwise OR.
  return jnp.sum(u << shifts, axis=-1, dtype=jnp.uint32)


def unpack_codes(w: jax.Array, bits: int, m: int) -> jax.Array:
  """Inverse of :func:`pack_codes`: ``uint32[..., m]`` codes."""
  per = WORD_BITS // bits
  if per == 1:
    return w[..., :m]
  shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
  mask = jnp.uint32((1 << bits) - 1)
  u = (w[..., None] >> shifts) & mask
  return u.reshape(w.shape[:-1] + (-1,))[..., :m]


class Plan(NamedTuple):
  """How :func:`integer_allreduce` exchanges ``length`` codes on n devices.

  Attributes:
    kind: ``"gather"`` or ``"scatter"``.
    bits: bits per code on the first (or only) exchange.
    sum_bits: bits per summed code (``scatter``'s all-gather).
    chunk: elements per device chunk (``scatter``), a multiple of 32.
    wire: ``[(hlo_kind, payload_bytes), ...]`` it issues.
  """

  kind: str
  bits: int
  sum_bits: int
  chunk: int
  wire: list


def plan(length: int, bound: int, n: int, low: int | None = None) -> Plan:
  """Chooses the exchange that moves fewest bytes for ``n`` devices.

  Both exchanges send ``(n - 1) / n`` of their payloads per device (ring
  all-gather and all-to-all), so comparing payloads compares traffic:
  ``gather`` moves ``n * L * b`` bits, ``scatter`` ``n * C * (b + b2)`` with
  ``C ~ L / n`` and ``b2`` the width of a sum of ``n`` codes, so
  ``scatter`` wins when ``n b > b + b2``: for int8 (``b = 8``, ``b2 = 16``)
  and ternary codes (``b = 2``, ``b2 = 4``) from ``n = 4`` on; at ``n = 3``
  they tie and at ``n = 2`` ``gather`` wins. On a tie ``gather`` (one
  collective, no partial sums) is taken.

  Args:
    length: number of codes per device.
    bound: codes lie in ``[-bound, bound]``.
    n: number of devices.
    low: if set, codes lie in ``[low, bound]`` instead (e.g. unsigned).

  Returns:
    A :class:`Plan`.
  """
  bits = code_bits(bound, low)
  sum_bits = code_bits(n * bound, None if low is None else n * low)
  words = _core.padded_length(length, WORD_BITS) * bits // WORD_BITS
  gather = [("all-gather", n * words * 4)]
  chunk = _core.padded_length(-(-length // n), WORD_BITS)
  scatter = [("all-to-all", n * chunk * bits // 8),
             ("all-gather", n * chunk * sum_bits // 8)]
  if n > 1 and sum(b for _, b in scatter) < sum(b for _, b in gather):
    return Plan("scatter", bits, sum_bits, chunk, scatter)
  return Plan("gather", bits, sum_bits, chunk, gather)


def _check_int(codes):
  return _core.vector(codes, "codes", jnp.integer, jnp.int32)


def integer_allreduce(codes: jax.Array, bound: int, axis_name, *,
                      low: int | None = None) -> jax.Array:
  """Exact sum over devices of integer codes, moved as packed words.

  .. math::
    s = \\sum_{i=1}^{n} c_i, \\qquad c_i \\in [-q, q]^L

  Args:
    codes: ``int[L]``, this device's codes, each in ``[-bound, bound]``.
    bound: ``q`` (static).
    axis_name: the axis to sum over, or None.
    low: if set (static), codes lie in ``[low, q]`` instead of ``[-q, q]``
      (``low = 0``, ``q = 255``: unsigned 8-bit codes, 8 bits each).

  Returns:
    ``int32[L]``, the sum, identical (and typed invariant) on every device.

  Example::

    total = integer_allreduce(jnp.array([1, -1, 0]), 1, "data")
  """
  codes = _check_int(codes)
  length = codes.shape[0]
  n = _core.axis_size(axis_name)
  p = plan(length, bound, n, low)
  offset = jnp.int32(bound if low is None else -low)
  if p.kind == "gather":
    padded = _core.padded_length(length, WORD_BITS)
    u = jnp.pad(codes + offset, (0, padded - length)).astype(jnp.uint32)
    rows = _core.all_gather(pack_codes(u, p.bits), axis_name)   # [n, W]
    vals = unpack_codes(rows, p.bits, length).astype(jnp.int32) - offset
    return jnp.sum(vals, axis=0)
  c = p.chunk
  u = jnp.pad(codes + offset, (0, n * c - length)).astype(jnp.uint32)
  words = pack_codes(u.reshape(n, c), p.bits)                   # [n, c b/32]
  got = _core.all_to_all(words, axis_name, 0, 0)
  mine = jnp.sum(unpack_codes(got, p.bits, c).astype(jnp.int32) - offset,
                 axis=0)                                        # [c]
  sum_off = n * offset
  packed = pack_codes((mine + sum_off).astype(jnp.uint32), p.sum_bits)
  total = _core.all_gather(packed, axis_name, tiled=True)
  vals = unpack_codes(total, p.sum_bits, n * c).astype(jnp.int32) - sum_off
  return vals[:length]


# ------------------------------------------------------ natural compression --


def _nat_encode(values: jax.Array) -> jax.Array:
  """float32[..., m] (m a multiple of 32, zero mantissas) -> 9-bit words."""
  bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
  sign = pack_codes(bits >> 31, 1)
  expo = pack_codes((bits >> 23) & jnp.uint32(0xFF), 8)
  return jnp.concatenate([sign, expo], axis=-1)


def _nat_decode(words: jax.Array, m: int) -> jax.Array:
  """Inverse of :func:`_nat_encode` for ``m`` values per row."""
  ws = m // WORD_BITS
  s = unpack_codes(words[..., :ws], 1, m)
  e = unpack_codes(words[..., ws:], 8, m)
  return jax.lax.bitcast_convert_type((s << 31) | (e << 23), jnp.float32)


def natural_plan(length: int, n: int) -> Plan:
  """The exchange of :func:`natural_allreduce` for ``n`` devices.

  ``gather``: all-gather of every device's 9-bit codes (``9 n L`` bits of
  payload). ``scatter``: all-to-all of 9-bit chunks, the owner averages its
  chunk in float32 and rounds it to powers of two again, all-gather of the
  9-bit rounded chunks (``18 L``). ``scatter`` from ``n = 3`` on (tie at 2,
  where the exact ``gather`` is kept).
  """
  padded = _core.padded_length(length, WORD_BITS)
  gather = [("all-gather", n * padded * 9 // 8)]
  chunk = _core.padded_length(-(-length // n), WORD_BITS)
  scatter = [("all-to-all", n * chunk * 9 // 8),
             ("all-gather", n * chunk * 9 // 8)]
  if n > 1 and sum(b for _, b in scatter) < sum(b for _, b in gather):
    return Plan("scatter", 9, 9, chunk, scatter)
  return Plan("gather", 9, 9, chunk, gather)


def natural_allreduce(values: jax.Array, axis_name,
                      reround: Callable[[jax.Array], jax.Array]
                      ) -> jax.Array:
  """Mean over devices of powers of two, moving 9 bits per element.

  ``values`` must be natural-compressed float32 (zero mantissa bits): each
  travels as its sign bit (32 to a word) and its exponent byte (4 to a
  word). With :func:`natural_plan`'s ``gather`` every device decodes all
  ``n`` rows and averages them exactly; with ``scatter`` the owner of a
  chunk averages the ``n`` decoded chunks and calls ``reround`` on the
  average (the sum of powers of two is not one), so each device sends
  about 18 bits per element whatever ``n``. An unbiased ``reround`` (natural
  compression with the owner's own noise) keeps the result unbiased.

  Args:
    values: ``float32[L]`` with zero mantissa bits.
    axis_name: the axis, or None.
    reround: ``float32[C] -> float32[C]`` with zero mantissas, applied by
      each chunk owner to its averaged chunk (``scatter`` only).

  Returns:
    ``float32[L]``: the mean, identical (invariant) on every device.
  """
  values = jnp.asarray(values)
  if values.dtype != jnp.float32:
    raise ValueError(f"values must be float32, got {values.dtype}")
  length = values.shape[0]
  n = _core.axis_size(axis_name)
  p = natural_plan(length, n)
  if p.kind == "gather":
    padded = _core.padded_length(length, WORD_BITS)
    rows = _core.all_gather(_nat_encode(jnp.pad(values, (0, padded - length))),
                            axis_name)
    return jnp.sum(_nat_decode(rows, padded), axis=0)[:length] / n
  c = p.chunk
  x = jnp.pad(values, (0, n * c - length)).reshape(n, c)
  got = _core.all_to_all(_nat_encode(x), axis_name, 0, 0)
  mine = reround(jnp.sum(_nat_decode(got, c), axis=0) / n)
  rows = _core.all_gather(_nat_encode(mine), axis_name)
  return _nat_decode(rows, c).reshape(-1)[:length]


__all__ = ["code_bits", "pack_codes", "unpack_codes", "plan", "Plan",
           "integer_allreduce", "natural_allreduce", "natural_plan"]
