"""ECQ-SGD's own tests: its quantizer is unbiased and within the variance
bound of its docstring (Wu et al. 2018's uniform stochastic quantizer of
``s`` levels of ``max |v|``), measured over 2000 draws."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm


def test_ecq_quantizer_is_unbiased_within_the_variance_bound():
  levels = 3
  tx = jaxcomm.ecq_sgd(levels=levels, alpha=1.0, beta=1.0, axis_name=None)
  rng = np.random.RandomState(0)
  v = {"w": jnp.asarray(rng.randn(64, 48).astype(np.float32))}
  state = tx.init(v)

  def draw(key):
    # A fresh state (h = 0) with its key replaced: the update is Q(v).
    upd, _ = tx.update(v, state._replace(key=key), v)
    return upd["w"]

  draws = 2000
  keys = jax.random.split(jax.random.PRNGKey(1), draws)
  q = np.asarray(jax.jit(jax.vmap(draw))(keys), np.float64)
  x = np.asarray(v["w"], np.float64)
  scale = np.abs(x).max()
  step = scale / levels
  # Every value is a whole number of steps, the nearest below or above.
  codes = q / step
  np.testing.assert_allclose(codes, np.round(codes), atol=1e-4)
  assert np.all(np.abs(q - x) < step * (1 + 1e-5))
  # Unbiased: each coordinate's mean within 5 standard errors.
  frac = np.abs(x) / step - np.floor(np.abs(x) / step)
  sigma = step * np.sqrt(frac * (1 - frac))
  assert np.all(np.abs(q.mean(axis=0) - x) <= 5 * sigma / np.sqrt(draws)
                + 1e-6)
  # The variance: the exact sum_k step^2 p_k (1 - p_k), within 3%, and
  # the bound d S^2 / (4 s^2).
  err = np.sum((q - x) ** 2, axis=(1, 2)).mean()
  exact = np.sum(sigma ** 2)
  bound = x.size * scale ** 2 / (4 * levels ** 2)
  assert abs(err / exact - 1) < 0.03, (err, exact)
  assert err <= bound, (err, bound)
  # Not vacuous: the bound is within a small factor of what is measured.
  assert bound < 4 * err, (err, bound)
