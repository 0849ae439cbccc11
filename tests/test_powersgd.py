"""PowerSGD's own properties (the shared battery runs its registry entries).

The user's example verbatim through DataParallel and pmap on 8 devices;
warm start as power iteration (Eckart-Young); two all-reduces of
``sum (n + m) r`` floats in the compiled HLO, on 2/4/8 devices; the leaf
rule and its one-time warning; zero and non-finite gradients; the dense
phase; the orthogonalizations; convergence on a low-rank regression.
"""

import subprocess
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import optimize

import jaxcomm
from jaxcomm import parallel
from jaxcomm.collectives import _lowrank
from jaxcomm.transforms.lowrank import _atomo
from jaxcomm.transforms.lowrank import _powersgd
from tests import entries_powersgd
from tests import harness
from tests import procs

N = 8


def _codec_state(opt_state):
  for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, jaxcomm.CompressState)):
    if isinstance(s, jaxcomm.CompressState):
      return s
  raise AssertionError("no CompressState")


def _per_leaf(tx, buffers, params):
  """A state's per-bucket residual buffers as one array per compressed
  leaf (tree order)."""
  return jaxcomm._compressor.spec_of(tx).leaves_of(buffers, params)


# ------------------------------------------------------------ the example --

RNG = np.random.RandomState(0)
W1 = (RNG.randn(32, 24) @ np.diag(0.5 ** np.arange(24))).astype(np.float32)


def _mlp_params():
  return {"w1": np.zeros((32, 24), np.float32),
          "b1": np.zeros((24,), np.float32),
          "w2": (np.eye(24, 16) * 0.5).astype(np.float32)}


def _mlp_loss(p, batch):
  x, y = batch
  h = x @ p["w1"] + p["b1"]
  return jnp.mean(jnp.sum((h @ p["w2"] - y) ** 2, axis=-1))


def _mlp_batch(t, size=64):
  r = np.random.RandomState(1000 + t)
  x = r.randn(size, 32).astype(np.float32)
  return x, (x @ W1 @ (np.eye(24, 16) * 0.5)).astype(np.float32)


def test_user_example_data_parallel_8_devices(mesh):
  ps = jaxcomm.powersgd(rank=4)
  tx = optax.chain(ps, optax.sgd(0.1))
  dp = parallel.DataParallel(_mlp_loss, tx, mesh)
  params, state = dp.init(_mlp_params())
  st = _codec_state(dp.layout)
  # Q is replicated, the residuals and the local error statistic per device.
  assert len(st.codec) == 1                   # one bucket
  assert not any(jax.tree.leaves(st.codec[0].q))
  assert all(st.residual) and st.codec[0].approx_error
  losses = []
  for t in range(12):
    params, state, m = dp.step(params, state, _mlp_batch(t))
    losses.append(float(m["loss"]))
  assert np.mean(losses[-3:]) < 0.8 * losses[0], losses
  cs = _codec_state(state)
  # w1 (32x24): (32+24)*4*2 < 768: compressed; w2 (24x16): 320 < 384: too;
  # b1 is 1-D: dense.
  res = _per_leaf(ps, cs.residual, _mlp_params())
  assert [r.shape for r in res] == [(N, 32, 24), (N, 24, 16)]
  want = (32 * 24 + 24 * 16) / ((32 + 24 + 24 + 16) * 4)
  np.testing.assert_allclose(np.asarray(cs.codec[0].compression_ratio),
                             want, rtol=1e-6)
  err = np.asarray(cs.codec[0].approx_error)
  assert err.shape == (N,) and np.all((err >= 0) & (err <= 1))


def test_user_example_pmap(mesh):
  del mesh
  tx = optax.chain(jaxcomm.powersgd(rank=4), optax.sgd(0.1))
  step = parallel.pmap_train_step(_mlp_loss, tx)
  n = jax.local_device_count()
  params = parallel.pmap_replicate(jax.tree.map(jnp.asarray, _mlp_params()))
  state = parallel.pmap_replicate(tx.init(_mlp_params()))
  losses = []
  for t in range(6):
    x, y = _mlp_batch(t)
    params, state, m = step(params, state, (x.reshape(n, -1, 32),
                                            y.reshape(n, -1, 16)))
    losses.append(float(m["loss"][0]))
  assert losses[-1] < losses[0]
  for leaf in jax.tree.leaves(params):     # params stay identical
    np.testing.assert_array_equal(leaf[0], leaf[-1])
  q = _codec_state(state).codec[0].q
  for leaf in q:                           # and so does Q
    np.testing.assert_array_equal(leaf[0], leaf[-1])


def test_inject_hyperparams_learning_rate_in_data_parallel(mesh):
  sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  tx = optax.chain(jaxcomm.powersgd(rank=4), sgd)
  dp = parallel.DataParallel(_mlp_loss, tx, mesh)
  params, state = dp.init(_mlp_params())
  params, state, _ = dp.step(params, state, _mlp_batch(0))
  state[1].hyperparams["learning_rate"] = jnp.asarray(0.0)
  before = jax.device_get(params)
  params, state, _ = dp.step(params, state, _mlp_batch(1))
  chex.assert_trees_all_equal(jax.device_get(params), before)


