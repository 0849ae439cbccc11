"""A dense data-parallel training run, as one of several processes.

Run by tests/test_multiprocess.py:
  python -m tests.mp_worker PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES OUT \
      [pod]
With NUM_PROCESSES == 1 it runs alone, without jax.distributed. With
``pod`` the mesh is ("dcn", "ici") = 2 x 4 (slices by process) and the
optimizer the hierarchical chain (dense over "ici", PowerSGD over "dcn").
With ``fsdp`` the mesh is ("dcn", "fsdp") = 2 x 4 with each fsdp group
spanning both processes (params sharded across hosts), the step
``DataParallel(auto_axes=("fsdp",))`` and top-k across "dcn".
"""

import json
import os
import sys


def main(argv):
  pid, nproc, port, local, out = (int(argv[0]), int(argv[1]), int(argv[2]),
                                  int(argv[3]), argv[4])
  mode = argv[5] if len(argv) > 5 else "flat"
  pod = mode == "pod"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import jaxcomm  # pylint: disable=import-outside-toplevel

  if nproc > 1:
    jaxcomm.parallel.initialize(f"localhost:{port}", nproc, pid,
                                local_device_count=local, timeout_s=60)
  else:
    jax.config.update("jax_num_cpu_devices", local)
  if mode == "fsdp":
    return _fsdp(pid, nproc, out)
  if pod:
    # Slices by process (2 x 4), or 2 slices cut from one process's 8.
    mesh = jaxcomm.parallel.make_pod_mesh(None if nproc > 1 else 2)
    assert dict(mesh.shape) == {"dcn": 2, "ici": 4}, mesh.shape
  else:
    mesh = jaxcomm.parallel.make_mesh()
    assert mesh.shape["data"] == 8, mesh.shape

  rng = np.random.RandomState(0)
  w_true = rng.randn(16, 4).astype(np.float32)
  params = {"w": np.zeros((16, 4), np.float32),
            "b": np.zeros((4,), np.float32)}

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  if pod:
    # Dense inside a slice, PowerSGD between slices.
    tx = optax.chain(jaxcomm.mean_gradients(axis_name="ici"),
                     jaxcomm.powersgd(2, axis_name="dcn"), optax.sgd(0.1))
    dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh, ("dcn", "ici"))
  else:
    tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))
    dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
  params, state = dp.init(params)
  losses = []
  per_proc = 32 // nproc
  for step in range(6):
    x, y = _batch(step, w_true)
    sl = slice(pid * per_proc, (pid + 1) * per_proc)
    batch = dp.shard_batch((x[sl], y[sl]))
    params, state, metrics = dp.step(params, state, batch)
    losses.append(float(jax.device_get(metrics["loss"])))
  _report(pid, nproc, out, losses)


def _report(pid, nproc, out, losses):
  """Process 0 writes the losses; every process leaves the job."""
  import jax  # pylint: disable=import-outside-toplevel
  if pid == 0:
    with open(out, "w") as f:
      json.dump({"losses": losses, "processes": jax.process_count(),
                 "devices": jax.device_count()}, f)
  if nproc > 1:
    jax.distributed.shutdown()


def _batch(step, w_true):
  """The whole batch of ``step`` (every process draws the same)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  r = np.random.RandomState(100 + step)
  x = r.randn(32, 16).astype(np.float32)
  return x, x @ w_true + 0.01 * r.randn(32, 4).astype(np.float32)


def _fsdp(pid, nproc, out):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import jaxcomm  # pylint: disable=import-outside-toplevel

  # Devices of "process" q (with one process: devices 4q..4q+3) as
  # columns: each fsdp row holds two devices of each process.
  devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  by_proc = [devs[:4], devs[4:]]
  grid = np.array([[by_proc[0][0], by_proc[0][1], by_proc[1][0],
                    by_proc[1][1]],
                   [by_proc[0][2], by_proc[0][3], by_proc[1][2],
                    by_proc[1][3]]])
  mesh = jax.sharding.Mesh(grid, ("dcn", "fsdp"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.RandomState(0)
  w_true = rng.randn(16, 4).astype(np.float32)
  host = {"w": 0.1 * rng.randn(16, 4).astype(np.float32),
          "b": np.zeros((4,), np.float32)}
  specs = {"w": P("fsdp", None), "b": P()}
  params = {k: jax.make_array_from_callback(
    v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
    for k, v in host.items()}

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  tx = optax.chain(jaxcomm.topk(0.25, axis_name="dcn"), optax.sgd(0.1))
  dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh, axis_name="dcn",
                                     auto_axes=("fsdp",))
  params, state = dp.init(params)
  rows = NamedSharding(mesh, P(("dcn", "fsdp")))
  losses = []
  for step in range(6):
    x, y = _batch(step, w_true)
    batch = tuple(jax.make_array_from_callback(a.shape, rows,
                                               lambda i, a=a: a[i])
                  for a in (x, y))
    params, state, metrics = dp.step(params, state, batch)
    losses.append(float(jax.device_get(metrics["loss"])))
  assert not params["w"].is_fully_addressable or nproc == 1
  _report(pid, nproc, out, losses)


if __name__ == "__main__":
  main(sys.argv[1:])
