"""Every compressor in the documented train step, under every kernel mode.

For each compressor of ``bench_wire.CONFIGS`` and each ``JAXCOMM_KERNELS``
mode (``auto``, ``always``, ``never``), builds a
:class:`jaxcomm.parallel.DataParallel` step (``jax.shard_map`` over all
visible devices, ``check_vma`` on) for a small MLP whose first kernel is
784 x 512 (the leaf that first showed kernels failing inside ``shard_map``
on a GPU), runs ``--steps`` steps on the same batches and prints per row:
whether it ran (or the first line of the error), the median step time after
the first (compiling) step, and the largest difference of the final params
from the ``never`` run (the kernels and the jnp paths must agree; sampled
selections and bit ties can make a handful of coordinates differ, so the
difference is printed, not asserted).

On a CPU host ``always`` runs the kernels in interpret mode (slow). On a
GPU or TPU it runs them compiled: this is the check that every kernel works
in the train step on that backend.

Run: ``python -m benchmarks.accelerator_check [--steps 5] [--only a,b]
[--part K/N]`` (``--part`` takes every N-th compressor from the K-th, 1-based,
to split the table across processes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.bench_wire import CONFIGS
from jaxcomm import kernels
from jaxcomm import parallel

MODES = ("never", "auto", "always")


def _loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  out = h @ params["w2"] + params["b2"]
  return jnp.mean(jnp.square(out - batch["y"]))


def _params():
  rng = np.random.RandomState(0)
  return {"w1": jnp.asarray(rng.randn(784, 512).astype(np.float32) * 0.03),
          "b1": jnp.zeros((512,), jnp.float32),
          "w2": jnp.asarray(rng.randn(512, 64).astype(np.float32) * 0.05),
          "b2": jnp.zeros((64,), jnp.float32)}


def _batches(steps: int, n: int, per_device: int = 16):
  rng = np.random.RandomState(1)
  return [{"x": rng.randn(n * per_device, 784).astype(np.float32),
           "y": rng.randn(n * per_device, 64).astype(np.float32)}
          for _ in range(steps)]


def run(make, mode: str, steps: int, mesh):
  """``(final params, [step ms])`` with ``JAXCOMM_KERNELS=mode``."""
  old = os.environ.get(kernels.ENV_VAR)
  os.environ[kernels.ENV_VAR] = mode
  try:
    tx = optax.chain(make(), optax.sgd(0.05))
    dp = parallel.DataParallel(_loss, tx, mesh)
    params, state = dp.init(_params())
    times = []
    for batch in _batches(steps, dp.num_devices):
      t0 = time.perf_counter()
      params, state, metrics = dp.step(params, state, batch)
      jax.block_until_ready((params, state, metrics))
      times.append(1e3 * (time.perf_counter() - t0))
    return jax.device_get(params), times
  finally:
    if old is None:
      os.environ.pop(kernels.ENV_VAR, None)
    else:
      os.environ[kernels.ENV_VAR] = old


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--only", default="",
                      help="comma-separated config names")
  parser.add_argument("--part", default="1/1",
                      help="K/N: every N-th compressor from the K-th")
  args = parser.parse_args(argv)
  only = set(filter(None, args.only.split(",")))
  try:
    part, parts = (int(v) for v in args.part.split("/"))
    if not 1 <= part <= parts:
      raise ValueError
  except ValueError:
    parser.error(f"--part must be K/N with 1 <= K <= N, got {args.part!r}")
  mesh = parallel.make_mesh()
  print(f"\nDataParallel step on {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), {mesh.devices.size} device(s), "
        f"jax {jax.__version__}; {args.steps} steps, median ms of steps "
        f"2..{args.steps}; max |params - params(never)| after the last.\n")
  print("| compressor | mode | ran | ms / step | max diff vs never |")
  print("|---|---|---|---:|---:|")
  failures = 0
  for i, (name, make) in enumerate(CONFIGS):
    if (only and name not in only) or i % parts != part - 1:
      continue
    ref = None
    for mode in MODES:
      try:
        params, times = run(make, mode, args.steps, mesh)
      except Exception as e:  # noqa: BLE001 -- a failure is a table row
        failures += 1
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        print(f"| {name} | {mode} | error: {type(e).__name__}: {msg} | | |")
        continue
      ms = statistics.median(times[1:]) if len(times) > 1 else times[0]
      if mode == "never":
        ref = params
      diff = "" if ref is None else f"{_max_diff(params, ref):.2e}"
      print(f"| {name} | {mode} | yes | {ms:.2f} | {diff} |")
  print(f"\n{failures} failed runs")


if __name__ == "__main__":
  main()
