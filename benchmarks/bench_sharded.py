"""A sharded model with compression across slices only: the transformer LM
split by its logical axes over (dcn=2, fsdp=4) CPU devices, the step of
``DataParallel(..., axis_name="dcn", auto_axes=("fsdp",))`` per
compressor, next to the plain ``jax.jit`` step a pod trainer compiles
(XLA's own float32 all-reduce over every device).

Per row, from one compiled program each: bytes each device sends across
``dcn`` (HLO, groups of 2; with the claim for one device's shards), bytes
gathered over the fast axis (FSDP's weight gathers; all-to-all too),
compiled memory per device (arguments + temporaries), and the CPU step
time (median). Simulated devices share this machine's cores: the times say
what the compressors cost in compute, not what a slow link would save.

  python -m benchmarks.bench_sharded --steps 5 \
      --out docs/benchmarks/sharded.md

With ``--memory``: every registered compressor (train.py's defaults) on
the same LM at fsdp=2 and fsdp=4, its compiled step's memory per device
without its optimizer state (what the state holds is the residual the
method keeps by definition) against the plain step's at the same fsdp:

  python -m benchmarks.bench_sharded --memory \
      --out docs/benchmarks/sharded_memory.md
"""

from __future__ import annotations

import argparse
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from benchmarks import _common  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from jaxcomm import wire  # noqa: E402
from models import transformer  # noqa: E402
from trainer import config  # noqa: E402

CONFIG = dict(vocab_size=128, d_model=256, num_heads=8, num_layers=2,
              d_ff=1024, max_len=64)
COMPRESSORS = {
  "mean_gradients (dense f32)": lambda: jaxcomm.mean_gradients(
    axis_name="dcn"),
  "cast bf16": lambda: jaxcomm.cast(jnp.bfloat16, axis_name="dcn"),
  "int8": lambda: jaxcomm.int8(axis_name="dcn"),
  "topk 0.01 + EF": lambda: jaxcomm.topk(0.01, axis_name="dcn"),
  "powersgd r4": lambda: jaxcomm.powersgd(4, axis_name="dcn"),
  "onebit": lambda: jaxcomm.onebit(axis_name="dcn"),
}


def _model(mesh):
  return transformer.sharded(mesh, **CONFIG)


def _split(ops):
  data = sum(wire.sent_bytes(o.kind, o.payload, o.group) for o in ops
             if o.group == 2)
  gathers = sum(o.payload for o in ops if o.group != 2 and o.kind in (
    "all-gather", "all-to-all"))
  return data, gathers


def _memory(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes)


