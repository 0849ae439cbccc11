"""The transformer LM compiled for TPU slices, compile-only (libtpu): per
method, per chip, against the plain jit step compiled the same way.

For each topology and slice count: compile time, memory per chip
(temporaries; arguments include the optimizer state), bytes handed to the
cross-slice runtime and bytes crossing slices (``jaxcomm.aot``'s count),
and the step time estimated as the TPU compiler's own estimate plus the
crossing bytes over 25 and 100 Gbit/s of DCN per chip (no overlap
assumed). Figures, not pass/fail.

  python -m benchmarks.bench_tpu --size 350m --topology v5e:2x2 \\
      --topology v5p:2x2x1 --slices 2 --slices 4 \\
      --out docs/benchmarks/tpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import optax  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm import aot  # noqa: E402

METHODS = {
  "mean_gradients": lambda: jaxcomm.mean_gradients(axis_name="dcn"),
  "bf16": lambda: jaxcomm.cast("bfloat16", axis_name="dcn"),
  "int8": lambda: jaxcomm.int8(axis_name="dcn"),
  "int4": lambda: jaxcomm.int4(axis_name="dcn"),
  "qsgd": lambda: jaxcomm.qsgd(axis_name="dcn"),
  "topk 1%": lambda: jaxcomm.topk(0.01, axis_name="dcn"),
  "dgc 1%": lambda: jaxcomm.dgc(0.01, axis_name="dcn"),
  "powersgd r4": lambda: jaxcomm.powersgd(rank=4, axis_name="dcn"),
  "onebit": lambda: jaxcomm.onebit(axis_name="dcn"),
  "signum": lambda: jaxcomm.signum(axis_name="dcn"),
}
GBPS = (25.0, 100.0)


def _mib(b):
  return b / 2**20


def run(size, topology, slices, methods, batch_size=None):
  mesh = aot.slice_mesh(topology, slices)
  loss_fn, params, batch = aot.transformer(mesh, size, batch=batch_size)
  hbm = aot.HBM.get(aot.generation(mesh), 0)
  compiled, secs = aot.compile_lowered(
    aot.plain_step(loss_fn).lower(params, batch))
  base = aot.analyze(compiled, secs, slices=slices, hbm=hbm)
  rows = [_row("plain jit step", base, base, 0)]
  print(rows[-1], flush=True)
  for name in methods:
    tx = optax.chain(METHODS[name](), optax.sgd(0.1))
    try:
      compiled, secs, state = aot.compile_method(loss_fn, params, batch,
                                                 mesh, tx)
    except Exception as e:  # a failure is a row, not the end of the table
      rows.append({"method": name, "error": f"{type(e).__name__}: "
                   + str(e).splitlines()[0][:200]})
      print(rows[-1], flush=True)
      continue
    fig = aot.analyze(compiled, secs, slices=slices, hbm=hbm)
    rows.append(_row(name, fig, base, aot.state_bytes_per_chip(state)))
    print(rows[-1], flush=True)
  nparams = sum(x.size for x in jax.tree.leaves(params))
  return {"topology": topology, "slices": slices, "size": size,
          "batch": int(batch["x"].shape[0]),
          "params": int(nparams), "generation": aot.generation(mesh),
          "chips": int(mesh.devices.size), "rows": rows}


def _row(name, fig, base, state):
  est = {g: fig.step_seconds(g) for g in GBPS}
  return {
    "method": name, "compile_s": fig.compile_seconds,
    "compile_x": fig.compile_seconds / base.compile_seconds,
    "temp": fig.temp, "temp_x": fig.temp / base.temp,
    "argument": fig.argument, "state": state, "peak": fig.peak,
    "fits": fig.fits, "handed": fig.handed, "crossing": fig.crossing,
    "crossing_x": fig.crossing / base.crossing if base.crossing else 0.0,
    "compute_s": fig.optimal_seconds, "unknown_cost_ops":
    fig.unknown_cost_ops, "mosaic": fig.mosaic,
    "step_s": {str(g): v for g, v in est.items()},
    "transfers": sorted({t.kind for t in fig.transfers})}


def table(result) -> str:
  lines = [
    f"### {result['topology']} x {result['slices']} slices "
    f"({result['chips']} chips, {result['generation']}), transformer "
    f"{result['size']} ({result['params'] / 1e6:.0f}M params, batch "
    f"{result['batch']} x 1024 tokens)", "",
    "| step | compile s (x plain) | temp MiB/chip (x plain) | state "
    "MiB/chip | handed MiB | crossing MiB (x plain) | est. step ms at "
    "25 / 100 Gbit/s |", "|---|---:|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    if "error" in r:
      lines.append(f"| {r['method']} | fails to compile: {r['error']} "
                   "| | | | | |")
      continue
    steps = " / ".join("n/a" if v is None else f"{v * 1e3:.1f}"
                       for v in r["step_s"].values())
    lines.append(
      f"| {r['method']} | {r['compile_s']:.1f} ({r['compile_x']:.1f}x) | "
      f"{_mib(r['temp']):.1f} ({r['temp_x']:.2f}x) | "
      f"{_mib(r['state']):.1f} | {_mib(r['handed']):.2f} | "
      f"{_mib(r['crossing']):.2f} ({r['crossing_x']:.3f}x) | {steps} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="350m", choices=sorted(aot.SIZES))
  p.add_argument("--topology", action="append")
  p.add_argument("--slices", type=int, action="append")
  p.add_argument("--method", action="append", choices=sorted(METHODS))
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per step (default: the size's)")
  p.add_argument("--out", default=None)
  p.add_argument("--json", default=None)
  p.add_argument("--overlap", action="store_true",
                 help="the bucket-cap sweep of overlap() instead")
  args = p.parse_args(argv)
  if args.overlap:
    text = overlap()
    print(text)
    if args.out:
      with open(args.out, "w") as f:
        f.write(text)
    return 0
  results = []
  for topo in args.topology or ["v5e:2x2"]:
    for s in args.slices or [2]:
      print(f"== {topo} x {s} slices", flush=True)
      results.append(run(args.size, topo, s, args.method or list(METHODS),
                         args.batch))
      if args.json:
        with open(args.json, "w") as f:
          json.dump(results, f, indent=1)
  text = "\n".join(table(r) for r in results)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  return 0



def overlap(topology="v5e:2x2", slices=2, dim=1024,
            caps=(None, 4 << 20, 1 << 20, 256 << 10)):
  """WFBP on TPU: for each bucket cap (``LeafPolicy(bucket_bytes=)``), the
  fraction of the backward pass scheduled after the first cross-slice
  send starts, and the compiler's step estimate, on the MLP of ``8 dim^2``
  params (``python -m benchmarks.bench_tpu --overlap``)."""
  mesh = aot.slice_mesh(topology, slices)
  loss_fn, params, batch = aot.mlp(mesh, dim)
  compiled, _ = aot.compile_lowered(
    aot.plain_step(loss_fn).lower(params, batch))
  base = aot.analyze(compiled, slices=slices)
  lines = [f"### Overlap with the backward pass ({topology} x {slices} "
           f"slices, MLP of {8 * dim * dim / 1e6:.1f}M params)", "",
           "| step | bucket cap | backward after the first send | "
           "cross-slice sends | compiler's estimate (us) |",
           "|---|---|---:|---:|---:|",
           f"| plain jit step | per leaf (XLA) | "
           f"{aot.backward_after_first_send(compiled):.1%} | "
           f"{len(base.transfers)} | {base.optimal_seconds * 1e6:.0f} |"]
  for name, make in (("bf16", lambda p: jaxcomm.cast(
      "bfloat16", axis_name="dcn", policy=p)),
                     ("topk 1%", lambda p: jaxcomm.topk(
                       0.01, axis_name="dcn", policy=p)),
                     ("powersgd r4", lambda p: jaxcomm.powersgd(
                       4, axis_name="dcn", policy=p))):
    for cap in caps:
      policy = jaxcomm.LeafPolicy(bucket_bytes=cap)
      tx = optax.chain(make(policy), optax.sgd(0.1))
      compiled, _, _ = aot.compile_method(loss_fn, params, batch, mesh, tx)
      fig = aot.analyze(compiled, slices=slices)
      frac = aot.backward_after_first_send(compiled)
      lines.append(
        f"| {name} | {'one bucket' if cap is None else f'{cap >> 10} KiB'}"
        f" | {'n/a' if frac is None else f'{frac:.1%}'} | "
        f"{len(fig.transfers)} | {fig.optimal_seconds * 1e6:.0f} |")
      print(lines[-1], flush=True)
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
