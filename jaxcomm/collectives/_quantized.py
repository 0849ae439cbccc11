"""Quantized allreduce: integer codes and scales on the wire, never floats.

The multi-level quantizers (QSGD, TernGrad, int8) in
:mod:`jaxcomm.transforms.quantize._quantization` quantize every device's
vector with a *shared* scale (the maximum over devices of the local bucket
statistic, one small ``pmax``), so that the sum of the decoded messages is
the scale times the *integer* sum of the codes. That sum is exact, so the
average is the linear average of what each device sent and error feedback
conserves mass.

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

:func:`requantized_allreduce` gives up exactness for width (EQuARX,
ZeRO++'s qgZ): every device codes each block of its vector on its own
block maximum, the chunk owner sums the decoded chunks in float32 and
requantizes the sum to the same width on the sum's own block maxima, and
keeps what that rounding left out as a server error. Each device sends
``2 (n - 1) / n (b + 16 / B)`` bits per element (bf16 steps per block of
``B``): 14.2 for int8 at ``n = 8``, against 21.4 exact and 28 for bf16.

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
  word ``i`` and holds element ``k * q + i`` (``q`` words): fields are
  contiguous slices, packed along a major direction so that the TPU
  compiler's (8, 128) tiles stay full (:func:`jaxcomm.collectives.
  pack_fields`).

  Args:
    u: ``uint32[..., m]`` with ``m`` a multiple of ``32 / bits``.
    bits: 1, 2, 4, 8, 16 or 32.

  Returns:
    ``uint32[..., m * bits / 32]``.
  """
  if WORD_BITS % bits:
    raise ValueError(f"pack_codes: bits must divide 32, got {bits}")
  if u.shape[-1] % (WORD_BITS // bits):
    raise ValueError(f"pack_codes: last axis {u.shape[-1]} must be a "
                     f"multiple of {WORD_BITS // bits}")
  return _core.pack_fields(u, bits)


def unpack_codes(w: jax.Array, bits: int, m: int) -> jax.Array:
  """Inverse of :func:`pack_codes`: ``uint32[..., m]`` codes."""
  return _core.unpack_fields(w, bits, m)


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
  words = _core.aligned_length(length) * bits // WORD_BITS
  gather = [("all-gather", n * words * 4)]
  chunk = _core.chunk_length(length, n)
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

  Raises:
    ValueError: when ``codes`` is not a 1-D integer array, or ``bound``
      (with ``low``) does not fit 32-bit codes.

  Examples:
    Ternary codes on 8 devices: device ``i`` sends ``[1, -1, i % 2]``;
    the exact sum crosses as 2-bit codes:

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> def f(i):
    ...   codes = jnp.stack([1, -1, i[0] % 2])
    ...   return jaxcomm.collectives.integer_allreduce(codes, 1, "data")
    >>> jax.shard_map(f, mesh=mesh, in_specs=P("data"),
    ...               out_specs=P())(jnp.arange(8)).tolist()
    [8, -8, 4]
  """
  codes = _check_int(codes)
  length = codes.shape[0]
  n = _core.axis_size(axis_name)
  p = plan(length, bound, n, low)
  offset = jnp.int32(bound if low is None else -low)
  if p.kind == "gather":
    padded = _core.aligned_length(length)
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
  total = _core.all_gather(packed, axis_name, tiled=True).reshape(n, -1)
  vals = unpack_codes(total, p.sum_bits, c).astype(jnp.int32) - sum_off
  return vals.reshape(-1)[:length]


# ------------------------------------------------ requantized allreduce --

# Code widths the requantized exchange offers: b-bit signed codes in
# [-(2^(b-1) - 1), 2^(b-1) - 1], stored offset and packed 32 / b to a word.
REQUANTIZED_BITS = (2, 4, 8)


def _check_requantized(bits, block) -> None:
  if isinstance(bits, bool) or bits not in REQUANTIZED_BITS:
    raise ValueError(f"bits must be one of {REQUANTIZED_BITS}, got {bits!r}")
  if isinstance(block, bool) or not isinstance(block, int) or block < 1:
    raise ValueError(f"block must be an int >= 1, got {block!r}")


class RequantizedPlan(NamedTuple):
  """The layout of :func:`requantized_allreduce` on ``n`` devices.

  Attributes:
    bits: bits per code (2, 4 or 8).
    bound: codes lie in ``[-bound, bound]`` (``2^(bits-1) - 1``).
    chunk: elements each device owns, ``ceil(length / n)`` rounded up to
      a multiple of 32, of a larger power of two for long vectors
      (:func:`jaxcomm.collectives.chunk_length`: what
      ``parallel.resize_state`` re-cuts a server error by).
    blocks: blocks per chunk, ``ceil(chunk / block)`` (the last one of
      each chunk may be short).
    words: ``uint32`` words of codes per chunk, ``chunk * bits / 32``.
    scale_words: ``uint32`` words of bf16 steps per chunk, two to a word.
    wire: ``[(hlo_kind, payload_bytes), ...]``.
  """

  bits: int
  bound: int
  chunk: int
  blocks: int
  words: int
  scale_words: int
  wire: list


def requantized_plan(length: int, n: int, bits: int, block: int
                     ) -> RequantizedPlan:
  """The chunks, blocks and collectives of :func:`requantized_allreduce`.

  Each phase moves, per chunk, the chunk's codes and one bf16 step per
  block: payload ``4 n (C b / 32 + ceil(ceil(C / B) / 2))`` bytes, of which
  each device sends ``(n - 1) / n`` (ring all-to-all and all-gather). With
  ``C ~ L / n`` that is ``2 (n - 1) / n (b + 16 / B)`` bits per element in
  all: 14.2 for ``b = 8``, 7.2 for ``b = 4`` at ``B = 128`` and ``n = 8``,
  against 28 for a bf16 ring all-reduce.
  """
  _check_requantized(bits, block)
  chunk = _core.chunk_length(length, n)
  blocks = -(-chunk // block)
  words = chunk * bits // WORD_BITS
  scale_words = -(-blocks // 2)
  payload = 4 * n * (words + scale_words)
  return RequantizedPlan(bits, 2 ** (bits - 1) - 1, chunk, blocks, words,
                         scale_words,
                         [("all-to-all", payload), ("all-gather", payload)])


def _bf16_up(u: jax.Array) -> jax.Array:
  """The smallest bfloat16 value ``>= u`` (``u >= 0`` float32), as float32:
  the low 16 bits of the float32 rounded up into the high ones."""
  bits = jax.lax.bitcast_convert_type(u, jnp.uint32)
  up = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(up, jnp.float32)


def block_quantize(v: jax.Array, bound: int):
  """Signed codes of ``v`` (``[..., B]`` rows, one block each) on a step
  of the block's own maximum.

  .. math::
    m = \\max_k |v_k|, \\quad
    s = \\lceil m (1 / q) \\rceil_{\\mathrm{bf16}}, \\quad
    c_k = \\operatorname{round}(v_k (1 / s))

  with ``q = bound``, every product and quotient rounded to float32,
  ``round`` half to even and a zero block giving ``s = 0`` and zero codes.
  ``|c_k| <= q``: ``|v_k| <= m <= q s``. The step is a bfloat16 value
  (8 significant bits), so a decoded value ``c_k s`` (7 + 8 bits) is exact
  in float32: sums of decoded values round the same whether or not the
  compiler fuses a product into an add (XLA's CPU backend does: a float32
  step made the chunk owner's sums, and so its rounding, depend on
  fusion), and the step travels in 16 bits.

  Returns:
    ``(c, s)``: ``int32[..., B]`` codes and ``float32[...]`` steps (bf16
    values); a code decodes to ``c * s``.
  """
  m = jnp.max(jnp.abs(v), axis=-1)
  s = _bf16_up(m * jnp.float32(1.0 / bound))
  inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
  q = jnp.round(v * inv[..., None]).astype(jnp.int32)
  return q, s


def _blocked(v, c: int, nb: int, block: int):
  """``[..., c]`` -> ``[..., nb, block]`` (zero-padded: padding never moves
  a block maximum)."""
  pad = [(0, 0)] * (v.ndim - 1) + [(0, nb * block - c)]
  return jnp.pad(v, pad).reshape(v.shape[:-1] + (nb, block))


def _decode_blocks(q, s, c: int):
  """Codes ``int32[..., nb, B]`` times their block's step (exact) ->
  ``float32[..., c]``."""
  vals = q.astype(jnp.float32) * s[..., None]
  return vals.reshape(vals.shape[:-2] + (-1,))[..., :c]


def _encode(q, s, p: "RequantizedPlan"):
  """Codes ``[..., nb, B]`` and steps ``[..., nb]`` -> ``uint32[..., words
  + scale_words]``: the chunk's packed codes (offset by ``bound``), then
  the steps' bfloat16 bits, two to a word."""
  flat = q.reshape(q.shape[:-2] + (-1,))[..., :p.chunk]
  words = pack_codes((flat + p.bound).astype(jnp.uint32), p.bits)
  half = jax.lax.bitcast_convert_type(s, jnp.uint32) >> 16
  pad = [(0, 0)] * (half.ndim - 1) + [(0, 2 * p.scale_words - p.blocks)]
  return jnp.concatenate([words, pack_codes(jnp.pad(half, pad), 16)],
                         axis=-1)


def _decode(msg, p: "RequantizedPlan", block: int):
  """Inverse of :func:`_encode`: ``float32[..., chunk]``."""
  q = unpack_codes(msg[..., :p.words], p.bits, p.chunk).astype(
    jnp.int32) - p.bound
  half = unpack_codes(msg[..., p.words:], 16, p.blocks)
  s = jax.lax.bitcast_convert_type(half << 16, jnp.float32)
  return _decode_blocks(_blocked(q, p.chunk, p.blocks, block), s, p.chunk)


def requantized_allreduce(x: jax.Array, server_error: jax.Array, axis_name,
                          *, bits: int, block: int):
  """Two-phase all-reduce of ``bits``-bit block codes, sums requantized.

  The chunk sums are requantized to ``bits`` bits by their owners, who
  keep what that rounding left out (a server error). The vector is cut
  into ``n`` chunks of ``C`` elements, each chunk into blocks of ``B =
  block`` elements (the last one of a chunk may be short). Every block is
  coded on a step of its own maximum: ``w = Q(x)``,
  codes in ``[-q, q]``, ``q = 2^(bits-1) - 1``, one bf16 step per block.

  Phase 1 (all-to-all): device ``j`` receives chunk ``j`` of every
  device's codes and steps, decodes them and sums them in device order in
  float32 (each decoded value is exact), and adds its server error ``e_j``
  (gradient-sum units): ``y = sum_i w_i + e_j``. Phase 2 (all-gather): it
  requantizes ``y`` the same way on ``y``'s own block maxima, ``z =
  Q(y)``, keeps ``e_j' = y - z`` and sends ``z``'s codes and steps to
  every device; the result is ``z / n``.

  Overflow of a requantized partial sum is impossible by construction:
  ``y`` is rescaled by its own block maximum before rounding (``|y_k| <=
  max|y| <= q s``), so every code lies in ``[-q, q]`` whatever ``n`` (no
  ``log2 n`` extra bits, unlike :func:`integer_allreduce`'s exact sums)
  and is the same ``bits`` wide as the first phase's.

  Mass: ``n * result + sum_j e_j' = sum_i w_i + sum_j e_j`` (up to float32
  rounding of the sums), so with the workers' error feedback ``n sum_t
  result_t + sum_i e_i + sum_j e_j = sum_t sum_i g_{t,i}``.

  Args:
    x: ``float[L]``, this device's vector.
    server_error: ``float32[S]``, ``S >= L`` (a state buffer stored in
      whole tiles, zeros past ``L``); the chunks are those of its width,
      and this device reads and writes only its own chunk ``[j C, (j + 1)
      C)`` (zero elsewhere).
    axis_name: the axis, or None.
    bits: 2, 4 or 8 (static).
    block: elements per step, ``>= 1`` (static).

  Returns:
    ``(mean, sent, server_error)``: ``float32[L]`` identical (typed
    invariant) on every device; this device's decoded message ``w``; the
    new server error.

  Raises:
    ValueError: naming the argument, when ``bits`` or ``block`` is not
      allowed, ``x`` is not a 1-D floating array, or ``server_error`` is
      not a 1-D floating array at least as long as ``x``.

  References:
    Google, `EQuARX: Efficient Quantized AllReduce in XLA for Distributed
    Machine Learning Acceleration <https://arxiv.org/abs/2506.17615>`_,
    2025 (block-wise int8 in both phases).
  """
  _check_requantized(bits, block)
  x = _core.vector(x, "x", jnp.floating, jnp.float32)
  length = x.shape[0]
  # At least L wide: a state buffer stored in whole tiles is wider.
  server_error = _core.vector(server_error, "server_error", jnp.floating,
                              jnp.float32, min_length=length)
  width = server_error.shape[0]
  n = _core.axis_size(axis_name)
  p = requantized_plan(width, n, bits, block)
  c, nb = p.chunk, p.blocks
  idx = _core.axis_index(axis_name)

  # Worker: every destination chunk in its own blocks.
  xs = _blocked(jnp.pad(x, (0, n * c - length)).reshape(n, c), c, nb, block)
  q, s = block_quantize(xs, p.bound)                        # [n, nb, B]
  sent = _decode_blocks(q, s, c).reshape(-1)[:length]
  got = _core.all_to_all(_encode(q, s, p), axis_name, 0, 0)

  # Owner of chunk idx: sum in device order, add the server error,
  # requantize on the sum's own block maxima.
  rows = _decode(got, p, block)                             # [n, C]
  y = rows[0]
  for i in range(1, n):
    y = y + rows[i]
  err_pad = jnp.pad(server_error, (0, n * c - width))
  y = y + jax.lax.dynamic_slice(err_pad, (idx * c,), (c,))
  r, big = block_quantize(_blocked(y, c, nb, block), p.bound)
  z = _decode_blocks(r, big, c)
  new_err = jax.lax.dynamic_update_slice(err_pad, y - z, (idx * c,))
  rows = _core.all_gather(_encode(r, big, p), axis_name)
  mean = _decode(rows, p, block).reshape(-1)[:length] / n
  return mean, sent, new_err[:width]


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
  padded = _core.aligned_length(length)
  gather = [("all-gather", n * padded * 9 // 8)]
  chunk = _core.chunk_length(length, n)
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
  word). With the ``gather`` exchange (up to 2 devices) every device
  decodes all ``n`` rows and averages them exactly; with ``scatter`` (from
  3 devices on) the owner of a
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

  Raises:
    ValueError: when ``values`` is not a 1-D float32 array.
  """
  values = jnp.asarray(values)
  if values.dtype != jnp.float32:
    raise ValueError(f"values must be float32, got {values.dtype}")
  length = values.shape[0]
  n = _core.axis_size(axis_name)
  p = natural_plan(length, n)
  if p.kind == "gather":
    padded = _core.aligned_length(length)
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
           "integer_allreduce", "natural_allreduce", "natural_plan",
           "REQUANTIZED_BITS", "requantized_plan", "RequantizedPlan",
           "requantized_allreduce", "block_quantize"]
