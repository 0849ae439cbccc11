"""Compile time and program size of every compressor's ``tx.update``.

For each public compressor (the name table of ``train.py``,
``train.COMPRESSORS``, with its default arguments, plus PowerSGD rank 1),
builds one ``tx.update`` inside an 8-device CPU ``jax.shard_map`` the way
``jaxcomm.parallel`` and the test harness do (params replicated, per-device
gradients with a leading device axis, the state laid out by
``parallel.state_layout`` with ``to_local`` / ``to_global``, ``check_vma``
on), lowers and compiles it without running it, and prints per shape set a
markdown table:

* ``compile s``: wall seconds of ``jit(...).lower(...)`` plus
  ``.compile()`` (the median over ``--reps`` with JAX's caches cleared in
  between; ``time.perf_counter`` as in ``benchmarks._common``);
* ``x dense``: that time over ``jaxcomm.mean_gradients()``'s (always
  measured, even when ``--only`` leaves it out);
* ``HLO ops (compiled)``: instructions in the optimized per-device HLO
  (``compiled.as_text()``, lines with `` = ``, fused computations
  included);
* ``StableHLO lines``: lines with `` = `` in ``lowered.as_text()``;
* ``CPU s``: CPU seconds (``time.process_time``, all threads) of the same
  lower + compile, steadier than wall time when other processes share the
  cores.

Shape sets: ``resnet18`` (``benchmarks._common.resnet18_shapes()``: CIFAR
ResNet-18, 62 leaves, 11,173,962 parameters) and ``transformer`` (a
24-layer, d_model 256, MLP 1024 transformer with an 8192 x 256 embedding
and no attention biases: 289 leaves, 21,026,816 parameters, see
:func:`transformer_shapes`). Inputs
are abstract (``jax.ShapeDtypeStruct`` with the shardings the real step
would get; the parameters are ``jnp.zeros`` for finding the state layout),
so nothing is allocated per device and nothing runs.

With ``--timeout S`` every compressor is measured in its own fresh Python
process (``python -m benchmarks.bench_compile --child ...``) that is killed
after S seconds (the row then reads ``timeout >Ss``); without it all rows
are measured in this process, one after another (later rows can profit
slightly from caches the earlier ones warmed). Rows are printed (and the
``--json`` file rewritten) as soon as each is done.

Run from the repository root::

  python -m benchmarks.bench_compile                       # everything
  python -m benchmarks.bench_compile --quick               # ~1 min
  python -m benchmarks.bench_compile --shapes transformer --only dgc,topk
  python -m benchmarks.bench_compile --timeout 600 --json out.json
  python -m benchmarks.bench_compile --compare before.json after.json

One run on a shared CPU host is noisy: read the ratios, not the digits.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jaxcomm  # noqa: E402
import train  # noqa: E402
from benchmarks._common import resnet18_shapes  # noqa: E402
from jaxcomm import parallel  # noqa: E402

N = 8
AXIS = "data"
SHAPE_SETS = ("resnet18", "transformer")
# Rows beyond train.COMPRESSORS' defaults: name -> (train name, kwargs).
VARIANTS = {"powersgd_r1": ("powersgd", {"rank": 1})}
# One compressor per family, for --quick.
QUICK = ("dense", "cast", "int8", "signsgd", "topk", "powersgd")
BASELINE = "dense"   # train.COMPRESSORS' name for mean_gradients


def transformer_shapes(layers: int = 24, d_model: int = 256,
                       d_ff: int = 1024, vocab: int = 8192) -> dict:
  """A decoder-only transformer's parameter shapes, by name.

  One ``(vocab, d_model)`` embedding, and per layer 12 leaves: layer-norm
  scale and bias twice, the q, k, v, o kernels ``(d_model, d_model)``
  (no attention biases), and the MLP's ``(d_model, d_ff)`` and
  ``(d_ff, d_model)`` kernels with their biases. The defaults give
  1 + 24 x 12 = 289 leaves and 8192 x 256 + 24 x 788,736 = 21,026,816
  parameters.
  """
  shapes = {"embed": (vocab, d_model)}
  for i in range(layers):
    pre = f"layer{i:02d}"
    shapes[f"{pre}/ln1_scale"] = (d_model,)
    shapes[f"{pre}/ln1_bias"] = (d_model,)
    for name in ("q", "k", "v", "o"):
      shapes[f"{pre}/attn_{name}_kernel"] = (d_model, d_model)
    shapes[f"{pre}/ln2_scale"] = (d_model,)
    shapes[f"{pre}/ln2_bias"] = (d_model,)
    shapes[f"{pre}/mlp_in_kernel"] = (d_model, d_ff)
    shapes[f"{pre}/mlp_in_bias"] = (d_ff,)
    shapes[f"{pre}/mlp_out_kernel"] = (d_ff, d_model)
    shapes[f"{pre}/mlp_out_bias"] = (d_model,)
  return shapes


def shapes_of(shape_set: str) -> dict:
  if shape_set == "resnet18":
    return resnet18_shapes()
  if shape_set == "transformer":
    return transformer_shapes()
  raise ValueError(f"unknown shape set {shape_set!r}; choose from "
                   f"{', '.join(SHAPE_SETS)}")


def compressor_names() -> list[str]:
  """train.py's names whose factory exists here, then the VARIANTS."""
  avail = train.available_compressors()
  return avail + [v for v, (base, _) in VARIANTS.items() if base in avail]


