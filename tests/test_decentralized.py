"""Decentralized SGD (D-PSGD) on the 8-device CPU mesh: mixing matrices
against their definitions, a numpy replay of Lian et al.'s update, and the
traffic (collective-permutes only, flat in the number of devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel
from jaxcomm import wire
from jaxcomm.collectives import _gossip
from tests import linear_model as L
from tests import references

N = 8


@pytest.mark.parametrize("topology", _gossip.MIXING_TOPOLOGIES)
def test_mixing_matrices_match_their_definitions(mesh, topology):
  """Mixing one-hot vectors on 8 devices gives W's rows; W is the
  definition's, doubly stochastic, and repeated mixing converges to the
  mean."""
  phases = len(_gossip.mixing_phases(topology, N))
  eye = jnp.eye(N, dtype=jnp.float32)
  for ph in range(phases):
    want = references.mixing_matrix(topology, N, ph)
    np.testing.assert_allclose(_gossip.mixing_matrix(topology, N, ph), want)
    assert np.allclose(want.sum(0), 1) and np.allclose(want.sum(1), 1)
    f = jax.jit(jax.shard_map(
      lambda x, ph=ph: _gossip.gossip_mix([x[0]], "data", topology,
                                          jnp.int32(ph))[0][None],
      mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(np.asarray(f(eye)), want, atol=1e-6)
  prod = np.eye(N)
  for k in range(60):
    prod = references.mixing_matrix(topology, N, k) @ prod
  np.testing.assert_allclose(prod, np.full((N, N), 1 / N), atol=1e-3)


@pytest.mark.parametrize("topology", ["ring", "hypercube"])
def test_dpsgd_matches_numpy(topology):
  """x_i <- sum_j W_ij x_j - lr g_i(x_i), W of the step's phase."""
  steps, lr = 5, 0.05
  _, _, s, hist = L.run(jaxcomm.dpsgd(optax.sgd(lr), topology=topology),
                         steps)
  xs = [L.np_params() for _ in range(N)]
  for t, batch in enumerate(L.make_batches(steps)):
    grads = [L.np_grad(xs[i], xi, yi)
             for i, (xi, yi) in enumerate(L.device_slices(*batch))]
    w = references.mixing_matrix(topology, N, t)
    xs = [{k: sum(w[i, j] * xs[j][k] for j in range(N)) - lr * grads[i][k]
           for k in xs[i]} for i in range(N)]
    want = {k: np.stack([x[k] for x in xs]) for k in xs[0]}
    L.close(hist[t][0], want)
  assert not L.agree(hist[-1][0])
  assert int(np.asarray(s.count)) == steps


def _permute_bytes(tx, k: int) -> float:
  """Bytes one device sends in ``tx``'s compiled step on ``k`` devices,
  after checking that the HLO holds collective-permutes only, exactly
  those ``tx`` claims."""
  mesh = jax.make_mesh((k,), ("data",), devices=jax.devices()[:k],
                       axis_types=(jax.sharding.AxisType.Auto,))
  dp = parallel.DataParallel(L.loss_fn, tx, mesh, donate=False)
  p, s = dp.init(L.params())
  ops = wire.collectives(dp.lower(p, s, dp.shard_batch(
    L.make_batches(1, n=k)[0])))
  assert {op.kind for op in ops} == {"collective-permute"}, ops
  assert sorted((o.kind, o.payload) for o in ops) == sorted(
    wire.claimed(tx, L.params(), k))
  return wire.summarize(ops, k).total_sent


def test_traffic_is_collective_permutes_flat_in_devices():
  """No all-reduce or all-gather: per device, one permute of the params
  per neighbour, the same bytes on 2, 4 and 8 devices (from the HLO)."""
  size = sum(int(np.size(x)) for x in jax.tree.leaves(L.params()))
  per_device = [_permute_bytes(jaxcomm.dpsgd(optax.sgd(0.05),
                                             topology="ring"), k)
                for k in (2, 4, 8)]
  assert per_device[1] == per_device[2] == 2 * 4 * size, per_device


