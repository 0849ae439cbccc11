"""ECQ-SGD (Wu et al. 2018): stochastic quantization with accumulated,
decayed error compensation.

Each device keeps ``h``, the quantization error accumulated over past steps
with decay ``beta``, and quantizes its gradient compensated by ``alpha h``
(Section 3 of the paper)::

  q = Q(g + alpha h)                 Q: unbiased, s levels of max |.|
  h' = beta h + g - q                the accumulated error
  update = (1 / n) sum_i q_i

``alpha = beta = 1`` is classic error feedback; ``beta < 1`` forgets old
error, ``alpha`` sets how much of it is added back. The quantizer is the
shared-scale engine of :mod:`._quantization` (codes that add as integers)
with the l-infinity scale and ``s`` levels.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import ClassVar

import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.transforms.quantize import _quantization as _q


def _is(value, number) -> bool:
  return isinstance(value, (int, float)) and float(value) == number


@dataclasses.dataclass(frozen=True)
class EcqCodec(_q.IntegerCodec):
  """ECQ-SGD's quantizer on ``g + alpha h`` (``h = x - g``: the shared
  residual is the paper's accumulated error), returning ``sent = q + (1 -
  beta) h`` so that the residual ``x - sent`` is ``beta h + g - q``.

  Attributes:
    levels: ``s``, the levels of ``|v| / max|v|`` (codes in ``[-s, s]``).
    bucket_size: elements per scale, or None: one scale per leaf.
    alpha: the compensation weight ``alpha >= 0`` (may be traced).
    beta: the error's decay, in ``[0, 1]`` (may be traced).
  """

  levels: int = 7
  bucket_size: int | None = None
  alpha: Any = 1.0
  beta: Any = 1.0
  stochastic: ClassVar[bool] = True
  stat_is_max: ClassVar[bool] = True
  wants_gradient: ClassVar[bool] = True

  @property
  def name(self):
    return f"ecq_sgd({self.levels})"

  @property
  def bound(self):
    return self.levels

  @property
  def mean_of_sent(self):
    # With beta < 1 the decayed error rides in sent (it leaves the
    # residual) but not in the mean.
    return _is(self.beta, 1.0)

  def stat(self, xb):
    return jnp.max(jnp.abs(xb), axis=1)

  def quantize(self, xb, s, u):
    levels = self.levels
    r = _q._safe_ratio(xb, s) * levels
    low = jnp.floor(r)
    lev = jnp.minimum(low + (u < r - low).astype(jnp.float32), levels)
    return (jnp.sign(xb) * lev).astype(jnp.int32)

  def unit(self, s):
    return s / self.levels

  def apply(self, x, state, ctx):
    g = ctx.grad
    h = x - g
    y = x if _is(self.alpha, 1.0) else g + jnp.asarray(
      self.alpha, jnp.float32) * h
    res = super().apply(y, state, ctx)
    sent = res.sent if _is(self.beta, 1.0) else res.sent + (
      1.0 - jnp.asarray(self.beta, jnp.float32)) * h
    return _codec.CodecResult(mean=res.mean, sent=sent, state=res.state)


@_registry.method(
    paper="Wu et al. 2018 (ECQ-SGD)",
    summary="stochastic levels of max|.|, accumulated decayed error "
    "compensation, integer allreduce")
@_compressor.shared_options
def ecq_sgd(levels: int | None = None, alpha: float = 1.0,
            beta: float = 0.9, bucket_size: int | None = None, *,
            axis_name="data", error_feedback: bool = True, policy=None,
            seed: int = 0, **options):
  """ECQ-SGD: stochastic quantization with decayed error compensation.

  Error-compensated quantized SGD: unbiased stochastic quantization of
  the gradient plus a decayed sum of past quantization errors.

  .. math::
    q_i = Q(g_i + \\alpha h_i), \\quad h_i \\leftarrow \\beta h_i + g_i -
    q_i, \\quad u = \\frac{1}{n} \\sum_i q_i

  with, per leaf (or bucket of ``bucket_size`` elements) ``v`` and ``S``
  the largest ``max |v|`` over devices, ``s = levels``:

  .. math::
    Q(v)_k = \\frac{S}{s} \\operatorname{sign}(v_k) \\, \\xi_k, \\quad
    \\xi_k = \\ell + \\mathrm{Bernoulli}(r - \\ell), \\quad r =
    \\frac{s |v_k|}{S}, \\; \\ell = \\lfloor r \\rfloor

  so ``E[Q(v)] = v`` and ``E ||Q(v) - v||^2 <= d S^2 / (4 s^2)`` (each
  coordinate rounds within one step ``S / s``; tested numerically). The
  codes in ``[-s, s]`` travel packed beside one float32 scale per leaf
  and add exactly as integers
  (:func:`jaxcomm.collectives.integer_allreduce`). ``h_i`` is the
  compressor's residual.

  Departures: the scale is the maximum over devices of ``max |v|`` (one
  small ``pmax``, as :func:`jaxcomm.qsgd`'s), so that the codes add as
  integers; quantization stays unbiased, and the bound above holds with
  that ``S``. Codes travel at a fixed width (``ceil(log2(2 s + 1))``
  bits), not entropy-coded as in the paper's experiments. With ``beta <
  1`` the forgotten part ``(1 - beta) h`` is dropped by design (the mass
  balance of classic error feedback holds for ``beta = 1``).

  Args:
    levels: ``s`` in ``[1, 32767]`` (static; default 7: 4-bit codes).
    alpha: the compensation weight ``alpha >= 0`` (injectable).
    beta: the decay of the accumulated error, in ``[0, 1]`` (injectable).
    bucket_size: elements per scale, ``>= 1``, or None (default): one
      scale per leaf (static).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: True (the only mode: ``h`` is the residual).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the noise; every device folds in its index.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``momentum`` is refused: chain a
      momentum optimizer after; ``shift_rate``, DIANA's, too).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (its residual is each device's
    ``h_i``).

  Raises:
    ValueError: naming the argument, for ``levels`` not an int in ``[1,
      32767]``, ``bucket_size`` not an int ``>= 1`` or None, an
      ``alpha`` that is not a finite number ``>= 0``, a ``beta`` outside
      ``[0, 1]``, an ``error_feedback`` other than True, a ``momentum``,
      or an ``axis_name``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses; the update raises one when it
      is called outside a context that binds ``axis_name``.

  Examples:
    Two steps on the 8 devices with the same gradient ``g_i = [i, -i /
    2, 1.5, 8 - i]`` on device ``i`` (1 to 8), with a leaf policy that
    compresses even a 4-value leaf, ``s = 7`` levels of the shared ``S =
    8`` and ``beta = 0.5``. The updates are the means of the devices'
    codes (multiples of ``S / (7 n)``); the mass lost is only the
    forgotten half of the first step's error: ``n`` times the updates
    plus the errors ``h`` kept, plus ``(1 - beta) h`` of step one, is the
    sum of the gradients:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.ecq_sgd(levels=7, beta=0.5,
    ...                      policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   h1 = state.residual[0][None]
    ...   second, state = tx.update(g[0], state)
    ...   return first, second, h1, state.residual[0][None]
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> first, second, h1, h2 = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P(), P("data"), P("data"))))(grads)
    >>> print((np.asarray(first, np.float64) * 8 * 7 / 8).round(3))
    [ 31. -17.  10.  24.]
    >>> kept = np.sum(h2, 0) + 0.5 * np.sum(h1, 0)
    >>> print(np.allclose(8 * (first + second) + kept, 2 * grads.sum(0),
    ...                   atol=1e-4))
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.ecq_sgd(levels=7, beta=0.9),
    ...                   optax.sgd(0.1))

  References:
    Wu et al, `Error Compensated Quantized SGD and its Applications to
    Large-scale Distributed Optimization <https://arxiv.org/abs/
    1806.08054>`_, 2018.
  """
  levels = 7 if levels is None else levels
  _checks.integer("levels", levels, 1)
  if levels > _q.MAX_LEVELS:
    raise ValueError(f"levels must be an int in [1, {_q.MAX_LEVELS}], got "
                     f"{levels!r}")
  if bucket_size is not None:
    _checks.integer("bucket_size", bucket_size, 1)
  alpha = _checks.number("alpha", alpha, 0.0, None, finite=True)
  beta = _checks.number("beta", beta, 0.0, 1.0)
  if error_feedback is not True:
    raise ValueError(
      f"error_feedback must be True for ecq_sgd (its accumulated error h "
      f"is the residual), got {error_feedback!r}")
  if options.get("momentum") is not None:
    raise ValueError("momentum: ecq_sgd compensates the gradient's own "
                     "quantization error; chain a momentum optimizer after")
  codec = EcqCodec(levels=levels, bucket_size=bucket_size, alpha=alpha,
                   beta=beta)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["ecq_sgd"]