def build(name: str):
  """``(tx, label)`` for a name of :func:`compressor_names`."""
  base, args = VARIANTS.get(name, (name, None))
  tx, key, kwargs = train.build_compressor(base, args, axis_name=AXIS)
  attr = train.COMPRESSORS[key][0]
  shown = ", ".join(f"{k}={getattr(v, '__name__', v)}"
                    for k, v in kwargs.items())
  return tx, f"{attr}({shown})"


def _mesh():
  devices = jax.devices("cpu")
  if len(devices) < N:
    raise RuntimeError(
      f"needs {N} CPU devices, have {len(devices)}: set XLA_FLAGS="
      f"--xla_force_host_platform_device_count={N} before JAX starts")
  return parallel.make_mesh(N, AXIS, devices=devices[:N])


def _count_ops(text: str) -> int:
  return sum(" = " in line for line in text.splitlines())


def _stepper(tx, mesh, layout):
  """The jitted shard_map'd ``tx.update``, as tests/harness.py builds it."""
  specs = parallel.state_specs(layout, AXIS)

  def step(params, state, grads):
    grads = jax.tree.map(
      lambda g, p: g[0] if jnp.issubdtype(g.dtype, jnp.floating) else p,
      grads, params)
    local = parallel.to_local(state, layout)
    upd, new = tx.update(grads, local, params)
    return upd, parallel.to_global(new, layout)

  return jax.jit(jax.shard_map(step, mesh=mesh,
                               in_specs=(P(), specs, P(AXIS)),
                               out_specs=(P(), specs)))


def _abstract_inputs(tx, params, mesh, layout):
  """Params, state and gradients as ShapeDtypeStructs with the shardings
  ``parallel.replicate`` / ``init_state`` / ``shard_batch`` give them."""
  rep = NamedSharding(mesh, P())
  dev = NamedSharding(mesh, P(AXIS))

  def sds(shape, dtype, per_device):
    if per_device:
      return jax.ShapeDtypeStruct((N,) + tuple(shape), dtype, sharding=dev)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=rep)

  state = jax.tree.map(lambda x, b: sds(x.shape, x.dtype, b),
                       jax.eval_shape(tx.init, params), layout)
  params_abs = jax.tree.map(lambda x: sds(x.shape, x.dtype, False), params)
  grads = jax.tree.map(lambda x: sds(x.shape, x.dtype, True), params)
  return params_abs, state, grads


def _warmup(mesh) -> None:
  """One small shard_map compile, so the first timed row pays no start-up."""
  f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, AXIS), mesh=mesh,
                            in_specs=P(AXIS), out_specs=P()))
  f.lower(jax.ShapeDtypeStruct(
    (N, 4), jnp.float32, sharding=NamedSharding(mesh, P(AXIS)))).compile()


