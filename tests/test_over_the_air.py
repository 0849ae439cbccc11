"""The simulated over-the-air aggregations (analog, Amiri & Gündüz 2020;
one-bit, Zhu et al. 2020) on 8 CPU devices.

The replay takes the channel's random draws (Rayleigh power gains per
device, the shared unit noise) from the same keys the compressor's state
hands each step, and computes the rest in numpy from the channel model:
truncated inversion keeps the devices whose gain reaches the threshold,
the receiver sees their sum plus noise of power ``P / SNR``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm import parallel
from jaxcomm import wire
from tests import harness

N = harness.N


def _params():
  return {"w": jnp.zeros((64, 48), jnp.float32)}


def _draws(seed, steps, size):
  """Per step: (gains [N], unit noise [size]) from the compressor's step
  keys (``key, step = split(key)`` each step from ``PRNGKey(seed)``)."""
  key = jax.random.PRNGKey(seed)
  out = []
  for _ in range(steps):
    key, step = jax.random.split(key)
    k_gain, k_noise = jax.random.split(step)
    gains = np.array([float(jax.random.exponential(
      jax.random.fold_in(k_gain, i), (), jnp.float32)) for i in range(N)])
    noise = np.asarray(jax.random.normal(k_noise, (size,), jnp.float32),
                       np.float64)
    out.append((gains, noise))
  return out


def np_channel(xs, gains, noise, snr_db, threshold, one_bit):
  active = gains >= threshold
  if one_bit:
    s = np.where(xs >= 0, 1.0, -1.0) * active[:, None]
    y = s.sum(0) + np.sqrt(10 ** (-snr_db / 10)) * noise
    return np.where(y >= 0, 1.0, -1.0)
  s = xs * active[:, None]
  power = np.mean([np.sum(x * x) / x.size for x in xs])
  y = s.sum(0) + np.sqrt(power * 10 ** (-snr_db / 10)) * noise
  k = active.sum()
  return y / k if k else np.zeros_like(y)


@pytest.mark.parametrize("one_bit", [False, True])
@pytest.mark.parametrize("snr_db,threshold", [(0.0, 0.0), (10.0, 0.5)])
def test_matches_the_channel_model(one_bit, snr_db, threshold):
  steps, seed = 3, 5
  make = jaxcomm.ota_onebit if one_bit else jaxcomm.ota_analog
  tx = make(snr_db, threshold=threshold, seed=seed)
  params = _params()
  grads = harness.make_grads(1, steps, params=params)
  mesh = parallel.make_mesh(N)
  ups, _, _ = harness.device_run(tx, mesh, grads, params=params)
  draws = _draws(seed, steps, 64 * 48)
  silent = 0
  for t in range(steps):
    xs = np.asarray(grads[t]["w"], np.float64).reshape(N, -1)
    gains, noise = draws[t]
    silent += int((gains < threshold).sum())
    want = np_channel(xs, gains, noise, snr_db, threshold, one_bit)
    got = np.asarray(ups[t]["w"]).ravel()
    if one_bit:   # signs: equal except where y is within rounding of 0
      assert np.mean(got == want) > 0.999
    else:
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  if threshold > 0:
    assert silent > 0   # truncation silenced someone


def test_high_snr_analog_is_the_mean_and_noise_grows_as_snr_falls():
  params = _params()
  grads = harness.make_grads(2, 1, params=params)
  mesh = parallel.make_mesh(N)
  exact = np.asarray(grads[0]["w"]).mean(0)
  errs = []
  for snr in (60.0, 20.0, 0.0):
    ups, _, _ = harness.device_run(jaxcomm.ota_analog(snr), mesh, grads,
                                   params=params)
    errs.append(float(np.sqrt(np.mean((ups[0]["w"] - exact) ** 2))))
  assert errs[0] < 1e-3 < errs[1] < errs[2]


def test_wire_is_the_compiled_all_reduce():
  params = _params()
  mesh = parallel.make_mesh(N)
  for tx, extra in ((jaxcomm.ota_analog(10.0), 2),
                    (jaxcomm.ota_onebit(10.0), 1)):
    claim = wire.claimed(tx, params, N)
    # The channel's all-reduce, and the 4-byte non-finite flag every
    # compressor's step carries.
    assert sorted(claim) == [("all-reduce", 4),
                             ("all-reduce", 4 * (64 * 48 + extra))]
    hlo = wire.report(harness.lower_update(tx, mesh, params), params=params)
    assert hlo.payload == wire.summarize(claim, n=N).payload


def test_says_it_is_a_simulation():
  for f in (jaxcomm.ota_analog, jaxcomm.ota_onebit):
    assert "simulation" in f.__doc__.lower()


@pytest.mark.parametrize("make,match", [
  (lambda: jaxcomm.ota_analog(float("nan")), "snr_db"),
  (lambda: jaxcomm.ota_analog("10"), "snr_db"),
  (lambda: jaxcomm.ota_onebit(10.0, threshold=-1.0), "threshold"),
  (lambda: jaxcomm.ota_analog(float("-inf")), "snr_db"),
  (lambda: jaxcomm.ota_onebit(float("inf")), "snr_db"),
  (lambda: jaxcomm.ota_onebit(10.0, threshold=float("inf")), "threshold"),
])
def test_bad_arguments_are_named(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_onebit_sends_plus_one_for_a_zero_gradient():
  """``sign(0) = +1`` (documented): all-zero gradients send ``+1`` from
  every device, and at 40 dB the vote of 8 is ``+1`` everywhere."""
  params = _params()
  grads = [{"w": np.zeros((N, 64, 48), np.float32)}]
  mesh = parallel.make_mesh(N)
  ups, _, _ = harness.device_run(jaxcomm.ota_onebit(40.0), mesh, grads,
                                 params=params)
  np.testing.assert_array_equal(ups[0]["w"], np.ones((64, 48)))
  assert "sign(0) = +1" in jaxcomm.ota_onebit.__doc__
  assert "sign(0) = +1" in jaxcomm.registry.get("ota_onebit").summary
