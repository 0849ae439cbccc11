"""IBCD's sampling (Mishchenko, Hanzely, Richtarik 2020): each device's
blocks are a uniform subset, independent of the other devices'."""

import jax
import numpy as np

import jaxcomm
from jaxcomm.transforms.sparsify import _ibcd


def test_subsets_are_uniform_and_independent_across_devices():
  n, m, k, draws = 4, 12, 3, 3000
  hits = np.zeros((n, m))
  both = 0
  for s in range(draws):
    chosen = np.asarray(_ibcd.block_choices(jax.random.PRNGKey(s), n, m, k))
    for i in range(n):
      assert len(set(chosen[i])) == k
      hits[i, chosen[i]] += 1
    both += len(set(chosen[0]) & set(chosen[1]))
  p = k / m
  se = np.sqrt(draws * p * (1 - p))
  assert np.all(np.abs(hits - draws * p) < 5 * se), hits
  # Independent devices share k^2 / m blocks on average (the same key
  # for all would share k; disjoint draws none).
  want = k * k / m
  assert abs(both / draws - want) < 0.1, both / draws


def test_the_plan_keeps_tau_m_blocks_and_gathers_below_two_over_n():
  assert _ibcd.plan(4224, 8, None, 128) == (33, 5, True)
  assert _ibcd.plan(4224, 8, 0.5, 128) == (33, 17, False)
  assert _ibcd.plan(4224, 1, None, 128) == (33, 33, False)


def test_ratio_one_is_the_dense_mean():
  tx = jaxcomm.ibcd(ratio=1.0, block_size=128, axis_name=None)
  g = {"w": jax.numpy.arange(1000.0).reshape(40, 25)}
  u, _ = tx.update(g, tx.init(g), g)
  np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(g["w"]))