def measure(name: str, shape_set: str, reps: int = 1, mesh=None) -> dict:
  """Lowers and compiles ``name``'s update on ``shape_set``; one row."""
  mesh = _mesh() if mesh is None else mesh
  params = {k: jnp.zeros(s, jnp.float32)
            for k, s in shapes_of(shape_set).items()}
  tx, label = build(name)
  layout = parallel.state_layout(tx, params, mesh, AXIS)
  args = _abstract_inputs(tx, params, mesh, layout)
  lower_s, compile_s, cpu_s = [], [], []
  for r in range(reps):
    if r:
      jax.clear_caches()
    fn = _stepper(tx, mesh, layout)
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    lower_s.append(t1 - t0)
    compile_s.append(t2 - t1)
    cpu_s.append(c2 - c0)
  total = [a + b for a, b in zip(lower_s, compile_s)]
  return {"name": name, "label": label, "status": "ok",
          "lower_s": statistics.median(lower_s),
          "compile_s": statistics.median(compile_s),
          "total_s": statistics.median(total),
          "cpu_s": statistics.median(cpu_s), "reps": reps,
          "hlo_ops": _count_ops(compiled.as_text()),
          "stablehlo_lines": _count_ops(lowered.as_text())}


def _measure_child(name: str, shape_set: str, reps: int,
                   timeout: float) -> dict:
  """:func:`measure` in a fresh process, killed after ``timeout`` s."""
  cmd = [sys.executable, "-m", "benchmarks.bench_compile", "--child", name,
         "--shapes", shape_set, "--reps", str(reps)]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"name": name, "label": name, "status": f"timeout >{timeout:g}s",
            "wall_s": time.perf_counter() - t0}
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("RESULT "):
      row = json.loads(line[len("RESULT "):])
      row["wall_s"] = time.perf_counter() - t0
      return row
  tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
  return {"name": name, "label": name, "status": f"failed: {tail[0]}"}


def _fmt_row(row: dict, dense_s: float | None) -> str:
  if row["status"] != "ok":
    return f"| {row['label']} | {row['status']} |  |  |  |  |"
  ratio = f"{row['total_s'] / dense_s:.1f}" if dense_s else ""
  return (f"| {row['label']} | {row['total_s']:.2f} | {ratio} | "
          f"{row['hlo_ops']:,} | {row['stablehlo_lines']:,} | "
          f"{row['cpu_s']:.2f} |")


def _meta(argv) -> dict:
  return {
    "command": "python -m benchmarks.bench_compile " + " ".join(argv),
    "date": datetime.datetime.now().astimezone().isoformat(
      timespec="seconds"),
    "jax": jax.__version__, "jaxlib": jaxlib.__version__,
    "jaxcomm_file": jaxcomm.__file__, "python": platform.python_version(),
    "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
    "machine": platform.machine(), "devices": N}


def run(shape_sets, names, *, reps=1, timeout=None, json_path=None,
        argv=()) -> dict:
  """Measures ``names`` on ``shape_sets`` and prints the tables."""
  out = {"meta": _meta(list(argv)), "results": {}}
  mesh = None if timeout else _mesh()
  if mesh is not None:
    _warmup(mesh)

  def one(name, shape_set):
    if timeout:
      return _measure_child(name, shape_set, reps, timeout)
    try:
      return measure(name, shape_set, reps, mesh)
    except Exception as e:  # pylint: disable=broad-except
      return {"name": name, "label": name,
              "status": f"failed: {type(e).__name__}: {e}"[:200]}

  for shape_set in shape_sets:
    shapes = shapes_of(shape_set)
    size = sum(int(np.prod(s)) for s in shapes.values())
    res = out["results"][shape_set] = {
      "leaves": len(shapes), "params": size, "rows": []}
    print(f"\n### {shape_set}: {len(shapes)} leaves, {size:,} parameters, "
          f"{N} CPU devices, jax {jax.__version__}\n", flush=True)
    print("| compressor | compile s | x dense | HLO ops (compiled) | "
          "StableHLO lines | CPU s |\n|---|---:|---:|---:|---:|---:|",
          flush=True)
    order = [BASELINE] + [n for n in names if n != BASELINE]
    dense_s = dense_cpu = None
    for name in order:
      row = one(name, shape_set)
      if name == BASELINE:
        dense_s, dense_cpu = row.get("total_s"), row.get("cpu_s")
      if row.get("total_s") and dense_s:
        row["x_dense"] = row["total_s"] / dense_s
      if row.get("cpu_s") and dense_cpu:
        row["x_dense_cpu"] = row["cpu_s"] / dense_cpu
      row["shown"] = name in names
      res["rows"].append(row)
      if row["shown"]:
        print(_fmt_row(row, dense_s), flush=True)
      if json_path:
        _write_json(json_path, out)
  return out


