"""Natural compression (Horvath et al. 2019): stochastic rounding to powers
of two, 9-bit codes; the chunk owner re-rounds the average."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _random
from jaxcomm import _registry
from jaxcomm.collectives import _quantized
from jaxcomm.transforms.quantize._quantization import device_key

# ---------------------------------------------------------------- natural --


def natural_round(x: jax.Array, key: jax.Array) -> jax.Array:
  """Unbiased stochastic rounding of float32 to a power of two (or 0).

  With ``|x| = 2^a (1 + m)``, ``m`` in ``[0, 1)`` the mantissa fraction,
  the result is ``sign(x) 2^a`` with probability ``1 - m`` and
  ``sign(x) 2^{a+1}`` with probability ``m``. Done on the bits: the
  exponent byte is incremented iff a uniform 23-bit integer is below the
  23 mantissa bits, so the probability is exact. Subnormals round to 0 or
  to the smallest normal, also unbiased. Departure: values within a factor
  two of the float32 maximum round down (the exponent saturates at 254)
  rather than to infinity; Inf stays Inf and NaN becomes an infinity of
  its sign (the code has no mantissa), still non-finite.

  Args:
    x: float32 array.
    key: PRNG key.

  Returns:
    float32 array, mantissa bits zero.
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  mant = bits & jnp.uint32(0x7FFFFF)
  expo = (bits >> 23) & jnp.uint32(0xFF)
  draw = _random.bits(key, x.shape) >> 9
  up = ((draw < mant) & (expo < 254)).astype(jnp.uint32)
  out = (bits & jnp.uint32(0x80000000)) | ((expo + up) << 23)
  return jax.lax.bitcast_convert_type(out, jnp.float32)


@dataclasses.dataclass(frozen=True)
class NaturalCodec(_codec.CodecBase):
  """Natural compression of each device's ``x``; each chunk's owner
  re-rounds the average (:func:`jaxcomm.natural`). No fields: it has no
  hyperparameters."""

  name = "natural"
  # Both roundings are unbiased; the owner's second one is why the mean
  # is not the mean of what was sent (so DIANA and EF21 refuse it).
  mean_of_sent = False
  unbiased = True

  def apply(self, x, state, ctx):
    flat = natural_round(x, device_key(ctx))
    owner_key = jax.random.fold_in(ctx.key,
                                   ctx.num_devices + ctx.device_index)
    mean = _quantized.natural_allreduce(
      flat, ctx.axis_name, lambda c: natural_round(c, owner_key))
    return _codec.CodecResult(mean=mean, sent=flat, state=state)

  def wire(self, layout, n):
    return _quantized.natural_plan(layout.size, n).wire


@_registry.method(
    paper="Horváth et al. 2019",
    summary="stochastic powers of two (9-bit codes)")
@_compressor.shared_options
def natural(*, axis_name="data", error_feedback: bool = False, policy=None,
            seed: int = 0,
            **options):
  """Natural compression: unbiased stochastic rounding to powers of two.

  .. math::
    C(x) = \\operatorname{sign}(x) \\, 2^{\\lfloor \\log_2 |x| \\rfloor}
    (1 + \\mathrm{Bernoulli}(p)), \\quad
    p = \\frac{|x| - 2^{\\lfloor \\log_2 |x| \\rfloor}}
    {2^{\\lfloor \\log_2 |x| \\rfloor}}

  ``E[C(x)] = x`` and the variance is at most ``|x|^2 / 8``. Each value
  travels as 9 bits (sign and float32 exponent byte): the rounding is done
  on the bits, the exponent incremented iff a uniform 23-bit integer is
  below the 23 mantissa bits, so the probability is exact (subnormals
  round to 0 or the smallest normal; values within a factor two of the
  float32 maximum round down; NaN becomes an infinity). On 3 or more
  devices the exchange is two-phase
  (:func:`jaxcomm.collectives.natural_allreduce`): the owner of each chunk
  averages the ``n`` decoded chunks and natural-compresses the average
  again with its own noise (``fold_in(key, n + device_index)``), as the
  paper's bidirectional scheme compresses the aggregate; the result stays
  unbiased and each device sends about 18 bits per element whatever ``n``
  (an all-gather would send ``9 (n - 1)``: more than a float32 psum from
  ``n = 8``). The second rounding is not fed back: with error feedback the
  mass is not exactly conserved. On 2 devices, and for a bucket so small
  that padding makes the all-gather the cheaper one (under 128 elements
  on 8 devices), the codes are all-gathered and averaged exactly.

  Args:
    axis_name: the data axis.
    error_feedback: keep the rounding error (not in the paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the noise; every device folds in its index.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the owner's second rounding makes the mean differ from the mean of
      what was sent).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for an ``error_feedback`` other than
      True, False, ``"ef21"`` and ``"diana"`` (both of these are refused:
      the mean is not the mean of what was sent), or an ``axis_name``,
      ``policy`` or option that :func:`jaxcomm.compressed` refuses; the
      update raises one when it is called outside a context that binds
      ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``, with a leaf policy that compresses even a 4-value
    leaf, and error feedback to read back what each device sent: every
    value is a signed power of two, ``1.5`` is sent as ``1`` or ``2``, 3
    as 2 or 4. This bucket is small, so the codes are all-gathered and
    the update is exactly their mean; no mass is lost:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.natural(error_feedback=True,
    ...                      policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> sent = grads - np.asarray(residual, np.float64)
    >>> print(grads[2], sent[2])                   # device 3
    [ 3.  -1.5  1.5  5. ] [ 2. -1.  2.  8.]
    >>> print(np.unique(np.abs(sent)))
    [0.  0.5 1.  2.  4.  8. ]
    >>> print(grads.mean(0), np.asarray(update, np.float64).round(4))
    [ 4.5  -2.25  1.5   3.5 ] [ 4.125  -2.5625  1.375   4.375 ]
    >>> print(np.allclose(8 * update, sent.sum(0)))
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.natural(), optax.sgd(0.1))

  References:
    Horvath et al, `Natural Compression for Distributed Deep Learning
    <https://arxiv.org/abs/1905.10988>`_, 2019.
  """
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(NaturalCodec(), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = [
  "natural",
]