def test_nan_on_one_device_still_mixes():
  batches = L.make_batches(2)
  x, y = batches[1]
  x = x.copy()
  x[5 * L.B] = np.nan
  batches[1] = (x, y)
  _, p, s, hist = L.run(jaxcomm.dpsgd(optax.sgd(0.05)), 2, batches)
  assert np.asarray(s.skipped).tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
  assert all(np.isfinite(v).all() for v in hist[-1][0].values())
  # Device 5's params at step 2 are its mixed params only.
  prev = hist[0][0]
  w = references.mixing_matrix("ring", N, 1)
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


# ------------------------------------------------------------ CHOCO-SGD ----

def _np_scaled_sign(d):
  return np.where(d >= 0, 1.0, -1.0) * np.mean(np.abs(d))


def np_choco(steps, lr, gamma, compress, topology="ring"):
  """Koloskova et al. 2019 on N devices: x+ = x - lr g; q = C(x+ - xh);
  xh_j += q_j for every j; x = x+ + gamma sum_j W_ij (xh_j - xh_i)
  (the public copies of all devices, not the memory-efficient sum)."""
  w = references.mixing_matrix(topology, N, 0)
  xs = [L.np_params() for _ in range(N)]
  xh = [{k: np.zeros_like(v) for k, v in xs[0].items()} for _ in range(N)]
  out = []
  for x_b, y_b in L.make_batches(steps):
    sl = L.device_slices(x_b, y_b)
    half = []
    for i in range(N):
      g = L.np_grad(xs[i], *sl[i])
      half.append({k: xs[i][k] - lr * g[k] for k in xs[i]})
    for i in range(N):
      for k in half[i]:
        xh[i][k] = xh[i][k] + compress(k, half[i][k] - xh[i][k])
    xs = [{k: half[i][k] + gamma * sum(
      w[i, j] * (xh[j][k] - xh[i][k]) for j in range(N)) for k in half[i]}
      for i in range(N)]
    out.append({k: np.stack([x[k] for x in xs]) for k in xs[0]})
  return out


_ALL = jaxcomm.LeafPolicy(min_size=1)


@pytest.mark.parametrize("name,make,compress", [
  ("topk", lambda: jaxcomm.topk(0.25, policy=_ALL),
   lambda k, d: references.np_topk(d, 0.25)),
  ("ef_signsgd", lambda: jaxcomm.ef_signsgd(policy=_ALL),
   lambda k, d: _np_scaled_sign(d)),
  # w compressed, the bias (rank 1) sent dense: C is the identity on it.
  ("topk, bias dense", lambda: jaxcomm.topk(
    0.1, policy=jaxcomm.LeafPolicy(min_size=1, min_ndim=2)),
   lambda k, d: d if k == "b" else references.np_topk(d, 0.1)),
])
def test_choco_matches_numpy(name, make, compress):
  del name
  steps, lr, gamma = 4, 0.05, 0.4
  tx = jaxcomm.choco(optax.sgd(lr), make(), gamma=gamma, topology="ring")
  _, _, s, hist = L.run(tx, steps)
  want = np_choco(steps, lr, gamma, compress)
  for t in range(steps):
    L.close(hist[t][0], want[t], rtol=1e-4, atol=2e-6)
  assert not L.agree(hist[-1][0])
  assert int(np.asarray(s.count)) == steps


