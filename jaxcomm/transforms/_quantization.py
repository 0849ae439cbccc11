"""Quantization compressors: multi-level quantizers with shared scales
(QSGD, TernGrad, int8, uint8); signs are in :mod:`._signs`, natural
compression in :mod:`._natural`.

Every factory returns ``compressed(codec, ...)``: error feedback, leaf
policy, dense psum of small leaves and non-finite handling come from
:func:`jaxcomm.compressed`. What travels is always packed into ``uint32``
words (signs 32 to a word, integer codes ``32 / bits`` to a word) plus
float32 scales, never dequantised floats.

=============== ============================== ================================
factory         message per element            exchange (per device sends)
=============== ============================== ================================
``onebit``      sign + per-leaf scale          1-bit compressed allreduce with
                                               server error, ~2 bits
``signsgd``     sign                           majority vote, ~2 bits
``signum``      sign of local momentum         majority vote, ~2 bits
``ef_signsgd``  sign + ``||x||_1 / d``         all-gather, ``n - 1`` bits
``qsgd``        level in ``[-s, s]``           integer allreduce
``terngrad``    ternary ``{-1, 0, 1}``         integer allreduce
``int8``        ``round(127 x / max|x|)``      two-phase, requantized, ~14 bits
                                               (exact integer allreduce, ~21)
``int4``        ``round(7 x / max|x|)``        two-phase, requantized, ~7 bits
``uint8``       ``round((x - min) / s)``       integer allreduce
``natural``     sign + exponent byte (9 bits)  two-phase, re-rounded, ~18 bits
=============== ============================== ================================

Randomness: the stochastic quantizers draw their noise from
``fold_in(ctx.key, device_index)``, independent per device (so the noise
averages down over devices) and reproducible from the state's seed.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _per_device
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.collectives import _quantized

# Defaults of the static arguments (the factories take None for them, so
# that optax.inject_hyperparams injects only what the caller passes).
DEFAULT_BUCKET_SIZE = 128
# QSGD's largest level count: 16-bit codes (wider ones are float32's size).
MAX_LEVELS = 2**15 - 1


def _sizes(shapes) -> list[int]:
  return [int(np.prod(s)) for s in shapes]


def _sign(x):
  return jnp.where(x >= 0, 1.0, -1.0).astype(jnp.float32)


def device_key(ctx: _compressor.Context) -> jax.Array:
  """This device's noise key: ``fold_in(ctx.key, device_index)``."""
  return jax.random.fold_in(ctx.key, ctx.device_index)




# ----------------------------------------------- shared-scale quantizers --


class _Layout(NamedTuple):
  """Bucket layout of the compressed leaves (static)."""

  sizes: list      # elements per leaf
  buckets: list    # bucket length per leaf
  counts: list     # buckets per leaf

  @property
  def padded(self) -> int:
    return sum(b * c for b, c in zip(self.buckets, self.counts))

  @property
  def num_buckets(self) -> int:
    return sum(self.counts)