# ---------------------------------------------------------- power iteration --

def _spectrum_matrix(n=40, m=30, decay=0.6, seed=0):
  r = np.random.RandomState(seed)
  u, _ = np.linalg.qr(r.randn(n, m))
  v, _ = np.linalg.qr(r.randn(m, m))
  s = decay ** np.arange(m)
  return (u * s) @ v.T, s


@pytest.mark.parametrize("rank", [1, 3])
def test_warm_start_converges_to_eckart_young_error(rank):
  """Same matrix, no EF, one device: the error tends to the SVD optimum."""
  mat, s = _spectrum_matrix()
  best = np.sqrt(np.sum(s[rank:] ** 2) / np.sum(s ** 2))
  g = {"w": jnp.asarray(mat, jnp.float32)}

  def errors(warm):
    tx = jaxcomm.powersgd(rank=rank, axis_name=None, error_feedback=False,
                          warm_start=warm)
    state = tx.init(g)
    update = jax.jit(tx.update)
    out = []
    for _ in range(25):
      upd, state = update(g, state)
      out.append(float(_codec_state(state).codec[0].approx_error))
    # The update is the projection P P^T M with its error as reported.
    approx = np.asarray(upd["w"], np.float64)
    np.testing.assert_allclose(np.linalg.norm(mat - approx)
                               / np.linalg.norm(mat), out[-1], rtol=1e-4)
    return out

  warm = errors(True)
  assert warm[0] > best * 1.001
  np.testing.assert_allclose(warm[-1], best, rtol=1e-4)
  assert all(a >= best * (1 - 1e-5) for a in warm)   # never beats the SVD
  cold = errors(False)
  assert min(cold) > best * 1.01   # a fresh Q each step stays short of it


# --------------------------------------------------------------- the wire --

def _sub_mesh(k):
  return jax.make_mesh((k,), ("data",), devices=jax.devices()[:k],
                       axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("k", [2, 4, 8])
def test_two_allreduces_of_n_plus_m_times_r(k):
  rank = 3
  tx = jaxcomm.powersgd(rank=rank)
  params = harness.battery_params()
  mesh = _sub_mesh(k)
  ops = jaxcomm.wire.collectives(_lower(tx, params, mesh, k))
  shapes = [(72, 16), (64, 48)]               # conv (3,3,8,16), w (64,48)
  p_bytes = sum(n * rank * 4 for n, _ in shapes)
  q_bytes = sum(m * rank * 4 for _, m in shapes)
  dense = (48 + 1) * 4                        # bias + non-finite flag
  assert all(o.kind == "all-reduce" for o in ops), ops
  # Exactly one all-reduce for all P's and one for all Q's; XLA may merge
  # the (independent) fused dense psum into either, never P with Q.
  pays = sorted(o.payload for o in ops)
  assert pays in (sorted([p_bytes, q_bytes, dense]),
                  sorted([p_bytes + dense, q_bytes]),
                  sorted([p_bytes, q_bytes + dense])), (pays, p_bytes,
                                                        q_bytes, dense)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, k), n=k,
                                 params=params)
  rep = jaxcomm.wire.summarize(ops, params=params)
  assert rep.payload == claim.payload
  dense_all = 4 * (64 * 48 + 3 * 3 * 8 * 16 + 48)
  np.testing.assert_allclose(
    rep.ratio, dense_all / (p_bytes + q_bytes + dense), rtol=1e-9)


def _lower(tx, params, mesh, k):
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  layout = parallel.state_layout(tx, params, mesh)
  specs = parallel.state_specs(layout)
  state = parallel.init_state(tx, params, mesh, layout=layout)

  def step(p, s, g):
    g = jax.tree.map(lambda x, q: x[0] if jnp.issubdtype(
      x.dtype, jnp.floating) else q, g, p)
    u, s2 = tx.update(g, parallel.to_local(s, layout), p)
    return u, parallel.to_global(s2, layout)

  fn = jax.jit(jax.shard_map(step, mesh=mesh,
                             in_specs=(P(), specs, P("data")),
                             out_specs=(P(), specs)))
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((k,) + x.shape,
                                                      x.dtype), params)
  return fn.lower(params, state, grads)