@pytest.mark.parametrize("name,make,compress", [
  ("topk", lambda: jaxcomm.topk(0.25, policy=_ALL),
   lambda k, d: references.np_topk(d, 0.25)),
  ("ef_signsgd", lambda: jaxcomm.ef_signsgd(policy=_ALL),
   lambda k, d: _np_scaled_sign(d)),
])
def test_choco_with_kernels_forced_matches_numpy(name, make, compress,
                                                 monkeypatch):
  """The accelerators' path inside the real 8-device gossip step: with
  JAXCOMM_KERNELS=always the messages' top-k selection and sign packing
  run as Pallas kernels (interpreted on CPU), and CHOCO still follows the
  paper's numpy replay."""
  del name
  monkeypatch.setenv("JAXCOMM_KERNELS", "always")
  calls = []
  real = pl.pallas_call
  monkeypatch.setattr(pl, "pallas_call",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  steps, lr, gamma = 3, 0.05, 0.4
  tx = jaxcomm.choco(optax.sgd(lr), make(), gamma=gamma, topology="ring")
  _, _, _, hist = L.run(tx, steps)
  assert calls, "no Pallas kernel was traced in the gossip step"
  want = np_choco(steps, lr, gamma, compress)
  for t in range(steps):
    L.close(hist[t][0], want[t], rtol=1e-4, atol=2e-6)


def test_choco_public_copies_are_the_sum_of_messages():
  """x_hat_i equals the sum of what device i sent, and s_i the W-weighted
  sum of the public copies (the memory-efficient form keeps only these)."""
  steps = 3
  tx = jaxcomm.choco(optax.sgd(0.05), jaxcomm.topk(0.25, policy=_ALL),
                     gamma=0.4)
  _, _, s, _ = L.run(tx, steps)
  cs = s.compress
  pub = np.asarray(cs.public[0])            # [N, size]: one bucket
  mixed = np.asarray(cs.mixed[0])
  w = references.mixing_matrix("ring", N, 0)
  np.testing.assert_allclose(mixed, w @ pub, rtol=1e-5, atol=1e-6)
  # top-k 25% of w (384) and b (16): each step adds at most 100 entries.
  assert (np.count_nonzero(pub, axis=1) <= steps * 100).all()
  assert (np.count_nonzero(pub, axis=1) > (steps - 1) * 100).all()


@pytest.mark.parametrize("make,ratio", [
  (lambda: jaxcomm.topk(0.1, policy=_ALL), None),
  (lambda: jaxcomm.randomk(0.1, policy=_ALL), None),
  (lambda: jaxcomm.ef_signsgd(policy=_ALL), None),
])
def test_choco_moves_only_messages_flat_in_devices(make, ratio):
  """Collective-permutes only, bytes as claimed, the same per device on
  4 and 8 devices, and fewer than D-PSGD's float32 params."""
  del ratio
  size = sum(int(np.size(x)) for x in jax.tree.leaves(L.params()))
  per_device = [_permute_bytes(jaxcomm.choco(optax.sgd(0.05), make(),
                                             gamma=0.5), k)
                for k in (4, 8)]
  assert per_device[0] == per_device[1] < 2 * 4 * size / 2.5, per_device


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.topk(0.1, policy=_ALL),
  lambda: jaxcomm.randomk(0.1, policy=_ALL),
  lambda: jaxcomm.ef_signsgd(policy=_ALL),
])
def test_gossip_messages_decode_to_what_was_sent(make):
  """decode(message(x)) == the decoded own message, bit for bit, and equal
  to what the codec's all-reduce path sends from the same input."""
  from jaxcomm import _compressor
  spec = _compressor.spec_of(make())
  lay = spec.layouts(L.params())[0]
  x = jnp.asarray(np.random.RandomState(3).randn(lay.size), jnp.float32)
  ctx = _compressor.Context(axis_name=None, num_devices=1,
                            device_index=jnp.int32(0), step=jnp.int32(0),
                            key=jax.random.PRNGKey(7), layout=lay)
  words, sent = spec.codec.message(x, ctx)
  assert words.dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(spec.codec.decode(words, ctx)),
                                np.asarray(sent))
  res = spec.codec.apply(x, (), ctx)
  np.testing.assert_array_equal(np.asarray(res.sent), np.asarray(sent))


def test_choco_nan_on_one_device_still_gossips():
  batches = L.make_batches(2)
  x, y = batches[1]
  x = x.copy()
  x[3 * L.B] = np.nan
  batches[1] = (x, y)
  tx = jaxcomm.choco(optax.sgd(0.05), jaxcomm.topk(0.25, policy=_ALL),
                     gamma=0.4)
  _, _, s, hist = L.run(tx, 2, batches)
  assert np.asarray(s.skipped).tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
  assert all(np.isfinite(v).all() for v in hist[-1][0].values())
  assert all(np.isfinite(np.asarray(b)).all() for b in s.compress.public)


