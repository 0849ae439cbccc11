"""Communication-efficient optimizers: 1-bit Adam and 1-bit LAMB.

Each is a whole Optax optimizer (not a compressor to chain before one):
Adam's (or LAMB's) moments and the exchange are one algorithm. Both run in
two phases on one step counter:

* **warm-up** (``count < freeze_step``): the exact mean gradient
  ``gbar`` (one fused dense psum) drives plain Adam / LAMB moments
  ``m = b1 m + (1 - b1) gbar``, ``v = b2 v + (1 - b2) gbar^2``;
* **compressed** (from ``freeze_step``): the variance is frozen; each
  device forms its local momentum ``m_i = b1 m + (1 - b1) g_i`` and the
  devices agree on ``m = mean_i m_i`` through :func:`jaxcomm.onebit`'s
  exchange (1 bit per element each way, worker error and chunk owners'
  server error kept in the state).

The exchange is one :func:`jaxcomm.compressed` transform with the onebit
codec and ``start_step=freeze_step``: its dense branch gives the warm-up's
exact mean (residuals untouched), its codec branch the compressed momentum,
so the error feedback, the leaf policy (small leaves in the fused dense
psum), the non-finite agreement, the wire accounting and
``parallel.resize_state`` are the ones every compressor uses. The
optimizer's own state (``mu``, ``nu``) is replicated: every device holds
the same averaged momentum. What the two share (the flat buffer, the checks,
the two-phase exchange) is in
:mod:`jaxcomm.transforms.optimizers._onebit_common`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import _vma
from jaxcomm.collectives import _core
from jaxcomm.transforms.optimizers._onebit_common import _check_common
from jaxcomm.transforms.optimizers._onebit_common import _check_params
from jaxcomm.transforms.optimizers._onebit_common import _corrections
from jaxcomm.transforms.optimizers._onebit_common import _direction
from jaxcomm.transforms.optimizers._onebit_common import _Flat
from jaxcomm.transforms.optimizers._onebit_common import _floating  # noqa: F401
from jaxcomm.transforms.optimizers._onebit_common import _keep
from jaxcomm.transforms.optimizers._onebit_common import _learning_rate
from jaxcomm.transforms.optimizers._onebit_common import _momentum_exchange
from jaxcomm.transforms.optimizers._onebit_common import _output
from jaxcomm.transforms.optimizers._onebit_common import _Phase
from jaxcomm.transforms.optimizers._onebit_common import _skip_overflow
from jaxcomm.transforms.optimizers._onebit_common import _variance
from jaxcomm.transforms.quantize import _signs


class OneBitAdamState(NamedTuple):
  """State of :func:`onebit_adam`.

  The moments are flat float32 buffers over the floating leaves (in
  ``jax.tree.leaves`` order), so the optimizer's arithmetic is a few ops
  on one buffer whatever the number of leaves. Their ``F`` values are
  stored in whole 1-D TPU tiles (``S`` values, zeros past ``F``;
  :func:`jaxcomm._buckets.stored_length`).

  Attributes:
    mu: the momentum, identical on every device (``float32[S]``).
    nu: the variance, frozen from ``freeze_step`` (``float32[S]``).
    nu_count: how many times ``nu`` was updated (its bias correction).
    exchange: the 1-bit exchange's :class:`jaxcomm.CompressState` (step
      counter, per-device worker error, per-device server error).
  """

  mu: jax.Array
  nu: jax.Array
  nu_count: jax.Array
  exchange: _compressor.CompressState


class OneBitLambState(NamedTuple):
  """State of :func:`onebit_lamb`.

  Attributes:
    mu: the momentum, identical on every device (``float32[S]``; as
      :class:`OneBitAdamState`).
    nu: the variance, frozen from ``freeze_step`` (``float32[S]``).
    nu_count: how many times ``nu`` was updated (its bias correction).
    exchange: the 1-bit exchange's :class:`jaxcomm.CompressState` (step
      counter, per-device worker error, per-device server error).
    nu_fresh: the variance re-estimated after the freeze from the
      momentum's change (``(m - b1 m_prev) / (1 - b1)``), ``float32[S]``.
    coeff: per floating leaf (layer), the moving average of LAMB's trust
      ratio during the warm-up; frozen with the variance.
    factor: per floating leaf, the last scaling factor of the frozen ratio.
  """

  mu: jax.Array
  nu: jax.Array
  nu_count: jax.Array
  exchange: _compressor.CompressState
  nu_fresh: jax.Array
  coeff: jax.Array
  factor: jax.Array



@dataclasses.dataclass(frozen=True)
class _DenseFirstSpec(_codec.Spec):
  """The exchange of ``onebit_adam(freeze_step=0)``: the compressed one,
  and behind a ``lax.cond`` on ``nu_count == 0`` one dense all-reduce of
  every floating element (a dense Adam step while the variance was never
  updated: a fresh state). The compiled step holds both, as LAG's does;
  ``step=0`` (a run from init) moves the dense one only, later steps the
  compressed one only."""

  def wire(self, params, n, step=None, splits=None):
    dense = [("all-reduce", 4 * _Flat.of(params).size)]
    if step == 0:
      return dense
    out = (super().wire(params, n, step) if splits is None else
           super().wire(params, n, step, splits=splits))
    return out if step is not None else out + dense


def _dense_first_spec(spec) -> _DenseFirstSpec:
  return _DenseFirstSpec(*(getattr(spec, f.name)
                           for f in dataclasses.fields(spec)))


def _dense_adam_step(flat, updates, state, b1, b2, axis_name):
  """One Adam step on the exact mean gradient (one psum), as the warm-up
  takes it: ``(gbar, mu, nu, nu_count, bad, exchange)``, the exchange's
  residuals untouched and its step counter advanced."""
  g = flat.flatten(updates)
  gbar = _core.psum(g, axis_name) / _core.axis_size(axis_name)
  mu = b1 * state.mu + (1.0 - b1) * gbar
  nu = b2 * state.nu + (1.0 - b2) * jnp.square(gbar)
  bad = ~(jnp.all(jnp.isfinite(gbar)) & jnp.all(jnp.isfinite(nu)))
  ex = state.exchange
  ex = ex._replace(
    count=optax.safe_increment(ex.count),
    stats=ex.stats._replace(
      nonfinite_steps=ex.stats.nonfinite_steps + bad.astype(jnp.int32)))
  return gbar, mu, nu, state.nu_count + 1, bad, ex


def _exchange(axis_name, policy, freeze_step):
  """The 1-bit momentum exchange, dense (exact) before ``freeze_step``."""
  return _signs.onebit(axis_name=axis_name, policy=policy,
                              start_step=freeze_step)


@_registry.method(
    paper="Tang et al. 2021",
    summary=(
      "warm-up: `optax.adamw` on the exact mean gradient; after: variance"
      " frozen; the momentum travels as 1-bit signs with worker and "
      "server error (the `onebit()` exchange and its bytes: 30.1x fewer "
      "than the dense psum on the char-LSTM at n=8, measured below)"))
def onebit_adam(
  learning_rate: float | Callable[[jax.Array], jax.Array],
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  *,
  freeze_step: int,
  bias_correction: bool = True,
  axis_name="data",
  policy=None,
) -> optax.GradientTransformationExtraArgs:
  """1-bit Adam (Tang et al. 2021): Adam whose momentum travels as signs.

  Warm-up (``count < freeze_step``): Adam on the exact mean gradient
  (one fused dense psum). From ``freeze_step`` the variance is frozen and
  the devices exchange the momentum instead of the gradient, compressed
  to 1 bit per element with worker and server error compensation:

  .. math::
    m_i = \\beta_1 m + (1 - \\beta_1) g_i, \\quad
    m = \\operatorname{onebit}(m_i), \\quad
    x \\leftarrow x - \\eta_t \\Big(
      \\frac{\\hat m}{\\sqrt{\\hat v_T} + \\epsilon} + \\lambda x\\Big)

  (``onebit``: :func:`jaxcomm.onebit`'s two-phase exchange, about 2 bits
  sent per element per device whatever the device count; ``v_T`` the
  variance at the freeze). Weight decay is decoupled (AdamW, as
  DeepSpeed's ``OnebitAdam``). With ``bias_correction`` the moments are
  corrected as ``optax.adam`` does (the variance by the number of its
  updates), so the warm-up equals ``optax.adam`` on the mean gradient.

  With a static ``freeze_step=0`` the variance comes from the state:
  restore the state of a warm-up run (same structure) and continue it
  with ``freeze_step=0``; no step of it runs the warm-up's dense psum.
  On a state whose variance was never updated (``nu_count == 0``: a fresh
  ``init``) the step is one dense Adam step on the exact mean gradient
  (behind a ``lax.cond``, so the compiled step holds that psum, and
  ``jaxcomm.wire.claimed`` lists it), which starts the variance; a
  compressed step on a zero variance would move the params by
  ``lr / eps``. Every error buffer is per-device
  state: orbax saves all of them and ``parallel.resize_state`` moves them
  to another device count without losing error mass.

  Args:
    learning_rate: a number or an optax schedule of the step.
    b1: Adam's momentum decay, in ``[0, 1)``.
    b2: Adam's variance decay, in ``[0, 1)``.
    eps: added to ``sqrt(v_hat)``.
    weight_decay: decoupled weight decay (needs ``params`` in ``update``).
    freeze_step: warm-up steps (static): the variance freezes and the
      1-bit exchange starts at this step. DeepSpeed suggests about 15-25%
      of training.
    bias_correction: correct the moments' initial bias as Adam does.
    axis_name: the data axis (a name, a tuple of names, or None).
    policy: a :class:`jaxcomm.LeafPolicy`: small leaves travel in the
      fused dense psum, exactly.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`OneBitAdamState`.

  Raises:
    ValueError: naming the argument, when ``learning_rate`` (a number) or
      ``weight_decay`` is negative or not finite, ``b1`` or ``b2`` is not
      in ``[0, 1)``, ``eps`` is not a finite number > 0, ``freeze_step`` is
      not an int >= 0 or is traced (it must be static),
      ``bias_correction`` is not a bool, or ``policy`` / ``axis_name`` is
      invalid. The update raises a ValueError for gradients that do not
      fit the params or the state, a complex gradient leaf,
      ``weight_decay`` without ``params``, a state that is not a
      :class:`OneBitAdamState`, and outside a context that binds
      ``axis_name``.

  Examples:
    The whole optimizer (it replaces ``optax.adamw``; no mean first):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> tx = jaxcomm.onebit_adam(1e-3, freeze_step=1000)

    A :class:`jaxcomm.parallel.DataParallel` step on 8 devices: device
    ``i`` pulls the 16 x 16 ``w`` toward its own target ``t_i`` (loss
    ``|w - t_i|^2 / 2``), so the optimum is the mean target. Two warm-up
    steps (Adam on the exact mean gradient), then two steps whose
    momentum travels as 1-bit signs; the distance to the optimum keeps
    falling:

    >>> mesh = jaxcomm.parallel.make_mesh()           # 8 devices on "data"
    >>> signs = jnp.where(jnp.sin(jnp.arange(256.0)) < 0, -1.0, 1.0)
    >>> noise = 0.4 * jnp.sin(0.7 * jnp.arange(2048.0))
    >>> targets = (signs + noise.reshape(8, 256)).reshape(8, 16, 16)
    >>> loss = lambda p, t: 0.5 * jnp.sum((p["w"] - t[0]) ** 2)
    >>> tx = jaxcomm.onebit_adam(0.1, freeze_step=2)
    >>> dp = jaxcomm.parallel.DataParallel(loss, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros((16, 16))})
    >>> for _ in range(4):
    ...   params, state, _ = dp.step(params, state, targets)
    ...   print(round(float(jnp.linalg.norm(params["w"] - targets.mean(0))),
    ...               2))
    14.38
    12.79
    11.28
    9.84

    The warm-up steps are ``optax.adam``'s on the mean gradient:

    >>> adam, w = optax.adam(0.1), jnp.zeros((16, 16))
    >>> s = adam.init(w)
    >>> for _ in range(2):
    ...   u, s = adam.update(w - targets.mean(0), s)   # the mean gradient
    ...   w = w + u
    ...   print(round(float(jnp.linalg.norm(w - targets.mean(0))), 2))
    14.38
    12.79

    and what they move is the dense psum's 256 float32 values; a step
    after the freeze moves packed signs (1 bit per value) and their
    scales in each of the exchange's two phases:

    >>> w0 = {"w": jnp.zeros((16, 16))}
    >>> jaxcomm.wire.claimed(tx, w0, 8, step=0)[0]
    ('all-reduce', 1024)
    >>> jaxcomm.wire.claimed(tx, w0, 8, step=2)[:2]
    [('all-to-all', 64), ('all-gather', 64)]

  References:
    Tang et al, `1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_,
    2021.
  """
  name = "onebit_adam"
  freeze_step = _check_common(name, learning_rate, b1, b2, eps, weight_decay,
                              freeze_step, bias_correction)
  ex = _exchange(axis_name, policy, freeze_step)
  spec = _compressor.spec_of(ex)
  if freeze_step == 0:
    spec = _dense_first_spec(spec)

  def init_fn(params):
    zeros = jnp.zeros((_Flat.of(params).stored_size,), jnp.float32)
    return OneBitAdamState(mu=zeros, nu=zeros,
                           nu_count=jnp.zeros([], jnp.int32),
                           exchange=ex.init(params))

  def finish(flat, updates, state, params, count, mu, nu, nu_count, bad,
             exchange):
    c1, c2 = _corrections(count, nu_count, b1, b2, bias_correction)
    u = _direction(mu, nu, c1, c2, eps)
    if params is not None:
      u = u + weight_decay * flat.flatten(params)
    step = -_learning_rate(learning_rate, count) * u
    bad, exchange = _skip_overflow(flat, step, updates, axis_name, bad,
                                   exchange, state.exchange)
    new = OneBitAdamState(
      mu=_keep(bad, mu, state.mu), nu=_keep(bad, nu, state.nu),
      nu_count=jnp.where(bad, state.nu_count, nu_count),
      exchange=exchange)
    return _output(flat, step, updates, bad), new

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    _checks.state_type(name, state, OneBitAdamState, "optimizer")
    flat = _check_params(name, updates, params, weight_decay, state,
                         axis_name)
    state = flat.load(state)

    def compressed_step(_):
      ph = _momentum_exchange(ex, flat, freeze_step, b1, updates, state,
                              params)
      nu = _variance(b2, ph, state.nu)
      bad = ph.bad | (ph.warm & ~jnp.all(jnp.isfinite(nu)))
      nu_count = state.nu_count + ph.warm.astype(jnp.int32)
      return finish(flat, updates, state, params, ph.count, ph.mu, nu,
                    nu_count, bad, ph.exchange)

    # freeze_step=0 on a variance never updated (a fresh state): one dense
    # Adam step instead of lr / eps steps on a zero variance.
    def dense_step():
      _, mu, nu, nu_count, bad, exchange = _dense_adam_step(
        flat, updates, state, b1, b2, axis_name)
      return finish(flat, updates, state, params, state.exchange.count, mu,
                    nu, nu_count, bad, exchange)

    out, new = _dense_while_fresh(freeze_step, state.nu_count, dense_step,
                                  compressed_step)
    return out, flat.store(new)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, spec), update_fn)



def _dense_while_fresh(freeze_step: int, nu_count, dense_step,
                       compressed_step):
  """The step of 1-bit Adam / 1-bit LAMB: ``compressed_step(None)``; with
  ``freeze_step=0``, ``dense_step()`` instead while the variance was never
  updated (``nu_count == 0``: a fresh state), its outputs typed like the
  compressed step's (one ``lax.cond``)."""
  if freeze_step > 0:
    return compressed_step(None)
  want = jax.eval_shape(compressed_step, None)

  def dense(_):
    return jax.tree.map(_vma.match_varying, dense_step(), want)

  return jax.lax.cond(nu_count == 0, dense, compressed_step, None)

@_registry.method(
    paper="Li et al. 2021",
    summary=(
      "warm-up: `optax.lamb` on the exact mean gradient (trust ratio "
      "clipped to `[min_coeff, max_coeff]`, its moving average kept); "
      "after: variance and trust ratio frozen; 1-bit momentum; the frozen"
      " ratio rescaled per layer by the drift of a re-estimated variance,"
      " bounded"))
def onebit_lamb(
  learning_rate: float | Callable[[jax.Array], jax.Array],
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-6,
  weight_decay: float = 0.0,
  *,
  freeze_step: int,
  bias_correction: bool = True,
  max_coeff: float = 10.0,
  min_coeff: float = 0.01,
  coeff_beta: float = 0.9,
  factor_max: float = 4.0,
  factor_min: float = 0.5,
  factor_threshold: float = 0.1,
  axis_name="data",
  policy=None,
) -> optax.GradientTransformationExtraArgs:
  """1-bit LAMB (Li et al. 2021): LAMB whose momentum travels as signs.

  Warm-up (``count < freeze_step``): LAMB on the exact mean gradient: per
  leaf (layer) the Adam direction ``u = m_hat / (sqrt(v_hat) + eps) +
  lambda x`` is scaled by the trust ratio ``c = clip(||x|| / ||u||,
  min_coeff, max_coeff)`` (1 where a norm is 0), and a moving average
  ``c_bar = coeff_beta c_bar + (1 - coeff_beta) c`` is kept. From
  ``freeze_step`` the variance and ``c_bar`` are frozen and the momentum
  is exchanged by the 1-bit exchange as in :func:`onebit_adam`. Because
  the frozen variance goes stale, the paper rescales the frozen ratio per
  layer by how much the variance has since changed: a fresh variance is
  re-estimated from the momentum's change, ``g~ = (m - b1 m_prev) / (1 -
  b1)``, ``v~ = b2 v~ + (1 - b2) g~^2`` (starting from ``v`` at the
  freeze), and

  .. math::
    f = \\max_j \\frac{\\sqrt{\\hat v_j} + \\epsilon}{\\sqrt{\\tilde v_j}
      + \\epsilon}

  (with weight decay blended by ``r = min(1, ||u - lambda x|| / ||u||)``:
  ``f r + 1 - r``), clipped to ``[factor_min, factor_max]`` and to within
  ``factor_threshold`` of the previous step's ``f``; the step is
  ``-lr c_bar f u``.

  Args:
    learning_rate: a number or an optax schedule of the step.
    b1: the momentum decay, in ``[0, 1)``.
    b2: the variance decay, in ``[0, 1)``.
    eps: added to ``sqrt(v_hat)`` (1e-6 as ``optax.lamb``).
    weight_decay: decoupled weight decay ``lambda``, part of the direction
      ``u`` the trust ratio scales.
    freeze_step: warm-up steps (static): the variance and the trust ratio
      freeze and the 1-bit exchange starts at this step.
    bias_correction: correct the moments' initial bias as Adam does.
    max_coeff: upper bound of the trust ratio.
    min_coeff: lower bound of the trust ratio.
    coeff_beta: decay of the trust ratio's moving average, in ``[0, 1]``.
    factor_max: upper bound of the frozen ratio's rescaling.
    factor_min: lower bound of the frozen ratio's rescaling.
    factor_threshold: largest relative change of the rescaling per step.
    axis_name: the data axis (a name, a tuple of names, or None).
    policy: a :class:`jaxcomm.LeafPolicy`: small leaves travel in the
      fused dense psum, exactly.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`OneBitLambState`.

  Raises:
    ValueError: naming the argument, for the arguments it shares with
      :func:`jaxcomm.onebit_adam` as there; when ``min_coeff``,
      ``max_coeff``, ``factor_min`` or ``factor_max`` is not a finite
      number > 0, ``coeff_beta`` not in ``[0, 1]``, ``factor_threshold``
      negative or not finite, or
      ``min_coeff > max_coeff`` or ``factor_min > factor_max``. The update
      raises a ValueError without ``params`` (the trust ratio needs them)
      and where :func:`jaxcomm.onebit_adam`'s does.

  Examples:
    The whole optimizer (it replaces ``optax.lamb``; no mean first):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> tx = jaxcomm.onebit_lamb(1e-3, freeze_step=1000, weight_decay=0.01)

    A :class:`jaxcomm.parallel.DataParallel` step on 8 devices: device
    ``i`` pulls the 16 x 16 ``w`` toward its own target ``t_i`` (loss
    ``|w - t_i|^2 / 2``), so the optimum is the mean target. Two warm-up
    steps (LAMB on the exact mean gradient; at ``w = 0`` the trust ratio
    is 1, then ``|w| / |u|``), then two steps with the frozen ratio and
    the momentum sent as 1-bit signs; the distance to the optimum keeps
    falling:

    >>> mesh = jaxcomm.parallel.make_mesh()           # 8 devices on "data"
    >>> signs = jnp.where(jnp.sin(jnp.arange(256.0)) < 0, -1.0, 1.0)
    >>> noise = 0.4 * jnp.sin(0.7 * jnp.arange(2048.0))
    >>> targets = (signs + noise.reshape(8, 256)).reshape(8, 16, 16)
    >>> loss = lambda p, t: 0.5 * jnp.sum((p["w"] - t[0]) ** 2)
    >>> tx = jaxcomm.onebit_lamb(0.1, freeze_step=2)
    >>> dp = jaxcomm.parallel.DataParallel(loss, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros((16, 16))})
    >>> for _ in range(4):
    ...   params, state, _ = dp.step(params, state, targets)
    ...   print(round(float(jnp.linalg.norm(params["w"] - targets.mean(0))),
    ...               2))
    14.38
    14.22
    12.94
    11.81

    The ratio's moving average, frozen since the freeze: ``0.9 * 1 + 0.1 *
    0.1`` (``|w| / |u| = 1.6 / 16`` at the second step):

    >>> print(np.asarray(state.coeff).round(3))
    [0.91]

  References:
    Li et al, `1-bit LAMB: Communication Efficient Large-Scale
    Large-Batch Training with LAMB's Convergence Speed
    <https://arxiv.org/abs/2104.06069>`_, 2021.
    You et al, `Large Batch Optimization for Deep Learning: Training BERT
    in 76 minutes <https://arxiv.org/abs/1904.00962>`_, 2020.
  """
  name = "onebit_lamb"
  freeze_step = _check_common(name, learning_rate, b1, b2, eps, weight_decay,
                              freeze_step, bias_correction)
  _checks.number("min_coeff", min_coeff, 0.0, None, lo_open=True)
  _checks.number("max_coeff", max_coeff, 0.0, None, lo_open=True)
  _checks.number("coeff_beta", coeff_beta, 0.0, 1.0)
  _checks.number("factor_min", factor_min, 0.0, None, lo_open=True)
  _checks.number("factor_max", factor_max, 0.0, None, lo_open=True)
  _checks.number("factor_threshold", factor_threshold, 0.0, None)
  for lo, a, hi, b in (("min_coeff", min_coeff, "max_coeff", max_coeff),
                       ("factor_min", factor_min, "factor_max", factor_max)):
    if not any(isinstance(v, jax.core.Tracer) for v in (a, b)) and a > b:
      raise ValueError(f"{name}: {lo} ({a}) must be <= {hi} ({b})")
  ex = _exchange(axis_name, policy, freeze_step)
  spec = _compressor.spec_of(ex)
  if freeze_step == 0:
    spec = _dense_first_spec(spec)

  def init_fn(params):
    flat = _Flat.of(params)
    zeros = jnp.zeros((flat.stored_size,), jnp.float32)
    ones = jnp.ones((len(flat.index),), jnp.float32)
    return OneBitLambState(
      mu=zeros, nu=zeros, nu_count=jnp.zeros([], jnp.int32),
      exchange=ex.init(params), nu_fresh=zeros, coeff=ones, factor=ones)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    _checks.state_type(name, state, OneBitLambState, "optimizer")
    flat = _check_params(name, updates, params, weight_decay, state,
                         axis_name)
    if params is None:
      raise ValueError(f"{name}: LAMB's trust ratio needs params: call "
                       "tx.update(grads, state, params)")
    state = flat.load(state)

    def lamb_step(ph):
      warm = ph.warm
      nu = _variance(b2, ph, state.nu)
      bad = ph.bad | (warm & ~jnp.all(jnp.isfinite(nu)))
      nu_count = state.nu_count + warm.astype(jnp.int32)
      c1, c2 = _corrections(ph.count, nu_count, b1, b2, bias_correction)
      # The params' buffer once the momentum is exchanged, not before.
      p = _core.after(flat.flatten(params), ph.mu)
      d = _direction(ph.mu, nu, c1, c2, eps)       # Adam's direction
      u = d + weight_decay * p
      # Per-leaf (layer) norms and maxima: segment reductions of the buffer.
      ids = flat.segments()
      leaf_norm = lambda x: jnp.sqrt(flat.leaf_sum(jnp.square(x), ids))
      pn, un, dn = leaf_norm(p), leaf_norm(u), leaf_norm(d)
      # Warm-up: LAMB's trust ratio and its moving average.
      ratio = jnp.where((pn > 0) & (un > 0), pn / jnp.where(un > 0, un, 1.0),
                        1.0)
      ratio = jnp.clip(ratio, min_coeff, max_coeff)
      coeff_warm = coeff_beta * state.coeff + (1.0 - coeff_beta) * ratio
      # Compressed: the fresh variance from the momentum's change, and the
      # frozen ratio's rescaling by how far the frozen variance has drifted.
      g_rec = (ph.mu - b1 * state.mu) / (1.0 - b1)
      fresh = b2 * state.nu_fresh + (1.0 - b2) * jnp.square(g_rec)
      fresh = jnp.where(jnp.isfinite(fresh), fresh, state.nu_fresh)
      drift = (jnp.sqrt(nu / c2) + eps) / (jnp.sqrt(fresh / c2) + eps)
      fac = flat.leaf_max(drift, ids)
      blend = jnp.where(un > 0, jnp.minimum(1.0, dn / jnp.where(
        un > 0, un, 1.0)), 1.0)
      fac = fac * blend + (1.0 - blend)
      fac = jnp.clip(fac, factor_min, factor_max)
      fac = jnp.clip(fac, state.factor * (1.0 - factor_threshold),
                     state.factor * (1.0 + factor_threshold))
      scale = jnp.where(warm, ratio, state.coeff * fac)
      step = (-_learning_rate(learning_rate, ph.count) * flat.expand(scale, ids)
              * u)
      bad, exchange = _skip_overflow(flat, step, updates, axis_name, bad,
                                     ph.exchange, state.exchange)
      new = OneBitLambState(
        mu=_keep(bad, ph.mu, state.mu), nu=_keep(bad, nu, state.nu),
        nu_count=jnp.where(bad, state.nu_count, nu_count),
        exchange=exchange,
        # While warm the fresh variance follows v, so it starts from v_T.
        nu_fresh=_keep(bad, jnp.where(warm, nu, fresh), state.nu_fresh),
        coeff=_keep(bad, jnp.where(warm, coeff_warm, state.coeff),
                    state.coeff),
        factor=_keep(bad, jnp.where(warm, state.factor, fac), state.factor))
      return _output(flat, step, updates, bad), new

    def compressed_step(_):
      return lamb_step(_momentum_exchange(ex, flat, freeze_step, b1,
                                          updates, state, params))

    # freeze_step=0 on a variance never updated (a fresh state): one dense
    # LAMB step, as the warm-up takes it, instead of lr / eps steps on a
    # zero variance (the frozen trust ratio is init's 1).
    def dense_step():
      gbar, mu, _, _, bad, exchange = _dense_adam_step(
        flat, updates, state, b1, b2, axis_name)
      return lamb_step(_Phase(count=state.exchange.count,
                              warm=jnp.ones([], bool), gbar=gbar, mu=mu,
                              bad=bad, exchange=exchange))

    out, new = _dense_while_fresh(freeze_step, state.nu_count, dense_step,
                                  compressed_step)
    return out, flat.store(new)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, spec), update_fn)


__all__ = [
  "onebit_adam",
  "onebit_lamb",
  "OneBitAdamState",
  "OneBitLambState",
]
