"""Each kernel op compiled for one TPU chip, compile-only (libtpu): the
Pallas kernel (Mosaic) against the jnp path, by the TPU compiler's own
estimate (``cost_analysis()["optimal_seconds"]``) and its memory. This is
what ``JAXCOMM_KERNELS=auto`` can decide by on TPU without a TPU.

  python -m benchmarks.bench_kernels_tpu [--topology v5e:2x2] [--size N]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomm import aot  # noqa: E402
from jaxcomm.kernels import bitpack  # noqa: E402
from jaxcomm.kernels import threshold  # noqa: E402
from jaxcomm.kernels import topk  # noqa: E402


def _ops(size):
  words = bitpack.num_words(size)
  return {
    "pack_signs": (lambda x, k: bitpack.pack_signs(x, use_kernel=k),
                   (size,), jnp.float32),
    "unpack_signs": (lambda w, k: bitpack.unpack_signs(w, size,
                                                       use_kernel=k),
                     (words,), jnp.uint32),
    "vote (8 rows)": (lambda w, k: bitpack.vote(w, size, use_kernel=k),
                      (8, words), jnp.uint32),
    "topk_abs k=16": (lambda x, k: topk.topk_abs(x, 16, use_kernel=k),
                      (size,), jnp.float32),
    "topk_abs k=64": (lambda x, k: topk.topk_abs(x, 64, use_kernel=k),
                      (size,), jnp.float32),
    "threshold_select": (lambda x, k: threshold.threshold_select(
      x, 0.5, size // 100, use_kernel=k), (size,), jnp.float32),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--size", type=int, default=1 << 22)
  args = p.parse_args(argv)
  dev = aot.topology_devices(args.topology, 1).flat[0]
  mesh = Mesh([dev], ("x",))
  print(f"{args.topology} ({dev.device_kind}), {args.size} elements, jax "
        f"{jax.__version__}\n")
  print("| op | path | compiler's estimate (us) | temp (MiB) | Mosaic "
        "kernels |\n|---|---|---:|---:|---:|")
  for name, (fn, shape, dtype) in _ops(args.size).items():
    arg = jax.ShapeDtypeStruct(shape, dtype,
                               sharding=NamedSharding(mesh, P()))
    for path, use in (("jnp", False), ("kernel", True)):
      with jax.set_mesh(mesh):
        try:
          compiled, secs = aot.compile_lowered(
            jax.jit(lambda a, use=use, fn=fn: fn(a, use)).lower(arg))
        except Exception as e:  # a row, not the end of the table
          print(f"| {name} | {path} | fails: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:120]} | | |")
          continue
      fig = aot.analyze(compiled, secs, slices=1)
      est = ("n/a" if fig.optimal_seconds is None else
             f"{fig.optimal_seconds * 1e6:.1f}")
      if fig.unknown_cost_ops:
        est += f" (+{fig.unknown_cost_ops} op(s) not costed)"
      print(f"| {name} | {path} | {est} | {fig.temp / 2**20:.2f} | "
            f"{fig.mosaic} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
