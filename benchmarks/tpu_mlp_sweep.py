"""Every registered compressor on the 8.4M-parameter MLP, compiled for two
TPU slices (compile-only, libtpu), against the plain jit step.

The tier (``tests/test_tpu.py``) checks a 0.5M model, whose fixed costs
can hide what grows with the matrices; this sweep compiles each
compressor at its registry defaults in ``jaxcomm.aot``'s MLP (w1 1024 x
4096 over fsdp by rows, w2 by columns; 8.0 MiB of f32 per chip) and prints
per chip the temporaries, the memory the tier bounds (temporaries and
arguments, less the optimizer state) over the plain step's, the bytes
crossing the slices over the plain step's, and the compile time. Figures,
not pass/fail.

  python -m benchmarks.tpu_mlp_sweep --topology v6e:2x2 [--method adacomp]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import optax  # noqa: E402

from jaxcomm import aot  # noqa: E402
from jaxcomm import registry  # noqa: E402


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v6e:2x2")
  parser.add_argument("--size", type=int, default=1024)
  parser.add_argument("--method", action="append", default=None)
  args = parser.parse_args(argv)
  mesh = aot.slice_mesh(args.topology, 2)
  loss_fn, params, batch = aot.mlp(mesh, args.size)
  compiled, secs = aot.compile_lowered(
    aot.plain_step(loss_fn).lower(params, batch))
  base = aot.analyze(compiled, secs, slices=2)
  plain = aot.memory_per_chip(base)
  print(f"{args.topology} x 2 slices, MLP {args.size}: plain jit step "
        f"temporaries {base.temp / 2**20:.2f} MiB, memory "
        f"{plain / 2**20:.2f} MiB\n")
  print("| method | temporaries MiB | x plain | memory MiB | x plain | "
        "crossing x plain | compile s |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  names = args.method or [m.name for m in registry.methods("compressor")]
  for name in names:
    tx = optax.chain(registry.get(name, "compressor").make(axis_name="dcn"),
                     optax.sgd(0.1))
    c, s, state = aot.compile_method(loss_fn, params, batch, mesh, tx)
    f = aot.analyze(c, s, slices=2)
    used = aot.memory_per_chip(f, state)
    print(f"| {name} | {f.temp / 2**20:.2f} | {f.temp / base.temp:.2f} | "
          f"{used / 2**20:.2f} | {used / plain:.2f} | "
          f"{f.crossing / base.crossing:.3f} | {s:.1f} |", flush=True)


if __name__ == "__main__":
  main()