@pytest.mark.parametrize("kwargs,match", [
  (dict(compressor=jaxcomm.powersgd(2)), "gossip message"),
  (dict(compressor=jaxcomm.topk(0.1, value_bits=2)), "gossip message"),
  (dict(compressor=jaxcomm.topk(0.1), topology="hypercube"), "topology"),
  (dict(compressor=jaxcomm.topk(0.1), gamma=1.5), "gamma"),
  (dict(compressor=jaxcomm.topk(0.1), gamma=0.0), "gamma"),
  (dict(compressor=optax.sgd(0.1)), "jaxcomm compressor"),
])
def test_choco_bad_arguments_are_named(kwargs, match):
  kwargs = {"gamma": 0.5, **kwargs}
  with pytest.raises(ValueError, match=match):
    jaxcomm.choco(optax.sgd(0.1), **kwargs)


# ------------------------------------------------------------------ SGP ----

# A directed graph with unequal in-degrees (device 4 hears from 3 and 7;
# device 0 only from 7): column stochastic mixing, not row stochastic.
_DIRECTED = [[1], [2], [3], [4], [5], [6], [7], [0, 4]]


def _np_push_matrix(out_lists, n=N):
  """P[j, i] = 1 / (1 + d_i) for j in out(i) and j = i (the definition)."""
  p = np.zeros((n, n))
  for i, outs in enumerate(out_lists):
    for j in [i] + list(outs):
      p[j, i] = 1.0 / (1 + len(outs))
  return p


def _exponential_out(k, n=N):
  return [[(i + (1 << (k % 3))) % n] for i in range(n)]


@pytest.mark.parametrize("topology", ["exponential", "directed"])
def test_sgp_matches_numpy(topology):
  """x_i = w_i z_i - lr g_i(z_i); (x, w) <- P (x, w); z = x / w."""
  steps, lr = 5, 0.05
  topo = _DIRECTED if topology == "directed" else "exponential"
  _, _, s, hist = L.run(jaxcomm.sgp(optax.sgd(lr), topology=topo), steps)
  zs = [L.np_params() for _ in range(N)]
  ws = np.ones(N)
  for t, batch in enumerate(L.make_batches(steps)):
    grads = [L.np_grad(zs[i], xi, yi)
             for i, (xi, yi) in enumerate(L.device_slices(*batch))]
    p = _np_push_matrix(_DIRECTED if topology == "directed"
                        else _exponential_out(t))
    assert np.allclose(p.sum(0), 1)                     # column stochastic
    xs = [{k: ws[i] * zs[i][k] - lr * grads[i][k] for k in zs[i]}
          for i in range(N)]
    ws_new = p @ ws
    zs = [{k: sum(p[i, j] * xs[j][k] for j in range(N)) / ws_new[i]
           for k in xs[i]} for i in range(N)]
    ws = ws_new
    want = {k: np.stack([z[k] for z in zs]) for k in zs[0]}
    L.close(hist[t][0], want)
    np.testing.assert_allclose(np.asarray(hist[t][1].compress.weight), ws,
                               rtol=1e-6)
  if topology == "directed":
    assert not np.allclose(ws, 1.0)      # the weights do correct something