def test_same_shapes_are_batched_and_match_numpy_per_leaf(mesh):
  """Same matrix shapes are one (G, n, m) batch of the flat bucket, even
  apart in tree order or from different leaf shapes; every leaf still gets
  its own Q (keyed by its tree index) and its own projection, as the numpy
  reference computes leaf by leaf. ``batch_same_shape`` changes nothing."""
  params = {"a": jnp.zeros((64, 48)), "bias": jnp.zeros((48,)),
            "c": jnp.zeros((3, 3, 8, 16)), "d": jnp.zeros((72, 16)),
            "e": jnp.zeros((64, 48))}
  comp = ["a", "c", "d", "e"]                 # compressed, tree order
  rank = 3
  grads = harness.make_grads(12, 3, params=params)
  out = {}
  for batch in (True, False):
    tx = jaxcomm.powersgd(rank=rank, batch_same_shape=batch)
    upd, state, _ = harness.device_run(tx, mesh, grads, params=params)
    cs = _codec_state(state)
    out[batch] = (upd, _per_leaf(tx, cs.residual, params))
    # Batches: (64,48) from a and e; (72,16) from c (3,3,8,16) and d.
    assert [x.shape for x in cs.codec[0].q] == [(2, 48, rank),
                                                (2, 16, rank)]
    claim = jaxcomm.wire.claimed(tx, params, N)
    assert sum(b for _, b in claim) == 4 * (rank * (2 * 64 + 2 * 48 + 2 * 72
                                                    + 2 * 16) + 48 + 1)
  chex.assert_trees_all_equal(out[True], out[False])
  ref_init, ref_step = entries_powersgd._ref(rank)  # pylint: disable=protected-access
  shapes = [tuple(params[k].shape) for k in comp]
  ref_state = ref_init(shapes)
  res = [[np.zeros(sh) for sh in shapes] for _ in range(N)]
  key = jax.random.PRNGKey(0)
  upd, res_dev = out[True]
  for t, g in enumerate(grads):
    key, sub = jax.random.split(key)
    xs = [[r + np.asarray(g[k][i], np.float64) for r, k in zip(res[i], comp)]
          for i in range(N)]
    mean, sent, ref_state = ref_step(xs, ref_state, t, sub, N)
    res = [[x - y for x, y in zip(xs[i], sent[i])] for i in range(N)]
    for k, m in zip(comp, mean):
      np.testing.assert_allclose(upd[t][k], m, rtol=1e-3, atol=1e-4,
                                 err_msg=f"{k} step {t}")
  for j in range(len(comp)):
    np.testing.assert_allclose(res_dev[j], np.stack([r[j] for r in res]),
                               rtol=1e-3, atol=1e-4, err_msg=comp[j])


# ---------------------------------------------------------- the leaf rule --

def test_leaf_rule_and_reshape():
  tx = jaxcomm.powersgd(rank=4)
  params = {"conv": jnp.zeros((3, 3, 8, 16)), "w": jnp.zeros((64, 48)),
            "b": jnp.zeros((48,)), "small": jnp.zeros((16, 16)),
            "i": jnp.zeros((64, 48), jnp.int32)}
  paths = jaxcomm._compressor.spec_of(tx).paths(params)
  got = dict(zip(sorted(params), paths))
  assert got == {"b": "dense", "conv": "compress", "i": "skip",
                 "small": "dense", "w": "compress"}
  assert _powersgd.matrix_shape((3, 3, 8, 16)) == (72, 16)
  assert _powersgd.matrix_shape((5, 7)) == (5, 7)
  # (n + m) r rate < n m decides: (16+16)*4*2 = 256 == 256 is not below.
  loose = jaxcomm.powersgd(rank=4, min_compression_rate=1.9)
  assert jaxcomm._compressor.spec_of(loose).paths(
    {"small": jnp.zeros((16, 16))}) == ["compress"]


def test_rank_above_min_dim_falls_back_to_dense_and_warns_once():
  tx = jaxcomm.powersgd(rank=8, axis_name=None, min_compression_rate=0.0)
  params = {"thin": jnp.ones((4, 100)), "w": jnp.ones((64, 48))}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(3):
      upd, state = update(params, state)
      jax.block_until_ready(upd)
  msgs = [str(w.message) for w in caught if "powersgd" in str(w.message)]
  assert len(msgs) == 1 and "(4, 100)" in msgs[0], msgs
  np.testing.assert_array_equal(upd["thin"], params["thin"])  # dense mean
  res = _per_leaf(tx, _codec_state(state).residual, params)
  assert [r.shape for r in res] == [(64, 48)]                  # only w


# ------------------------------------------------------------- bad input --

@pytest.mark.parametrize("method", list(_lowrank.ORTHOGONALIZATIONS))
def test_zero_gradients_give_no_nan_and_keep_q(method):
  tx = jaxcomm.powersgd(rank=2, axis_name=None, orthogonalization=method)
  params = {"w": jnp.zeros((64, 48))}
  state = tx.init(params)
  q0 = _codec_state(state).codec[0].q
  update = jax.jit(tx.update)
  upd, state = update(params, state)
  cs = _codec_state(state)
  assert np.all(np.asarray(upd["w"]) == 0)
  assert np.all(np.asarray(cs.residual[0]) == 0)
  chex.assert_trees_all_equal(cs.codec[0].q, q0)
  assert float(cs.codec[0].approx_error) == 0.0
  # And a real gradient afterwards is compressed normally.
  mat, _ = _spectrum_matrix(64, 48)
  upd, state = update({"w": jnp.asarray(mat, jnp.float32)}, state)
  assert np.all(np.isfinite(np.asarray(upd["w"])))
  assert 0 < float(_codec_state(state).codec[0].approx_error) < 1


