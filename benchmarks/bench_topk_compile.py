"""TPU compile time of the selection ops, compile-only (libtpu).

The TPU compiler's code generation of a sort, and of a 1-D prefix sum,
grows with its length; a step that takes a top-k of a large leaf spends
most of its compile there. Two tables, each measured in this one run:

1. One chip: ``lax.top_k(|x|, k)`` against
   :func:`jaxcomm.kernels.topk.topk_abs_radix_segments` (value order, and
   ``order="any"``), and ``jnp.cumsum`` of a 1-D int32 array against the
   blocked ``jaxcomm._prefix.prefix_sum``; seconds of ``.compile()``.
2. Steps: the sparse battery entries compiled as ``tests/test_tpu.py``
   compiles them (the tier's model, sharded on two v5e slices) with
   ``JAXCOMM_TOPK_SEARCH=sort`` (``lax.top_k``, the default) and ``radix``
   (leaves from ``RADIX_TOPK_MIN_SIZE`` entries): compile seconds over the
   plain jit step's, the compiler's estimate of a step's run time
   (``optimal_seconds``) and the memory a chip. The radix search trades
   run time for compile time.

  python -m benchmarks.bench_topk_compile [--sizes 4096,65536] [--no-steps]

One run on a shared CPU host is noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomm import _prefix  # noqa: E402
from jaxcomm import aot  # noqa: E402
from jaxcomm.kernels import topk  # noqa: E402

STEP_ENTRIES = ("topk_ef", "threshold_ef", "stc_ef",
                "dgc_warmup_exact", "gtopk_ef", "sparcml_ef", "mgs_merged",
                "scalecom_ef", "adacomp_ef")


def _seconds(fn, n, dtype, sharding) -> float:
  x = jax.ShapeDtypeStruct((n,), dtype, sharding=sharding)
  lowered = jax.jit(fn).lower(x)
  t = time.perf_counter()
  lowered.compile()
  return time.perf_counter() - t


def ops_table(sizes, topology: str) -> None:
  devices = aot.topology_devices(topology, 1)
  sharding = NamedSharding(Mesh(devices[:1].reshape(1), ("x",)), P())
  _seconds(lambda x: x * 2, 1024, jnp.float32, sharding)    # warm-up
  print(f"One {topology} chip, compile seconds (libtpu compile-only):\n")
  print("| entries | k | lax.top_k | radix (value order) | radix (any) | "
        "cumsum int32 | prefix_sum |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for n in sizes:
    k = max(1, n // 100)
    a = _seconds(lambda x, k=k: lax.top_k(jnp.abs(x), k), n, jnp.float32,
                 sharding)
    b = _seconds(lambda x, k=k, n=n: topk.topk_abs_radix_segments(
      x, [(0, 1, n, k)]), n, jnp.float32, sharding)
    c = _seconds(lambda x, k=k, n=n: topk.topk_abs_radix_segments(
      x, [(0, 1, n, k)], order="any"), n, jnp.float32, sharding)
    d = _seconds(lambda x: jnp.cumsum(x, dtype=jnp.int32), n, jnp.int32,
                 sharding)
    e = _seconds(lambda x: _prefix.prefix_sum(x, jnp.int32), n, jnp.int32,
                 sharding)
    print(f"| {n:,} | {k:,} | {a:.2f} | {b:.2f} | {c:.2f} | {d:.2f} | "
          f"{e:.2f} |", flush=True)


def steps_table(names) -> None:
  import optax  # pylint: disable=import-outside-toplevel

  from jaxcomm.kernels import _dispatch  # pylint: disable=import-outside-toplevel
  from tests import test_tpu as tier  # pylint: disable=import-outside-toplevel

  def compile_step(name):
    tx = tier.ENTRIES[name].make(axis_name="dcn", **tier.KWARGS.get(name, {}))
    fig, state, _, _ = tier._compile(  # pylint: disable=protected-access
      optax.chain(tx, optax.sgd(0.1)), "v5e", "sharded")
    return fig, aot.memory_per_chip(fig, state)

  tier._plain("v5e")  # pylint: disable=protected-access
  plain = tier._plain.__wrapped__("v5e")  # pylint: disable=protected-access
  print(f"\nSteps on the TPU tier's model (sharded, v5e:2x2 x 2 slices), "
        f"plain jit step: compile {plain.compile_seconds:.2f} s, the "
        f"compiler's estimate {plain.optimal_seconds * 1e6:.0f} us, "
        f"{aot.memory_per_chip(plain) / 2**20:.1f} MiB a chip. "
        f"JAXCOMM_TOPK_SEARCH=sort (the default) against radix:\n")
  print("| entry | sort: compile s | x plain | estimate us | MiB | "
        "radix: compile s | x plain | estimate us | MiB |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  saved = os.environ.get(_dispatch.TOPK_SEARCH_VAR)
  for name in names:
    cells = []
    try:
      for search in ("sort", "radix"):
        os.environ[_dispatch.TOPK_SEARCH_VAR] = search
        fig, mem = compile_step(name)
        cells.append(
          f"{fig.compile_seconds:.2f} | "
          f"{fig.compile_seconds / plain.compile_seconds:.1f}x | "
          f"{fig.optimal_seconds * 1e6:.0f} | {mem / 2**20:.1f}")
    finally:
      if saved is None:
        os.environ.pop(_dispatch.TOPK_SEARCH_VAR, None)
      else:
        os.environ[_dispatch.TOPK_SEARCH_VAR] = saved
    print(f"| {name} | {' | '.join(cells)} |", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="4096,16384,65536,1048576",
                      help="comma-separated entry counts")
  parser.add_argument("--topology", default="v5e:2x2")
  parser.add_argument("--no-steps", action="store_true",
                      help="only the one-chip table (the steps take ~2 "
                      "minutes)")
  args = parser.parse_args(argv)
  try:
    aot.topology_devices(args.topology, 1)
  except ValueError as e:
    print(f"skipped: {e}")
    return
  ops_table([int(s) for s in args.sizes.split(",")], args.topology)
  if not args.no_steps:
    steps_table(STEP_ENTRIES)


if __name__ == "__main__":
  main()
