"""The gradient-leakage evaluation (benchmarks/leakage.py): DLG recovers a
digit from a dense gradient, and the messages it attacks are what each
compressor sends, against plain numpy computations of them."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import leakage


def _tree(seed, hidden=16):
  """Gradient-like leaves of the MLP's shapes: w1 (64, 16) is compressed
  by the default policy, the rest (under 256 elements) travel dense."""
  rng = np.random.default_rng(seed)
  shapes = {"w1": (64, hidden), "b1": (hidden,), "w2": (hidden, 10),
            "b2": (10,)}
  return {k: rng.standard_normal(s).astype(np.float32)
          for k, s in shapes.items()}


def _np_sign(x):
  return np.where(x >= 0, 1.0, -1.0)


def _np_topk(x, ratio):
  flat = x.ravel()
  k = max(1, math.ceil(ratio * flat.size - 1e-9))
  idx = np.argsort(-np.abs(flat), kind="stable")[:k]
  out = np.zeros_like(flat)
  out[idx] = flat[idx]
  return out.reshape(x.shape)


def _np_int8(x, block=128):
  flat = x.ravel().astype(np.float64)
  out = np.empty_like(flat)
  for start in range(0, flat.size, block):
    b = flat[start:start + block]
    s = np.abs(b).max()
    out[start:start + block] = np.round(b / s * 127.0) * s / 127.0
  return out.reshape(x.shape)


def _np_powersgd(x, rank, j):
  # Q_0 of the j-th compressed leaf is an input of the codec (its
  # docstring's normal(fold_in(PRNGKey(seed), j), (m, r))), drawn here.
  q0 = np.asarray(jax.random.normal(
    jax.random.fold_in(jax.random.PRNGKey(0), j), (x.shape[1], rank)),
    np.float64)
  p, _ = np.linalg.qr(x.astype(np.float64) @ q0)
  return p @ (p.T @ x)


def _np_onebit(x):
  return np.linalg.norm(x) / math.sqrt(x.size) * _np_sign(x)


CASES = [
  (leakage.Setting("topk", 0.1), lambda x, j: _np_topk(x, 0.1)),
  (leakage.Setting("topk", 0.02), lambda x, j: _np_topk(x, 0.02)),
  (leakage.Setting("int8"), lambda x, j: _np_int8(x)),
  (leakage.Setting("powersgd", 1), lambda x, j: _np_powersgd(x, 1, j)),
  (leakage.Setting("powersgd", 2), lambda x, j: _np_powersgd(x, 2, j)),
  (leakage.Setting("onebit"), lambda x, j: _np_onebit(x)),
  (leakage.Setting("signsgd"), lambda x, j: _np_sign(x)),
]


@pytest.mark.parametrize("setting,ref", CASES, ids=[c[0].name for c in CASES])
def test_message_is_the_codecs_decoded_message(setting, ref):
  grads = _tree(0)
  got = leakage.sent_message(leakage.compressor(setting),
                             jax.tree.map(jnp.asarray, grads))
  route = leakage.paths(setting, grads)
  assert [k for k in sorted(grads) if route[k] == "compress"] == ["w1"]
  for k, x in grads.items():
    want = ref(x, 0) if route[k] == "compress" else x
    np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-5,
                               atol=1e-6, err_msg=f"{setting.name}: {k}")


def test_all_leaves_compresses_the_biases():
  grads = _tree(1)
  s = leakage.Setting("topk", 0.1, all_leaves=True)
  route = leakage.paths(s, grads)
  assert all(v == "compress" for v in route.values())
  got = leakage.sent_message(leakage.compressor(s),
                             jax.tree.map(jnp.asarray, grads))
  for k, x in grads.items():
    np.testing.assert_allclose(np.asarray(got[k]), _np_topk(x, 0.1),
                               rtol=1e-6, atol=0, err_msg=k)


def _np_mlp_grad(p, x, label):
  """Cross-entropy gradient of sigmoid(x W1 + b1) W2 + b2, by hand."""
  z = x @ p["w1"] + p["b1"]
  h = 1.0 / (1.0 + np.exp(-z))
  o = h @ p["w2"] + p["b2"]
  e = np.exp(o - o.max())
  dz2 = e / e.sum()
  dz2[label] -= 1.0
  dh = p["w2"] @ dz2
  dz1 = dh * h * (1.0 - h)
  return {"w1": np.outer(x, dz1), "b1": dz1, "w2": np.outer(h, dz2),
          "b2": dz2}


def test_diloco_message_is_the_local_delta():
  params = leakage.init_mlp(jax.random.PRNGKey(3), hidden=16)
  rng = np.random.default_rng(2)
  x = rng.uniform(size=64).astype(np.float32)
  period, lr, label = 3, leakage.DILOCO_LR, 4
  got = leakage.diloco_message(params, jnp.asarray(x), label, period)
  theta = {k: np.asarray(v, np.float64) for k, v in params.items()}
  p = dict(theta)
  for _ in range(period):
    g = _np_mlp_grad(p, x.astype(np.float64), label)
    p = {k: p[k] - lr * g[k] for k in p}
  for k in theta:
    np.testing.assert_allclose(np.asarray(got[k]), theta[k] - p[k],
                               rtol=2e-4, atol=2e-6, err_msg=k)


def test_example_gradient_matches_numpy():
  params = leakage.init_mlp(jax.random.PRNGKey(4), hidden=16)
  x = np.random.default_rng(5).uniform(size=64).astype(np.float32)
  got = leakage.example_grad(params, jnp.asarray(x),
                             jax.nn.one_hot(7, leakage.NUM_CLASSES))
  want = _np_mlp_grad({k: np.asarray(v, np.float64)
                       for k, v in params.items()}, x.astype(np.float64), 7)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-4,
                               atol=1e-7, err_msg=k)


@pytest.mark.parametrize("setting", [leakage.Setting("topk", 0.1),
                                     leakage.Setting("powersgd", 1)],
                         ids=lambda s: s.name)
def test_bytes_match_the_wire_claim(setting):
  params = leakage.init_mlp(jax.random.PRNGKey(0))
  assert leakage.message_bytes(setting, params) == leakage.claimed_bytes(
    setting, params)


def test_bytes_by_hand():
  params = leakage.init_mlp(jax.random.PRNGKey(0))
  dense = 4 * (64 + 10)     # the biases travel dense by default
  assert leakage.message_bytes(leakage.Setting("dense"), params) == 4 * (
    64 * 64 + 64 + 64 * 10 + 10)
  assert leakage.message_bytes(leakage.Setting("int8"), params) == (
    64 * 64 + 640 + 4 * (32 + 5) + dense)
  assert leakage.message_bytes(leakage.Setting("signsgd"), params) == (
    (64 * 64 + 640) // 8 + dense)
  assert leakage.message_bytes(leakage.Setting("onebit"), params) == (
    (64 * 64 + 640) // 8 + 8 + dense)


def test_dlg_recovers_a_digit_from_the_dense_gradient():
  images, labels = leakage.load_images(1)
  params = leakage.init_mlp(jax.random.PRNGKey(0), hidden=16)
  s = leakage.Setting("dense")
  route = leakage.paths(s, params)
  msg = leakage.observe(s, params, jnp.asarray(images[0]), int(labels[0]))
  aux = leakage.aux_of(s, msg, route, params)
  x, y, final, x0 = jax.jit(
    lambda k: leakage.attack(s, route, params, msg, aux, k, 150))(
      jax.random.PRNGKey(1))
  rec = np.clip(np.asarray(x), 0.0, 1.0)
  mse = float(np.mean((rec - images[0]) ** 2))
  start = float(np.mean((np.asarray(x0) - images[0]) ** 2))
  assert start > 0.1
  assert mse < 1e-3, (mse, float(final))
  assert mse < 0.01 * start
  assert int(np.argmax(np.asarray(y))) == int(labels[0])
