"""A linear least-squares model whose gradients numpy computes in closed
form, and the 8-device run around it: what the local-update and gossip
tests replay in plain numpy."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxcomm import parallel
from jaxcomm import wire

N = 8
B = 4          # examples per device per step
D_IN, D_OUT = 24, 16   # w: 384 elements (compressed by the default policy)


def params():
  r = np.random.RandomState(0)
  return {"b": jnp.asarray(r.randn(D_OUT) * 0.1, jnp.float32),
          "w": jnp.asarray(r.randn(D_IN, D_OUT) * 0.1, jnp.float32)}


def make_batches(steps, seed=1, n=N):
  r = np.random.RandomState(seed)
  w_true = r.randn(D_IN, D_OUT) * 0.3
  out = []
  for _ in range(steps):
    x = r.randn(n * B, D_IN).astype(np.float32)
    y = (x @ w_true + 0.1 * r.randn(n * B, D_OUT)).astype(np.float32)
    out.append((x, y))
  return out


def loss_fn(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def np_grad(p, x, y):
  """Closed-form gradient of the mean squared error (float64)."""
  r = x @ p["w"] + p["b"] - y
  scale = 2.0 / r.size
  return {"b": scale * r.sum(0), "w": scale * x.T @ r}


def np_params():
  return {k: np.asarray(v, np.float64) for k, v in params().items()}


def rows(x):
  return np.asarray(jax.device_get(x))


def run(tx, steps, batches=None, mesh=None, n=N):
  """``steps`` DataParallel steps of ``tx`` on ``n`` devices; returns
  (dp, params, state, [(host params, state, metrics) per step])."""
  mesh = mesh if mesh is not None else parallel.make_mesh(n)
  dp = parallel.DataParallel(loss_fn, tx, mesh, donate=False)
  p, s = dp.init(params())
  history = []
  data = batches if batches is not None else make_batches(steps, n=n)
  for t in range(steps):
    p, s, m = dp.step(p, s, data[t])
    jax.block_until_ready(p)
    history.append((jax.tree.map(rows, p), s, m))
  return dp, p, s, history


def assert_collectives_only_in_sync(tx, n=N):
  """``tx``'s compiled step on ``n`` devices holds collectives only inside
  the conditional's branches, and they are what ``wire.claimed`` lists."""
  dp = parallel.DataParallel(loss_fn, tx, parallel.make_mesh(n),
                             donate=False)
  p, s = dp.init(params())
  compiled = dp.lower(p, s, dp.shard_batch(make_batches(1, n=n)[0])
                      ).compile()
  assert wire.collectives(compiled, outside_branches=True) == []
  got = sorted((op.kind, op.payload) for op in wire.collectives(compiled))
  assert got == sorted(wire.claimed(tx, params(), n)), got


def resize_run(dp, p, s, n):
  """A run's params and state on the host (one row per device), and both
  resized to ``n`` devices: (host params, host state, new params, new
  state)."""
  host_p = jax.tree.map(rows, p)
  host_s = jax.tree.map(rows, jax.device_get(s))
  return (host_p, host_s, parallel.resize_params(host_p, n),
          parallel.resize_state(host_s, dp.layout, n))


def place(tx, host_p, host_s, n):
  """A DataParallel of ``tx`` on the first ``n`` devices, with host params
  and state (one row per device) placed on it: (dp, params, state)."""
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))
  dp = parallel.DataParallel(loss_fn, tx, mesh, donate=False)
  dp.init(params())
  p = dp.place_params(host_p)
  s = jax.tree.map(
    lambda v, b: parallel._global(v, jax.sharding.NamedSharding(
      mesh, P("data") if b else P())), host_s, dp.layout)
  return dp, p, s


def device_slices(x, y, n=N):
  return [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(n)]


def agree(tree) -> bool:
  return all(np.array_equal(v[0], v[i]) for v in jax.tree.leaves(tree)
             for i in range(1, v.shape[0]))


def close(got, want, rtol=2e-5, atol=2e-6):
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol,
                               err_msg=k)