def test_nonfinite_gradient_leaves_residual_and_q_unchanged():
  tx = jaxcomm.powersgd(rank=2, axis_name=None)
  mat, _ = _spectrum_matrix(64, 48)
  g = {"w": jnp.asarray(mat, jnp.float32)}
  update = jax.jit(tx.update)
  _, s1 = update(g, tx.init(g))
  for bad in (np.nan, np.inf):
    gb = {"w": g["w"].at[3, 4].set(bad)}
    upd, s2 = update(gb, s1)
    assert np.all(np.isnan(np.asarray(upd["w"])))
    c1, c2 = _codec_state(s1), _codec_state(s2)
    chex.assert_trees_all_equal((c1.residual, c1.codec),
                                (c2.residual, c2.codec))
    assert int(c2.stats.nonfinite_steps) == 1


@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_huge_and_tiny_gradients_scale_the_steps_exactly(mesh, scale):
  """Finite gradients far from 1 (1e20 on every device, whose warm-started
  Q times M would overflow float32, or 1e-25, whose squares flush to zero):
  PowerSGD is positively homogeneous, so every update, residual and
  approximation error is the unit-scale one times ``scale`` (errors: the
  same), finite, and no step is skipped."""
  params = {k: v for k, v in harness.battery_params().items() if k != "step"}
  grads = harness.make_grads(13, 3, params=params)
  big = [jax.tree.map(lambda x: (x * np.float32(scale)).astype(np.float32),
                      g) for g in grads]
  out = {}
  for name, seq in (("unit", grads), ("scaled", big)):
    tx = jaxcomm.powersgd(rank=4)
    upd, state, _ = harness.device_run(tx, mesh, seq, params=params)
    cs = _codec_state(state)
    assert int(np.asarray(cs.stats.nonfinite_steps).max()) == 0, name
    out[name] = (upd, _per_leaf(tx, cs.residual, params),
                 np.asarray(cs.codec[0].approx_error))
  for t in range(len(grads)):
    for k in ("w", "conv", "b"):
      got = np.asarray(out["scaled"][0][t][k], np.float64)
      assert np.all(np.isfinite(got)), (t, k)
      np.testing.assert_allclose(got / scale, out["unit"][0][t][k],
                                 rtol=1e-3, atol=1e-4, err_msg=f"{k} {t}")
  for got, want in zip(out["scaled"][1], out["unit"][1]):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got / scale, want, rtol=1e-3, atol=1e-4)
  err = out["scaled"][2]
  assert np.all(np.isfinite(err)) and np.all(err > 0)
  np.testing.assert_allclose(err, out["unit"][2], rtol=1e-3)


@pytest.mark.parametrize("scale", [0.0, 1e-44, 1e-30, 1e-12, 1.0, 1e18,
                                   1e30, 3e38])
def test_sum_of_squares_is_scale_safe(scale):
  """The approximation error's ``|x|^2`` as ``(s, |x / s|^2)``: finite and
  exact to float32 rounding for finite ``x`` of any magnitude."""
  r = np.random.RandomState(7)
  x = (r.uniform(-1, 1, 100_000) * scale).astype(np.float32)
  s, tot = jax.jit(_powersgd._sum_sq)(jnp.asarray(x))  # pylint: disable=protected-access
  s, tot = float(s), float(tot)
  assert np.isfinite(tot) and s > 0 and np.log2(s) == int(np.log2(s))
  want = np.sum(np.square(x.astype(np.float64) / s))
  if scale < 1e-38:        # subnormal inputs may flush to zero on CPU
    assert 0.0 <= tot <= want * (1 + 1e-5) + 1e-30
  else:
    np.testing.assert_allclose(tot, want, rtol=1e-4)


