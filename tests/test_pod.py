"""Several data axes: a ("dcn", "ici") mesh of 2 x 4 CPU devices.

``DataParallel`` over both axes lays per-device state out over all of them;
a compressor over the tuple equals the same compressor on a flat 8-device
mesh, and the hierarchical recipe (dense mean inside a slice, compression
between slices) equals compression between 2 devices that each hold a
slice's batch, with the parameter-sized all-reduce only inside the slices
(read from the compiled HLO).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def _train(tx, mesh, axis, batches):
  dp = parallel.DataParallel(loss_fn, tx, mesh, axis, donate=False)
  p, s = dp.init(_params())
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
