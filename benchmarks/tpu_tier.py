"""The TPU tier's memory rows as a table (compile-only, libtpu).

For each battery entry named (default: every entry), compiles its step as
``tests/test_tpu.py`` does (the tier's model and mesh: sharded on two v5e
slices, block mode on two v6e slices) and prints the memory per chip the
tier checks (temporaries and arguments, less the optimizer state) over the
plain SGD jit step's and over the plain step of the optimizer a whole
optimizer replaces, and whether it is within the tier's bound. Figures,
not pass/fail.

  python -m benchmarks.tpu_tier --entry atomo_s2 --entry fetchsgd
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import optax  # noqa: E402

from jaxcomm import aot  # noqa: E402
from tests import test_tpu as tier  # noqa: E402

GENERATION = {"sharded": "v5e", "block": "v6e"}


def row(name: str, mode: str) -> str:
  gen = GENERATION[mode]
  tx = tier.ENTRIES[name].make(axis_name="dcn", **tier.KWARGS.get(name, {}))
  fig, state, _, _ = tier._compile(  # pylint: disable=protected-access
    optax.chain(tx, optax.sgd(0.1)), gen, mode)
  used = aot.memory_per_chip(fig, state)
  sgd = aot.memory_per_chip(tier._plain(gen))  # pylint: disable=protected-access
  own = tier._plain_memory(gen, name)  # pylint: disable=protected-access
  bound = tier.TEMP_RATIO * own + tier.TEMP_SLACK
  return (f"| {name} | {mode} ({gen}) | {fig.temp / 1e6:.2f} | "
          f"{used / 1e6:.2f} | {used / sgd:.2f}x | {used / own:.2f}x | "
          f"{'within' if used <= bound else 'over'} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--entry", action="append", default=None,
                      choices=sorted(tier.ENTRIES))
  parser.add_argument("--mode", action="append", default=None,
                      choices=sorted(GENERATION))
  args = parser.parse_args(argv)
  print("| entry | mode | temporaries MB | memory MB | vs plain SGD | "
        "vs its own plain step | bound |")
  print("|---|---|---:|---:|---:|---:|---|")
  for name in args.entry or sorted(tier.ENTRIES):
    for mode in args.mode or ("sharded", "block"):
      print(row(name, mode), flush=True)


if __name__ == "__main__":
  main()
