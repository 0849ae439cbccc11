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
    return ("ota_onebit" if self.one_bit else "ota_analog") + \
      f"({self.snr_db}dB)"

  def apply(self, x, state, ctx):
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
  with a key seeded by ``seed``. See
  :mod:`jaxcomm.transforms.quantize._over_the_air`.

  Args:
    snr_db: receive SNR per element, in dB.
    threshold: the power-gain cut-off of truncated channel inversion
      (``|h|^2 ~ Exp(1)``; 0: every device transmits).
    axis_name: the data axis.
    error_feedback: keep what a silent device did not send (not in the
      paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: the channel's seed.
  """
  snr_db, threshold = _args(snr_db, threshold)
  return _compressor.compressed(
    OverTheAirCodec(snr_db=snr_db, threshold=threshold, one_bit=False),
    axis_name=axis_name, error_feedback=error_feedback, policy=policy,
    seed=seed, **options)


@_registry.method(
    paper="Zhu et al. 2020 (OBDA)",
    static=("snr_db", "threshold"),
    defaults={"snr_db": 10.0},
    summary=(
      "simulated one-bit over-the-air majority vote: signs summed by a "
      "Rayleigh channel with truncated inversion and noise at `snr_db`; "
      "the receiver takes the sign"))
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
  software with a key seeded by ``seed``. The update is the voted sign
  (``sign(0) = +1``); the learning rate comes downstream, as for
  :func:`jaxcomm.signsgd`.

  Args:
    snr_db: receive SNR per element, in dB.
    threshold: the power-gain cut-off of truncated channel inversion.
    axis_name: the data axis.
    error_feedback: keep ``x - sign(x)`` per device (not in the paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: the channel's seed.
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