def _memory_table(batch, only=None) -> str:
  """The ``--memory`` table: per registered compressor, compiled memory
  per device without its state, over the plain step's, fsdp 2 and 4."""
  names = [n for n in config.available_compressors()
           if only is None or n in only]
  cols, plain = {}, {}
  for fsdp in (2, 4):
    mesh = jax.make_mesh((2, fsdp), ("dcn", "fsdp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:2 * fsdp])
    loss_fn, placed, specs = _model(mesh)
    on_mesh = jax.device_put(batch, NamedSharding(mesh, P(("dcn", "fsdp"))))

    def step(p, b, loss_fn=loss_fn):
      loss, g = jax.value_and_grad(loss_fn)(p, b)
      return jax.tree.map(lambda a, d: a - 0.01 * d, p, g), loss
    plain[fsdp] = _memory(jax.jit(step).lower(placed, on_mesh).compile())
    for name in names:
      comp, _, _ = config.build_compressor(name, axis_name="dcn")
      tx = optax.chain(comp, optax.sgd(0.01))
      dp = parallel.DataParallel(loss_fn, tx, mesh, axis_name="dcn",
                                 auto_axes=("fsdp",), donate=False)
      params, state = dp.init(placed)
      c = dp.lower(params, state, dp.shard_batch(batch)).compile()
      state_bytes = sum(x.addressable_shards[0].data.nbytes
                        for x in jax.tree.leaves(state))
      cols.setdefault(name, {})[fsdp] = (_memory(c) - state_bytes,
                                         state_bytes)
      print(f"  fsdp={fsdp} {name}: {cols[name][fsdp][0] / 1e6:.2f} MB",
            file=sys.stderr, flush=True)
  lines = [
    "`python -m benchmarks.bench_sharded --memory`", "",
    f"Transformer LM ({CONFIG}), mesh (dcn=2, fsdp) of CPU devices, jax "
    f"{jax.__version__}; each compressor with train.py's defaults, then "
    "SGD. Memory per device: the compiled step's arguments and "
    "temporaries less its optimizer state, over the plain jit step's "
    f"(fsdp=2: {plain[2] / 1e6:.2f} MB, fsdp=4: {plain[4] / 1e6:.2f} MB).",
    "",
    "| compressor | fsdp=2 (MB) | vs plain | fsdp=4 (MB) | vs plain | "
    "state at fsdp=4 (MB) |",
    "|---|---:|---:|---:|---:|---:|"]
  for name in sorted(cols, key=lambda n: -cols[n][4][0] / plain[4]):
    (m2, _), (m4, s4) = cols[name][2], cols[name][4]
    lines.append(f"| {name} | {m2 / 1e6:.2f} | {m2 / plain[2]:.2f}x | "
                 f"{m4 / 1e6:.2f} | {m4 / plain[4]:.2f}x | {s4 / 1e6:.2f} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--out", default=None)
  ap.add_argument("--memory", action="store_true",
                  help="the memory table of every registered compressor")
  ap.add_argument("--only", default=None,
                  help="with --memory: comma-separated compressor names")
  args = ap.parse_args(argv)
  if args.memory:
    rng = np.random.RandomState(0)
    tok = rng.randint(0, CONFIG["vocab_size"],
                      size=(args.batch, CONFIG["max_len"] + 1)).astype(
                        np.int32)
    text = _memory_table({"x": tok[:, :-1], "y": tok[:, 1:]},
                         args.only.split(",") if args.only else None)
    print(text)
    if args.out:
      with open(args.out, "w") as f:
        f.write(text + "\n")
    return
  mesh = jax.make_mesh((2, 4), ("dcn", "fsdp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  loss_fn, placed, specs = _model(mesh)
  rng = np.random.RandomState(0)
  tok = rng.randint(0, CONFIG["vocab_size"],
                    size=(args.batch, CONFIG["max_len"] + 1)).astype(np.int32)
  batch = {"x": tok[:, :-1], "y": tok[:, 1:]}
  on_mesh = jax.device_put(batch, NamedSharding(mesh, P(("dcn", "fsdp"))))
  shards = parallel.shard_shapes(placed, specs, mesh)
  n_params = sum(int(np.size(x)) for x in jax.tree.leaves(placed))

  def plain(p, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    return jax.tree.map(lambda a, c: a - 0.01 * c, p, g), loss
  plain = jax.jit(plain)
  compiled = plain.lower(placed, on_mesh).compile()
  ops = wire.collectives(compiled)
  base_mem = _memory(compiled)
  base_gather = _split(ops)[1]
  base_ms = _common.time_ms(plain, placed, on_mesh, reps=args.steps)
  print(f"  plain: {base_ms:.1f} ms", file=sys.stderr, flush=True)
  # The plain step's gradient all-reduce spans all 8 devices: what one
  # device sends for it (ring), of which the cross-slice part is the
  # payload a dense all-reduce between the 2 slices would move.
  grad_ar = sum(wire.sent_bytes(o.kind, o.payload, o.group) for o in ops
                if o.kind == "all-reduce")
  rows = [("plain jit step (XLA all-reduce, f32)", None, grad_ar,
           base_gather, base_mem, base_ms)]
  for name, make in COMPRESSORS.items():
    comp = make()
    tx = optax.chain(comp, optax.sgd(0.01))
    dp = parallel.DataParallel(loss_fn, tx, mesh, axis_name="dcn",
                               auto_axes=("fsdp",), donate=False)
    params, state = dp.init(placed)
    b = dp.shard_batch(batch)
    c = dp.lower(params, state, b).compile()
    data, gathers = _split(wire.collectives(c))
    claim = wire.summarize(wire.claimed(
      comp, shards, 2, splits=parallel.shard_splits(specs, mesh)),
      2).total_sent
    step = lambda p, s, x, dp=dp: dp.step(p, s, x)
    ms = _common.time_ms(step, params, state, b, reps=args.steps)
    rows.append((name, claim, data, gathers, _memory(c), ms))
    print(f"  {name}: {ms:.1f} ms", file=sys.stderr, flush=True)
  lines = [
    f"Transformer LM ({n_params:,} params: {CONFIG}), batch {args.batch} "
    f"x {CONFIG['max_len']}, mesh (dcn=2, fsdp=4) of CPU devices, jax "
    f"{jax.__version__}.", "",
    "| step | claim across dcn (B/device) | HLO across dcn (B/device) | "
    "gathered over fsdp (B) | memory/device (MB) | vs plain | "
    "CPU step (ms) |",
    "|---|---:|---:|---:|---:|---:|---:|"]
  for name, claim, data, gathers, mem, ms in rows:
    lines.append(
      f"| {name} | {'' if claim is None else f'{claim:,.0f}'} | "
      f"{data:,.0f} | {gathers:,} | {mem / 1e6:.2f} | "
      f"{mem / base_mem:.2f}x | {ms:.1f} |")
  lines.append("")
  lines.append(
    "The plain step's row counts its whole gradient all-reduce (over all 8 "
    "devices, fast and slow links alike). Compressed rows count only what "
    "crosses dcn; the all-reduce of the gradient inside a slice (the "
    "compiler's, over fsdp) is left out of both columns.")
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