def test_push_sum_converges_to_the_average_on_a_directed_graph(mesh):
  """Repeated push-sum rounds: x / w tends to the average of the starting
  values; x alone (plain column-stochastic mixing) does not."""
  r = np.random.RandomState(4)
  x0 = r.randn(N, 5).astype(np.float32)
  flat0 = np.concatenate([x0, np.ones((N, 1), np.float32)], axis=1)

  def rounds(flat):
    f = flat[0]
    for t in range(80):
      f = _gossip.push_sum_mix(f, "data", _DIRECTED, jnp.int32(t))
    return f[None]

  out = np.asarray(jax.jit(jax.shard_map(
    rounds, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
      jnp.asarray(flat0)))
  np.testing.assert_allclose(out[:, :5] / out[:, 5:], np.broadcast_to(
    x0.mean(0), (N, 5)), atol=1e-4)
  assert np.abs(out[:, :5] - x0.mean(0)).max() > 0.05
  np.testing.assert_allclose(out.sum(0), flat0.sum(0), rtol=1e-5,
                             atol=1e-5)            # mass conserved


def test_sgp_traffic_is_collective_permutes():
  """Permutes only, as claimed: exponential one per step (flat from 4 to
  8 devices); the directed graph needs two classes (7 sends twice)."""
  size = sum(int(np.size(x)) for x in jax.tree.leaves(L.params())) + 1
  for k, topo, want in ((4, "exponential", 4 * size),
                        (8, "exponential", 4 * size),
                        (8, _DIRECTED, 2 * 4 * size)):
    tx = jaxcomm.sgp(optax.sgd(0.05), topology=topo)
    _permute_bytes(tx, k)
    assert sorted(wire.claimed(tx, L.params(), k, step=0)) == sorted(
      [("collective-permute", 4 * size)] * (want // (4 * size)))


@pytest.mark.parametrize("topology,match", [
  ("ring", "topology"), ([[0]], "other devices"), ([[1], [1, 1]], "once"),
  ("x", "topology"), ([["a"]], "topology"),
])
def test_sgp_bad_topology_is_named(topology, match):
  with pytest.raises(ValueError, match=match):
    jaxcomm.sgp(optax.sgd(0.1), topology=topology)


def test_sgp_graph_of_the_wrong_size_is_named():
  tx = jaxcomm.sgp(optax.sgd(0.1), topology=[[1], [0]])
  with pytest.raises(ValueError, match="2 devices but the axis has 8"):
    L.run(tx, 1)


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.choco(optax.sgd(0.05, momentum=0.9),
                        jaxcomm.topk(0.25, policy=_ALL), gamma=0.4),
  lambda: jaxcomm.sgp(optax.sgd(0.05, momentum=0.9), topology=_DIRECTED),
], ids=["choco", "sgp"])
def test_gossip_memory_restarts_on_resize(make):
  """8 -> 4 devices: params keep their average, the inner momenta are
  averaged in pairs, CHOCO's public copies restart at 0 and push-sum's
  weight at 1 (as at init); 4 devices then train on (exponential graph
  for SGP: the directed one names 8 devices)."""
  tx = make()
  dp, p, s, _ = L.run(tx, 3)
  host_p, host_s, new_p, new_s = L.resize_run(dp, p, s, 4)
  for k in host_p:
    np.testing.assert_allclose(new_p[k].mean(0), host_p[k].mean(0),
                               rtol=1e-6, atol=1e-7)
  mom = jax.tree.leaves(new_s.inner)
  old_mom = jax.tree.leaves(host_s.inner)
  for a, b in zip(mom, old_mom):
    if np.ndim(b) and b.shape[0] == N:
      np.testing.assert_allclose(a, b.reshape((4, 2) + b.shape[1:]).mean(1),
                                 rtol=1e-6)
  cs = new_s.compress
  if isinstance(cs, jaxcomm.ChocoState):
    assert any(np.abs(b).max() > 0 for b in host_s.compress.public)
    for b in cs.public + cs.mixed:
      if b.size:                 # (the empty buffer of no dense leaves)
        assert b.shape[0] == 4 and not np.any(b)
    tx4 = tx
  else:
    assert not np.allclose(host_s.compress.weight, 1.0)
    np.testing.assert_array_equal(cs.weight, np.ones(4, np.float32))
    tx4 = jaxcomm.sgp(optax.sgd(0.05, momentum=0.9))
  dp4, p4, s4 = L.place(tx4, new_p, new_s, 4)
  for t in range(3):
    p4, s4, _ = dp4.step(p4, s4, L.make_batches(3, seed=7, n=4)[t])
    jax.block_until_ready(p4)
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(p4))
