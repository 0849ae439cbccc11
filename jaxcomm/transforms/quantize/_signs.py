"""Sign compressors (1 bit per element): onebit (Seide et al. 2014;
DeepSpeed's two-phase exchange, Tang et al. 2021), signSGD and signum with
a majority vote (Bernstein et al. 2018, 2019), EF-signSGD (Karimireddy et
al. 2019)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _per_device
from jaxcomm import _registry
from jaxcomm.collectives import _signs
from jaxcomm.transforms.quantize._quantization import _sign

# ------------------------------------------------------------------ onebit --


class OneBitState(NamedTuple):
  """Codec state of :func:`jaxcomm.onebit`.

  Attributes:
    server_error: ``float32[S]`` per device (``S`` the bucket's stored
      size, :attr:`jaxcomm._buckets.Layout.stored_size`: whole tiles,
      zeros past the leaves' total); device ``k`` uses only its chunk
      ``[k C, (k + 1) C)`` of it; kept in gradient-sum units (``n`` times
      the error of the mean).
  """

  server_error: jax.Array


# Device k holds the whole server error of its chunk k (not a share of a
# mean): resizing re-cuts the total into the new devices' chunks.
_per_device.register(OneBitState, server_error=_per_device.OWNED)


@dataclasses.dataclass(frozen=True)
class OneBitCodec(_codec.CodecBase):
  """Scaled signs by DeepSpeed's two-phase compressed allreduce, with the
  chunk owners' server error as state (:func:`jaxcomm.onebit`). No fields:
  it has no hyperparameters."""

  name = "onebit"
  mean_of_sent = False

  def init(self, layout):
    return OneBitState(jnp.zeros([layout.stored_size], jnp.float32))

  def apply(self, x, state, ctx):
    mean, sent, err = _signs.compressed_allreduce(
      x, ctx.layout.sizes, state.server_error, ctx.axis_name)
    return _codec.CodecResult(mean=mean, sent=sent, state=OneBitState(err))

  def wire(self, layout, n):
    return _signs.compressed_allreduce_wire(layout.sizes, n,
                                            layout.stored_size)


@_registry.method(
    gap=(
      "one bit a coordinate, worker and server error: short on the "
      "char-LSTM in 300 steps"),
    paper="Seide et al. 2014; Tang et al. 2021",
    summary=(
      "packed signs + scale, worker and server EF (DeepSpeed-style "
      "2-phase)"),
    aliases=("1bit",))
@_compressor.shared_options
def onebit(*, axis_name="data", error_feedback: bool = True, policy=None,
           **options):
  """1-bit SGD with error feedback and DeepSpeed's compressed allreduce.

  Each device sends the sign of its error-compensated gradient and one
  scale per leaf; each chunk owner averages the decoded chunks, adds its
  server error and sends the chunk back as signs and one scale:

  .. math::
    w_i = \\frac{\\|x_i\\|_2}{\\sqrt d} \\operatorname{sign}(x_i), \\quad
    e_i' = x_i - w_i, \\quad
    y = \\frac{1}{n}\\sum_i w_i + \\epsilon, \\quad
    u = \\frac{\\|y\\|_2}{\\sqrt{C}} \\operatorname{sign}(y), \\quad
    \\epsilon' = y - u

  (``x_i = g_i + e_i``; ``\\epsilon`` per chunk, kept by its owner). Each
  device sends about 2 bits per element whatever the number of devices
  (:func:`jaxcomm.collectives.compressed_allreduce`). Both error buffers are
  per-device state (checkpointed; ``parallel.resize_state`` sums them).

  Departures: Seide et al. reconstruct with per-column means of the
  positive and negative entries; as DeepSpeed, one scale ``||x||_2/sqrt(d)``
  per leaf is used (per chunk on the server). sign(0) = +1.

  Args:
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the worker error (the server error is always kept).
    policy: a :class:`jaxcomm.LeafPolicy`.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (its codec state a
    :class:`jaxcomm.OneBitState` per bucket).

  Raises:
    ValueError: naming the argument, for an ``error_feedback`` other than
      True, False, ``"ef21"`` and ``"diana"`` (both of these are refused:
      the server re-compresses the mean), or an ``axis_name``,
      ``policy`` or option that :func:`jaxcomm.compressed` refuses; the
      update raises one when it is called outside a context that binds
      ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``, with a leaf policy that compresses even a 4-value
    leaf. The update is one scale times the signs of the averaged
    messages; what the devices' signs and the server's left out stays in
    the worker residuals and the chunk owner's server error, so ``n``
    times the update plus both errors is the sum of the gradients:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.onebit(policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return (update, state.residual[0][None],
    ...           state.codec[0].server_error[None])
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update, residual, server = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"), P("data"))))(grads)
    >>> print(grads.mean(0), np.asarray(update, np.float64).round(3))
    [ 4.5  -2.25  1.5   3.5 ] [ 3.562 -3.562  3.562  3.562]
    >>> kept = np.sum(residual, 0) + np.sum(server, 0)
    >>> print(np.allclose(8 * update + kept, grads.sum(0), atol=1e-5))
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.onebit(), optax.sgd(0.1))

  References:
    Seide et al, `1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs
    <https://www.microsoft.com/en-us/research/publication/1-bit-stochastic-gradient-descent-and-application-to-data-parallel-distributed-training-of-speech-dnns/>`_,
    2014.
    Tang et al, `1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, 2021.
  """
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(OneBitCodec(), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


# --------------------------------------------------------- majority vote --


class SignumState(NamedTuple):
  """Codec state of :func:`jaxcomm.signum`: the local momentum.

  Attributes:
    momentum: ``float32[L]`` per device, ``L`` the bucket's size (laid out
      as the bucket): this device's ``m_i``, on which the devices vote.
  """

  momentum: jax.Array


@dataclasses.dataclass(frozen=True)
class MajorityVoteCodec(_codec.CodecBase):
  """The devices' majority sign times ``scale``
  (:func:`jaxcomm.signsgd`), or their vote on each device's local momentum
  (:func:`jaxcomm.signum`).

  Attributes:
    scale: ``gamma``, the size of the voted sign.
    beta: signum's momentum (its state), or None: signSGD's vote on ``x``.
  """

  scale: float = 1.0
  beta: float | None = None
  mean_of_sent = False

  @property
  def name(self):
    return "signsgd" if self.beta is None else "signum"

  def init(self, layout):
    if self.beta is None:
      return ()
    return SignumState(jnp.zeros([layout.size], jnp.float32))

  def apply(self, x, state, ctx):
    beta, scale = self.beta, self.scale
    if beta is None:
      votes_on, new_state = x, state
    else:
      votes_on = beta * state.momentum + (1.0 - beta) * x
      new_state = SignumState(votes_on)
    v = _signs.majority_vote(votes_on, ctx.axis_name)
    return _codec.CodecResult(mean=v * scale, sent=_sign(votes_on) * scale,
                              state=new_state)

  def wire(self, layout, n):
    return _signs.majority_vote_wire(layout.size, n)


@_registry.method(
    gap=(
      "majority vote of signs without error feedback (biased); at the "
      "char-LSTM's x30 a sign step is too large (x10: 50.1)"),
    paper="Bernstein et al. 2018",
    summary="packed signs, majority vote in 2 phases")
@_compressor.shared_options
def signsgd(scale: float = 1.0, *, axis_name="data",
            error_feedback: bool = False, policy=None,
            **options):
  """signSGD with majority vote: the update is the devices' majority sign.

  .. math::
    u = \\gamma \\operatorname{sign}\\Big(\\sum_{i=1}^{n}
    \\operatorname{sign}(g_i)\\Big)

  The paper applies ``x -= lr * u`` with ``gamma = 1``; here the update is
  the voted sign times ``scale`` (``gamma``) and the learning rate comes
  downstream: ``optax.chain(signsgd(), optax.sgd(lr))``. Majority vote is
  not a linear average (the battery does not check mass conservation), and
  the paper keeps no error feedback. Each device sends about 2 bits per
  element whatever the number of devices
  (:func:`jaxcomm.collectives.majority_vote`). sign(0) = +1 and ties (even
  ``n``) vote +1: a 1-bit code has no zero, so a coordinate whose gradient
  is 0 on every device (all-zero gradients, a frozen or unused parameter)
  moves by ``-lr * scale`` every step. Keep such leaves out of the vote
  with ``LeafPolicy(mask=...)`` (they then get the exact dense mean, 0) or
  ``optax.masked``.

  Args:
    scale: ``gamma``, a positive number (injectable).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep ``x - scale * sign(x)`` per device (not in the
      paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for a ``scale`` that is not a
      finite positive number, an ``error_feedback`` other than True, False,
      ``"ef21"`` and ``"diana"`` (both of these are refused: a vote is
      not the mean of what was sent), or an ``axis_name``, ``policy`` or
      option that :func:`jaxcomm.compressed` refuses; the update raises
      one when it is called outside a context that binds ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient
    ``[i, -i, i - 6, 1]``, except device 1, whose last value is ``-20``;
    a leaf policy compresses even this 4-value leaf. The update is the
    majority sign; in the last column 7 devices vote ``+1``, although the
    mean is negative.

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.signsgd(policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, _ = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i, i - 6, np.where(i == 1, -20.0, 1.0)],
    ...                        axis=1)
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(grads.mean(0), np.asarray(update, np.float64))
    [ 4.5   -4.5   -1.5   -1.625] [ 1. -1. -1.  1.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.signsgd(), optax.sgd(1e-4))

  References:
    Bernstein et al, `signSGD: Compressed Optimisation for Non-Convex
    Problems <https://arxiv.org/abs/1802.04434>`_, 2018.
    Bernstein et al, `signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant <https://arxiv.org/abs/1810.05291>`_, 2019.
  """
  _checks.number("scale", scale, 0.0, None, lo_open=True)
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(MajorityVoteCodec(scale=scale),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


@_registry.method(
    gap=(
      "majority vote of signs of each device's momentum: the char-LSTM's "
      "rate scale (x30, dense's) is too large for a sign step (x10: "
      "58.3)"),
    paper="Bernstein et al. 2018, 2019",
    summary="packed signs, majority vote in 2 phases")
@_compressor.shared_options
def signum(beta: float = 0.9, scale: float = 1.0, *, axis_name="data",
           error_feedback: bool = False, policy=None,
           **options):
  """Signum with majority vote: devices vote on their local momentum.

  .. math::
    m_i \\leftarrow \\beta m_i + (1 - \\beta) g_i, \\qquad
    u = \\gamma \\operatorname{sign}\\Big(\\sum_i
    \\operatorname{sign}(m_i)\\Big)

  The momentum ``m_i`` is per-device codec state; the exchange is
  :func:`jaxcomm.collectives.majority_vote` (about 2 bits per element per
  device). Use a downstream optimizer without momentum
  (``optax.sgd(lr)``). As :func:`jaxcomm.signsgd`, no error feedback by
  default and no mass conservation; sign(0) = +1, so coordinates with zero
  momentum move by ``-lr * scale`` (mask such leaves out, see
  :func:`jaxcomm.signsgd`).

  Args:
    beta: momentum in ``[0, 1)`` (injectable).
    scale: ``gamma``, a positive number (injectable).
    axis_name: the data axis.
    error_feedback: keep ``x - scale * sign(m)`` per device (not in the
      paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (its codec state a
    :class:`jaxcomm.SignumState` per bucket).

  Raises:
    ValueError: naming the argument, for a ``beta`` outside ``[0, 1)``, a
      ``scale`` that is not a finite positive number, an ``error_feedback``
      other than True, False, ``"ef21"`` and ``"diana"`` (both of these
      are refused: a vote is not the mean of what was sent), or an
      ``axis_name``, ``policy`` or option that :func:`jaxcomm.compressed`
      refuses; the update raises one when it is called outside a context
      that binds ``axis_name``.

  Examples:
    Two steps on the 8 devices: device ``i`` (1 to 8) has the gradient
    ``g_i = [i, -i, i - 6, 1]`` (device 1's last value ``-20``), then
    ``-g_i / 2``. The first vote is :func:`jaxcomm.signsgd`'s; at the
    second the momentum ``0.09 g_i - 0.05 g_i = 0.04 g_i`` still points
    the first way, so the vote does not flip:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.signum(0.9, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   second, state = tx.update(-g[0] / 2, state)
    ...   return first, second, state.codec[0].momentum[None]
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i, i - 6, np.where(i == 1, -20.0, 1.0)],
    ...                        axis=1)
    >>> first, second, momentum = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P(), P("data"))))(grads)
    >>> print(np.asarray(first, np.float64), np.asarray(second, np.float64))
    [ 1. -1. -1.  1.] [ 1. -1. -1.  1.]
    >>> print(np.asarray(momentum[0], np.float64).round(3))   # device 1's
    [ 0.04 -0.04 -0.2  -0.8 ]

    In training, an optimizer without momentum follows it:

    >>> opt = optax.chain(jaxcomm.signum(0.9), optax.sgd(1e-4))

  References:
    Bernstein et al, `signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant <https://arxiv.org/abs/1810.05291>`_, 2019.
  """
  _checks.decay("beta", beta)
  _checks.number("scale", scale, 0.0, None, lo_open=True)
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(MajorityVoteCodec(scale=scale, beta=beta),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


# ------------------------------------------------------------- ef_signsgd --


def _mean_abs(lay, x):
  """Each leaf's ``||x||_1 / d`` (short leaves batched, padded with 0)."""
  sums = lay.reduce(lambda v: jnp.sum(jnp.abs(v), axis=1), x, pad=0.0)
  return sums / jnp.asarray(np.asarray(lay.sizes, np.float32))


