"""Lazy aggregation (``jaxcomm.lag``): who sends, what the skipped steps
move, the skip rate over a run."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm import wire
from tests import harness


def _run(mesh, grads_seq, zeta=1.0):
  tx = jaxcomm.lag(zeta, axis_name="data")
  updates, state, _ = harness.device_run(tx, mesh, grads_seq)
  return updates, jaxcomm.compress_states(state)[0].codec[0]


def test_constant_gradients_are_sent_once(mesh):
  """Every device's gradient is the same at every step: after the first
  step nobody sends (``senders`` 0), and the update stays the exact mean
  from the state."""
  g = harness.make_grads(1, 1)[0]
  updates, codec = _run(mesh, [g] * 4)
  mean = {k: np.asarray(v, np.float64).mean(axis=0) for k, v in g.items()}
  for u in updates:
    for k in mean:
      np.testing.assert_allclose(np.asarray(u[k]), mean[k], rtol=1e-5,
                                 atol=1e-6)
  assert int(np.asarray(codec.senders).reshape(-1)[0]) == 0
  np.testing.assert_array_equal(np.asarray(codec.sent_steps), 1)


def test_only_the_devices_whose_gradient_moved_send(mesh):
  """Devices 0-3 keep one gradient, devices 4-7 get a new one each step
  whose change since the last is twice the change since the previous
  step (so ``||g - h||^2 > ||g - y||^2``): 4 senders a step, the others
  reused; the counts give the skip rate, 1 - 4/8."""
  rng = np.random.default_rng(0)
  base = harness.make_grads(2, 1)[0]
  seq = []
  drift = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in
           base.items()}
  for t in range(5):
    g = {}
    for k, v in base.items():
      v = np.array(v, np.float32)
      # Devices 4-7 move along a fixed direction: h_i (sent at the last
      # step) and y_i (the last gradient) coincide, and then the moved
      # part grows quadratically in t, so the trigger keeps firing.
      v[4:] = v[4:] + (t * t) * drift[k][4:]
      g[k] = jnp.asarray(v)
    seq.append(g)
  updates, codec = _run(mesh, seq, zeta=0.5)
  assert int(np.asarray(codec.senders).reshape(-1)[0]) == 4
  np.testing.assert_array_equal(np.asarray(codec.sent_steps),
                                [1, 1, 1, 1, 5, 5, 5, 5])
  last = {k: np.asarray(v, np.float64).mean(axis=0) for k, v in seq[-1].items()}
  for k in ("conv", "w"):
    np.testing.assert_allclose(np.asarray(updates[-1][k]), last[k],
                               rtol=1e-5, atol=1e-5)


def test_the_full_exchange_sits_behind_a_condition(mesh):
  """Outside conditional branches the compiled step holds only the 4-byte
  count of senders (and the fused dense psum); the bucket's all-reduce is
  inside the branch that runs when some device sends."""
  tx = jaxcomm.lag(1.0, axis_name="data")
  params = harness.battery_params()
  lowered = harness.lower_update(tx, mesh)
  always = wire.collectives(lowered, outside_branches=True)
  every = wire.collectives(lowered)
  size = sum(int(np.prod(params[k].shape)) for k in harness.COMPRESSED)
  assert not any(op.payload == 4 * size for op in always)
  assert any(op.payload == 4 * size for op in every)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="zeta"):
    jaxcomm.lag(-0.5)
  with pytest.raises(ValueError, match="error_feedback"):
    jaxcomm.lag(1.0, error_feedback=False)


@pytest.mark.parametrize("bad", ["nan_on_one", "huge_everywhere"])
def test_a_skipped_first_step_does_not_stop_the_first_send(mesh, bad):
  """Step 0 is non-finite (a NaN on device 3, or 1e38 everywhere: the
  device sum overflows) and skipped; the first *taken* step must send
  whole, as the first step does in the paper's reference. Before, the
  rule read the step counter (which counts the skipped step): the trigger
  then compared ``|g|^2`` with itself and no leaf ever moved again. The
  run after the skip equals the numpy reference started at that step."""
  from tests import entries_lazy
  seq = harness.make_grads(5, 4)
  bad_g = {k: np.array(v, np.float32) for k, v in seq[0].items()}
  for k in bad_g:
    if bad == "nan_on_one":
      bad_g[k][3] = np.nan
    else:
      bad_g[k][:] = 1e38
  bad_g = {k: jnp.asarray(v) for k, v in bad_g.items()}
  # zeta >= 1: at a first step the trigger compares |g|^2 with zeta |g|^2
  # and cannot fire by itself.
  zeta = 2.0
  updates, codec = _run(mesh, [bad_g] + seq, zeta=zeta)
  assert not np.all(np.isfinite(np.asarray(updates[0]["w"])))
  ref, _, _ = entries_lazy._lag_run(zeta)(
      [{k: np.asarray(v) for k, v in g.items()} for g in seq], harness.N)
  for u, r in zip(updates[1:], ref):
    for k in ("conv", "w", "b"):
      np.testing.assert_allclose(np.asarray(u[k]), r[k], rtol=1e-5,
                                 atol=1e-5)
  # The first taken step sent on every device.
  assert np.all(np.asarray(codec.sent_steps) >= 1)
