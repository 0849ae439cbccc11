"""A dense data-parallel training run, as one of several processes.

Run by tests/test_multiprocess.py:
  python -m tests.mp_worker PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES OUT \
      [pod]
With NUM_PROCESSES == 1 it runs alone, without jax.distributed. With
``pod`` the mesh is ("dcn", "ici") = 2 x 4 (slices by process) and the
optimizer the hierarchical chain (dense over "ici", PowerSGD over "dcn").
"""

import json
import os
import sys


def main(argv):
  pid, nproc, port, local, out = (int(argv[0]), int(argv[1]), int(argv[2]),
                                  int(argv[3]), argv[4])
  pod = len(argv) > 5 and argv[5] == "pod"
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
    r = np.random.RandomState(100 + step)
    x = r.randn(32, 16).astype(np.float32)
    y = x @ w_true + 0.01 * r.randn(32, 4).astype(np.float32)
    sl = slice(pid * per_proc, (pid + 1) * per_proc)
    batch = dp.shard_batch((x[sl], y[sl]))
    params, state, metrics = dp.step(params, state, batch)
    losses.append(float(jax.device_get(metrics["loss"])))
  if pid == 0:
    with open(out, "w") as f:
      json.dump({"losses": losses, "processes": jax.process_count(),
                 "devices": jax.device_count()}, f)
  if nproc > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])
