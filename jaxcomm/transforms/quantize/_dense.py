"""Dense baselines: the plain mean every compressor is compared to, and casts.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core


@dataclasses.dataclass(frozen=True)
class MeanCodec(_codec.CodecBase):
  """Accepts no leaf: every floating leaf goes through the fused dense psum
  (``apply`` is never called)."""

  name = "mean_gradients"

  def accepts(self, shape):
    del shape
    return False

  def apply(self, x, state, ctx):
    raise AssertionError("mean_gradients compresses no leaf")

  def wire(self, layout, n):
    return []


@_registry.method(
    paper="—",
    name="dense",
    summary="float32 mean, one fused all-reduce",
    aliases=("none", "mean", "mean_gradients"))
def mean_gradients(axis_name="data"):
  """Averages gradients over the data axis with one fused psum.

  .. math::
    u = \\frac{1}{n} \\sum_{i=1}^{n} g_i

  The reference every compressor is measured against: all floating leaves
  are flattened into one buffer, summed with one all-reduce and divided by
  the number of devices. Non-floating leaves pass through.

  Args:
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (no residual: nothing is left out).

  Raises:
    ValueError: when ``axis_name`` is not a name, a tuple of distinct
      names or None; the update raises one when it is called outside a
      context that binds ``axis_name`` (``shard_map``, ``pmap``).

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``; chained with ``optax.sgd(0.5)``, every device's
    update is minus half their exact mean:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.5))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, _ = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(grads.mean(0), np.asarray(update, np.float64).round(3))
    [ 4.5  -2.25  1.5   3.5 ] [-2.25   1.125 -0.75  -1.75 ]
  """
  return _compressor.compressed(MeanCodec(), axis_name=axis_name,
                                error_feedback=False)


_CAST_DTYPES = {
  "bfloat16": jnp.bfloat16, "float16": jnp.float16,
  "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2,
}


def _dtype_name(dtype) -> str:
  try:
    name = np.dtype(dtype).name
  except TypeError:
    name = None
  if name not in _CAST_DTYPES:
    raise ValueError(
      f"dtype must be one of {sorted(_CAST_DTYPES)}, got {dtype!r}")
  return name


@dataclasses.dataclass(frozen=True)
class CastCodec(_codec.CodecBase):
  """Each device's ``x / n`` cast to ``dtype``; chunk sums in float32.

  Attributes:
    dtype: the wire dtype's name (a key of ``_CAST_DTYPES``).
  """

  dtype: str = "bfloat16"
  # The chunk sums are rounded again after the float32 sum: the mean is
  # not exactly the mean of what the devices sent.
  mean_of_sent = False

  def __post_init__(self):
    _dtype_name(self.dtype)

  @property
  def name(self):
    return f"cast({self.dtype})"

  @property
  def _scaled(self) -> bool:
    return np.dtype(_CAST_DTYPES[self.dtype]).itemsize == 1

  def _exponent(self, x, ctx):
    """FP8: the bucket's shared power of two ``2^k``: ``max_i |x_i|``
    (one 4-byte ``pmax``) divided by it is below ``2^t <= top / 2``, so
    every device's ``x / (n 2^k)`` and their sum stay within the type
    (rounding up by at most 1/8), and neither cast saturates."""
    top = float(jnp.finfo(_CAST_DTYPES[self.dtype]).max)
    t = int(np.frexp(top / 2)[1]) - 1           # 2^t <= top / 2
    m = _core.pmax(jnp.max(jnp.abs(x)), ctx.axis_name)
    _, e = jnp.frexp(jnp.where(jnp.isfinite(m), m, 0.0))   # m < 2^e
    return (e - t).astype(jnp.int32)

  def apply(self, x, state, ctx):
    dtype = _CAST_DTYPES[self.dtype]
    n = ctx.num_devices
    # Divide by n before the cast, so the sum cannot overflow where the
    # mean would not (fp16's max is 65504). FP8 scales the bucket by a
    # shared power of two first (exact), so that neither its cast nor the
    # cast of the chunk sums saturates outside the error feedback.
    k = self._exponent(x, ctx) if self._scaled else None
    scaled = x if k is None else jnp.ldexp(x, -k)
    low = _core.wire_cast(scaled / n, dtype).astype(jnp.float32)
    mean = _core.scatter_gather_sum(low, ctx.axis_name, dtype)
    sent = low * n
    if k is not None:
      mean, sent = jnp.ldexp(mean, k), jnp.ldexp(sent, k)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    itemsize = np.dtype(_CAST_DTYPES[self.dtype]).itemsize
    chunk = _core.padded_length(-(-layout.size // n), 4 // itemsize)
    scale = [("all-reduce", 4)] if self._scaled else []
    return scale + [("all-to-all", chunk * n * itemsize),
                    ("all-gather", chunk * n * itemsize)]


@_registry.method(
    paper="Micikevicius et al. 2018",
    summary="16-bit, divided by n first, float32 accumulation",
    defaults={"dtype": jnp.bfloat16},
    aliases=("bf16", "fp16"))
@_compressor.shared_options
def cast(dtype="bfloat16", *, axis_name="data", error_feedback=False,
         policy=None,
         **options):
  """Averages gradients in a low-precision dtype (fp16/bf16 compression).

  .. math::
    u = \\mathrm{f32}\\Big(\\sum_i \\mathrm{cast}(g_i / n)\\Big)

  Each device divides by the device count *before* casting (so the sum
  cannot overflow where the mean would not); the exchange moves ``dtype``
  (half the bytes of float32) in two phases, an all-to-all after which each
  device adds its chunk of the ``n`` contributions in float32, and an
  all-gather of the summed chunks
  (:func:`jaxcomm.collectives.scatter_gather_sum`); the result is cast to
  the gradient's own dtype. With ``error_feedback=True`` the rounding error
  is kept per device and sent later. As PyTorch's
  ``fp16_compress_hook``/``bf16_compress_hook``; leaves under the policy's
  ``min_size`` travel in the fused float32 psum.

  Args:
    dtype: ``"bfloat16"`` (default), ``"float16"``, ``"float8_e4m3fn"``
      or ``"float8_e5m2"``, or the JAX dtypes themselves (a string is what
      ``optax.inject_hyperparams`` leaves static; a dtype object is
      callable, and it would take it for a schedule). The FP8 casts scale
      each bucket by one shared power of two (the largest ``|x|`` over
      devices, one 4-byte ``pmax``), chosen so that neither the devices'
      values nor the chunk sums reach the type's largest finite value: no
      saturation, at any magnitude. The second rounding, of the chunk
      sums, is not fed back (as for every dtype); with one scale per
      bucket, values under about ``n 2^-16`` of the bucket's maximum
      (E4M3; ``n 2^-30`` for E5M2) still flush to zero; keep
      ``error_feedback=True`` with them, or use :func:`jaxcomm.mx`, whose
      block scales follow the values.
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the rounding error per device.
    policy: a :class:`jaxcomm.LeafPolicy` (default: leaves of >= 256
      elements are cast).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the chunk sums are rounded again, so the mean is not the mean of
      what was sent).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with ``error_feedback=True``, its
    residual holds each device's rounding error).

  Raises:
    ValueError: naming the argument, for a ``dtype`` that is not one of
      the four above, or an ``axis_name``, ``error_feedback``
      (``"ef21"`` and ``"diana"`` are refused: the mean is not the mean
      of what was sent), ``policy`` or option that
      :func:`jaxcomm.compressed` refuses; the update raises one when it
      is called outside a context that binds ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i / 3,
    -i / 7, 0.1, 100 i + 1 / 3]``, with a leaf policy that casts even a
    4-value leaf. What travels is bfloat16 (8 significant bits), so the
    update agrees with the exact mean to about 3 significant digits:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.cast("bfloat16", policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, _ = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i / 3, -i / 7, 0 * i + 0.1,
    ...                         100 * i + 1 / 3], axis=1).astype(np.float32)
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> mean = grads.astype(np.float64).mean(0)
    >>> print(mean.round(3).tolist())
    [1.5, -0.643, 0.1, 450.333]
    >>> print(np.asarray(update, np.float64).round(3).tolist())
    [1.5, -0.641, 0.1, 450.0]
    >>> print(np.abs(update - mean).max() / np.abs(mean).max() < 2.0**-8)
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.cast(jnp.bfloat16), optax.sgd(0.1))

  References:
    Micikevicius et al, `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, 2018.
  """
  return _compressor.compressed(CastCodec(_dtype_name(dtype)),
                                axis_name=axis_name,
                                error_feedback=error_feedback,
                                policy=policy, **options)


__all__ = [
  "cast",
  "mean_gradients",
]
