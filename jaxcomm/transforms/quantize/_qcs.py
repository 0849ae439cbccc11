"""Quantized compressive sampling (Abdi, Fekri 2020): a structured random
projection of the gradient, quantized, summed in the compressed space,
reconstructed by the projection's transpose, with error feedback.

The bucket (zero-padded) is a ``[B, c]`` grid whose ``c`` columns are
blocks of ``B = block`` elements (a power of two). The projection of a
block is a subsampled randomized Hadamard transform, the same on every
device (drawn from the step's shared key)::

  P = R H D / sqrt(B)     D: random signs, H: B x B Hadamard (Sylvester),
                          R: m of the B rows, m = ceil(ratio B)
  y_i = P x_i             [m, c], never a dense matrix: log2 B butterflies
  q_i = Q(y_i)            stochastic rounding to s levels of a shared scale
  mean = P^T (sum_i q_i) / n,   sent_i = P^T q_i   (e_i' = x_i - sent_i)

``P P^T = I``: ``P^T`` is the projection's pseudo-inverse, the least-norm
reconstruction of the measurements.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _random
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.collectives import _quantized
from jaxcomm.transforms.quantize import _quantization as _q


def plan(size: int, block: int, ratio: float) -> tuple[int, int]:
  """``(c, m)``: the ``c`` blocks of ``block`` elements a bucket of
  ``size`` fills, and the ``m = max(1, ceil(ratio block))`` rows kept of
  each block's transform."""
  c = -(-int(size) // int(block))
  m = max(1, min(block, math.ceil(float(ratio) * block - 1e-9)))
  return c, m


def hadamard(v: jax.Array) -> jax.Array:
  """``H v`` along the major axis of ``v`` (``[B, c]``, ``B`` a power of
  two; ``H`` Sylvester's, unnormalized): ``log2 B`` butterflies."""
  b, c = v.shape
  h = 1
  while h < b:
    w = v.reshape(b // (2 * h), 2, h, c)
    v = jnp.stack([w[:, 0] + w[:, 1], w[:, 0] - w[:, 1]], axis=1).reshape(
      b, c)
    h *= 2
  return v


def draws(key, block: int, c: int, m: int):
  """The shared projection of one step: ``(signs [B, c], rows [m])``,
  signs ``-1`` where ``uniform(fold_in(key, 0)) < 1/2``, rows the ``m``
  largest of ``uniform(fold_in(key, 1), (B,))`` in descending order."""
  u = _random.uniform(jax.random.fold_in(key, 0), (block, c))
  signs = jnp.where(u < 0.5, -1.0, 1.0).astype(jnp.float32)
  rows = jax.lax.top_k(
    jax.random.uniform(jax.random.fold_in(key, 1), (block,)), m)[1]
  return signs, rows


@dataclasses.dataclass(frozen=True)
class QcsCodec(_codec.CodecBase):
  """Subsampled randomized Hadamard measurements of each block, quantized
  to integer codes of one shared scale, summed exactly, reconstructed by
  the transpose (:func:`jaxcomm.qcs`).

  Attributes:
    ratio: ``m / B``, the measurements kept per block, in ``(0, 1]``.
    block: ``B``, elements per block (a power of two).
    levels: ``s``, codes in ``[-s, s]``.
  """

  ratio: float = 0.25
  block: int = 1024
  levels: int = 7

  @property
  def name(self):
    return f"qcs({self.ratio}, {self.levels})"

  def apply(self, x, state, ctx):
    size, b, s, n = x.shape[0], self.block, self.levels, ctx.num_devices
    c, m = plan(size, b, self.ratio)
    key = jax.random.fold_in(ctx.key, min(ctx.layout.leaves))
    signs, rows = draws(key, b, c, m)
    norm = 1.0 / math.sqrt(b)
    grid = jnp.pad(x, (0, b * c - size)).reshape(b, c)
    y = jnp.take(hadamard(grid * signs), rows, axis=0) * norm     # [m, c]
    scale = _core.pmax(jnp.max(jnp.abs(y))[None], ctx.axis_name)[0]
    u = _random.uniform(
      jax.random.fold_in(jax.random.fold_in(key, 2), ctx.device_index),
      (m, c))
    r = _q._safe_ratio(jnp.abs(y), scale) * s
    low = jnp.floor(r)
    lev = jnp.minimum(low + (u < r - low).astype(jnp.float32), s)
    codes = (jnp.where(y < 0, -1.0, 1.0) * lev).astype(jnp.int32)
    total = _quantized.integer_allreduce(codes.reshape(-1), s,
                                         ctx.axis_name).reshape(m, c)
    unit = scale / s

    def back(z):
      full = jnp.zeros((b, c), jnp.float32).at[rows].set(z)
      return (hadamard(full) * (norm * signs)).reshape(-1)[:size]

    mean = back(total.astype(jnp.float32) * (unit / n))
    sent = back(codes.astype(jnp.float32) * unit)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    c, m = plan(layout.size, self.block, self.ratio)
    return ([("all-reduce", 4)]
            + _quantized.plan(m * c, self.levels, n, None).wire)


@_registry.method(
    gap=(
      "a quarter of each block's Hadamard measurements, decoded by the "
      "transpose without rescaling, 4-bit codes of one scale"),
    paper="Abdi, Fekri 2020 (quantized compressive sampling)",
    summary="subsampled randomized Hadamard measurements, integer codes "
    "of a shared scale, summed; transpose reconstruction",
    static=("ratio", "block", "levels"))
@_compressor.shared_options
def qcs(ratio: float | None = None, block: int | None = None,
        levels: int | None = None, *, axis_name="data",
        error_feedback: bool = True, policy=None, seed: int = 0,
        **options):
  """Quantized compressive sampling of the gradient, with error feedback.

  Random structured measurements of the gradient, quantized and
  all-reduced, reconstructed by the transpose.

  .. math::
    y_i = P x_i, \\quad u = \\frac{1}{n} P^T \\sum_{i=1}^{n} Q(y_i),
    \\quad e_i \\leftarrow x_i - P^T Q(y_i), \\quad P = \\frac{1}{\\sqrt
    B} R H D

  per block of ``B`` elements: ``D`` random signs, ``H`` the ``B x B``
  Hadamard matrix (applied as ``log2 B`` butterflies, never stored), ``R``
  ``m = ceil(ratio B)`` of its ``B`` rows. ``D`` and ``R`` are drawn
  afresh every step from the key every device shares, so the devices'
  measurements live in one space and add. ``Q`` rounds ``s |y| / S``
  stochastically (unbiased) to an integer in ``[0, s]``, ``S`` the
  largest ``|y|`` over all devices (one 4-byte ``pmax``); the codes
  (``ceil(log2(2 s + 1))`` bits) are summed exactly as integers
  (:func:`jaxcomm.collectives.integer_allreduce`). ``P P^T = I``, so
  ``P^T`` is the pseudo-inverse: the reconstruction is the least-norm
  signal with the averaged measurements; what it misses (``(I - P^T P)
  x`` and the rounding) stays in each device's residual, and ``n u =
  sum_i sent_i``: no mass is lost.

  Static shapes and departures: the bucket (compressed leaves
  concatenated) is zero-padded to ``c`` blocks and laid out ``[B, c]``
  (block ``j`` is every ``c``-th element from ``j``; the transform runs
  along the major axis, the ``c`` blocks are the lanes); one scale per
  bucket. The paper reconstructs with a sparse-recovery decoder in some
  of its settings; here the decoder is the transpose (linear, so the
  devices' measurements can be summed before decoding, and contractive,
  which error feedback needs), not rescaled by ``B / m``.

  Args:
    ratio: ``m / B``, measurements per element, in ``(0, 1]``, or None
      (default): 0.25 (static).
    block: ``B``, a power of two ``>= 2``, or None (default): 1024
      (static).
    levels: ``s`` in ``[1, 32767]``, or None (default): 7 (4-bit codes;
      static).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what the measurements miss (default True).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the shared key the projection and the noise come from.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (its residual holds what each
    device's measurements missed).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``,
      a ``block`` that is not a power of two ``>= 2``, ``levels`` not an
      int in ``[1, 32767]``, an ``error_feedback`` other than True,
      False, ``"ef21"`` and ``"diana"`` (``"diana"`` is refused: the
      reconstruction is biased), or an ``axis_name``, ``policy`` or
      option that :func:`jaxcomm.compressed` refuses; the update raises
      one when it is called outside a context that binds ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``, with a leaf policy that compresses even a 4-value
    leaf, one block of ``B = 4``, of which ``ratio=0.5`` keeps ``m = 2``
    measurements. The update is the transpose of the mean measurements,
    so it misses part of the mean; what each device's measurements
    missed stays in its residual, and no mass is lost: ``n`` times the
    update plus the residuals is the sum of the gradients:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.qcs(ratio=0.5, block=4,
    ...                  policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(grads.mean(0), np.asarray(update, np.float64).round(3))
    [ 4.5  -2.25  1.5   3.5 ] [ 3.375 -3.375  2.531  2.531]
    >>> print(np.allclose(8 * update + np.sum(residual, 0), grads.sum(0),
    ...                   atol=1e-5))
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.qcs(ratio=0.25), optax.sgd(0.1))

  References:
    Abdi, Fekri, `Quantized Compressive Sampling of Stochastic Gradients
    for Efficient Communication in Distributed Deep Learning
    <https://ojs.aaai.org/index.php/AAAI/article/view/5706>`_, AAAI 2020.
  """
  ratio = 0.25 if ratio is None else _checks.ratio("ratio", ratio)
  block = 1024 if block is None else _checks.integer("block", block, 2)
  if block & (block - 1):
    raise ValueError(f"block must be a power of two >= 2, got {block!r}")
  levels = 7 if levels is None else levels
  _checks.integer("levels", levels, 1)
  if levels > _q.MAX_LEVELS:
    raise ValueError(f"levels must be an int in [1, {_q.MAX_LEVELS}], got "
                     f"{levels!r}")
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(QcsCodec(ratio, block, levels),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["qcs"]
