"""Battery entries compiled for TPU on a model of the shape family
(``tests/tpu_shapes.py``), as ``tests/test_tpu_shapes.py`` compiles them:
memory per chip over the plain step's, compile time over the plain
step's, and the layout lint's findings. Figures, not pass/fail
(compile-only, libtpu).

  python -m benchmarks.tpu_shapes --model odd_6m --entry onebit \\
      --entry dist_ef_sgdm
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import optax  # noqa: E402

from jaxcomm import aot  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from tests import test_tpu as tier  # noqa: E402
from tests import test_tpu_shapes as family  # noqa: E402
from tests import tpu_shapes  # noqa: E402


def row(name: str, model: str, gen: str) -> str:
  loss_fn, params, batch = family._model(model, gen)  # pylint: disable=protected-access
  _, base = family._plain(model, gen)  # pylint: disable=protected-access
  tx = tier.ENTRIES[name].make(axis_name="dcn",
                               **family.KWARGS.get(name, {}))
  dp = parallel.DataParallel(loss_fn, optax.chain(tx, optax.sgd(0.1)),
                             tier._mesh(gen), axis_name="dcn",  # pylint: disable=protected-access
                             auto_axes=("fsdp",), donate=False)
  try:
    p, state = dp.init(params)
    compiled, secs = aot.compile_lowered(dp.lower(p, state, batch))
  except Exception as e:  # noqa: BLE001  (a row: what failed, and why)
    return f"| {name} | does not compile: {str(e).splitlines()[0][:120]} |"
  fig = aot.analyze(compiled, secs, slices=tier.SLICES)
  used = aot.memory_per_chip(fig, state)
  plain = family._plain_memory(model, gen, name)  # pylint: disable=protected-access
  found = aot.padded_buffers(compiled, min_bytes=tier.lint_limit(base.temp))
  lint = "; ".join(str(f) for f in found[:2]) or "clean"
  return (f"| {name} | {used / 2**20:.1f} | {used / plain:.2f}x | "
          f"{secs:.1f} | {secs / max(base.compile_seconds, 1e-9):.1f}x | "
          f"{lint} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="mixed", choices=tpu_shapes.MODELS)
  parser.add_argument("--gen", default="v5e", choices=sorted(tier.GENERATIONS))
  parser.add_argument("--entry", action="append",
                      help="a battery entry (repeatable; default: every one)")
  args = parser.parse_args(argv)
  names = args.entry or tier.NAMES
  for name in names:
    if name not in tier.ENTRIES:
      parser.error(f"--entry: unknown entry {name!r}")
  _, base = family._plain(args.model, args.gen)  # pylint: disable=protected-access
  print(f"{args.model} on {args.gen}:2x2 x {tier.SLICES} slices: plain step "
        f"{aot.memory_per_chip(base) / 2**20:.1f} MiB a chip (temporaries "
        f"{base.temp / 2**20:.1f} MiB), compile {base.compile_seconds:.1f} s")
  print("| entry | MiB a chip | x plain | compile s | x plain | lint |")
  print("|---|---:|---:|---:|---:|---|")
  for name in names:
    print(row(name, args.model, args.gen), flush=True)


if __name__ == "__main__":
  main()
