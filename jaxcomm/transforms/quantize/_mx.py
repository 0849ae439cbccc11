"""OCP microscaling (MX) formats on the wire: blocks of 32 elements that
share one power-of-two scale (OCP Microscaling Formats Specification v1.0,
2023; Rouhani et al. 2023).

========== ========= ===================== ==================
format     element   largest normal        bits per element
========== ========= ===================== ==================
mxfp8      E4M3      448 (2^8 x 1.75)      8.25
mxfp8_e5m2 E5M2      57344 (2^15 x 1.75)   8.25
mxfp6      E2M3      7.5 (2^2 x 1.875)     6.25
mxfp6_e3m2 E3M2      28 (2^4 x 1.75)       6.25
mxfp4      E2M1      6 (2^2 x 1.5)         4.25
========== ========= ===================== ==================

A block ``V`` of 32 values is sent as the E8M0 scale ``X = 2^(floor(log2
max|V|) - emax)`` (``emax`` the exponent of the element type's largest
normal; one byte) and the 32 elements ``V / X`` rounded to nearest-even in
the element type, saturating at its largest value (the spec leaves the
overflow of ``V / X`` up to ``2^(emax+1)`` to the implementation; saturation
is what the spec's reference code does). The FP8 elements are XLA's own
conversion (round to nearest-even), whose bit patterns are the codes;
FP6 and FP4, which XLA on CPU cannot convert to, round on a table of the
element type's values (from ``ml_dtypes``) to the same codes (the two
agree on every FP8 midpoint, its neighbours and 5M random values);
codes are packed into ``uint32`` words.

Blocks are cut within each leaf, never across two (the spec scales blocks
of one tensor): block ``j`` of a leaf is its flattened (row-major)
elements ``32 j .. 32 j + 31``, so a leaf ends in at most one short block,
and only where its size is not a multiple of 32 (blocking along a matrix
dimension, as MX matmuls do, would end every row in one). Here a short
block of ``k < 32`` elements is scaled by its own ``k`` elements, as if the
block size were ``k``: it travels as a whole block whose ``32 - k`` missing
elements are zeros, which change neither ``max |V|`` nor any element's
code, and whose codes are decoded and dropped, never returned as values
(the wire carries up to 31 such codes per leaf; :meth:`MxCodec.wire`
claims them). Each group of equal leaves is padded by one op, on its
``[G, leaf_size]`` view; a bucket whose leaves are all whole blocks is
sent as it is. In a step on a sharded model, the leaf is each device's
shard of it: blocks start at the shard's first element.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core

BLOCK = 32
# format -> (ml_dtypes element type, bits per element, emax).
FORMATS = {
  "mxfp8": (ml_dtypes.float8_e4m3fn, 8, 8),
  "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 8, 15),
  "mxfp6": (ml_dtypes.float6_e2m3fn, 6, 2),
  "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 6, 4),
  "mxfp4": (ml_dtypes.float4_e2m1fn, 4, 2),
}


def magnitudes(fmt: str) -> np.ndarray:
  """The element type's finite non-negative values, in code order (codes
  ``0 .. 2^(bits-1) - 1`` without the sign bit; NaN and Inf codes left
  out)."""
  dtype, bits, _ = FORMATS[fmt]
  codes = np.arange(2 ** (bits - 1), dtype=np.uint8)
  vals = codes.view(dtype).astype(np.float64)
  vals = vals[np.isfinite(vals)]
  assert np.all(np.diff(vals) > 0), fmt
  return vals.astype(np.float32)


# Element types XLA converts to on every backend: rounding and decoding
# are one convert, the codes their bit patterns (= table indices: the NaN
# and Inf codes these tables leave out come last).
_NATIVE = {"mxfp8": jnp.float8_e4m3fn, "mxfp8_e5m2": jnp.float8_e5m2}


def _round_native(a, table, dtype):
  """:func:`_round_to_table` by XLA's convert (``a >= 0`` saturated)."""
  q = jnp.minimum(a, table[-1]).astype(dtype)
  return jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)


