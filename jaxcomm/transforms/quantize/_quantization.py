"""Quantization compressors: multi-level quantizers with shared scales
(QSGD, TernGrad; the engine int8, int4 and uint8 share, whose factories
are in :mod:`._integer`); signs are in :mod:`._signs`, natural
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
from jaxcomm import _random
from jaxcomm import _registry
from jaxcomm import _rows
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


def _pad_rows(v, extra: int, *, edge: bool):
  """``v`` (``[count, d]``) with ``extra`` columns more: zeros, or with
  ``edge`` copies of each row's last value (``jnp.pad``'s modes). The edge
  copies are a select over a zero pad, both element-wise, so the compiler
  fuses them into what reads the padded rows; ``jnp.pad(mode="edge")`` is
  a concatenate, which it kept as one more buffer of the bucket's size
  (uint8 with partial buckets: 1.40x the plain FSDP step's memory)."""
  padded = jnp.pad(v, ((0, 0), (0, extra)))
  if not edge:
    return padded
  col = jax.lax.broadcasted_iota(jnp.int32, padded.shape, 1)
  return jnp.where(col >= v.shape[1], v[:, -1:], padded)


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
    u = (_random.uniform(device_key(ctx), xb.shape)
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

  def _apply_per_segment(self, x, state, ctx):
    """One bucket per leaf, leaves of many shapes: the statistic of each
    leaf by :meth:`jaxcomm._buckets.Layout.reduce` (short leaves as rows
    of a few zero-padded batches: a symmetric statistic ignores zeros),
    the codes element-wise on the flat bucket, each element under its
    leaf's shared scale. The same codes, draws and wire as the path by
    groups (a leaf's bucket is the leaf: no padding), with one op per
    batch of short leaves instead of one per leaf shape (a hundred
    leaves of distinct shapes: ~200 small buffers fewer on a TPU)."""
    lay = ctx.layout
    local = lay.reduce(self.stat, x, pad=0.0)
    s = lay.broadcast(_core.pmax(local, ctx.axis_name))
    u = (_random.uniform(device_key(ctx), x.shape) if self.stochastic
         else None)
    q = self.quantize(x[None], s[None], None if u is None else u[None])[0]
    total = _quantized.integer_allreduce(q, self.bound, ctx.axis_name,
                                         low=self.low)
    un = self.unit(s)
    return _codec.CodecResult(
      mean=total.astype(jnp.float32) * un / ctx.num_devices,
      sent=q.astype(jnp.float32) * un, state=state)

  def apply(self, x, state, ctx):
    layout = ctx.layout
    bucket_size = self.bucket_size
    if (bucket_size is None and self.stat_is_max and not self.prepares
        and not self.asymmetric):
      block = _buckets.leaf_blocks(layout.sizes)
      if block is not None:
        return self._apply_per_leaf(x, state, ctx, block)
    if (bucket_size is None and not self.prepares and not self.asymmetric
        and _rows.plan([(g.offset, g.count, g.leaf_size)
                        for g in layout.groups])[0]):
      return self._apply_per_segment(x, state, ctx)
    # The bucket as [rows, b] blocks of buckets. Consecutive groups whose
    # leaves split into whole buckets of one width b (no padding, no
    # per-leaf ``prepare``) are one contiguous region of x: a free reshape,
    # with no copy in and none out. A group that pads its last bucket (or
    # that ``prepare`` transforms per leaf) is [G, d] -> padded -> [G c, b].
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
        v = _pad_rows(v, b * c - d, edge=self.asymmetric)
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
    key = device_key(ctx) if self.stochastic else None
    codes, units, zeros, off, boff = [], [], [], 0, 0
    for xb in xbs:
      rows = xb.shape[0]
      s = shared[boff:boff + rows]
      # This bucket's slice of one flat draw over the padded buckets.
      u = (_random.uniform(key, xb.shape, offset=off) if self.stochastic
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
  devices (:func:`jaxcomm.qsgd`).

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
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate`` with
      ``error_feedback="diana"`` only).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for ``levels`` not an int in ``[1,
      32767]``, ``bucket_size`` not an int ``>= 1``, an
      ``error_feedback`` other than True, False, ``"ef21"`` and
      ``"diana"``, or an ``axis_name``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses; the update raises one when it
      is called outside a context that binds ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``: one bucket of 4, whose largest norm over devices is
    ``S = ||[8, -4, 1.5, 0]|| = 9.07``. With ``s = 4`` levels the update
    is ``S / (4 n)`` times the sum of the devices' integer codes, and it
    lies within one level ``S / 4`` of the exact mean:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.qsgd(levels=4, bucket_size=4,
    ...                   policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, _ = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> update = np.asarray(update, np.float64)
    >>> S = np.linalg.norm(grads, axis=1).max()
    >>> print((update * 8 * 4 / S).round(3))      # the summed codes
    [15. -8.  5. 11.]
    >>> print(grads.mean(0), np.abs(update - grads.mean(0)).max() < S / 4)
    [ 4.5  -2.25  1.5   3.5 ] True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.qsgd(levels=15, bucket_size=512),
    ...                   optax.sgd(0.1))

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
  maximum over devices (:func:`jaxcomm.terngrad`); one bucket per leaf.

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
    gap=(
      "stochastic ternary of high variance: at dense's rate it diverged "
      "on the conv net, at lr.json's 0.03 the char-LSTM learns slowly"),
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
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate`` with
      ``error_feedback="diana"`` only).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for a ``clip_sigma`` that is not a
      finite positive number or None, an ``error_feedback`` other than True,
      False, ``"ef21"`` and ``"diana"`` (``"diana"`` is refused with
      ``clip_sigma``, which biases the codes), or an ``axis_name``,
      ``policy`` or option that :func:`jaxcomm.compressed` refuses; the
      update raises one when it is called outside a context that binds
      ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``, so the shared scale is ``s = 8``: each device sends
    ternary codes (``sign(g_k)`` with probability ``|g_k| / s``, else 0),
    and the update is ``s / n`` times their sum, an integer in ``[-8,
    8]`` here:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.terngrad(policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, _ = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(grads.mean(0), np.asarray(update, np.float64).round(3))
    [ 4.5  -2.25  1.5   3.5 ] [ 3. -3.  2.  3.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.terngrad(clip_sigma=2.5), optax.sgd(0.1))

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


__all__ = [
  "qsgd",
  "terngrad",
]