def _write_json(path: str, obj) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
    f.write("\n")
  os.replace(tmp, path)


def compare(paths: list[str]) -> str:
  """Markdown tables, per shape set, of the ``x dense`` and compiled-op
  columns of several ``--json`` files side by side (each file's own dense
  row is its baseline, so runs on different days compare by ratio)."""
  runs = []
  for path in paths:
    with open(path) as f:
      runs.append((os.path.splitext(os.path.basename(path))[0],
                   json.load(f)))
  out = []
  for shape_set in SHAPE_SETS:
    tables = [r["results"].get(shape_set) for _, r in runs]
    if not any(tables):
      continue
    first = next(t for t in tables if t)
    out.append(f"\n### {shape_set}: {first['leaves']} leaves, "
               f"{first['params']:,} parameters\n")
    head = ["compressor"] + [f"x dense {n}" for n, _ in runs] + [
      f"HLO ops {n}" for n, _ in runs]
    out.append("| " + " | ".join(head) + " |")
    out.append("|---|" + "---:|" * (len(head) - 1))
    labels = {}
    for t in tables:
      for row in (t or {}).get("rows", []):
        labels.setdefault(row["name"], row["label"])
    for name, label in labels.items():
      cells, ops = [], []
      for t in tables:
        row = next((r for r in (t or {}).get("rows", [])
                    if r["name"] == name), None)
        ok = row is not None and row.get("status") == "ok"
        cells.append(f"{row['x_dense']:.1f}" if ok else "-")
        ops.append(f"{row['hlo_ops']:,}" if ok else "-")
      out.append("| " + " | ".join([label] + cells + ops) + " |")
  return "\n".join(out)


def _split(text: str | None) -> list[str]:
  return [s.strip() for s in (text or "").split(",") if s.strip()]


def main(argv=None) -> None:
  argv = [] if argv is None else list(argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=None,
                      help=f"comma-separated, of {', '.join(SHAPE_SETS)} "
                      "(default: all; resnet18 with --quick)")
  parser.add_argument("--only", default=None,
                      help="comma-separated compressor names (default: all)")
  parser.add_argument("--quick", action="store_true",
                      help=f"only {', '.join(QUICK)} on resnet18 (unless "
                      "--shapes / --only say otherwise)")
  parser.add_argument("--reps", type=int, default=1,
                      help="compiles per row (median; caches cleared)")
  parser.add_argument("--timeout", type=float, default=None,
                      help="measure each row in a fresh process killed "
                      "after this many seconds")
  parser.add_argument("--json", default=None, help="write results here")
  parser.add_argument("--list", action="store_true",
                      help="print the compressor names and exit")
  parser.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                      help="print the --json files' tables side by side "
                      "and exit (nothing is compiled)")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.compare:
    print(compare(args.compare))
    return
  if args.child:
    mesh = _mesh()
    _warmup(mesh)
    row = measure(args.child, args.shapes, args.reps, mesh)
    print("RESULT " + json.dumps(row), flush=True)
    return
  avail = compressor_names()
  if args.list:
    print("\n".join(avail))
    return
  shape_sets = _split(args.shapes) or (
    ["resnet18"] if args.quick else list(SHAPE_SETS))
  for s in shape_sets:
    shapes_of(s)
  names = _split(args.only) or (
    [n for n in avail if n in QUICK] if args.quick else avail)
  names = [n if n in avail else train.ALIASES.get(n.lower(), n)
           for n in names]
  unknown = [n for n in names if n not in avail]
  if unknown:
    parser.error(f"unknown compressor(s) {', '.join(unknown)}; choose from "
                 f"{', '.join(avail)}")
  print(f"Compile time of one tx.update in an {N}-device CPU shard_map "
        f"(check_vma on): lower + compile wall seconds, median of "
        f"{args.reps}; x dense = over mean_gradients(); CPU s = the "
        f"process's CPU seconds for the same; "
        f"{os.cpu_count()} CPU cores, jax {jax.__version__}"
        + (f", each row in a fresh process (timeout {args.timeout:g} s)"
           if args.timeout else "") + ".", flush=True)
  run(shape_sets, names, reps=args.reps, timeout=args.timeout,
      json_path=args.json, argv=argv)


if __name__ == "__main__":
  main(sys.argv[1:])