def _round_to_table(a, table):
  """Codes of the table entries nearest to ``a >= 0`` (ties to the even
  code), ``a`` saturated at the table's last entry.

  The code is the number of midpoints ``m_i = (t_i + t_{i+1}) / 2`` below
  ``a``, a midpoint ``a`` equals counting when it rounds up to the even
  code ``i + 1``: one unrolled sum of comparisons with constants (the
  tables hold 8 or 32 magnitudes; their midpoints are exact in float32),
  which XLA fuses into one pass with no index or gathered array the size
  of the input.
  """
  t = np.asarray(table, np.float64)
  a = jnp.minimum(a, jnp.float32(t[-1]))
  code = jnp.zeros(a.shape, jnp.uint32)
  for i in range(len(t) - 1):
    mid = np.float32((t[i] + t[i + 1]) / 2)
    assert float(mid) == (t[i] + t[i + 1]) / 2, (i, t[i], t[i + 1])
    up = (a > mid) | ((a == mid) if (i + 1) % 2 == 0 else False)
    code = code + up.astype(jnp.uint32)
  return code


def _pack(codes, bits):
  """``uint32[..., 32, B]`` codes of ``bits`` bits (one block per column)
  -> ``uint32[..., bits, B]``: word ``i`` of a block holds bit ``i`` of its
  32 codes (bit planes). Blocks run along the minor dimension, so every
  array here is lane-dense on TPU (a block's 32 codes along it tiled to
  128 lanes: 4x the memory, and MXFP4's step took 4.2x the plain step's
  temporaries)."""
  rows = jnp.arange(BLOCK, dtype=jnp.uint32)[:, None]
  planes = [jnp.sum(((codes >> jnp.uint32(i)) & 1) << rows, axis=-2,
                    dtype=jnp.uint32) for i in range(bits)]
  return jnp.stack(planes, axis=-2)


def _unpack(words, bits):
  """Inverse of :func:`_pack`."""
  rows = jnp.arange(BLOCK, dtype=jnp.uint32)[:, None]
  codes = jnp.zeros(words.shape[:-2] + (BLOCK, words.shape[-1]), jnp.uint32)
  for i in range(bits):
    codes = codes | (((words[..., i:i + 1, :] >> rows) & 1)
                     << jnp.uint32(i))
  return codes


def words_per(length: int, fmt: str) -> int:
  """uint32 words of ``length`` elements (a multiple of 128) in ``fmt``."""
  bits = FORMATS[fmt][1]
  return length * bits // 32 + length // BLOCK // 4


