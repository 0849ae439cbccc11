"""Compile a train step for two TPU slices on any Linux machine, no TPU.

libtpu (``pip install "jax[tpu]"``) compiles for TPU topologies without a
TPU: nothing is allocated or run. This script takes a Flax NNX MLP as
abstract parameters (``nnx.eval_shape``: shapes, dtypes and shardings, no
values), split over the chips of each slice (``fsdp``), and compiles for
2 slices of a ``v5e:2x2`` pod (8 chips):

* the plain ``jax.jit`` step a sharded trainer writes (XLA's own float32
  reductions over every chip, across slices too), and
* ``jaxcomm.parallel.DataParallel`` steps that compress only across the
  slices: int8 codes and PowerSGD rank 4.

From each compiled program ``jaxcomm.aot`` reads the compiler's memory per
chip (arguments, temporaries, peak against the chip's HBM), the bytes each
chip sends across slices, the compile time and the compiler's step-time
estimate with the crossing bytes at 25 Gbit/s. Run it with::

  python examples/aot_tpu_report.py                     # dim 1024
  python examples/aot_tpu_report.py --topology v6e:2x2 --slices 4
  python examples/aot_tpu_report.py --quick             # dim 256, int8

libtpu may print warnings about the TPU it does not find (accelerator
type, worker hostnames): compiling needs none.
``python -m jaxcomm.aot`` does the same from the command line.
"""

import os

# Eight simulated CPU devices, set before JAX starts, unless JAX_PLATFORMS
# names another platform or XLA_FLAGS already sets a device count. (The
# TPU chips compiled for below are libtpu's compile-only devices.)
_FLAGS = os.environ.get("XLA_FLAGS", "")
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and (
    "xla_force_host_platform_device_count" not in _FLAGS):
  os.environ["XLA_FLAGS"] = (
    _FLAGS + " --xla_force_host_platform_device_count=8").strip()
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm import aot  # noqa: E402


class MLP(nnx.Module):
  """``layers`` GELU layers of width ``4 dim`` and back, residual."""

  def __init__(self, dim: int, layers: int, rngs: nnx.Rngs):
    self.ups = nnx.List([nnx.Linear(dim, 4 * dim, rngs=rngs)
                         for _ in range(layers)])
    self.downs = nnx.List([nnx.Linear(4 * dim, dim, rngs=rngs)
                           for _ in range(layers)])

  def __call__(self, x):
    for up, down in zip(self.ups, self.downs):
      x = x + down(jax.nn.gelu(up(x)))
    return x


def mib(b: float) -> str:
  return f"{b / 2**20:,.2f}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--topology", default="v5e:2x2",
                  help="one slice, e.g. v5e:2x2, v6e:2x2, v5p:2x2x1")
  ap.add_argument("--slices", type=int, default=2)
  ap.add_argument("--dim", type=int, default=1024)
  ap.add_argument("--quick", action="store_true",
                  help="a small model (the test suite's)")
  args = ap.parse_args(argv)
  dim = 256 if args.quick else args.dim

  # The compile-only chips: a mesh ("dcn" across slices, "fsdp" over the
  # chips of a slice). Without libtpu this raises a ValueError saying so.
  try:
    mesh = aot.slice_mesh(args.topology, args.slices)
  except ValueError as e:
    raise SystemExit(f"cannot compile for TPU here: {e}") from e
  hbm = aot.HBM.get(aot.generation(mesh), 0)

  # Abstract params: nnx.eval_shape builds the model without allocating
  # it; each leaf then gets a NamedSharding: a matrix split over fsdp along
  # its axis of width dim (as MaxText's FSDP splits the embedding axis),
  # vectors replicated.
  model = nnx.eval_shape(lambda: MLP(dim, layers=2, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)

  def spec(x):
    if x.ndim < 2:
      return P()
    return P("fsdp", None) if x.shape[0] == dim else P(None, "fsdp")

  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
    x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))), params)
  batch_rows = 16 * mesh.devices.size
  data = jax.ShapeDtypeStruct((batch_rows, dim), jnp.float32,
                              sharding=NamedSharding(mesh, P(("dcn", "fsdp"))))
  batch = {"x": data, "y": data}

  def loss_fn(params, batch):
    out = nnx.merge(graphdef, params)(batch["x"])
    return jnp.mean((out - batch["y"]) ** 2)

  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"{args.topology} x {args.slices} slices ({mesh.devices.size} chips, "
        f"{hbm / 2**30:.0f} GiB HBM each): MLP of {n_params / 1e6:.1f}M "
        "params, compile only")

  # The plain jit step, compiled for the pod (aot.plain_step: the gradient
  # on whole arrays, SGD, XLA's reductions).
  compiled, secs = aot.compile_lowered(
    aot.plain_step(loss_fn).lower(params, batch))
  figures = {"plain jit": aot.analyze(compiled, secs, slices=args.slices,
                                      hbm=hbm)}
  # DataParallel steps manual over "dcn" only, fsdp left to the compiler:
  # each chip compresses its own shards; only the slow axis is compressed.
  compressors = {"int8": jaxcomm.int8(axis_name="dcn"),
                 "powersgd r4": jaxcomm.powersgd(4, axis_name="dcn")}
  if args.quick:
    del compressors["powersgd r4"]
  state_bytes = {"plain jit": 0}
  for name, comp in compressors.items():
    tx = optax.chain(comp, optax.sgd(0.1))
    compiled, secs, state = aot.compile_method(
      loss_fn, params, batch, mesh, tx, data_axis="dcn", auto_axes=("fsdp",))
    figures[name] = aot.analyze(compiled, secs, slices=args.slices, hbm=hbm)
    # The optimizer state a chip keeps (error-feedback residuals), which
    # the arguments include.
    state_bytes[name] = aot.state_bytes_per_chip(state)

  plain = figures["plain jit"]
  print(f"\n{'step':12s} {'compile':>8s} {'arguments':>11s} {'state':>10s} "
        f"{'temporaries':>11s} {'peak':>10s} {'crossing':>10s} "
        f"{'25 Gbit/s':>10s}")
  for name, f in figures.items():
    est = f.step_seconds(25.0)
    print(f"{name:12s} {f.compile_seconds:7.1f}s {mib(f.argument):>11s} "
          f"{mib(state_bytes[name]):>10s} {mib(f.temp):>11s} "
          f"{mib(f.peak):>10s} {mib(f.crossing):>10s} "
          + (f"{est * 1e3:7.2f} ms" if est is not None else "       n/a"))
  print("\n(per chip, MiB; state: the optimizer state among the arguments; "
        "crossing: bytes a chip sends across slices; 25 Gbit/s: the "
        "compiler's step estimate plus the crossing bytes at that rate)")
  for name, f in figures.items():
    if name == "plain jit":
      continue
    print(f"{name}: peak memory {f.peak / plain.peak:.2f}x the plain step's"
          + ("" if f.fits is None else
             f" ({'fits' if f.fits else 'DOES NOT FIT'} in HBM)")
          + f"; bytes across slices {plain.crossing:,.0f} -> "
          f"{f.crossing:,.0f}: {plain.crossing / f.crossing:.1f}x fewer")


if __name__ == "__main__":
  main()
