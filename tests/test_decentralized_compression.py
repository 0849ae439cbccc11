"""Decentralized training with compressed gossip on the 8-device CPU mesh:
DCD-PSGD and ECD-PSGD (Tang et al. 2018) and SQuARM-SGD (Singh et al.
2020) against numpy replays of the papers' updates (written from the
papers: explicit replicas / estimates of every device, not the kept sums),
their traffic from the compiled HLO, and their refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import _compressor
from jaxcomm import parallel
from jaxcomm import wire
from tests import linear_model as L
from tests import references

N = 8
_ALL = jaxcomm.LeafPolicy(min_size=1)


def _scaled_sign(d):
  return np.where(d >= 0, 1.0, -1.0) * np.mean(np.abs(d))


_COMPRESSORS = {
  "topk": (lambda: jaxcomm.topk(0.25, policy=_ALL),
           lambda d: references.np_topk(d, 0.25)),
  "ef_signsgd": (lambda: jaxcomm.ef_signsgd(policy=_ALL), _scaled_sign),
}


def _grads(xs, batch):
  return [L.np_grad(xs[i], xi, yi)
          for i, (xi, yi) in enumerate(L.device_slices(*batch))]


def _stack(xs):
  return {k: np.stack([x[k] for x in xs]) for k in xs[0]}


def np_dcd(steps, lr, compress, topology):
  """Tang et al. 2018, Algorithm 1: x_half_i = sum_j W_ij xhat_j - lr g_i;
  q_i = C(x_half_i - x_i); x_i += q_i; every replica xhat_j += q_j."""
  w = references.mixing_matrix(topology, N, 0)
  xs = [L.np_params() for _ in range(N)]
  reps = [L.np_params() for _ in range(N)]     # xhat_j, as neighbours hold
  out = []
  for batch in L.make_batches(steps):
    g = _grads(xs, batch)
    qs = []
    for i in range(N):
      half = {k: sum(w[i, j] * reps[j][k] for j in range(N)) - lr * g[i][k]
              for k in xs[i]}
      qs.append({k: compress(half[k] - xs[i][k]) for k in xs[i]})
    xs = [{k: xs[i][k] + qs[i][k] for k in xs[i]} for i in range(N)]
    reps = [{k: reps[j][k] + qs[j][k] for k in reps[j]} for j in range(N)]
    out.append(_stack(xs))
  return out


def np_ecd(steps, lr, compress, topology):
  """Tang et al. 2018, Algorithm 2 (t = 1, 2, ...; y^1 = x^1):
  x_i^{t+1} = sum_j W_ij y_j^t - lr g_i(x_i^t);
  z_i = (1 - t/2) x_i^t + (t/2) x_i^{t+1};
  y_j^{t+1} = (1 - 2/t) y_j^t + (2/t) C(z_j)."""
  w = references.mixing_matrix(topology, N, 0)
  xs = [L.np_params() for _ in range(N)]
  ys = [L.np_params() for _ in range(N)]
  out = []
  for t, batch in enumerate(L.make_batches(steps), start=1):
    g = _grads(xs, batch)
    new = [{k: sum(w[i, j] * ys[j][k] for j in range(N)) - lr * g[i][k]
            for k in xs[i]} for i in range(N)]
    zs = [{k: (1 - t / 2) * xs[i][k] + (t / 2) * new[i][k] for k in xs[i]}
          for i in range(N)]
    ys = [{k: (1 - 2 / t) * ys[j][k] + (2 / t) * compress(zs[j][k])
           for k in ys[j]} for j in range(N)]
    xs = new
    out.append(_stack(xs))
  return out


@pytest.mark.parametrize("topology", ["ring", "torus"])
@pytest.mark.parametrize("comp", ["topk", "ef_signsgd"])
@pytest.mark.parametrize("method", ["dcd_psgd", "ecd_psgd"])
def test_dcd_ecd_match_numpy(method, comp, topology):
  steps, lr = 4, 0.05
  make, compress = _COMPRESSORS[comp]
  tx = getattr(jaxcomm, method)(optax.sgd(lr), make(), topology=topology)
  _, p, s, hist = L.run(tx, steps)
  replay = np_dcd if method == "dcd_psgd" else np_ecd
  want = replay(steps, lr, compress, topology)
  for t in range(steps):
    L.close(hist[t][0], want[t], rtol=1e-4, atol=1e-5)
  assert not L.agree(hist[-1][0])
  dist = float(parallel.consensus_distance(p))
  assert 0 < dist < 10 and np.isfinite(dist)
  assert int(np.asarray(s.count)) == steps


def test_unbiased_randomk_is_unbiased_and_scaled():
  """unbiased=True: random-k's message times size / k, so the average
  over step keys of the decoded message is the input."""
  from jaxcomm.transforms.gossip import _dcd
  spec = _compressor.spec_of(jaxcomm.randomk(0.25, policy=_ALL))
  lay = spec.layouts(L.params())[0]
  codec = _dcd.UnbiasedRandomk(spec.codec)
  x = jnp.asarray(np.random.RandomState(3).randn(lay.size), jnp.float32)

  def one(key):
    ctx = _compressor.Context(axis_name=None, num_devices=1,
                              device_index=jnp.int32(0), step=jnp.int32(0),
                              key=key, layout=lay)
    words, sent = codec.message(x, ctx)
    return codec.decode(words, ctx), sent, spec.codec.message(x, ctx)[1]

  dec, sent, plain = jax.jit(jax.vmap(one))(
    jax.random.split(jax.random.PRNGKey(0), 2000))
  np.testing.assert_array_equal(np.asarray(dec), np.asarray(sent))
  # b: 16 elements, k = 4 (x4); w: 384, k = 96 (x4).
  np.testing.assert_allclose(np.asarray(sent), 4 * np.asarray(plain),
                             rtol=1e-6)
  # Each coordinate is kept with probability 1/4, times 4: the mean of
  # 2000 draws has a standard deviation of |x| sqrt(3 / 2000).
  err = np.abs(np.asarray(dec).mean(0) - np.asarray(x))
  assert (err <= 5 * np.sqrt(3 / 2000) * np.abs(np.asarray(x))).all()
  assert err.max() > 0                       # each draw is not the input


def np_squarm(steps, lr, beta, gamma, period, c, compress, topology):
  """Singh et al. 2020, Algorithm 1: v = beta v + g; x_half = x - lr (beta
  v + g); at t + 1 = 0 mod H, device i sends q_i = C(x_half_i - xhat_i) if
  ||x_half_i - xhat_i||^2 > c lr^2, else nothing (q_i = 0); xhat_j +=
  q_j; x_i = x_half_i + gamma sum_j W_ij (xhat_j - xhat_i)."""
  w = references.mixing_matrix(topology, N, 0)
  xs = [L.np_params() for _ in range(N)]
  vs = [{k: np.zeros_like(a) for k, a in xs[0].items()} for _ in range(N)]
  xh = [{k: np.zeros_like(a) for k, a in xs[0].items()} for _ in range(N)]
  sends = np.zeros(N, int)
  out = []
  for t, batch in enumerate(L.make_batches(steps)):
    g = _grads(xs, batch)
    vs = [{k: beta * vs[i][k] + g[i][k] for k in g[i]} for i in range(N)]
    half = [{k: xs[i][k] - lr * (beta * vs[i][k] + g[i][k]) for k in g[i]}
            for i in range(N)]
    if (t + 1) % period:
      xs = half
    else:
      for i in range(N):
        dist = sum(np.sum((half[i][k] - xh[i][k]) ** 2) for k in half[i])
        if dist > c * lr ** 2:
          sends[i] += 1
          xh[i] = {k: xh[i][k] + compress(half[i][k] - xh[i][k])
                   for k in half[i]}
      xs = [{k: half[i][k] + gamma * sum(
        w[i, j] * (xh[j][k] - xh[i][k]) for j in range(N)) for k in half[i]}
        for i in range(N)]
    out.append((_stack(xs), sends.copy()))
  return out


@pytest.mark.parametrize("topology,period,c", [
  ("ring", 1, 0.0),      # every step, every device: CHOCO with Nesterov
  ("ring", 2, 1800.0),   # some devices fire at the second sync, some not
  ("torus", 3, 0.0),
])
def test_squarm_matches_numpy(topology, period, c):
  steps, lr, beta, gamma = 6, 0.05, 0.9, 0.4
  tx = jaxcomm.squarm(optax.sgd(lr, momentum=beta, nesterov=True),
                      jaxcomm.topk(0.25, policy=_ALL), gamma=gamma,
                      period=period, threshold=c, learning_rate=lr,
                      topology=topology)
  _, p, s, hist = L.run(tx, steps)
  want = np_squarm(steps, lr, beta, gamma, period, c,
                   lambda d: references.np_topk(d, 0.25), topology)
  for t in range(steps):
    L.close(hist[t][0], want[t][0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hist[t][1].compress.sends),
                                  want[t][1])
  sends = want[-1][1]
  if c:
    assert 0 < sends.sum() < N * steps // period, sends   # some stayed quiet
  else:
    assert (sends == steps // period).all()
  rounds = np.asarray(s.compress.rounds)
  assert (rounds == rounds[0]).all() and rounds[0] <= steps // period
  assert np.isfinite(float(parallel.consensus_distance(p)))


def test_squarm_quiet_when_no_device_fires():
  """A threshold no device passes: no sends, no exchange ran, params are
  the local steps only (each device alone)."""
  tx = jaxcomm.squarm(optax.sgd(0.05), jaxcomm.topk(0.25, policy=_ALL),
                      gamma=0.5, threshold=1e9, learning_rate=0.05)
  _, _, s, hist = L.run(tx, 2)
  assert not np.asarray(s.compress.sends).any()
  assert not np.asarray(s.compress.rounds).any()
  xs = [L.np_params() for _ in range(N)]
  for t, batch in enumerate(L.make_batches(2)):
    g = _grads(xs, batch)
    xs = [{k: xs[i][k] - 0.05 * g[i][k] for k in xs[i]} for i in range(N)]
    L.close(hist[t][0], _stack(xs))


def _lowered(tx, k):
  mesh = jax.make_mesh((k,), ("data",), devices=jax.devices()[:k],
                       axis_types=(jax.sharding.AxisType.Auto,))
  dp = parallel.DataParallel(L.loss_fn, tx, mesh, donate=False)
  p, s = dp.init(L.params())
  return dp.lower(p, s, dp.shard_batch(L.make_batches(1, n=k)[0]))


@pytest.mark.parametrize("method", ["dcd_psgd", "ecd_psgd"])
@pytest.mark.parametrize("make,words", [
  (lambda: jaxcomm.topk(0.1, policy=_ALL), 2 * (39 + 2)),   # values+indices
  (lambda: jaxcomm.randomk(0.1, policy=_ALL), 39 + 2),      # values only
  (lambda: jaxcomm.ef_signsgd(policy=_ALL), 12 + 1 + 2),    # signs, scales
])
def test_dcd_ecd_bytes_from_the_hlo(method, make, words):
  """Collective-permutes only, one per ring neighbour, each the fused
  message the spec claims (the same on 4 and 8 devices), every one run
  unconditionally."""
  for k in (4, 8):
    tx = getattr(jaxcomm, method)(optax.sgd(0.05), make())
    low = _lowered(tx, k)
    ops = wire.collectives(low)
    assert sorted((o.kind, o.payload) for o in ops) == sorted(
      wire.claimed(tx, L.params(), k))
    assert {o.kind for o in ops} == {"collective-permute"}
    assert len(ops) == 2 and len(wire.collectives(
      low, outside_branches=True)) == 2
  claim = wire.claimed(tx, L.params(), 8)
  assert claim[0][1] <= 4 * words, claim


def test_squarm_bytes_and_no_collective_outside_branches():
  """SQuARM's compiled step: a 4-byte all-reduce (did any trigger fire)
  and the permutes, all inside conditional branches (a non-sync or
  untriggered step runs none); the claim per step: nothing off the
  synchronization steps."""
  tx = jaxcomm.squarm(optax.sgd(0.05), jaxcomm.topk(0.1, policy=_ALL),
                      gamma=0.5, period=3, threshold=1.0,
                      learning_rate=0.05)
  low = _lowered(tx, 8)
  ops = wire.collectives(low)
  assert sorted((o.kind, o.payload) for o in ops) == sorted(
    wire.claimed(tx, L.params(), 8))
  assert ("all-reduce", 4) in [(o.kind, o.payload) for o in ops]
  assert wire.collectives(low, outside_branches=True) == []
  assert wire.claimed(tx, L.params(), 8, step=0) == []
  assert wire.claimed(tx, L.params(), 8, step=1) == []
  assert wire.claimed(tx, L.params(), 8, step=2) == wire.claimed(
    tx, L.params(), 8)


@pytest.mark.parametrize("method", ["dcd_psgd", "ecd_psgd"])
def test_dcd_ecd_nan_on_one_device_still_gossips(method):
  batches = L.make_batches(2)
  x, y = batches[1]
  x = x.copy()
  x[3 * L.B] = np.nan
  batches[1] = (x, y)
  tx = getattr(jaxcomm, method)(optax.sgd(0.05),
                                jaxcomm.topk(0.25, policy=_ALL))
  _, _, s, hist = L.run(tx, 2, batches)
  assert np.asarray(s.skipped).tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
  assert all(np.isfinite(v).all() for v in hist[-1][0].values())
  assert all(np.isfinite(np.asarray(b)).all() for b in s.compress.pull)


_TOPK = jaxcomm.topk(0.1)


@pytest.mark.parametrize("kwargs,match", [
  (dict(compressor=jaxcomm.powersgd(2)), "gossip message"),
  (dict(compressor=optax.sgd(0.1)), "jaxcomm compressor"),
  (dict(compressor=_TOPK, topology="hypercube"), "topology"),
  (dict(compressor=_TOPK, unbiased=True), "unbiased"),
  (dict(compressor=_TOPK, unbiased="yes"), "unbiased"),
  (dict(compressor=_TOPK, seed=-1), "seed"),
  (dict(compressor=_TOPK, axis_name=3), "axis_name"),
])
@pytest.mark.parametrize("method", ["dcd_psgd", "ecd_psgd"])
def test_dcd_ecd_bad_arguments_are_named(method, kwargs, match):
  with pytest.raises(ValueError, match=match):
    getattr(jaxcomm, method)(optax.sgd(0.1), **kwargs)
  with pytest.raises(ValueError, match="inner"):
    getattr(jaxcomm, method)("sgd", _TOPK)


@pytest.mark.parametrize("kwargs,match", [
  (dict(compressor=jaxcomm.powersgd(2)), "gossip message"),
  (dict(gamma=0.0), "gamma"),
  (dict(gamma=1.5), "gamma"),
  (dict(period=0), "period"),
  (dict(period=1.5), "period"),
  (dict(threshold=-1.0), "threshold"),
  (dict(threshold=1.0), "learning_rate"),
  (dict(threshold=1.0, learning_rate=0.0), "learning_rate"),
  (dict(topology="exponential"), "topology"),
])
def test_squarm_bad_arguments_are_named(kwargs, match):
  kwargs = {"compressor": _TOPK, "gamma": 0.5, **kwargs}
  with pytest.raises(ValueError, match=match):
    jaxcomm.squarm(optax.sgd(0.1), **kwargs)


def test_registered_as_gossip_methods():
  for name in ("dcd_psgd", "ecd_psgd", "squarm"):
    m = jaxcomm.registry.get(name)
    assert m.family == "local" and m.gossip, name


@pytest.mark.parametrize("method", ["dcd_psgd", "ecd_psgd"])
def test_no_compressor_is_dpsgd(method):
  """compressor=None sends every value (C the identity): both are D-PSGD,
  x_i <- sum_j W_ij x_j - lr g_i(x_i) (ECD's estimates are then exact)."""
  steps, lr = 3, 0.05
  _, _, _, hist = L.run(getattr(jaxcomm, method)(optax.sgd(lr)), steps)
  w = references.mixing_matrix("ring", N, 0)
  xs = [L.np_params() for _ in range(N)]
  for t, batch in enumerate(L.make_batches(steps)):
    g = _grads(xs, batch)
    xs = [{k: sum(w[i, j] * xs[j][k] for j in range(N)) - lr * g[i][k]
           for k in xs[i]} for i in range(N)]
    L.close(hist[t][0], _stack(xs), rtol=1e-4, atol=1e-5)
