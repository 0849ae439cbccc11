"""The command line of :mod:`jaxcomm.aot` (internal):
``python -m jaxcomm.aot --help``.

Every flag is checked before the first compile: a bad one ends the command
with one ``error:`` line naming it (exit status 2). A step that does not
fit the chip's HBM is reported in one line, the compiler's per-chip need
beside the capacity (exit status 1).
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxcomm import aot


def _fmt_bytes(b: float) -> str:
  return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def _report(name, fig: aot.Figures, base: aot.Figures | None, gbps):
  ratio = (lambda a, b: f" ({a / b:.2f}x)" if base and b else "")
  lines = [
    f"{name}:",
    f"  compile             {fig.compile_seconds:8.1f} s"
    + (ratio(fig.compile_seconds, base.compile_seconds) if base else ""),
    f"  memory per chip     arguments {_fmt_bytes(fig.argument)}, "
    f"temporaries {_fmt_bytes(fig.temp)}"
    + (ratio(fig.temp, base.temp) if base else "")
    + f", peak {_fmt_bytes(fig.peak)}"
    + ("" if fig.fits is None else
       f" of {_fmt_bytes(fig.hbm)} HBM: "
       + ("fits" if fig.fits else "DOES NOT FIT")),
    f"  across slices       handed {_fmt_bytes(fig.handed)}, crossing "
    f"{_fmt_bytes(fig.crossing)}"
    + (ratio(fig.crossing, base.crossing) if base else "")
    + f" in {len(fig.transfers)} sends ("
    + ", ".join(sorted({t.kind for t in fig.transfers})) + ")",
    f"  Mosaic kernels      {fig.mosaic}",
  ]
  if fig.optimal_seconds is not None:
    est = ", ".join(f"{g:g} Gbit/s {fig.step_seconds(g) * 1e3:.2f} ms"
                    for g in gbps)
    lines.append("  estimated step      compute "
                 f"{fig.optimal_seconds * 1e3:.2f} ms; + crossing bytes at "
                 f"{est}"
                 + (f" ({fig.unknown_cost_ops} ops of unknown cost left "
                    "out)" if fig.unknown_cost_ops else ""))
  print("\n".join(lines), flush=True)


def cli_value(text: str):
  """Internal: a ``--compressor`` argument's value, parsed.

  ``true`` / ``false`` (any case) give a bool, ``none`` None, then an int,
  a float, else the string itself.
  """
  low = text.strip().lower()
  if low in ("true", "false"):
    return low == "true"
  if low == "none":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


# The families whose methods the command compiles: a gradient compressor
# or a delay around one (chained before SGD), or a whole optimizer.
_CLI_FAMILIES = ("compressor", "delay", "optimizer")
_SIZE = r"([\d.]+\s*[KMGTP]?i?B?)"
_NEED_AND_CAPACITY = (
  # "the total memory required for HLO temporaries (107.48G) exceeds
  # available HBM (15.75G)"
  re.compile(r"required for ([\w ]+?) \(" + _SIZE
             + r"\) exceeds available HBM \(" + _SIZE + r"\)"),
  re.compile(r"()" + _SIZE + r" exceeds available HBM \(" + _SIZE + r"\)"),
  # "Used 17.35G of 15.48G hbm"
  re.compile(r"()Used " + _SIZE + r" of " + _SIZE + r" hbm"),
)


def does_not_fit(name: str, error: BaseException) -> str | None:
  """Internal: the report line for a step whose compile ran out of memory.

  Args:
    name: the step's name in the report.
    error: what the compile raised.

  Returns:
    One line naming the per-chip need and the chip's capacity as the
    compiler states them, or None when ``error`` is not the compiler's
    ``RESOURCE_EXHAUSTED``.
  """
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text:
    return None
  for pattern in _NEED_AND_CAPACITY:
    m = pattern.search(text)
    if m:
      what = f" for {m.group(1)}" if m.group(1) else ""
      return (f"{name}: does not fit: needs {m.group(2)} per chip{what}, "
              f"the chip has {m.group(3)} of HBM (the compiler's "
              "RESOURCE_EXHAUSTED)")
  first = " ".join(text.split())[:300]
  return f"{name}: does not fit: {first}"


def _chips(mesh: Mesh, spec) -> list[int]:
  """Per dim of a ``PartitionSpec``: the devices it is split over."""
  out = []
  for part in tuple(spec):
    names = () if part is None else (
      (part,) if isinstance(part, str) else tuple(part))
    out.append(int(np.prod([mesh.shape[a] for a in names])))
  return out


def _check_divisible(parser, mesh: Mesh, params, batch, args, slice_chips):
  """Refuses (``parser.error``) a model whose params or batch do not split
  evenly over the mesh, naming the flag to change."""
  for what, tree in (("params", params), ("batch", batch)):
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
      spec = x.sharding.spec
      for dim, (n, k) in enumerate(zip(x.shape, _chips(mesh, spec))):
        if n % k:
          leaf = jax.tree_util.keystr(path)
          if what == "params":
            parser.error(
              f"--size {args.size}: {args.model} param {leaf} has "
              f"{n} along dim {dim}, not divisible by the {k} chips it is "
              f"split over (a {args.topology} slice has {slice_chips} "
              f"chips): pick a size that is a multiple of {k}")
          parser.error(
            f"--slices {args.slices}: the {args.model} batch {leaf} has "
            f"{n} rows along dim {dim}, not divisible by the {k} chips of "
            f"{args.slices} x {args.topology} it is split over: use fewer "
            "slices")


def _build(parser, spec: str):
  """``(name, tx)`` of a ``--compressor`` value, or ``parser.error``."""
  from jaxcomm import registry
  name, _, rest = spec.partition(":")
  try:
    m = registry.get(name)
  except ValueError:
    parser.error(
      f"--compressor {spec!r}: unknown method {name!r}; it takes a "
      f"{', '.join(_CLI_FAMILIES[:-1])} or {_CLI_FAMILIES[-1]} method: "
      + ", ".join(n for f in _CLI_FAMILIES for n in registry.names(f)))
  if m.family not in _CLI_FAMILIES:
    parser.error(
      f"--compressor {spec!r}: {name} is a {m.family} method "
      f"({registry.FAMILIES[m.family].split(':')[0]}), not a gradient "
      "compressor, a delay or a whole optimizer; the command compiles "
      f"those ({', '.join(_CLI_FAMILIES)} families)")
  params = m.parameters()
  takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
  kwargs = {}
  for kv in filter(None, rest.split(",")):
    k, eq, v = kv.partition("=")
    k = k.strip()
    if not eq or not k:
      parser.error(f"--compressor {spec!r}: expected name:key=value,...; "
                   f"got {kv!r}")
    if k == "axis_name":
      parser.error(f"--compressor {spec!r}: axis_name is the command's "
                   "('dcn', across slices); leave it out")
    if k not in params and not takes_any:
      parser.error(
        f"--compressor {spec!r}: {name} has no option {k!r}; its options: "
        + ", ".join(p for p in params if p != "axis_name"))
    kwargs[k] = cli_value(v)
  try:
    tx = m.make(**kwargs, axis_name="dcn")
  except (TypeError, ValueError) as e:
    parser.error(f"--compressor {spec!r}: {e}")
  if m.family != "optimizer":
    tx = optax.chain(tx, optax.sgd(0.1))
  return name, tx


def _compile_or_report(name, compile_fn):
  """``compile_fn()``, or None after printing that the step does not fit
  (any other error propagates)."""
  try:
    return compile_fn()
  except Exception as e:  # the compiler's error type differs by version
    line = does_not_fit(name, e)
    if line is None:
      raise
    print(line, flush=True)
    return None


def main(argv=None) -> int:
  """Internal: the ``python -m jaxcomm.aot`` command (see the module).

  Every flag is checked before the first compile: a bad one ends the
  command with one ``error:`` line and exit status 2. A step that does not
  fit the chip's HBM is reported in one line and the command returns 1.
  """
  parser = argparse.ArgumentParser(
    prog="python -m jaxcomm.aot",
    description="Compile a jaxcomm step ahead of time for TPU slices (no "
    "TPU needed) and print per-chip memory, bytes across slices, compile "
    "time and the compiler's step-time estimate, next to the plain jit "
    "step.")
  parser.add_argument("--topology", default="v5e:2x2",
                      help="one slice, e.g. v5e:2x2, v5p:2x2x1, v6e:2x2")
  parser.add_argument("--slices", type=int, default=2)
  parser.add_argument("--model", default="transformer",
                      choices=("transformer", "mlp"))
  parser.add_argument("--size", default="small",
                      help=f"transformer: {', '.join(aot.SIZES)}; mlp: dim")
  parser.add_argument("--compressor", action="append", default=None,
                      help="a registered compressor, delay or whole "
                      "optimizer (repeatable; default topk); args as "
                      "name:key=value,...")
  parser.add_argument("--dcn-gbps", type=float, action="append",
                      default=None, help="DCN Gbit/s per chip for the "
                      "estimate (repeatable; default 25 and 100)")
  args = parser.parse_args(argv)
  if args.slices < 1:
    parser.error(f"--slices: expected a positive int, got {args.slices}")
  for g in args.dcn_gbps or ():
    if not math.isfinite(g) or g <= 0:
      parser.error(f"--dcn-gbps: expected a finite bandwidth > 0 Gbit/s, "
                   f"got {g}")
  if args.model == "transformer":
    if args.size not in aot.SIZES:
      parser.error(f"--size for transformer: expected one of "
                   f"{', '.join(aot.SIZES)}, got {args.size!r}")
  else:
    try:
      dim = int(args.size) if args.size != "small" else 1024
    except ValueError:
      parser.error(f"--size for mlp: expected an int dim > 0, got "
                   f"{args.size!r}")
    if dim < 1:
      parser.error(f"--size for mlp: expected an int dim > 0, got {dim}")
  methods = [_build(parser, spec) for spec in args.compressor or ["topk"]]
  try:
    mesh = aot.slice_mesh(args.topology, args.slices)
  except ValueError as e:
    parser.error(f"--topology {args.topology!r}: {e}")
  slice_chips = mesh.devices.size // args.slices
  try:
    if args.model == "transformer":
      loss_fn, params, batch = aot.transformer(mesh, args.size)
    else:
      loss_fn, params, batch = aot.mlp(mesh, dim)
  except ValueError as e:
    parser.error(f"--model {args.model}: {e}")
  _check_divisible(parser, mesh, params, batch, args, slice_chips)
  gen = aot.generation(mesh)
  hbm = aot.HBM.get(gen, 0)
  nparams = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  print(f"{args.topology} x {args.slices} slices ({mesh.devices.size} chips, "
        f"{gen}), {args.model} {args.size}: {nparams / 1e6:.1f}M params, "
        f"jax {jax.__version__}", flush=True)
  gbps = args.dcn_gbps or [25.0, 100.0]
  status = 0
  done = _compile_or_report("plain jit step", lambda: aot.compile_lowered(
    aot.plain_step(loss_fn).lower(params, batch)))
  base = None
  if done is None:
    status = 1
  else:
    base = aot.analyze(*done, slices=args.slices, hbm=hbm)
    _report("plain jit step", base, None, gbps)
  for name, tx in methods:
    done = _compile_or_report(name, lambda tx=tx: aot.compile_method(
      loss_fn, params, batch, mesh, tx))
    if done is None:
      status = 1
      continue
    compiled, secs, state = done
    fig = aot.analyze(compiled, secs, slices=args.slices, hbm=hbm)
    _report(f"{name} (state {_fmt_bytes(aot.state_bytes_per_chip(state))} "
            "per chip)", fig, base, gbps)
  return status


if __name__ == "__main__":
  sys.exit(main())
