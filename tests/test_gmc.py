"""GMC's own tests: with every coordinate sent it is heavy-ball momentum
SGD on the mean gradient, and its memory and updates balance the
gradients plus the global momentum re-added each step (Zhao et al. 2019,
Algorithm 1)."""

import numpy as np

import jaxcomm
from tests import harness


def test_gmc_sending_everything_is_heavy_ball_momentum(mesh):
  beta = 0.8
  tx = jaxcomm.gmc(1.0, beta=beta)
  grads = harness.make_grads(seed=2, steps=4)
  updates, state, _ = harness.device_run(tx, mesh, grads)
  d = {k: 0.0 for k in harness.COMPRESSED}
  for t, g in enumerate(grads):
    for k in harness.COMPRESSED:
      d[k] = np.asarray(g[k], np.float64).mean(axis=0) + beta * d[k]
      np.testing.assert_allclose(updates[t][k], d[k], rtol=1e-5, atol=1e-5,
                                 err_msg=f"{k} at step {t}")
  for r in harness.residuals_of(state):
    np.testing.assert_allclose(r, 0.0, atol=1e-5)


def test_gmc_memory_balances_gradients_and_global_momentum(mesh):
  """``sum_i u_i + n sum_t d_t = sum_t sum_i g_i + n beta sum_t d_{t-1}``:
  nothing a device computed is lost, only delayed."""
  beta = 0.9
  tx = jaxcomm.gmc(0.05, beta=beta)
  grads = harness.make_grads(seed=3, steps=5)
  updates, state, _ = harness.device_run(tx, mesh, grads)
  res = harness.residuals_of(state)
  n = harness.N
  for j, k in enumerate(harness.COMPRESSED):
    total_g = sum(np.asarray(g[k], np.float64).sum(axis=0) for g in grads)
    d = [np.asarray(u[k], np.float64) for u in updates]
    pushed = n * beta * sum(d[:-1])
    balance = res[j].astype(np.float64).sum(axis=0) + n * sum(d)
    np.testing.assert_allclose(balance, total_g + pushed,
                               atol=1e-4 * np.abs(total_g).max(),
                               err_msg=k)
    # The memory holds something: top-k at 5% delays most coordinates.
    assert np.abs(res[j]).max() > 0.1
