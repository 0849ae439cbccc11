"""Several data axes: a ("dcn", "ici") mesh of 2 x 4 CPU devices.

``DataParallel`` over both axes lays per-device state out over all of them;
a compressor over the tuple equals the same compressor on a flat 8-device
mesh, and the hierarchical recipe (dense mean inside a slice, compression
between slices) equals compression between 2 devices that each hold a
slice's batch, with the parameter-sized all-reduce only inside the slices
(read from the compiled HLO).
"""

import math

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

D_IN, D_OUT, B = 32, 24, 4


def _params():
  r = np.random.RandomState(0)
  return {"b": jnp.asarray(r.randn(D_OUT) * 0.1, jnp.float32),
          "w": jnp.asarray(r.randn(D_IN, D_OUT) * 0.1, jnp.float32)}


def _batches(steps, per_step):
  r = np.random.RandomState(3)
  w_true = r.randn(D_IN, D_OUT) * 0.3
  out = []
  for _ in range(steps):
    x = r.randn(per_step, D_IN).astype(np.float32)
    out.append((x, (x @ w_true).astype(np.float32)))
  return out


def loss_fn(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _pod_mesh():
  return jax.make_mesh((2, 4), ("dcn", "ici"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _flat_mesh(k):
  return jax.make_mesh((k,), ("data",), devices=jax.devices()[:k],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _train(tx, mesh, axis, batches, loss=loss_fn, params=None):
  dp = parallel.DataParallel(loss, tx, mesh, axis, donate=False)
  p, s = dp.init(_params() if params is None else params)
  for b in batches:
    p, s, _ = dp.step(p, s, b)
    jax.block_until_ready(p)
  return dp, p, s


def test_compressor_over_both_axes_equals_the_flat_mesh():
  axes = ("dcn", "ici")
  batches = _batches(4, 8 * B)
  _, p_pod, s_pod = _train(
    optax.chain(jaxcomm.powersgd(2, axis_name=axes), optax.sgd(0.1)),
    _pod_mesh(), axes, batches)
  _, p_flat, _ = _train(
    optax.chain(jaxcomm.powersgd(2, axis_name="data"), optax.sgd(0.1)),
    _flat_mesh(8), "data", batches)
  for k in p_flat:
    np.testing.assert_allclose(np.asarray(p_pod[k]), np.asarray(p_flat[k]),
                               rtol=1e-6, atol=1e-6)
  residual = jaxcomm.compress_states(s_pod)[0].residual[0]
  assert residual.shape[0] == 8           # one row per device of the pod


def test_hierarchical_chain_compresses_only_between_slices():
  """mean over "ici", then PowerSGD over "dcn": the same as PowerSGD on 2
  devices whose batches are the slices' batches; the HLO's parameter-sized
  all-reduce spans the 4 devices of a slice, PowerSGD's factors the 2
  slices."""
  axes = ("dcn", "ici")
  batches = _batches(4, 8 * B)
  tx = optax.chain(jaxcomm.mean_gradients(axis_name="ici"),
                   jaxcomm.powersgd(2, axis_name="dcn"), optax.sgd(0.1))
  dp, p_pod, s_pod = _train(tx, _pod_mesh(), axes, batches)
  _, p_two, _ = _train(
    optax.chain(jaxcomm.powersgd(2, axis_name="data"), optax.sgd(0.1)),
    _flat_mesh(2), "data", batches)
  for k in p_two:
    np.testing.assert_allclose(np.asarray(p_pod[k]), np.asarray(p_two[k]),
                               rtol=1e-5, atol=1e-6)
  p, s = dp.init(_params())
  ops = wire.collectives(dp.lower(p, s, dp.shard_batch(batches[0])))
  size = 4 * (D_IN * D_OUT + D_OUT)
  big = [op for op in ops if op.payload >= size]
  assert big and all(op.group == 4 for op in big), ops
  between = [op for op in ops if op.group == 2]
  assert between and all(op.payload < size / 2 for op in between), ops


# -------------------------------------------- params split over a model axis

def _model_mesh():
  return jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


HALF = D_OUT // 2


def _sharded_loss(p, batch):
  """Column-parallel linear layer: this device's half of the outputs; the
  squared error summed over both halves (psum over "model")."""
  x, y = batch
  m = jax.lax.axis_index("model")
  y_m = jax.lax.dynamic_slice_in_dim(y, m * HALF, HALF, axis=1)
  part = jnp.sum((x @ p["w"] + p["b"] - y_m) ** 2)
  return jax.lax.psum(part, "model") / (x.shape[0] * D_OUT)


def _half_loss(m):
  def loss(p, batch):
    x, y = batch
    return jnp.sum((x @ p["w"] + p["b"] - y[:, m * HALF:(m + 1) * HALF])
                   ** 2) / (x.shape[0] * D_OUT)
  return loss


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.mean_gradients(),
  lambda: jaxcomm.topk(0.25),
  lambda: jaxcomm.powersgd(2),
], ids=["mean", "topk", "powersgd"])
def test_params_split_over_a_model_axis_stay_split(make):
  """DataParallel keeps a (data=4, model=2) split of the params: each
  model half trains exactly as a 4-device run on that half alone (top-k
  and PowerSGD compress each device's block: per-shard k, per-shard low
  rank), params come back split as given, and every collective of the step
  spans the 4 data devices or the 2 model devices of the loss's psum."""
  mesh = _model_mesh()
  specs = {"b": P("model"), "w": P(None, "model")}
  params = jax.tree.map(
    lambda x, sp: jax.device_put(x, jax.sharding.NamedSharding(mesh, sp)),
    _params(), specs)
  batches = _batches(3, 4 * B)
  tx = optax.chain(make(), optax.sgd(0.1))
  dp = parallel.DataParallel(_sharded_loss, tx, mesh, donate=False)
  p, s = dp.init(params)
  for b in batches:
    p, s, _ = dp.step(p, s, b)
  assert p["w"].sharding.spec == P(None, "model")
  ops = wire.collectives(dp.lower(p, s, dp.shard_batch(batches[0])))
  assert {op.group for op in ops} <= {4, 2}, ops
  assert all(op.payload <= 8 for op in ops if op.group == 2), ops
  for m in range(2):
    cut = lambda x, m=m: np.asarray(x)[..., m * HALF:(m + 1) * HALF]
    _, want, _ = _train(optax.chain(make(), optax.sgd(0.1)), _flat_mesh(4),
                        "data", batches, loss=_half_loss(m),
                        params=jax.tree.map(cut, _params()))
    for k in ("b", "w"):
      np.testing.assert_allclose(cut(p[k]), np.asarray(want[k]),
                                 rtol=1e-5, atol=1e-6, err_msg=f"{m} {k}")


def test_make_pod_mesh_groups_devices():
  devs = jax.devices()[:8]
  mesh = parallel.make_pod_mesh(2, devices=devs)
  assert dict(mesh.shape) == {"dcn": 2, "ici": 4}
  assert [d.id for d in mesh.devices[1]] == [d.id for d in devs[4:]]
  # One process, no slices: one group (one host) of all its devices.
  assert dict(parallel.make_pod_mesh(devices=devs).shape) == {"dcn": 1,
                                                             "ici": 8}
  with pytest.raises(ValueError, match="num_slices"):
    parallel.make_pod_mesh(3, devices=devs)


# ------------------------------- one exchange per host (sharded_exchange)

def _np_device_grads(p, batch):
  """Each of the 8 devices' flat gradient (leaves "b", "w"), dcn-major."""
  x, y = batch
  out = []
  for i in range(8):
    xi, yi = x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]
    r = xi @ p["w"] + p["b"] - yi
    c = 2.0 / r.size
    out.append(np.concatenate([c * r.sum(0), (c * xi.T @ r).ravel()]))
  return out


def _unflat(v, p):
  return {"b": v[:D_OUT], "w": v[D_OUT:].reshape(D_IN, D_OUT)}


def _sharded(inner):
  return optax.chain(parallel.sharded_exchange(inner, fast_size=4),
                     optax.sgd(0.1))


def test_sharded_exchange_of_the_mean_equals_the_flat_mean():
  batches = _batches(3, 8 * B)
  axes = ("dcn", "ici")
  _, p_pod, _ = _train(_sharded(jaxcomm.mean_gradients(axis_name="dcn")),
                       _pod_mesh(), axes, batches)
  _, p_flat, _ = _train(optax.chain(jaxcomm.mean_gradients(),
                                    optax.sgd(0.1)),
                        _flat_mesh(8), "data", batches)
  for k in p_flat:
    np.testing.assert_allclose(np.asarray(p_pod[k]), np.asarray(p_flat[k]),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernels", ["never", "always"])
def test_sharded_exchange_topk_matches_numpy_and_its_claimed_bytes(
    kernels, monkeypatch):
  """Top-k 10% with error feedback between hosts, each of a host's 4
  devices compressing its quarter of the host's mean (top-k per share):
  the params follow a numpy replay, each device keeps the residual of its
  own share, and the compiled step moves the params once inside each host
  (reduce-scatter, all-gather over groups of 4) and between hosts only
  top-k's claim for one share. With JAXCOMM_KERNELS=always the selection
  is the Pallas kernel (interpreted on CPU) inside this step."""
  monkeypatch.setenv("JAXCOMM_KERNELS", kernels)
  calls = []
  real = pl.pallas_call
  monkeypatch.setattr(pl, "pallas_call",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  axes, steps, ratio = ("dcn", "ici"), 3, 0.1
  batches = _batches(steps, 8 * B)
  inner = jaxcomm.topk(ratio, axis_name="dcn", error_feedback=True,
                       policy=jaxcomm.LeafPolicy(min_size=1))
  dp, p_pod, s_pod = _train(_sharded(inner), _pod_mesh(), axes, batches)
  assert bool(calls) == (kernels == "always")

  n = D_OUT + D_IN * D_OUT
  share = -(-n // 4)
  p = {k: np.asarray(v, np.float64) for k, v in _params().items()}
  err = np.zeros((2, 4, share))
  k_sel = max(1, math.ceil(ratio * share * (1 - 1e-9)))
  for batch in batches:
    g = _np_device_grads(p, batch)
    upd = np.zeros(4 * share)
    for j in range(4):
      sent = []
      for h in range(2):
        host = np.pad(np.mean(g[4 * h:4 * h + 4], 0), (0, 4 * share - n))
        x = host[j * share:(j + 1) * share] + err[h, j]
        s = np.zeros_like(x)
        sel = np.argsort(-np.abs(x), kind="stable")[:k_sel]
        s[sel] = x[sel]
        err[h, j] = x - s
        sent.append(s)
      upd[j * share:(j + 1) * share] = np.mean(sent, 0)
    step = _unflat(upd[:n], p)
    p = {k: p[k] - 0.1 * step[k] for k in p}
  for k in p:
    np.testing.assert_allclose(np.asarray(p_pod[k]), p[k], rtol=1e-4,
                               atol=1e-5, err_msg=k)
  residual = np.asarray(jaxcomm.compress_states(s_pod)[0].residual[0])
  np.testing.assert_allclose(residual.reshape(2, 4, share), err, rtol=1e-4,
                             atol=1e-5)

  p0, s0 = dp.init(_params())
  ops = wire.collectives(dp.lower(p0, s0, dp.shard_batch(batches[0])))
  inside = sorted((op.kind, op.payload) for op in ops if op.group == 4)
  assert inside == [("all-gather", 4 * 4 * share),
                    ("reduce-scatter", 4 * 4 * share)], ops
  between = sorted((op.kind, op.payload) for op in ops if op.group == 2)
  claim = wire.claimed(inner, {"share": jax.ShapeDtypeStruct(
    (share,), jnp.float32)}, 2)
  assert between == sorted(claim), (ops, claim)


def test_sharded_exchange_refuses_what_it_cannot_split():
  with pytest.raises(ValueError, match="PowerSGD takes matrices"):
    _train(_sharded(jaxcomm.powersgd(2, axis_name="dcn")), _pod_mesh(),
           ("dcn", "ici"), _batches(1, 8 * B))
  with pytest.raises(ValueError, match="slow axis"):
    parallel.sharded_exchange(jaxcomm.topk(0.1, axis_name="ici"),
                              fast_size=4)
  with pytest.raises(ValueError, match="fast_size"):
    parallel.sharded_exchange(jaxcomm.topk(0.1, axis_name="dcn"),
                              fast_size=0)
  with pytest.raises(ValueError, match="must be floating"):
    parallel.exchange_share({"i": jnp.zeros(3, jnp.int32)}, 2)
  assert parallel.exchange_share(_params(), 4)["share"].shape == (
    -(-(D_IN * D_OUT + D_OUT) // 4),)
  with pytest.raises(ValueError, match="fast_size=2 but axis 'ici' has 4"):
    _train(optax.chain(parallel.sharded_exchange(
      jaxcomm.mean_gradients(axis_name="dcn"), fast_size=2), optax.sgd(0.1)),
      _pod_mesh(), ("dcn", "ici"), _batches(1, 8 * B))