@pytest.mark.parametrize("rank", [1, 2])
def test_eps_is_added_to_the_norms_of_the_unscaled_p(rank):
  """Q's columns are scaled by powers of two before ``M Q``; the Gram-Schmidt
  (and rank-1) ``eps`` is scaled alike, so it still adds to the column norms
  of ``P = M Q`` itself, as in PyTorch. Numpy reference, 3 warm steps (Q
  grows with M), no error feedback, eps large enough to matter."""
  eps = 2.0
  r = np.random.RandomState(6)
  mats = [r.randn(64, 48) * 4 for _ in range(3)]
  tx = jaxcomm.powersgd(rank=rank, axis_name=None, error_feedback=False,
                        orthogonalization="gram_schmidt",
                        orthogonalization_epsilon=eps)
  state = tx.init({"w": jnp.zeros((64, 48))})
  update = jax.jit(tx.update)
  q = entries_powersgd._draw(jax.random.PRNGKey(0), 0, 48, rank)  # pylint: disable=protected-access
  for t, mat in enumerate(mats):
    upd, state = update({"w": jnp.asarray(mat, jnp.float32)}, state)
    p = mat @ q
    cols = []
    for k in range(rank):          # modified Gram-Schmidt, eps on the norm
      v = p[:, k]
      for c in cols:
        v = v - (c @ v) * c
      cols.append(v / (np.linalg.norm(v) + eps))
    p = np.stack(cols, axis=1)
    q = mat.T @ p
    np.testing.assert_allclose(upd["w"], p @ q.T, rtol=1e-4, atol=1e-4,
                               err_msg=f"step {t}")
  np.testing.assert_allclose(_codec_state(state).codec[0].q[0][0], q,
                             rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------- dense phase --

def test_start_step_is_dense_then_compressed(mesh):
  ps = jaxcomm.powersgd(rank=2, start_step=2)
  tx = optax.chain(ps, optax.sgd(1.0))
  params = {k: v for k, v in harness.battery_params().items() if k != "step"}
  grads = harness.make_grads(7, 3, params=params)
  upd, state, _ = harness.device_run(tx, mesh, grads[:2], params=params)
  for t in range(2):   # exact means, nothing left behind, Q untouched
    for k in ("w", "conv"):
      np.testing.assert_allclose(-upd[t][k], grads[t][k].mean(0), rtol=1e-5,
                                 atol=1e-6)
  cs = _codec_state(state)
  assert all(np.all(r == 0) for r in cs.residual)
  chex.assert_trees_all_equal(
    cs.codec[0].q, jax.device_get(_codec_state(tx.init(params)).codec[0].q))
  assert float(cs.codec[0].compression_ratio) == 1.0
  upd, state, _ = harness.device_run(tx, mesh, grads[2:], params=params,
                                     state=state)
  cs = _codec_state(state)
  assert float(cs.codec[0].compression_ratio) > 1.0
  res = _per_leaf(ps, cs.residual, params)
  assert len(res) == 2 and all(np.abs(r).max() > 0 for r in res)


# ------------------------------------------------------ orthogonalization --

@pytest.mark.parametrize("method", list(_lowrank.ORTHOGONALIZATIONS))
def test_orthogonalizations_agree_with_numpy_reference(method):
  """One device, several steps with EF: numpy PowerSGD (numpy QR)."""
  rank = 3
  tx = jaxcomm.powersgd(rank=rank, axis_name=None, orthogonalization=method,
                        seed=5)
  shape = (3, 3, 8, 16)
  r = np.random.RandomState(2)
  gs = [r.randn(*shape).astype(np.float32) for _ in range(3)]
  state = tx.init({"c": jnp.zeros(shape)})
  update = jax.jit(tx.update)
  ref_init, ref_step = entries_powersgd._ref(rank, seed=5)  # pylint: disable=protected-access
  ref_state = ref_init([shape])
  res = np.zeros(shape)
  key = jax.random.PRNGKey(5)
  for t, g in enumerate(gs):
    upd, state = update({"c": jnp.asarray(g)}, state)
    key, sub = jax.random.split(key)
    x = res + g
    mean, sent, ref_state = ref_step([[x]], ref_state, t, sub, 1)
    res = x - sent[0][0]
    np.testing.assert_allclose(upd["c"], mean[0], rtol=1e-3, atol=1e-4)
  got = _per_leaf(tx, _codec_state(state).residual, {"c": jnp.zeros(shape)})
  np.testing.assert_allclose(got[0], res, rtol=1e-3, atol=1e-4)


def test_orthogonalizations_on_hard_blocks():
  r = np.random.RandomState(3)
  p = jnp.asarray(r.randn(2, 50, 4), jnp.float32)
  q64 = np.linalg.qr(np.asarray(p, np.float64))[0]
  want = np.einsum("bnk,bmk->bnm", q64, q64)
  for method in _lowrank.ORTHOGONALIZATIONS:
    f = _lowrank.orthogonalizer(method, 4)
    q = np.asarray(jax.jit(f)(p, 0.0), np.float64)
    np.testing.assert_allclose(np.einsum("bnk,bmk->bnm", q, q), want,
                               atol=1e-5, err_msg=method)
    # Rank-deficient (one zero column, a repeated column) and all-zero.
    bad = p.at[:, :, 1].set(0.0).at[:, :, 3].set(p[:, :, 0])
    for x in (bad, jnp.zeros_like(p)):
      assert np.all(np.isfinite(np.asarray(jax.jit(f)(x, 0.0)))), method
  # Rank 1: normalization only (the shortcut), zero stays zero.
  f1 = _lowrank.orthogonalizer("householder", 1)
  col = jnp.asarray(r.randn(1, 30, 1), jnp.float32)
  np.testing.assert_allclose(f1(col, 0.0), col / jnp.linalg.norm(col),
                             rtol=1e-6)
  assert np.all(np.asarray(f1(jnp.zeros((1, 30, 1)), 0.0)) == 0)


# ------------------------------------------------------------ convergence --

def test_convergence_matches_dense_sgd_on_low_rank_task(mesh):
  """Rank-2 targets: rank 2 and 4 with EF reach dense SGD's final loss.

  (With plain SGD at twice this learning rate, rank 2 with EF diverges on
  this task after ~60 steps, as a float64 simulation of PyTorch's hook
  does too: the residual delays mass by many steps.)
  """
  r = np.random.RandomState(4)
  w_true = (r.randn(32, 2) @ r.randn(2, 24)).astype(np.float32) / 4

  def loss(p, batch):
    x, y = batch
    return jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=-1))

  data = []
  for _ in range(40):
    x = r.randn(N * 16, 32).astype(np.float32)
    data.append((x, x @ w_true + 0.01 * r.randn(N * 16, 24).astype(
      np.float32)))

  def run(tx):
    dp = parallel.DataParallel(loss, optax.chain(tx, optax.sgd(0.1)), mesh)
    params, state = dp.init({"w": np.zeros((32, 24), np.float32),
                             "b": np.zeros((24,), np.float32)})
    losses = []
    for batch in data:
      params, state, m = dp.step(params, state, batch)
      losses.append(float(m["loss"]))
    return np.mean(losses[-10:]), losses[0]

  dense, first = run(jaxcomm.mean_gradients())
  assert dense < 1e-3 * first, (dense, first)
  for rank in (2, 4):
    low, _ = run(jaxcomm.powersgd(rank=rank))
    assert low < dense * 1.25, (rank, low, dense)


