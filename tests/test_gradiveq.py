"""GradiVeQ: the refresh step's pieces, and a bucket large enough for
several of them against the numpy reference of the battery entry."""

import jax.numpy as jnp
import numpy as np

import jaxcomm
from jaxcomm.transforms.lowrank import _gradiveq
from tests import entries_powersgd
from tests import harness


def test_pieces_cover_the_slices_once():
  assert _gradiveq.pieces(33, 128) == [(0, 33)]
  for s, d in ((1026, 128), (4096, 256), (129, 128), (7, 4096)):
    got = _gradiveq.pieces(s, d)
    assert 1 <= len(got) <= 4
    assert got[0][0] == 0 and got[-1][1] == s
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_refresh_in_pieces_matches_the_reference(mesh):
  # 160 x 256 = 40960 elements: 2 pieces of 80 slices of 128.
  params = {"w": jnp.zeros((160, 256), jnp.float32)}
  assert len(_gradiveq.pieces(320, 128)) == 2
  tx = jaxcomm.gradiveq(dim=128, rank=8, refresh=2,
                        axis_name=harness.AXIS)
  grads = harness.make_grads(seed=4, steps=4, params=params)
  updates, _, _ = harness.device_run(tx, mesh, grads, params=params)
  _, ref_step = entries_powersgd._gradiveq_ref(128, 8, 2)
  state, res = None, [np.zeros((160, 256))] * harness.N
  for t, g in enumerate(grads):
    xs = [[np.asarray(g["w"][i], np.float64) + res[i]]
          for i in range(harness.N)]
    mean, sent, state = ref_step(xs, state, t, None, harness.N)
    res = [xs[i][0] - sent[i][0] for i in range(harness.N)]
    np.testing.assert_allclose(updates[t]["w"], mean[0], rtol=1e-3,
                               atol=1e-4)


def test_huge_finite_step_leaves_a_finite_orthonormal_basis(mesh):
  """A refresh step at ``|g| ~ 1e30`` (its Gram matrix's squares would
  overflow float32) gives a finite orthonormal basis, and the projected
  steps at ``|g| ~ 1`` that follow match the float64 reference."""
  params = {"w": jnp.zeros((32, 128), jnp.float32)}
  tx = jaxcomm.gradiveq(dim=128, rank=8, refresh=100,
                        axis_name=harness.AXIS,
                        policy=jaxcomm.LeafPolicy(min_size=1))
  grads = harness.make_grads(seed=5, steps=4, params=params)
  grads[0] = {"w": grads[0]["w"] * np.float32(1e30)}
  updates, state, _ = harness.device_run(tx, mesh, grads, params=params)
  ut = np.asarray(state.codec[0], np.float64)
  if ut.ndim == 3:                         # one copy per device
    ut = ut[0]
  assert np.all(np.isfinite(ut))
  np.testing.assert_allclose(ut @ ut.T, np.eye(8), atol=1e-5)
  _, ref_step = entries_powersgd._gradiveq_ref(128, 8, 100)
  ref, res = None, [np.zeros((32, 128))] * harness.N
  for t, g in enumerate(grads):
    xs = [[np.asarray(g["w"][i], np.float64) + res[i]]
          for i in range(harness.N)]
    mean, sent, ref = ref_step(xs, ref, t, None, harness.N)
    res = [xs[i][0] - sent[i][0] for i in range(harness.N)]
    assert np.all(np.isfinite(updates[t]["w"])), t
    scale = 1e30 if t == 0 else 1.0
    np.testing.assert_allclose(updates[t]["w"] / scale, mean[0] / scale,
                               rtol=1e-3, atol=1e-4)