def bucket_layout(shapes, bucket_size: int | None) -> _Layout:
  """Each leaf is cut into buckets of ``min(bucket_size, size)`` elements
  (one bucket per leaf when ``bucket_size`` is None), the last zero-padded.
  """
  sizes = _sizes(shapes)
  buckets = [d if bucket_size is None else min(bucket_size, d)
             for d in sizes]
  buckets = [max(b, 1) for b in buckets]
  counts = [-(-d // b) for d, b in zip(sizes, buckets)]
  return _Layout(sizes, buckets, counts)


@dataclasses.dataclass(frozen=True)
class IntegerCodec(_codec.CodecBase):
  """A quantizer whose codes, under a scale shared by all devices, add up.

  The base of :class:`QsgdCodec`, :class:`TerngradCodec`,
  :class:`IntCodec` and :class:`Uint8Codec`, which set its fields and
  define ``stat``, ``quantize`` and ``unit`` (and ``prepare``, ``zero``).

  Per bucket: ``stat(xb) -> [nb]`` (``[nb, 2]`` when ``asymmetric``) the
  local statistic;
  the shared scale is its maximum over devices (one small ``pmax``);
  ``quantize(xb, S, u) -> int32`` codes in ``[-bound, bound]`` (``[low,
  bound]`` if ``low`` is set); ``unit(S)`` the value of one code step.
  ``prepare(v)`` runs before bucketing on ``[G, d]`` rows, one leaf per
  row (TernGrad's per-leaf clipping), where ``prepares``.
  Codes are summed exactly by :func:`jaxcomm.collectives.integer_allreduce`.
  ``unbiased``: ``E[decoded] = x`` (the codec's ``unbiased``, for DIANA).

  Asymmetric codes: ``zero(S)`` is the value of code 0, a code ``q`` decodes
  to ``zero(S) + unit(S) q`` and a sum ``t`` of ``n`` codes to ``n zero(S) +
  unit(S) t``. The last bucket is then padded with its last value, not 0,
  so that padding cannot move the bucket's minimum or maximum.

  One bucket per leaf (``bucket_size=None``) with a statistic that is a
  maximum over the bucket (``stat_is_max``: block maxima combine by max)
  and no ``prepare`` runs on the ``[L / B, B]`` view of the whole bucket
  (:func:`jaxcomm._buckets.leaf_blocks`): block maxima, one sorted segment
  maximum per leaf, the leaf's scale read back per block; the same ops for
  any number of leaf sizes.

  Attributes:
    bucket_size: elements per bucket (the subclass's field), or None: one
      bucket per leaf.
    bound: the largest code (the subclass's class attribute or property).
    low: the smallest code, or None for ``-bound``.
    stochastic: whether ``quantize`` takes uniform noise ``u``.
    stat_is_max: whether ``stat`` is a maximum over the bucket.
    prepares: whether ``prepare`` runs.
    asymmetric: whether ``zero`` is set (two statistics per bucket).
  """

  low: ClassVar[int | None] = None
  stochastic: ClassVar[bool] = False
  stat_is_max: ClassVar[bool] = False
  prepares: ClassVar[bool] = False
  asymmetric: ClassVar[bool] = False

  def stat(self, xb):
    raise NotImplementedError

  def quantize(self, xb, s, u):
    raise NotImplementedError

  def unit(self, s):
    raise NotImplementedError

  def prepare(self, v):
    return v

  def zero(self, s):
    raise NotImplementedError

  def _apply_per_leaf(self, x, state, ctx, block):
    sizes = ctx.layout.sizes
    xb = x.reshape(-1, block)
    ids = _buckets.block_leaf_ids(sizes, block)
    local = jax.ops.segment_max(self.stat(xb), ids,
                                num_segments=len(sizes),
                                indices_are_sorted=True)
    s = _core.pmax(local, ctx.axis_name)[ids][:, None]
    u = (jax.random.uniform(device_key(ctx), xb.shape, jnp.float32)
         if self.stochastic else None)
    q = self.quantize(xb, s, u)
    total = _quantized.integer_allreduce(q.ravel(), self.bound,
                                         ctx.axis_name, low=self.low)
    t = total.reshape(xb.shape).astype(jnp.float32)
    un = self.unit(s)
    mean = t * un / ctx.num_devices
    sent = q.astype(jnp.float32) * un
    return _codec.CodecResult(mean=mean.reshape(-1),
                              sent=sent.reshape(-1), state=state)

  def apply(self, x, state, ctx):
    layout = ctx.layout
    bucket_size = self.bucket_size
    if (bucket_size is None and self.stat_is_max and not self.prepares
        and not self.asymmetric):
      block = _buckets.leaf_blocks(layout.sizes)
      if block is not None:
        return self._apply_per_leaf(x, state, ctx, block)
    lay = bucket_layout(layout.shapes, bucket_size)
    # The bucket as [rows, b] blocks of buckets. Consecutive groups whose
    # leaves split into whole buckets of one width b (no padding, no
    # per-leaf ``prepare``) are one contiguous region of x: a free reshape,
    # with no copy in and none out. A group that pads its last bucket (or
    # that ``prepare`` transforms per leaf) is [G, d] -> padded -> [G c, b].
    mode = "edge" if self.asymmetric else "constant"
    parts = []   # (offset, size, b, padded: (count, d, c) | None)
    for g in layout.groups:
      d = g.leaf_size
      b = d if bucket_size is None else max(1, min(bucket_size, d))
      c = -(-d // b)
      if b * c == d and not self.prepares:
        if (parts and parts[-1][3] is None and parts[-1][2] == b
            and parts[-1][0] + parts[-1][1] == g.offset):
          o, sz, _, _ = parts[-1]
          parts[-1] = (o, sz + g.count * d, b, None)
        else:
          parts.append((g.offset, g.count * d, b, None))
      else:
        parts.append((g.offset, g.count * d, b, (g.count, d, c)))
    xbs = []
    for off, size, b, padded in parts:
      v = x[off:off + size]
      if padded is None:
        xbs.append(v.reshape(size // b, b))
        continue
      count, d, c = padded
      v = v.reshape(count, d)
      if self.prepares:
        v = self.prepare(v)
      if b * c != d:
        v = jnp.pad(v, ((0, 0), (0, b * c - d)), mode=mode)
      xbs.append(v.reshape(count * c, b))
    # Consecutive parts with the same bucket width are one [N, b] block:
    # the statistics, the quantizer and the decoder run once per block.
    blocks: list[list[int]] = []
    for i, xb in enumerate(xbs):
      if blocks and xbs[blocks[-1][0]].shape[1] == xb.shape[1]:
        blocks[-1].append(i)
      else:
        blocks.append([i])
    cat = lambda parts: parts[0] if len(parts) == 1 else jnp.concatenate(
      parts)
    xbs = [cat([xbs[i] for i in blk]) for blk in blocks]
    local = cat([self.stat(xb) for xb in xbs])
    shared = _core.pmax(local, ctx.axis_name)
    if self.stochastic:
      noise = jax.random.uniform(device_key(ctx), (lay.padded,),
                                 jnp.float32)
    codes, units, zeros, off, boff = [], [], [], 0, 0
    for xb in xbs:
      rows = xb.shape[0]
      s = shared[boff:boff + rows]
      u = (noise[off:off + xb.size].reshape(xb.shape) if self.stochastic
           else None)
      codes.append(self.quantize(xb, s[:, None], u))
      units.append(self.unit(s)[:, None])
      zeros.append(self.zero(s)[:, None] if self.asymmetric else None)
      off += xb.size
      boff += rows
    total = _quantized.integer_allreduce(
      cat([q.ravel() for q in codes]), self.bound, ctx.axis_name,
      low=self.low)
    n = ctx.num_devices
    mean, sent, off = [], [], 0
    for q, un, z, blk in zip(codes, units, zeros, blocks):
      t = total[off:off + q.size].reshape(q.shape).astype(jnp.float32)
      off += q.size
      if z is None:
        m = t * un / n
        e = q.astype(jnp.float32) * un
      else:
        m = z + un * (t / n)
        e = z + un * q.astype(jnp.float32)
      if all(parts[i][3] is None for i in blk):
        # Whole buckets only: the block is already the bucket's elements.
        mean.append(m.reshape(-1))
        sent.append(e.reshape(-1))
        continue
      row = 0
      for i in blk:
        _, size, b, padded = parts[i]
        count, d, c = padded if padded is not None else (size // b, b, 1)
        # [G c, b] -> [G, c b] -> the leaves' own d elements (a free
        # reshape when no padding was added).
        for out, v in ((mean, m), (sent, e)):
          v = v[row:row + count * c]
          if b * c != d:
            v = v.reshape(count, c * b)[:, :d]
          out.append(v.reshape(-1))
        row += count * c
    return _codec.CodecResult(mean=cat(mean), sent=cat(sent), state=state)

  def wire(self, layout, n):
    lay = bucket_layout(layout.shapes, self.bucket_size)
    stats = 2 if self.asymmetric else 1
    return ([("all-reduce", 4 * stats * lay.num_buckets)]
            + _quantized.plan(lay.padded, self.bound, n, self.low).wire)


def _safe_ratio(x, s):
  return jnp.where(s > 0, jnp.abs(x) / jnp.where(s > 0, s, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class QsgdCodec(IntegerCodec):
  """QSGD's stochastic levels on each bucket's norm, its maximum over
  devices (:func:`qsgd`).

  Attributes:
    levels: ``s``, the largest code (in ``[1, MAX_LEVELS]``).
    bucket_size: elements per bucket.
  """

  levels: int = 127
  bucket_size: int = DEFAULT_BUCKET_SIZE
  stochastic = True
  unbiased = True

  @property
  def name(self):
    return f"qsgd({self.levels})"

  @property
  def bound(self):
    return self.levels

  def stat(self, xb):
    return jnp.sqrt(jnp.sum(xb * xb, axis=1))

  def quantize(self, xb, s, u):
    levels = self.levels
    r = _safe_ratio(xb, s) * levels
    low = jnp.floor(r)
    lev = jnp.minimum(low + (u < r - low).astype(jnp.float32), levels)
    return (jnp.sign(xb) * lev).astype(jnp.int32)

  def unit(self, s):
    return s / self.levels


@_registry.method(
    family="compressor",
    paper="Alistarh et al. 2017",
    summary="stochastic unbiased levels, shared scale")
@_compressor.shared_options
def qsgd(levels: int | None = None, bucket_size: int | None = None, *,
         axis_name="data",
         error_feedback: bool = False, policy=None, seed: int = 0,
         **options):
  """QSGD: stochastic, unbiased quantization to ``levels`` norm-scaled levels.

  Per bucket ``v`` of ``bucket_size`` elements, with ``S`` the largest
  bucket norm ``||v||_2`` over devices and ``s = levels``:

  .. math::
    Q(v_k) = \\frac{S}{s} \\operatorname{sign}(v_k) \\, \\xi_k, \\quad
    \\xi_k = \\ell + \\mathrm{Bernoulli}(r - \\ell), \\quad
    r = \\frac{s |v_k|}{S}, \\; \\ell = \\lfloor r \\rfloor

  so ``E[Q(v)] = v``. Codes ``sign * xi`` in ``[-s, s]`` travel packed
  (:func:`jaxcomm.collectives.integer_allreduce`) beside one float32 scale
  per bucket.

  Departure from the paper: the scale is the *maximum over devices* of the
  bucket norms (one ``pmax`` of one float per bucket), not each device's
  own norm. Quantization stays unbiased (any ``S >= |v_k|`` is), the
  variance grows by at most ``(S / ||v||)^2``, and the devices' codes can
  then be added exactly as integers, which lets the chunked exchange keep
  per-device traffic about constant in ``n`` and keeps error feedback
  conservative.

  Args:
    levels: ``s`` in ``[1, 32767]`` (static: it sets the code width;
      default 127). Codes of more levels would be 32 bits wide, as large
      as the float32 they replace, and their sums over devices could
      overflow.
    bucket_size: elements per bucket, ``>= 1`` (static; default 128).
    axis_name: the data axis.
    error_feedback: keep the quantization error (not in the paper), or
      ``"diana"`` (unbiased: DIANA's shifts, with ``shift_rate``).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the noise; every device folds in its index.

  Example::

    tx = optax.chain(jaxcomm.qsgd(levels=15, bucket_size=512),
                     optax.sgd(0.1))

  References:
    Alistarh et al, `QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>`_, 2017.
  """
  # Static arguments default to None so that optax.inject_hyperparams
  # injects only what it is given.
  levels = 127 if levels is None else levels
  bucket_size = DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size
  _checks.integer("levels", levels, 1)
  if levels > MAX_LEVELS:
    raise ValueError(
      f"levels must be an int in [1, {MAX_LEVELS}] (wider codes cost as "
      "much as float32 and their sums over devices overflow), got "
      f"{levels!r}")
  _checks.integer("bucket_size", bucket_size, 1)
  _checks.error_feedback(error_feedback)
  codec = QsgdCodec(levels=levels, bucket_size=bucket_size)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


@dataclasses.dataclass(frozen=True)
class TerngradCodec(IntegerCodec):
  """TernGrad's stochastic ternary codes on each leaf's maximum, its
  maximum over devices (:func:`terngrad`); one bucket per leaf.

  Attributes:
    clip_sigma: ``c``: each leaf is first clipped to ``c`` times the
      standard deviation of its entries; None: no clipping.
  """

  clip_sigma: float | None = None
  name = "terngrad"
  bucket_size = None                        # one bucket per leaf
  bound = 1
  stochastic = True
  stat_is_max = True

  @property
  def prepares(self):
    return self.clip_sigma is not None

  @property
  def unbiased(self):
    # Clipping to c sigma biases it; the stochastic ternary step does not.
    return self.clip_sigma is None

  def stat(self, xb):
    return jnp.max(jnp.abs(xb), axis=1)

  def quantize(self, xb, s, u):
    keep = (u < _safe_ratio(xb, s)).astype(jnp.float32)
    return (jnp.sign(xb) * keep).astype(jnp.int32)

  def unit(self, s):
    return s

  def prepare(self, v):                     # [G, d]: one leaf per row
    bound = self.clip_sigma * jnp.std(v, axis=1, keepdims=True)
    return jnp.clip(v, -bound, bound)


@_registry.method(
    family="compressor",
    paper="Wen et al. 2017",
    summary="stochastic ternary, shared layer scale")
@_compressor.shared_options
def terngrad(clip_sigma: float | None = None, *, axis_name="data",
             error_feedback: bool = False, policy=None, seed: int = 0,
             **options):
  """TernGrad: stochastic ternary gradients with a shared per-layer scale.

  Per leaf (layer-wise scaling), with ``s`` the maximum of ``max|g|`` over
  devices (the paper's scalar sharing):

  .. math::
    \\tilde g_k = s \\operatorname{sign}(g_k) \\, b_k, \\quad
    b_k \\sim \\mathrm{Bernoulli}(|g_k| / s)

  unbiased: ``E[g~] = g``. Optionally each device first clips its gradient
  to ``[-c sigma, c sigma]`` with ``sigma`` the standard deviation of the
  leaf's entries and ``c = clip_sigma`` (the paper uses ``c = 2.5``); the
  clipped part then stays in the residual if error feedback is on. Ternary
  codes travel 2 bits each; their sums are exact integers
  (:func:`jaxcomm.collectives.integer_allreduce`).

  Args:
    clip_sigma: ``c > 0`` or None (no clipping; injectable when set).
    axis_name: the data axis.
    error_feedback: keep the quantization error (not in the paper), or
      ``"diana"`` (without ``clip_sigma``, which biases it).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the noise; every device folds in its index.

  Example::

    tx = optax.chain(jaxcomm.terngrad(clip_sigma=2.5), optax.sgd(0.1))

  References:
    Wen et al, `TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning <https://arxiv.org/abs/1705.07878>`_, 2017.
  """
  if clip_sigma is not None:
    _checks.number("clip_sigma", clip_sigma, 0.0, None,
                             lo_open=True)
  _checks.error_feedback(error_feedback)
  codec = TerngradCodec(clip_sigma=clip_sigma)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


class RequantizedState(NamedTuple):
  """Codec state of :func:`int8` and :func:`int4` (unless
  ``exchange="exact"``).

  Attributes:
    server_error: ``float32[L]`` per device (``L`` the bucket's size):
      what the chunk owner's requantization of the chunk sums left out,
      in gradient-sum units; device ``k`` uses only its chunk ``[k C, (k
      + 1) C)`` (:func:`jaxcomm.collectives.requantized_allreduce`).
  """

  server_error: jax.Array


# As onebit's server error: device k holds its chunk's mass in full.
_per_device.register(RequantizedState, server_error=_per_device.OWNED)

EXCHANGES = ("exact", "requantized")


def _sent_cost(collectives) -> int:
  """Bytes one device sends, up to the common ``(n - 1) / n``: ring
  all-reduces send their payload twice, all-gathers and all-to-alls once."""
  return sum(b * (2 if k == "all-reduce" else 1) for k, b in collectives)


@dataclasses.dataclass(frozen=True)
class IntCodec(IntegerCodec):
  """Signed ``bits``-bit codes on a per-bucket (per-block) maximum, its
  maximum over devices, summed exactly (:func:`int8`'s ``"exact"``
  exchange).

  Attributes:
    bits: the code width (codes in ``[-q, q]``, ``q = 2^(bits-1) - 1``).
    bucket_size: elements per scale.
  """

  bits: int = 8
  bucket_size: int = DEFAULT_BUCKET_SIZE

  @property
  def name(self):
    return f"int{self.bits}"

  @property
  def bound(self):
    return 2 ** (self.bits - 1) - 1

  def stat(self, xb):
    return jnp.max(jnp.abs(xb), axis=1)

  def quantize(self, xb, s, u):
    del u
    return jnp.round(_safe_ratio(xb, s) * float(self.bound) * jnp.sign(xb)
                     ).astype(jnp.int32)

  def unit(self, s):
    return s / float(self.bound)


@dataclasses.dataclass(frozen=True)
class RequantizedCodec(_codec.CodecBase):
  """Signed ``bits``-bit codes on a per-block maximum by the requantized
  exchange, or by :class:`IntCodec`'s exact one where that moves fewer
  bytes (``exchange=None``) (:func:`int8`).

  Attributes:
    bits: the code width.
    bucket_size: elements per block (per scale).
    exchange: ``"requantized"``, or None: the one that moves fewer bytes
      on the step's device count.
  """

  bits: int = 8
  bucket_size: int = DEFAULT_BUCKET_SIZE
  exchange: str | None = None
  # The requantized mean is not the mean of what devices sent (the owner
  # rounds it again): EF21 is refused for it by name.
  mean_of_sent = False

  @property
  def name(self):
    return f"int{self.bits}"

  @property
  def exact(self) -> IntCodec:
    """The exact exchange's codec."""
    return IntCodec(bits=self.bits, bucket_size=self.bucket_size)

  def _choose(self, layout, n):
    if self.exchange is not None:
      return self.exchange
    if n <= 1:
      return "exact"
    requant = _quantized.requantized_plan(layout.size, n, self.bits,
                                          self.bucket_size).wire
    if _sent_cost(requant) < _sent_cost(self.exact.wire(layout, n)):
      return "requantized"
    return "exact"

  def init(self, layout):
    return RequantizedState(jnp.zeros([layout.size], jnp.float32))

  def apply(self, x, state, ctx):
    if self._choose(ctx.layout, ctx.num_devices) == "exact":
      # A server error left by the requantized exchange (a state resized
      # to a device count where the exact one moves fewer bytes) is sent
      # now, not lost: it joins this device's message but not its
      # residual (zero otherwise, and then nothing changes).
      err = state.server_error
      res = self.exact.apply(x + err, (), ctx)
      return _codec.CodecResult(mean=res.mean, sent=res.sent - err,
                                state=RequantizedState(jnp.zeros_like(err)))
    mean, sent, err = _quantized.requantized_allreduce(
      x, state.server_error, ctx.axis_name, bits=self.bits,
      block=self.bucket_size)
    return _codec.CodecResult(mean=mean, sent=sent,
                              state=RequantizedState(err))

  def wire(self, layout, n):
    if self._choose(layout, n) == "exact":
      return self.exact.wire(layout, n)
    return _quantized.requantized_plan(layout.size, n, self.bits,
                                       self.bucket_size).wire


def _block_int(name, bits, bucket_size, exchange, error_feedback):
  """The codec of :func:`int8` and :func:`int4` at ``bits`` bits (``name``
  is ``f"int{bits}"``, the codec's own)."""
  del name
  bucket_size = DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size
  _checks.integer("bucket_size", bucket_size, 1)
  _checks.error_feedback(error_feedback)
  if exchange is not None and (not isinstance(exchange, str)
                               or exchange not in EXCHANGES):
    raise ValueError(f"exchange must be one of {EXCHANGES} or None (the "
                     f"one that moves fewer bytes), got {exchange!r}")
  if exchange is None and error_feedback in ("ef21", "diana"):
    # EF21 keeps h = mean_i h_i only where the result is the mean of what
    # devices sent: the exact exchange.
    exchange = "exact"
  if exchange == "exact":
    return IntCodec(bits=bits, bucket_size=bucket_size)
  return RequantizedCodec(bits=bits, bucket_size=bucket_size,
                          exchange=exchange)


_EXCHANGE_DOC = """
  Two exchanges (``exchange``; None takes the one that moves fewer bytes
  on the step's device count: the requantized one from ``n = 2`` on):

  * ``"exact"``: the scale of each bucket (``bucket_size`` elements of one
    leaf, the last one padded) is the maximum over devices (one small
    ``pmax``), so the codes add up exactly: the chunk owners sum them as
    integers and send back ``ceil(log2(2 q n + 1))``-bit sums
    (:func:`jaxcomm.collectives.integer_allreduce`). The mean is the mean
    of what devices sent; EF21 works.
  * ``"requantized"`` (EQuARX's and ZeRO++'s pattern): every device scales
    each block of ``B = bucket_size`` elements by its own maximum; an
    all-to-all gives each chunk's owner every device's codes and block
    maxima; it sums them in float32, adds its server error and requantizes
    the sum to the same width on the sum's own block maxima; an all-gather
    returns the requantized chunks
    (:func:`jaxcomm.collectives.requantized_allreduce`); each block's step
    is its maximum over ``q`` rounded up to a bfloat16 value (16 bits on
    the wire, and decoded values exact in float32). Each device sends
    ``2 (n - 1) / n (b + 16 / B)`` bits per element. A requantized sum
    cannot overflow its codes: it is divided by its own block maximum
    before rounding, so every code lies in ``[-q, q]`` whatever ``n``.
    Blocks are cut from the flat bucket (within each device's chunk), so a
    block may span the end of one leaf and the start of the next. The
    owner's rounding error is kept as server-side error feedback (per
    device, on its own chunk, in gradient-sum units, as :func:`onebit`'s):
    ``n sum_t mean_t + sum_i e_i + sum server_error = sum_t sum_i g_t,i``.
    The mean is not the mean of what devices sent, so EF21 and DIANA
    need ``exchange="exact"`` (None picks it for them).
"""


@_registry.method(
    family="compressor",
    paper="Dettmers 2016; EQuARX (Google 2025)",
    summary="int8 codes + per-block scale, requantized 2-phase, EF")
@_compressor.shared_options
def int8(bucket_size: int | None = None, *, axis_name="data",
         exchange: str | None = None,
         error_feedback: bool = True, policy=None,
         **options):
  """int8 quantization with a per-bucket scale and error feedback.

  .. math::
    q_k = \\operatorname{round}(127 x_k / S), \\quad
    \\hat x_k = \\frac{S}{127} q_k, \\quad
    S = \\max_{k \\in b} |x_k|

  Deterministic rounding (half to even). With error feedback (default)
  the rounding error is resent later and mass is conserved.
  {exchange}
  At ``n = 8`` with ``B = 128`` (compiled HLO, one 1M-element leaf):
  14.2 bits per element sent per device (requantized), against 21.4
  (exact) and 28 for a bf16 ring all-reduce (:func:`cast`).

  Args:
    bucket_size: elements per scale, ``>= 1`` (static; default 128).
    axis_name: the data axis.
    exchange: ``"exact"``, ``"requantized"`` or None (fewer bytes).
    error_feedback: keep the rounding error per device.
    policy: a :class:`jaxcomm.LeafPolicy`.

  Example::

    tx = optax.chain(jaxcomm.int8(), optax.adam(1e-3))

  References:
    Dettmers, `8-Bit Approximations for Parallelism in Deep Learning
    <https://arxiv.org/abs/1511.04561>`_, 2016.
    Google, `EQuARX: Efficient Quantized AllReduce in XLA for Distributed
    Machine Learning Acceleration <https://arxiv.org/abs/2506.17615>`_,
    2025.
  """
  codec = _block_int("int8", 8, bucket_size, exchange, error_feedback)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


@_registry.method(
    family="compressor",
    paper="ZeRO++ qgZ (Wang et al. 2023); EQuARX (Google 2025)",
    summary="int4 codes + per-block scale, requantized 2-phase, EF")
@_compressor.shared_options
def int4(bucket_size: int | None = None, *, axis_name="data",
         exchange: str | None = None,
         error_feedback: bool = True, policy=None,
         **options):
  """int4 quantization with a per-block scale and error feedback.

  .. math::
    q_k = \\operatorname{round}(7 x_k / S), \\quad
    \\hat x_k = \\frac{S}{7} q_k, \\quad
    S = \\max_{k \\in b} |x_k|

  :func:`int8` at 4 bits: codes in ``[-7, 7]`` travel 8 to a ``uint32``
  word (XLA's CPU backend widens sub-32-bit collectives). Deterministic
  rounding (half to even); error feedback (default) resends the rounding
  error, which at 15 levels is most of what makes it train.
  {exchange}
  At ``n = 8`` with ``B = 128`` (compiled HLO, one 1M-element leaf): 7.2
  bits per element sent per device (requantized), against 10.9 (exact,
  8-bit sums) and 28 for a bf16 ring all-reduce.

  Args:
    bucket_size: elements per scale, ``>= 1`` (static; default 128).
    axis_name: the data axis.
    exchange: ``"exact"``, ``"requantized"`` or None (fewer bytes).
    error_feedback: keep the rounding error per device.
    policy: a :class:`jaxcomm.LeafPolicy`.

  Example::

    tx = optax.chain(jaxcomm.int4(), optax.sgd(0.1, momentum=0.9))

  References:
    Wang et al, `ZeRO++: Extremely Efficient Collective Communication for
    Giant Model Training <https://arxiv.org/abs/2306.10209>`_, 2023 (qgZ:
    int4 gradients by all-to-all).
    Google, `EQuARX: Efficient Quantized AllReduce in XLA for Distributed
    Machine Learning Acceleration <https://arxiv.org/abs/2506.17615>`_,
    2025.
  """
  codec = _block_int("int4", 4, bucket_size, exchange, error_feedback)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


int8.__doc__ = int8.__doc__.replace("{exchange}", _EXCHANGE_DOC)
int4.__doc__ = int4.__doc__.replace("{exchange}", _EXCHANGE_DOC)


def _uint8_span(S):
  """``(lo, s)`` from the shared ``(-lo, hi)``: ``s = (hi - lo) / 255``."""
  return -S[..., 0], (S[..., 1] + S[..., 0]) / 255.0


@dataclasses.dataclass(frozen=True)
class Uint8Codec(IntegerCodec):
  """Asymmetric 8-bit codes on each bucket's ``(min, max)``, shared over
  devices (:func:`uint8`).

  Attributes:
    bucket_size: elements per ``(l, s)`` pair.
  """

  bucket_size: int = DEFAULT_BUCKET_SIZE
  name = "uint8"
  bound = 255
  low = 0
  asymmetric = True

  def stat(self, xb):
    return jnp.stack([-jnp.min(xb, axis=1), jnp.max(xb, axis=1)], axis=1)

  def quantize(self, xb, S, u):
    del u
    lo, s = _uint8_span(S)
    r = jnp.where(s > 0, (xb - lo) / jnp.where(s > 0, s, 1.0), 0.0)
    return jnp.clip(jnp.round(r), 0, 255).astype(jnp.int32)

  def unit(self, S):
    return _uint8_span(S)[1]

  def zero(self, S):
    return _uint8_span(S)[0]


@_registry.method(
    family="compressor",
    paper="PyTorch DDP uint8 hook; Dettmers 2016",
    summary="uint8 codes + per-bucket min and scale (shared over devices), EF")
@_compressor.shared_options
def uint8(bucket_size: int | None = None, *, axis_name="data",
          error_feedback: bool = True, policy=None,
          **options):
  """Asymmetric uint8 quantization with a per-bucket minimum and scale.

  .. math::
    \\ell = \\min_{i} \\min_{k \\in b} x_{i,k}, \\quad
    h = \\max_{i} \\max_{k \\in b} x_{i,k}, \\quad
    s = \\frac{h - \\ell}{255}, \\quad
    q_k = \\operatorname{round}\\Big(\\frac{x_k - \\ell}{s}\\Big)
    \\in [0, 255], \\quad
    \\hat x_k = \\ell + s q_k

  The bucket's bounds ``l`` and ``h`` are shared by all devices (one
  ``pmax`` of ``(-min, max)`` per bucket, two floats) so that the codes add
  up exactly: the sum of ``n`` devices' codes ``t`` decodes as ``n l + s t``
  and the mean is ``l + s t / n``. Codes travel 8 bits each
  (:func:`jaxcomm.collectives.integer_allreduce` with ``low=0``). A bucket
  with ``s = 0`` sends all-zero codes and decodes to ``l`` exactly.
  Deterministic rounding (half to even); with error feedback (default) the
  rounding error ``x - x_hat`` is resent later and mass is conserved.

  Compared with :func:`int8`, the 256 levels span ``[l, h]`` rather than
  ``[-S, S]``: finer steps for buckets far from symmetric about 0, at one
  more float32 per bucket.

  Args:
    bucket_size: elements per ``(l, s)`` pair, ``>= 1`` (static; default
      128).
    axis_name: the data axis.
    error_feedback: keep the rounding error per device.
    policy: a :class:`jaxcomm.LeafPolicy`.

  Example::

    tx = optax.chain(jaxcomm.uint8(), optax.adam(1e-3))

  References:
    PyTorch, `DDP Communication Hooks: quantization hooks
    <https://pytorch.org/docs/stable/ddp_comm_hooks.html>`_ (one
    ``(min, scale)`` per tensor; here per bucket).
    Dettmers, `8-Bit Approximations for Parallelism in Deep Learning
    <https://arxiv.org/abs/1511.04561>`_, 2016.
  """
  bucket_size = DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size
  _checks.integer("bucket_size", bucket_size, 1)
  _checks.error_feedback(error_feedback)
  codec = Uint8Codec(bucket_size=bucket_size)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


__all__ = [
  "int4",
  "int8",
  "qsgd",
  "terngrad",
  "uint8",
  "RequantizedState",
]