def test_updates_equal_pytorch_residual_convention(mesh):
  """Own-projection residuals give the same updates as PyTorch's hook.

  PyTorch keeps ``e_i = M_i - P Q^T / n``; jaxcomm keeps
  ``e_i = M_i - P Q_i^T``. Both leave the same sum over devices, and P and
  Q depend on the sum only, so every update agrees.
  """
  rank = 2
  tx = jaxcomm.powersgd(rank=rank)
  grads = harness.make_grads(11, 4)
  updates, _, _ = harness.device_run(tx, mesh, grads)
  shapes = {"conv": (3, 3, 8, 16), "w": (64, 48)}
  key = jax.random.PRNGKey(0)
  qs = {k: entries_powersgd._draw(key, j, s[-1], rank)  # pylint: disable=protected-access
        for j, (k, s) in enumerate(sorted(shapes.items()))}
  res = {k: [np.zeros(_powersgd.matrix_shape(s)) for _ in range(N)]
         for k, s in shapes.items()}
  for t, g in enumerate(grads):
    for k, s in shapes.items():
      ms = [res[k][i] + np.asarray(g[k][i], np.float64).reshape(
        _powersgd.matrix_shape(s)) for i in range(N)]
      p, _ = np.linalg.qr(sum(m @ qs[k] for m in ms))
      qs[k] = sum(m.T @ p for m in ms)
      approx = p @ qs[k].T / N
      res[k] = [m - approx for m in ms]
      np.testing.assert_allclose(updates[t][k], approx.reshape(s),
                                 rtol=1e-3, atol=1e-4, err_msg=f"{k} {t}")


@pytest.mark.parametrize("method", ["householder", "gram_schmidt", "cholesky"])
def test_padded_orthogonalization_equals_per_shape(method):
  """P blocks of several row counts orthogonalized in one zero-padded stack
  give each block's own orthonormal basis (numpy QR's, up to column
  signs), and nothing in the padded rows."""
  from jaxcomm.collectives import _lowrank
  rng = np.random.default_rng(3)
  shapes = [(2, 300, 3), (1, 40, 3), (3, 7, 3)]
  ps = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
  assert _lowrank._bins(shapes) == [[0, 1, 2]]
  orth = _lowrank.orthogonalizer(method, 3)
  got = _lowrank._orthogonalize_batches(orth, ps, [0.0] * 3, False)
  for p, q in zip(ps, got):
    assert q.shape == p.shape
    for g in range(p.shape[0]):
      ref, _ = np.linalg.qr(np.asarray(p[g], np.float64))
      qg = np.asarray(q[g], np.float64)
      np.testing.assert_allclose(np.abs(qg.T @ ref), np.eye(3), atol=1e-4)
      np.testing.assert_allclose(qg.T @ qg, np.eye(3), atol=1e-4)
  # Far apart row counts with big blocks get bins of their own.
  assert _lowrank._bins([(64, 8192, 4), (96, 256, 4)]) == [[0], [1]]