@dataclasses.dataclass(frozen=True)
class EfSignSgdCodec(_codec.CodecBase):
  """Signs times each leaf's ``||x||_1 / d``, all-gathered
  (:func:`jaxcomm.ef_signsgd`); a gossip codec. No fields: it has no
  hyperparameters."""

  name = "ef_signsgd"

  def apply(self, x, state, ctx):
    lay = ctx.layout
    scales = _mean_abs(lay, x)
    sent = lay.broadcast(scales) * _sign(x)
    mean = _signs.gather_signs(x, scales, lay.sizes, ctx.axis_name)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    return _signs.gather_signs_wire(layout.sizes, n)

  def message(self, x, ctx):
    lay = ctx.layout
    scales = _mean_abs(lay, x)
    return (_signs.sign_message(x, scales),
            lay.broadcast(scales) * _sign(x))

  def decode(self, words, ctx):
    return _signs.decode_sign_message(words, ctx.layout.sizes)


@_registry.method(
    gap=(
      "scaled signs with error feedback, as onebit; short on the "
      "char-LSTM"),
    paper="Karimireddy et al. 2019",
    summary="scaled signs, EF, all-gather",
    aliases=("signsgd_ef",))
@_compressor.shared_options
def ef_signsgd(*, axis_name="data", error_feedback: bool = True,
               policy=None,
               **options):
  """EF-signSGD: scaled signs with error feedback.

  .. math::
    p_i = g_i + e_i, \\quad
    \\Delta_i = \\frac{\\|p_i\\|_1}{d} \\operatorname{sign}(p_i), \\quad
    e_i' = p_i - \\Delta_i, \\quad
    u = \\frac{1}{n}\\sum_i \\Delta_i

  per leaf of ``d`` elements. The average is the exact linear average of
  what each device sent, so error feedback conserves gradient mass; the
  signs and the per-leaf scales are all-gathered (each device sends ``n-1``
  bits per element: :func:`jaxcomm.onebit`'s two-phase exchange scales
  better). The paper's step ``x -= lr * Delta`` is ``optax.sgd(lr)``
  downstream.

  Args:
    axis_name: the data axis.
    error_feedback: keep the residual (the paper's point; default True).
    policy: a :class:`jaxcomm.LeafPolicy`.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for an ``error_feedback`` other than
      True, False, ``"ef21"`` and ``"diana"`` (``"diana"`` is refused:
      scaled signs are biased), or an ``axis_name``, ``policy`` or option
      that :func:`jaxcomm.compressed` refuses; the update raises one when
      it is called outside a context that binds ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``, with a leaf policy that compresses even a 4-value
    leaf. Device ``i`` sends ``||g_i||_1 / 4`` times its signs
    ``[+, -, +, +]`` (sign(0) = +1), device 8 ``3.375``. The update is
    the exact mean of the messages, and the residuals keep the rest:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.ef_signsgd(policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(grads[7] - np.asarray(residual[7], np.float64))  # device 8's
    [ 3.375 -3.375  3.375  3.375]
    >>> print(grads.mean(0), np.asarray(update, np.float64).round(4))
    [ 4.5  -2.25  1.5   3.5 ] [ 2.9375 -2.9375  2.9375  2.9375]
    >>> print(np.allclose(8 * update + np.sum(residual, 0), grads.sum(0)))
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.ef_signsgd(), optax.sgd(0.01))

  References:
    Karimireddy et al, `Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes <https://arxiv.org/abs/1901.09847>`_, 2019.
  """
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(EfSignSgdCodec(), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)


__all__ = [
  "ef_signsgd",
  "onebit",
  "signsgd",
  "signum",
  "OneBitState",
  "SignumState",
]
