"""Over-the-air aggregation, simulated: the devices' messages summed by a
fading multiple-access channel with additive noise (Zhu, Xu, Huang & Cui
2020, one-bit; Amiri & Gündüz 2020, analog).

This is a simulation. Nothing here touches a radio: the exchange is an
ordinary all-reduce of float32 values, and the channel is applied to it in
software with a seeded key:

* each device draws a Rayleigh power gain ``|h_i|^2 ~ Exp(1)`` per step;
* truncated channel inversion: a device whose gain is below
  ``threshold`` stays silent this step, the others invert their channel so
  that their signals arrive with equal amplitude (the papers' power
  control; the transmit power this costs is not modelled);
* the receiver gets ``y = sum_{active} s_i + z``, ``z ~ N(0, sigma^2 I)``
  with ``sigma^2 = P / SNR``: ``P = 1`` for one-bit signs, and for analog
  values ``P`` the devices' average power per element (the mean over
  devices of ``||x_i||^2 / d``);
* one-bit (Zhu et al.): ``s_i = sign(x_i)``, the receiver's estimate is
  ``sign(y)``, a majority vote decided by the noisy sum; analog (Amiri &
  Gündüz): ``s_i = x_i``, the estimate is ``y / k`` with ``k`` the number
  of active devices (0 when none is).

The number of active devices and the power travel as 1 or 2 more floats in
the same all-reduce. Devices share the noise draw (one key per step) and
draw their gains from it folded with their index, so the result is the
same on every device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core


def _channel(ctx, size: int, threshold: float):
  """(active flag of this device, the shared unit noise draw)."""
  k_gain, k_noise = jax.random.split(ctx.key)
  gain = jax.random.exponential(jax.random.fold_in(k_gain, ctx.device_index),
                                (), jnp.float32)
  active = (gain >= threshold).astype(jnp.float32)
  noise = jax.random.normal(k_noise, (size,), jnp.float32)
  return active, noise


@dataclasses.dataclass(frozen=True)
class OverTheAirCodec(_codec.CodecBase):
  """A simulated fading channel with noise on the summed messages.

  Attributes:
    snr_db: the receiver's signal-to-noise ratio per element, in dB.
    threshold: truncated channel inversion's power-gain cut-off.
    one_bit: True: signs and a majority decision (Zhu et al.); False:
      analog values averaged over the active devices (Amiri & Gündüz).
  """

  snr_db: float = 10.0
  threshold: float = 0.0
  one_bit: bool = False
  mean_of_sent = False

  @property
  def name(self):
    """The public name with the SNR, ``"ota_analog(10.0dB)"``."""
    return ("ota_onebit" if self.one_bit else "ota_analog") + \
      f"({self.snr_db}dB)"

  def apply(self, x, state, ctx):
    """One step on one bucket: the channel applied to the summed messages.

    Args:
      x: this device's flat ``float32[L]`` bucket (error feedback added).
      state: the codec's state for the bucket (``()``: stateless).
      ctx: the step's :class:`jaxcomm.Context` (the key the channel is
        drawn from, the device index, the axis).

    Returns:
      A :class:`jaxcomm.CodecResult` of the receiver's estimate
      (identical on every device), what this device transmitted (zeros
      when silent) and ``state``.
    """
    size = x.shape[0]
    active, noise = _channel(ctx, size, self.threshold)
    inv_snr = 10.0 ** (-self.snr_db / 10.0)
    if self.one_bit:
      s = jnp.where(x >= 0, 1.0, -1.0) * active
      tot = _core.fused_psum([s, active], ctx.axis_name)
      y = tot[0] + jnp.sqrt(inv_snr) * noise
      mean = jnp.where(y >= 0, 1.0, -1.0)
      return _codec.CodecResult(mean=mean, sent=s, state=state)
    s = x * active
    power = jnp.sum(x * x) / size
    tot = _core.fused_psum([s, active, power], ctx.axis_name)
    n = ctx.num_devices
    sigma = jnp.sqrt(tot[2] / n * inv_snr)
    y = tot[0] + sigma * noise
    k = tot[1]
    mean = jnp.where(k > 0, y / jnp.maximum(k, 1.0), 0.0)
    return _codec.CodecResult(mean=mean, sent=s, state=state)

  def wire(self, layout, n):
    """The collectives :meth:`~jaxcomm.OverTheAirCodec.apply` issues.

    Args:
      layout: the bucket's static layout.
      n: the number of devices (the payload does not depend on it).

    Returns:
      ``[("all-reduce", bytes)]``: the bucket's values and the active
      count (and, analog, the power), 4 bytes each.
    """
    return [("all-reduce", 4 * (layout.size + (1 if self.one_bit else 2)))]


def _args(snr_db, threshold):
  # Python floats, or tracers under optax.inject_hyperparams (kept as
  # they are: both enter the channel only as array arithmetic).
  def real(v):
    return v if isinstance(v, jax.core.Tracer) else float(v)
  return (real(_checks.number("snr_db", snr_db)),
          real(_checks.number("threshold", threshold, 0.0)))


@_registry.method(
    paper="Amiri & Gündüz 2020",
    static=("snr_db", "threshold"),
    defaults={"snr_db": 10.0},
    summary=(
      "simulated analog over-the-air sum: Rayleigh fading with truncated "
      "channel inversion, Gaussian noise at `snr_db`; the sum over active "
      "devices divided by their count"))
@_compressor.shared_options
def ota_analog(snr_db: float, *, threshold: float = 0.0, axis_name="data",
               error_feedback: bool = False, policy=None, seed: int = 0,
               **options):
  """Analog over-the-air averaging through a simulated fading channel.

  .. math::
    \\hat g = \\frac{1}{k}\\Big(\\sum_{i: |h_i|^2 \\ge t} g_i + z\\Big),
    \\quad z \\sim \\mathcal N(0, \\tfrac{P}{\\mathrm{SNR}} I)

  (Amiri & Gündüz 2020, with truncated channel inversion.) A simulation:
  the exchange is a float32 all-reduce and the channel (per-device Rayleigh
  gains, the silent devices below ``threshold``, noise of power ``P /
  SNR``, ``P`` the devices' mean power per element) is applied in software
  with a key seeded by ``seed`` (the docstring of
  ``jaxcomm/transforms/quantize/_over_the_air.py`` describes the channel).

  Args:
    snr_db: receive SNR per element, in dB.
    threshold: the power-gain cut-off of truncated channel inversion
      (``|h|^2 ~ Exp(1)``; 0: every device transmits).
    axis_name: the data axis.
    error_feedback: keep what a silent device did not send (not in the
      paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: the channel's seed.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for an ``snr_db`` that is not a
      finite number, a ``threshold`` that is not a finite number ``>= 0``,
      or an ``axis_name``, ``error_feedback`` (``"ef21"`` and ``"diana"``
      are refused: the estimate is not the mean of what was sent),
      ``policy`` or option that :func:`jaxcomm.compressed` refuses; the
      update raises one when it is called outside a context that binds
      ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient ``[i, -i /
    2, 1.5, 8 - i]``, with a leaf policy that compresses even a 4-value
    leaf. With the cut-off ``threshold=1`` about ``1 - e^-1 = 63%`` of
    the devices stay silent in a step, here devices 1, 4, 5, 7 and 8
    (with error feedback each keeps its whole gradient); at 40 dB the
    estimate is the mean of the other three, up to the channel's noise:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.ota_analog(40.0, threshold=1.0, error_feedback=True,
    ...                         policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> silent = np.all(np.asarray(residual) == grads, axis=1)
    >>> print(np.flatnonzero(silent) + 1)          # the silent devices
    [1 4 5 7 8]
    >>> heard = grads[~silent].mean(0)
    >>> print(heard.round(3), np.abs(update - heard).max() < 0.05)
    [ 3.667 -1.833  1.5    4.333] True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.ota_analog(20.0), optax.sgd(0.1))
  """
  snr_db, threshold = _args(snr_db, threshold)
  return _compressor.compressed(
    OverTheAirCodec(snr_db=snr_db, threshold=threshold, one_bit=False),
    axis_name=axis_name, error_feedback=error_feedback, policy=policy,
    seed=seed, **options)


@_registry.method(
    gap=(
      "one-bit vote through a fading channel at 10 dB SNR: the receiver's "
      "sign errors"),
    paper="Zhu et al. 2020 (OBDA)",
    static=("snr_db", "threshold"),
    defaults={"snr_db": 10.0},
    summary=(
      "simulated one-bit over-the-air majority vote: signs summed by a "
      "Rayleigh channel with truncated inversion and noise at `snr_db`; "
      "the receiver takes the sign (sign(0) = +1: a zero gradient still "
      "moves)"))
@_compressor.shared_options
def ota_onebit(snr_db: float, *, threshold: float = 0.0, axis_name="data",
               error_feedback: bool = False, policy=None, seed: int = 0,
               **options):
  """One-bit over-the-air majority vote through a simulated fading channel.

  .. math::
    \\hat v = \\operatorname{sign}\\Big(\\sum_{i: |h_i|^2 \\ge t}
    \\operatorname{sign}(g_i) + z\\Big),
    \\quad z \\sim \\mathcal N(0, \\mathrm{SNR}^{-1} I)

  (Zhu et al. 2020, one-bit broadband digital aggregation, with truncated
  channel inversion; each sign is sent with unit power.) A simulation: the
  signs travel in a float32 all-reduce and the channel is applied in
  software with a key seeded by ``seed``. The update is the voted sign;
  the learning rate comes downstream, as for :func:`jaxcomm.signsgd`.

  Ties go to ``+1``, on the devices and at the receiver:
  ``sign(0) = +1``. The paper's devices send one-bit digitally modulated
  symbols, ``+1`` or ``-1``, with no symbol for zero; this implementation
  sends ``+1`` for a zero coordinate. An all-zero gradient (a frozen
  parameter, a masked or padded coordinate) therefore still sends ``+1``
  from every device and is updated by ``+1`` (the noise can flip it);
  exclude such leaves with ``policy``, or mask the update downstream,
  where that matters.

  Args:
    snr_db: receive SNR per element, in dB.
    threshold: the power-gain cut-off of truncated channel inversion.
    axis_name: the data axis.
    error_feedback: keep ``x - sign(x)`` per device (not in the paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: the channel's seed.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`.

  Raises:
    ValueError: naming the argument, for an ``snr_db`` that is not a
      finite number, a ``threshold`` that is not a finite number ``>= 0``,
      or an ``axis_name``, ``error_feedback`` (``"ef21"`` and ``"diana"``
      are refused: a vote is not the mean of what was sent), ``policy`` or
      option that :func:`jaxcomm.compressed` refuses; the update raises
      one when it is called outside a context that binds ``axis_name``.

  Examples:
    On the 8 devices, device ``i`` (1 to 8) has the gradient
    ``[i, -i, i - 6, 1]``, except device 1, whose last value is ``-20``;
    a leaf policy compresses even this 4-value leaf. At 10 dB the noise
    (``0.32`` per element) is small beside the sums of signs, ``8``,
    ``-8``, ``-2`` and ``6``, so the receiver takes the majority sign, as
    :func:`jaxcomm.signsgd`, although the last column's mean is negative:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.ota_onebit(10.0, policy=jaxcomm.LeafPolicy(min_size=1))
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

    >>> opt = optax.chain(jaxcomm.ota_onebit(10.0), optax.sgd(1e-4))
  """
  snr_db, threshold = _args(snr_db, threshold)
  return _compressor.compressed(
    OverTheAirCodec(snr_db=snr_db, threshold=threshold, one_bit=True),
    axis_name=axis_name, error_feedback=error_feedback, policy=policy,
    seed=seed, **options)


__all__ = [
  "OverTheAirCodec",
  "ota_analog",
  "ota_onebit",
]
