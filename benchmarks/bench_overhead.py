"""Per-step compute overhead of every compressor, on this machine's backend.

For the CIFAR ResNet-18 gradient shapes (62 leaves, 11,173,962 parameters),
times one jitted ``tx.update`` with ``axis_name=None`` (the compressor's own
arithmetic, no collective) for every compressor of ``bench_wire.CONFIGS``
and prints the median and the overhead over the dense ``mean_gradients``
update, measured in the same run, round-robin (every round times every
compressor once, so a slow moment of a shared machine hits all of them).
Wall-clock figures, no pass/fail: on a 2-core CPU they show the trend (how
many passes over the gradients a compressor makes); on a GPU they are the
per-step overhead the engine issue targets (at most 0.5 ms).

Run: ``python -m benchmarks.bench_overhead [--rounds 7] [--json PATH]``.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm
from benchmarks._common import resnet18_shapes
from benchmarks.bench_wire import CONFIGS
from benchmarks.bench_wire import _label


def _grads(shapes, seed=0):
  rng = np.random.RandomState(seed)
  return {k: jnp.asarray(rng.randn(*s).astype(np.float32))
          for k, s in shapes.items()}


# PowerSGD's options that trade kernel launches for arithmetic: timed beside
# the defaults (the defaults were chosen on CPU).
VARIANTS = [
  ("powersgd r4, batched", lambda **kw: jaxcomm.powersgd(
    4, batch_same_shape=True, **kw)),
  ("powersgd r4, cholesky", lambda **kw: jaxcomm.powersgd(
    4, orthogonalization="cholesky", **kw)),
  ("powersgd r4, batched + cholesky", lambda **kw: jaxcomm.powersgd(
    4, batch_same_shape=True, orthogonalization="cholesky", **kw)),
  ("powersgd r4, gram_schmidt", lambda **kw: jaxcomm.powersgd(
    4, orthogonalization="gram_schmidt", **kw)),
]


# The baseline every row is compared with: the dense mean's label.
DENSE = _label(jaxcomm.registry.get("dense", "compressor"))


def measure(rounds: int = 7, only=None) -> dict:
  """Median ms of one update per compressor name."""
  shapes = resnet18_shapes()
  params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
  grads = _grads(shapes)
  fns = {}
  for name, make in CONFIGS + VARIANTS:
    if only and name not in only and name != DENSE:
      continue
    tx = make(axis_name=None)   # the same compressor, no collectives
    state = tx.init(params)
    fn = jax.jit(tx.update)
    jax.block_until_ready(fn(grads, state, params))      # compile + warm
    fns[name] = (fn, state)
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, (fn, state) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(grads, state, params))
      times[name].append(1e3 * (time.perf_counter() - t0))
  return {name: statistics.median(ts) for name, ts in times.items()}


def table(ms: dict) -> str:
  dense = ms[DENSE]
  rows = ["| compressor | ms / update | overhead ms | x dense |",
          "|---|---:|---:|---:|"]
  for name, t in ms.items():
    rows.append(f"| {name} | {t:.2f} | {t - dense:+.2f} | {t / dense:.1f} |")
  return "\n".join(rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--only", default="",
                      help="config names separated by ';' (or by ',' when "
                      "no name has one; dense is kept)")
  parser.add_argument("--json", default="")
  args = parser.parse_args(argv if argv is not None else [])
  only = set(filter(None, args.only.split(";" if ";" in args.only
                                          else ",")))
  ms = measure(args.rounds, only)
  print(f"ResNet-18 (CIFAR) gradient, 62 leaves, 11,173,962 parameters; "
        f"backend {jax.default_backend()}, {jax.device_count()} devices "
        f"visible, jax {jax.__version__}; tx.update with axis_name=None, "
        f"median of {args.rounds} round-robin rounds.\n")
  print(table(ms))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"backend": jax.default_backend(), "jax": jax.__version__,
                 "ms": ms}, f, indent=1)


if __name__ == "__main__":
  import sys  # noqa: PLC0415
  main(sys.argv[1:])