def encode(x, fmt: str):
  """``float32[..., L]`` (``L`` a multiple of 128) -> ``uint32[...,
  words_per(L)]``: the element codes, then the E8M0 scales four to a
  word."""
  _, bits, emax = FORMATS[fmt]
  table = magnitudes(fmt)
  lead, length = x.shape[:-1], x.shape[-1]
  # Blocks as columns: (..., 32, B), lane-dense (see _pack).
  blocks = jnp.swapaxes(x.reshape(lead + (length // BLOCK, BLOCK)), -1,
                        -2).astype(jnp.float32)
  amax = jnp.max(jnp.abs(blocks), axis=-2)
  _, e = jnp.frexp(amax)                    # amax = m 2^e, m in [0.5, 1)
  shared = jnp.where(amax > 0, e - 1 - emax, -127)
  shared = jnp.clip(shared, -127, 127).astype(jnp.int32)
  # ldexp, not exp2: exact powers of two (XLA's exp2 is exp(x ln 2)).
  scaled = jnp.ldexp(blocks, -shared[..., None, :])
  if fmt in _NATIVE:
    mag = _round_native(jnp.abs(scaled), table, _NATIVE[fmt])
  else:
    mag = _round_to_table(jnp.abs(scaled), table)
  sign = (scaled < 0) & (mag > 0)
  codes = mag | (sign.astype(jnp.uint32) << (bits - 1))
  packed = _pack(codes, bits).reshape(lead + (-1,))
  scales = (shared + 127).astype(jnp.uint8)
  return jnp.concatenate([packed, _core.to_words(scales)], axis=-1)


def decode(words, length: int, fmt: str):
  """Inverse of :func:`encode`: ``float32[..., length]``."""
  _, bits, _ = FORMATS[fmt]
  lead = words.shape[:-1]
  nblocks = length // BLOCK
  packed = words[..., :nblocks * bits].reshape(lead + (bits, nblocks))
  scales = _core.from_words(words[..., nblocks * bits:], jnp.uint8)
  codes = _unpack(packed, bits)
  low = codes & ((1 << (bits - 1)) - 1)
  if fmt in _NATIVE:
    mag = jax.lax.bitcast_convert_type(low.astype(jnp.uint8),
                                       _NATIVE[fmt]).astype(jnp.float32)
  else:
    mag = jnp.asarray(magnitudes(fmt))[low]
  val = jnp.where((codes >> (bits - 1)) & 1, -mag, mag)
  exp = scales.astype(jnp.int32) - 127
  return jnp.swapaxes(jnp.ldexp(val, exp[..., None, :]), -1, -2).reshape(
    lead + (length,))


def _chunk(size: int, n: int) -> int:
  return _core.padded_length(-(-size // n), 4 * BLOCK)


def _whole_blocks(size: int) -> int:
  """``size`` rounded up to whole blocks."""
  return -(-size // BLOCK) * BLOCK


def blocked_size(layout) -> int:
  """Elements of ``layout``'s bucket with each leaf padded to whole blocks
  (what the codec encodes, before the chunks' padding)."""
  return sum(g.count * _whole_blocks(g.leaf_size) for g in layout.groups)


def _aligned(layout) -> bool:
  return all(g.leaf_size % BLOCK == 0 for g in layout.groups)


def to_blocks(x, layout):
  """``float32[layout.size]`` -> ``float32[blocked_size(layout)]``: each
  leaf followed by zeros up to whole blocks, so that every block of 32 lies
  in one leaf (one pad per group of equal leaves)."""
  if _aligned(layout):
    return x
  parts = [jnp.pad(v, ((0, 0), (0, _whole_blocks(g.leaf_size) -
                                g.leaf_size)))
           for v, g in zip(layout.views(x), layout.groups)]
  return layout.join(parts)


def from_blocks(y, layout):
  """Inverse of :func:`to_blocks` (``y``'s leading axes kept): the
  padding's elements are dropped."""
  if _aligned(layout):
    return y
  lead, parts, offset = y.shape[:-1], [], 0
  for g in layout.groups:
    width = _whole_blocks(g.leaf_size)
    v = y[..., offset:offset + g.count * width].reshape(
      lead + (g.count, width))
    parts.append(v[..., :g.leaf_size])
    offset += g.count * width
  return layout.join(parts)


@dataclasses.dataclass(frozen=True)
class MxCodec(_codec.CodecBase):
  """Each device's chunks in an MX format by all-to-all; the owner adds
  them in float32 and all-gathers its sum, in MX again (:func:`jaxcomm.mx`).

  Attributes:
    fmt: the format's name (a key of ``FORMATS``).
  """

  fmt: str = "mxfp8"
  # The reducer rounds each chunk's sum to the format again: the mean is
  # not exactly the mean of what the devices sent.
  mean_of_sent = False

  @property
  def name(self):
    return f"mx({self.fmt})"

  def apply(self, x, state, ctx):
    fmt, layout = self.fmt, ctx.layout
    # Every leaf padded to whole blocks; chunks are whole blocks too, so no
    # block crosses a leaf (see the module's docstring).
    x = to_blocks(x, layout)
    size = blocked_size(layout)
    if ctx.axis_name is None:
      length = _chunk(size, 1)
      own = decode(encode(jnp.pad(x, (0, length - size)), fmt), length,
                   fmt)[:size]
      own = from_blocks(own, layout)
      return _codec.CodecResult(mean=own, sent=own, state=state)
    n = ctx.num_devices
    chunk = _chunk(size, n)
    # x is the residual plus the gradient: left fused, XLA transposes
    # both into the blocks' layout (two bucket-sized copies, and the
    # gradient's flat copy besides); computed once, one copy of x is.
    x = _compressor._materialized(x, ctx.step)
    rows = jnp.pad(x, (0, chunk * n - size)).reshape(n, chunk)
    words = encode(rows, fmt)                               # [n, W]
    sent = from_blocks(decode(words, chunk, fmt).reshape(-1)[:size], layout)
    got = _core.all_to_all(words, ctx.axis_name, 0, 0)      # my chunk, n x
    mine = jnp.sum(decode(got, chunk, fmt), axis=0)
    total = _core.all_gather(encode(mine, fmt), ctx.axis_name, tiled=True)
    total = decode(total.reshape(n, -1), chunk, fmt).reshape(-1)[:size]
    total = from_blocks(total, layout)
    return _codec.CodecResult(mean=total / n, sent=sent, state=state)

  def wire(self, layout, n):
    # The blocks of every leaf, its short last block sent whole.
    w = words_per(_chunk(blocked_size(layout), n), self.fmt)
    return [("all-to-all", 4 * n * w), ("all-gather", 4 * n * w)]


@_registry.method(
    paper="OCP MX v1.0 2023; Rouhani et al. 2023",
    summary="32-element blocks, shared 2^e scale, FP8/FP6/FP4 elements",
    defaults={"fmt": "mxfp8"})
@_compressor.shared_options
def mx(fmt: str = "mxfp8", *, axis_name="data", error_feedback=False,
       policy=None, **options):
  """Averages gradients in an OCP microscaling format, both phases.

  .. math::
    X_b = 2^{\\lfloor \\log_2 \\max_{j \\in b} |x_j| \\rfloor - e_{max}},
    \\quad q_j = X_b \\, \\mathrm{rne}(x_j / X_b)

  The exchange is :func:`jaxcomm.cast`'s two phases with MX on the wire:
  an all-to-all of every device's MX-coded chunks, each device decodes its
  chunk's ``n`` contributions and adds them in float32, rounds the sum to
  MX again (fresh block scales: it cannot overflow, the scale follows the
  sum) and an all-gather of the summed chunks. Blocks are cut within each
  leaf (in a sharded step, each device's shard of it); a leaf whose size
  is not a multiple of 32 ends in a short block, sent zero-padded to 32.
  Each device sends ``2 (n - 1) / n`` times the MX buffer: ``8.25 / 6.25 /
  4.25`` bits per element against bf16's 16. With ``error_feedback=True``
  each device keeps its own rounding (not the reducer's second one).

  Args:
    fmt: ``"mxfp8"`` (E4M3), ``"mxfp8_e5m2"``, ``"mxfp6"`` (E2M3),
      ``"mxfp6_e3m2"`` or ``"mxfp4"`` (E2M1).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep each device's rounding error.
    policy: a :class:`jaxcomm.LeafPolicy`.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the reducer rounds again, so the mean is not the mean of what was
      sent).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for a ``fmt`` that is not one of the
      five above, or an ``axis_name``, ``error_feedback`` (``"ef21"`` and
      ``"diana"`` are refused: the mean is not the mean of what was
      sent), ``policy`` or option that :func:`jaxcomm.compressed`
      refuses; the update raises one when it is called outside a context
      that binds ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``, with a leaf policy that compresses even a 4-value
    leaf (one short block). In MXFP4 device 8's ``[8, -4, 1.5, 0]`` has
    the scale ``2^(3 - 2) = 2``, and ``1.5 / 2`` rounds to the E2M1 value
    1 (a tie, to the even code), so it sends ``[8, -4, 2, 0]``; with error
    feedback its residual keeps the difference. The summed chunk is
    rounded to MXFP4 again on its way back:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.mx("mxfp4", error_feedback=True,
    ...                 policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None, :4]
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(grads[7] - np.asarray(residual[7]))  # what device 8 sent
    [ 8. -4.  2.  0.]
    >>> print(grads.mean(0), np.asarray(update, np.float64).round(3))
    [ 4.5  -2.25  1.5   3.5 ] [ 4.  -2.   1.5  3. ]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.mx("mxfp4", error_feedback=True),
    ...                   optax.sgd(0.1))

  References:
    Open Compute Project, `OCP Microscaling Formats (MX) Specification
    v1.0 <https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf>`_,
    2023. Rouhani et al, `Microscaling Data Formats for Deep Learning
    <https://arxiv.org/abs/2310.10537>`_, 2023.
  """
  _checks.choice("fmt", fmt, tuple(FORMATS))
  return _compressor.compressed(MxCodec(fmt=fmt), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


def bits_per_element(fmt: str) -> float:
  """Bits on the wire per element of ``fmt`` (elements and scales)."""
  return FORMATS[fmt][1] + 8 / BLOCK


__all__ = ["mx"]