_MANY_SHAPES_CHILD = r"""
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
import jax, numpy as np, optax
import jaxcomm
from jaxcomm import parallel
from flax import nnx
from models import transformer
model = transformer.TransformerLM(vocab_size=128, d_model=256, num_heads=8,
                                  num_layers=1, d_ff=1024, max_len=64,
                                  rngs=nnx.Rngs(0))
graphdef, params = nnx.split(model, nnx.Param)
def loss_fn(p, b):
  logits = nnx.merge(graphdef, p)(b["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
tx = optax.chain(jaxcomm.powersgd(4), optax.sgd(0.01))
dp = parallel.DataParallel(loss_fn, tx, parallel.make_mesh())
params, state = dp.init(params)
tok = np.random.RandomState(0).randint(0, 128, (16, 65)).astype(np.int32)
out = dp.step(params, state, {"x": tok[:, :-1], "y": tok[:, 1:]})
jax.block_until_ready(out)
print("finished", float(out[2]["loss"]))
"""


def test_batched_orthogonalization_finishes_on_8_cpu_devices():
  """XLA's CPU QR kernel splits a batch of matrices over the intra-op
  thread pool and waits; 8 simulated devices doing so at once on few cores
  used to wait forever (the LM's equal-shaped blocks: wq, wk, wv). Run in a
  child process with a deadline, so a regression fails instead of hanging
  the suite."""
  out = subprocess.run([sys.executable, "-c", _MANY_SHAPES_CHILD],
                       env=procs.child_env(), cwd=procs.ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "finished" in out.stdout, out.stdout[-500:]


# --------------------------------------------------------------- ATOMO ----


def _atomo_sent(tx, m, keys):
  """What ATOMO's codec decodes its own message of matrix ``m`` to (one
  device, no exchange) under ``keys`` step keys: ``[keys, r, c]``."""
  params = {"w": jnp.zeros(m.shape, jnp.float32)}
  spec = jaxcomm.spec_of(tx)
  (layout,) = spec.layouts(params)
  state = spec.codec.init(layout)
  flat = jnp.asarray(m, jnp.float32).reshape(-1)

  def one(key):
    ctx = jaxcomm.Context(axis_name=None, num_devices=1,
                          device_index=jnp.zeros([], jnp.int32),
                          step=jnp.zeros([], jnp.int32), key=key,
                          layout=layout)
    return spec.codec.apply(flat, state, ctx).sent

  ks = jax.random.split(jax.random.PRNGKey(11), keys)
  return np.asarray(jax.jit(jax.vmap(one))(ks), np.float64).reshape(
    (keys,) + m.shape)


def _with_spectrum(sigma, shape, seed):
  rng = np.random.RandomState(seed)
  u, _ = np.linalg.qr(rng.randn(shape[0], len(sigma)))
  v, _ = np.linalg.qr(rng.randn(shape[1], len(sigma)))
  return ((u * np.asarray(sigma)) @ v.T).astype(np.float32)


@pytest.mark.parametrize("which", ["gaussian", "saturated"])
def test_atomo_is_unbiased_and_sends_exactly_s_atoms(which):
  """Over 2000 keys the mean of ``sent`` is ``M`` within 5 standard errors
  per element, and every draw is a sum of exactly ``s`` rank-one atoms
  (systematic sampling). ``saturated``: the top atom has ``p = 1``."""
  budget, shape = 2, (24, 16)
  if which == "gaussian":
    m = np.random.RandomState(0).randn(*shape).astype(np.float32)
  else:
    m = _with_spectrum([40.0, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0,
                        0.8, 0.6, 0.4, 0.3, 0.2, 0.1], shape, 1)
  tx = jaxcomm.atomo(budget, axis_name=None)
  samples = _atomo_sent(tx, m, 2000)
  want = m.astype(np.float64)
  k = samples.shape[0]
  se = np.sqrt(samples.var(axis=0, ddof=1) / k)
  tol = 5.0 * se + 1e-6 * np.abs(want).max()
  assert np.all(np.abs(samples.mean(axis=0) - want) <= tol), np.max(
    np.abs(samples.mean(axis=0) - want) / tol)
  assert samples.var(axis=0).mean() > 1e-3 * np.mean(want * want)
  sv = np.linalg.svd(samples, compute_uv=False)          # [k, 16]
  ranks = np.sum(sv > 1e-4 * sv[:, :1], axis=1)
  np.testing.assert_array_equal(ranks, budget)
  if which == "saturated":
    # The saturated atom is in every draw, with its own weight 40.
    np.testing.assert_allclose(sv[:, 0], 40.0, rtol=1e-4)


def _brute_force_probabilities(sigma, budget):
  """The paper's problem, by a generic solver: minimise ``sum sigma_i^2 /
  p_i`` subject to ``sum p_i = s``, ``0 < p_i <= 1``."""
  sigma = np.asarray(sigma, np.float64)
  sigma = sigma / sigma.max()     # the solution does not depend on scale
  k = sigma.size
  res = optimize.minimize(
    lambda p: np.sum(sigma ** 2 / p), np.full(k, budget / k),
    jac=lambda p: -sigma ** 2 / p ** 2, method="SLSQP",
    bounds=[(1e-9, 1.0)] * k,
    constraints=[{"type": "eq", "fun": lambda p: np.sum(p) - budget,
                  "jac": lambda p: np.ones(k)}],
    options={"ftol": 1e-14, "maxiter": 1000})
  assert res.success, res.message
  return res.x


@pytest.mark.parametrize("sigma,budget", [
  ([5.0, 4.0, 3.0, 2.0, 1.0], 2),            # nothing saturates
  ([10.0, 1.0, 1.0, 1.0, 0.5], 2),           # the top atom saturates
  ([100.0, 50.0, 1.0, 1.0, 1.0, 1.0], 3),    # two saturate
  ([9.0, 8.0, 1.0, 0.9, 0.1, 0.05], 3),
  ([1.0, 1.0, 1.0, 1.0], 2),
])
def test_atomo_water_filling_solves_the_papers_problem(sigma, budget):
  p = np.asarray(_atomo.water_filling(jnp.asarray(sigma, jnp.float32),
                                      budget), np.float64)
  np.testing.assert_allclose(p.sum(), budget, rtol=1e-6)
  assert np.all(p > 0) and np.all(p <= 1.0)
  want = _brute_force_probabilities(sigma, budget)
  np.testing.assert_allclose(p, want, atol=1e-4)
  # And the battery's reference (the paper's iterative loop) agrees.
  np.testing.assert_allclose(
    entries_powersgd.atomo_probabilities(sigma, budget), p, rtol=1e-6)


def test_atomo_water_filling_rank_deficient():
  """Fewer nonzero singular values than the budget: those atoms are sent
  whole (p = 1), the zero ones never (p = 0)."""
  p = _atomo.water_filling(jnp.asarray([[3.0, 0.0, 0.0, 0.0],
                                        [0.0, 0.0, 0.0, 0.0]]), 2)
  np.testing.assert_array_equal(np.asarray(p), [[1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("shape,rank", [
  ((24, 16), 16), ((16, 24), 16), ((3, 9, 5), 5), ((40, 12), 3),
  ((6, 6), 0)])
def test_atomo_gram_svd_is_the_svd(shape, rank):
  """``gram_svd`` against numpy's float64 SVD: the same singular values
  (descending), orthonormal factors, an exact reconstruction; a matrix of
  rank ``rank`` (0: zeros) has ``rank`` nonzero atoms and no NaN."""
  rng = np.random.RandomState(sum(shape))
  a = rng.randn(*shape)
  if rank < min(shape[-2:]):
    a = (rng.randn(*shape[:-1], rank) @ rng.randn(rank, shape[-1])
         if rank else np.zeros(shape))
  u, sigma, vh = (np.asarray(t, np.float64) for t in jax.jit(
    _atomo.gram_svd)(jnp.asarray(a, jnp.float32)))
  want = np.linalg.svd(a, compute_uv=False)
  scale = max(want.max(), 1.0)
  np.testing.assert_allclose(sigma, want, atol=1e-5 * scale)
  assert np.all(np.diff(sigma, axis=-1) <= 0)
  np.testing.assert_allclose(np.einsum("...rk,...k,...kc->...rc", u, sigma,
                                       vh), a, atol=1e-5 * scale)
  # Orthonormal factors: all k vectors on the Gram matrix's side, those
  # of the nonzero atoms on the other.
  v, u = np.swapaxes(vh, -1, -2), u
  small, other = (v, u) if shape[-2] >= shape[-1] else (u, v)
  k = sigma.shape[-1]
  np.testing.assert_allclose(np.swapaxes(small, -1, -2) @ small,
                             np.broadcast_to(np.eye(k), sigma.shape + (k,)),
                             atol=1e-5)
  live = sigma > 1e-4 * scale
  for b in np.ndindex(sigma.shape[:-1]):
    o = other[b][:, live[b]]
    np.testing.assert_allclose(o.T @ o, np.eye(o.shape[1]), atol=1e-3)
  assert np.isfinite(u).all() and np.isfinite(vh).all()


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
@pytest.mark.parametrize("rank", [1, 4, 12])
def test_outer_product_paths_are_the_product(platform, rank, monkeypatch):
  """``P Q^T`` as ``_lowrank._outer`` forms it on each platform (TPU: a
  float32-precision dot; elsewhere multiply-adds up to rank 8, a dot
  above), here on the CPU with the platform read as given, against
  numpy's float64 product, scaled and not."""
  from jaxcomm.kernels import _dispatch  # noqa: PLC0415
  monkeypatch.setattr(_dispatch, "platform", lambda: platform)
  rng = np.random.RandomState(rank)
  p = rng.randn(3, 40, rank).astype(np.float32)
  qt = rng.randn(3, rank, 24).astype(np.float32)
  want = np.einsum("gnr,grm->gnm", p.astype(np.float64), qt)
  got = jax.jit(_lowrank._outer)(p, qt)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  got = jax.jit(lambda a, b: _lowrank._outer(a, b, 0.25))(p, qt)
  np.testing.assert_allclose(np.asarray(got), 0.25 * want, rtol=1e-5,
                             atol=1e-5)
