"""Benchmark of the quantization family (markdown tables, no asserts).

1. On a 25M-element float32 gradient, on the default backend: sign packing,
   unpacking and the 8-worker packed vote, next to ``jnp.packbits``, and the
   whole onebit worker compression (residual add, scale, pack, residual
   update), each as a ratio to one memory copy of the buffer.
2. Bytes on the wire per device per step for each compressor against the
   dense float32 psum, for ResNet-18 (CIFAR) parameter shapes at n = 8,
   from :func:`jaxcomm.wire.claimed`; for some compressors spot-checked
   against the collectives of the compiled 8-device step.

Run: ``python -m benchmarks.bench_quantization [--size N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxcomm  # noqa: E402
from benchmarks._common import resnet18_shapes  # noqa: E402
from benchmarks._common import time_ms  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from jaxcomm.collectives import _signs  # noqa: E402
from jaxcomm.kernels import bitpack  # noqa: E402


@jax.jit
def onebit_compress(g, e):
  """onebit's worker stage on one flat leaf: what each step does locally."""
  x = g + e
  scale = _signs.worker_scales(x, [x.shape[0]])[0]
  words = bitpack.pack_signs(x)
  return words, scale, x - scale * jnp.where(x >= 0, 1.0, -1.0)


COMPRESSORS = [
  ("mean_gradients (dense psum)", jaxcomm.mean_gradients),
  ("onebit", jaxcomm.onebit),
  ("signsgd (majority vote)", jaxcomm.signsgd),
  ("signum (majority vote)", jaxcomm.signum),
  ("ef_signsgd", jaxcomm.ef_signsgd),
  ("qsgd(127, 128)", jaxcomm.qsgd),
  ("qsgd(7, 512)", lambda **kw: jaxcomm.qsgd(7, 512, **kw)),
  ("terngrad", jaxcomm.terngrad),
  ("int8(128)", jaxcomm.int8),
  ("natural", jaxcomm.natural),
]
SPOT_CHECK = ("onebit", "signsgd (majority vote)", "int8(128)")


def _hlo_sent(tx, params, n):
  """Bytes sent per device by the compiled n-device step (None if < n)."""
  if len(jax.devices()) < n:
    return None
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = parallel.state_layout(tx, params, mesh, "data")
  specs = parallel.state_specs(layout, "data")
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  def step(params, state, grads):
    local = parallel.to_local(state, layout)
    upd, new = tx.update(jax.tree.map(lambda g: g[0], grads), local, params)
    return upd, parallel.to_global(new, layout)

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs,
                                                        P("data")),
                             out_specs=(P(), specs)))
  state = parallel.init_state(tx, params, mesh, "data", layout)
  grads = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct((n,) + p.shape, p.dtype), params)
  lowered = fn.lower(params, state, grads)
  return jaxcomm.wire.report(lowered, params=params).total_sent


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=25_000_000)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--workers", type=int, default=8)
  args = parser.parse_args([] if argv is None else argv)
  n, reps = args.size, args.reps

  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  e = 0.1 * jax.random.normal(jax.random.key(1), (n,), jnp.float32)
  copy_ms = time_ms(jax.jit(lambda v: v + 0), x, reps=reps)
  rows = [("copy (`x + 0`)", copy_ms, "baseline: read + write 4 B/elem")]
  rows.append(("`jnp.packbits(x > 0)` (uint8)",
               time_ms(jax.jit(lambda v: jnp.packbits(v > 0)), x, reps=reps),
               ""))
  rows.append(("bitpack.pack_signs (default path)",
               time_ms(bitpack.pack_signs, x, reps=reps),
               f"backend={jax.default_backend()}"))
  words = bitpack.pack_signs(x)
  rows.append(("bitpack.unpack_signs (default path)",
               time_ms(lambda w: bitpack.unpack_signs(w, n), words, reps=reps),
               "writes 4 B/elem"))
  stacked = jnp.stack([words] + [words ^ jnp.uint32(i * 2654435761 %
                                                    2 ** 32)
                                 for i in range(1, args.workers)])
  rows.append((f"bitpack.vote, {args.workers} workers (default path)",
               time_ms(lambda w: bitpack.vote(w, n), stacked, reps=reps),
               "input: packed words"))
  rows.append(("onebit compress (g + e, scale, pack, e')",
               time_ms(onebit_compress, x, e, reps=reps),
               "reads g, e; writes e' and 1/32 words"))

  print(f"\nquantization kernels on {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), n={n:,} float32, median of "
        f"{reps}\n")
  print("| op | ms | x copy | note |")
  print("|---|---:|---:|---|")
  for name, ms, note in rows:
    print(f"| {name} | {ms:.1f} | {ms / copy_ms:.2f} | {note} |")

  params = {k: jnp.zeros(v) for k, v in resnet18_shapes().items()}
  devices = 8
  total = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  dense = jaxcomm.wire.summarize(
    [("all-reduce", 4 * total)], n=devices, params=params).total_sent
  print(f"\nbytes on the wire per device per step, ResNet-18 shapes "
        f"({total:,} float32), n={devices}; ring formulas "
        "(jaxcomm.wire); default leaf policy (leaves >= 256 elements "
        "compressed, the rest in one fused psum)\n")
  print("| compressor | claimed MB sent | vs dense psum | bits/param | "
        "compiled HLO MB |")
  print("|---|---:|---:|---:|---:|")
  for name, factory in COMPRESSORS:
    tx = factory(axis_name="data")
    claim = jaxcomm.wire.summarize(
      jaxcomm.wire.claimed(tx, params, devices), n=devices, params=params)
    hlo = ""
    if name in SPOT_CHECK:
      sent = _hlo_sent(tx, params, devices)
      hlo = "n/a (< 8 devices)" if sent is None else f"{sent / 1e6:.3f}"
    print(f"| {name} | {claim.total_sent / 1e6:.3f} | "
          f"{dense / claim.total_sent:.1f}x | "
          f"{8 * claim.total_sent / total:.2f} | {hlo} |")


if __name__ == "__main__":
  main(sys.argv[1:])
