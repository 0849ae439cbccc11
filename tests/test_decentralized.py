"""Decentralized SGD (D-PSGD) on the 8-device CPU mesh: mixing matrices
against their definitions, a numpy replay of Lian et al.'s update, and the
traffic (collective-permutes only, flat in the number of devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel
from jaxcomm import wire
from jaxcomm.collectives import _gossip
from tests import test_local as L

N = 8


def _expected(topology, n, phase):
  """W from the topologies' definitions (independent of _gossip)."""
  w = np.zeros((n, n))
  if topology == "ring":
    for i in range(n):
      for j in (i - 1, i, i + 1):
        w[i, j % n] += 1 / 3
  elif topology == "torus":          # 2 x 4 for n = 8
    r, c = 2, n // 2
    for i in range(n):
      a, b = divmod(i, c)
      for da, db in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
        w[i, ((a + da) % r) * c + (b + db) % c] += 0.2
  elif topology == "hypercube":
    for i in range(n):
      w[i, i] += 0.5
      w[i, i ^ (1 << (phase % 3))] += 0.5
  else:                              # one-peer exponential
    for i in range(n):
      w[i, i] += 0.5
      w[i, (i + (1 << (phase % 3))) % n] += 0.5
  return w


@pytest.mark.parametrize("topology", _gossip.MIXING_TOPOLOGIES)
def test_mixing_matrices_match_their_definitions(mesh, topology):
  """Mixing one-hot vectors on 8 devices gives W's rows; W is the
  definition's, doubly stochastic, and repeated mixing converges to the
  mean."""
  phases = len(_gossip.mixing_phases(topology, N))
  eye = jnp.eye(N, dtype=jnp.float32)
  for ph in range(phases):
    want = _expected(topology, N, ph)
    np.testing.assert_allclose(_gossip.mixing_matrix(topology, N, ph), want)
    assert np.allclose(want.sum(0), 1) and np.allclose(want.sum(1), 1)
    f = jax.jit(jax.shard_map(
      lambda x, ph=ph: _gossip.gossip_mix([x[0]], "data", topology,
                                          jnp.int32(ph))[0][None],
      mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(np.asarray(f(eye)), want, atol=1e-6)
  prod = np.eye(N)
  for k in range(60):
    prod = _expected(topology, N, k) @ prod
  np.testing.assert_allclose(prod, np.full((N, N), 1 / N), atol=1e-3)


@pytest.mark.parametrize("topology", ["ring", "hypercube"])
def test_dpsgd_matches_numpy(topology):
  """x_i <- sum_j W_ij x_j - lr g_i(x_i), W of the step's phase."""
  steps, lr = 5, 0.05
  _, _, s, hist = L._run(jaxcomm.dpsgd(optax.sgd(lr), topology=topology),
                         steps)
  xs = [L._np_params() for _ in range(N)]
  for t, batch in enumerate(L._batches(steps)):
    grads = [L.np_grad(xs[i], xi, yi)
             for i, (xi, yi) in enumerate(L._device_slices(*batch))]
    w = _expected(topology, N, t)
    xs = [{k: sum(w[i, j] * xs[j][k] for j in range(N)) - lr * grads[i][k]
           for k in xs[i]} for i in range(N)]
    want = {k: np.stack([x[k] for x in xs]) for k in xs[0]}
    L._close(hist[t][0], want)
  assert not L._agree(hist[-1][0])
  assert int(np.asarray(s.count)) == steps


def test_traffic_is_collective_permutes_flat_in_devices():
  """No all-reduce or all-gather: per device, one permute of the params
  per neighbour, the same bytes on 2, 4 and 8 devices (from the HLO)."""
  size = sum(int(np.size(x)) for x in jax.tree.leaves(L._params()))
  per_device = []
  for k in (2, 4, 8):
    mesh = jax.make_mesh((k,), ("data",), devices=jax.devices()[:k],
                         axis_types=(jax.sharding.AxisType.Auto,))
    tx = jaxcomm.dpsgd(optax.sgd(0.05), topology="ring")
    dp = parallel.DataParallel(L.loss_fn, tx, mesh, donate=False)
    p, s = dp.init(L._params())
    ops = wire.collectives(dp.lower(p, s, dp.shard_batch(
      L._batches(1, n=k)[0])))
    assert {op.kind for op in ops} == {"collective-permute"}, ops
    assert sorted((o.kind, o.payload) for o in ops) == sorted(
      wire.claimed(tx, L._params(), k))
    per_device.append(wire.summarize(ops, k).total_sent)
  assert per_device[1] == per_device[2] == 2 * 4 * size, per_device


def test_nan_on_one_device_still_mixes():
  batches = L._batches(2)
  x, y = batches[1]
  x = x.copy()
  x[5 * L.B] = np.nan
  batches[1] = (x, y)
  _, p, s, hist = L._run(jaxcomm.dpsgd(optax.sgd(0.05)), 2, batches)
  assert np.asarray(s.skipped).tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
  assert all(np.isfinite(v).all() for v in hist[-1][0].values())
  # Device 5's params at step 2 are its mixed params only.
  prev = hist[0][0]
  w = _expected("ring", N, 1)
  for k in prev:
    np.testing.assert_allclose(hist[1][0][k][5],
                               np.tensordot(w[5], prev[k], axes=1),
                               rtol=1e-5, atol=1e-6)


def test_consensus_distance():
  x = np.zeros((N, 3), np.float32)
  x[2, 1] = 8.0        # mean 1.0 in that column: distance 7
  assert float(parallel.consensus_distance({"a": jnp.asarray(x)})) == 7.0


def test_bad_topology_is_named():
  with pytest.raises(ValueError, match="topology"):
    jaxcomm.dpsgd(optax.sgd(0.1), topology="star")
