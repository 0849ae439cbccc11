"""What DataParallel's one-step-in-flight rule costs on simulated CPU devices.

A small MLP (64-256-10, global batch 256) on 8 simulated CPU devices, top-k
1% + SGD: the same steps with ``block=True`` (the CPU default: each step
waits for the previous step's params and state, no result read) and with
``block=False`` reading the loss every step or every 10 steps (a loop that
never reads a result aborts in XLA's CPU collectives: see README).
Rounds alternate; medians of 3. Prints ms per step.

  python -m benchmarks.cpu_block [steps]
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = " ".join(
  [os.environ.get("XLA_FLAGS", ""),
   "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm import parallel  # noqa: E402


def _loss(p, batch):
  x, y = batch
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(
    h @ p["w2"], y).mean()


def main(steps: int = 300) -> None:
  r = np.random.RandomState(0)
  params = {"w1": r.randn(64, 256).astype(np.float32) * 0.1,
            "b1": np.zeros(256, np.float32),
            "w2": r.randn(256, 10).astype(np.float32) * 0.1}
  batches = [(r.randn(256, 64).astype(np.float32), r.randint(0, 10, 256))
             for _ in range(8)]
  mesh = parallel.make_mesh()
  modes = {"block=True, no reads": (True, 0),
           "block=False, loss read every step": (False, 1),
           "block=False, loss read every 10 steps": (False, 10)}
  runs = {}
  for name, (block, _) in modes.items():
    dp = parallel.DataParallel(
      _loss, optax.chain(jaxcomm.topk(0.01), optax.sgd(0.1)), mesh,
      block=block)
    p, s = dp.init(params)
    sharded = [dp.shard_batch(b) for b in batches]
    for i in range(5):                        # compile and warm up
      p, s, m = dp.step(p, s, sharded[i % 8])
    jax.block_until_ready((p, s, m))
    runs[name] = [dp, p, s, sharded, []]
  for _ in range(3):
    for name, (_, every) in modes.items():
      dp, p, s, sharded, times = runs[name]
      t0 = time.perf_counter()
      for i in range(steps):
        p, s, m = dp.step(p, s, sharded[i % 8])
        if every and i % every == every - 1:
          float(m["loss"])
      jax.block_until_ready((p, s, m))
      times.append(time.perf_counter() - t0)
      runs[name][1:3] = [p, s]
  print(f"| loop ({steps} steps, 8 CPU devices) | ms/step |")
  print("|---|---:|")
  for name, run in runs.items():
    print(f"| {name} | {1e3 * np.median(run[4]) / steps:.2f} |")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
