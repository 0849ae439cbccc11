"""Every compressor at its registry defaults, on three tasks, against dense.

A user takes a method's defaults from the README's table and the optimizer
and rate its last column gives (``docs/benchmarks/lr.json``, swept on the
digits MLP). This benchmark trains exactly that on 8 simulated CPU devices
and reports the held-out accuracy beside dense's, on three tasks:

* ``digits_mlp``: the MLP on scikit-learn's digits, the task the rates were
  swept on (300 steps, batch 128);
* ``char_lstm``: the default job's character LSTM on the Python help texts
  (300 steps, batch 64 of 64 characters; next-character accuracy);
* ``digits_cnn``: the conv net on digits, a model no rate or default in the
  registry was chosen on (300 steps, batch 128).

The rate: lr.json's rate for the method times the task's scale, one number
per task: the dense rate of that task (the lowest held-out loss of dense
at lr.json's dense rate times 1/3, 1, 3, 10, 30 or 100, measured first in
the same run; never the grid's largest, which would say the grid is too
narrow) over lr.json's dense rate. On the digits MLP, where lr.json was swept,
the scale is 1 by definition: each method trains at exactly lr.json's
rate. Constant rate, seed 0, momentum SGD or plain SGD as lr.json says.

A method is *within* when its accuracy is at most 2 points below dense's on
every task. The registry's ``Method.gap`` says, for each method that is
not, by how much and why (the README's table prints it).

Run from the repository root::

  python -m benchmarks.defaults                  # about 25 min on 2 cores
  python -m benchmarks.defaults --methods gradiveq,lag --tasks digits_mlp

Output: a markdown table on stdout and in ``--out`` (default
``docs/benchmarks/defaults.md``), and the rows as json beside it.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  from benchmarks._xla import raise_cpu_collective_timeouts
  raise_cpu_collective_timeouts()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import train  # noqa: E402
from benchmarks.lr_sweep import optimizer_flag  # noqa: E402

# A method within this many accuracy points of dense keeps its defaults.
POINTS = 2.0
# The dense rate of a task: lr.json's dense rate times the best of these.
DENSE_SCALES = (1 / 3, 1.0, 3.0, 10.0, 30.0, 100.0)


@dataclasses.dataclass(frozen=True)
class Task:
  """One training task: train.Config fields and a line for the table."""
  name: str
  label: str
  config: dict
  # The task's rate scale, or None: measured (:func:`dense_scale`).
  scale: float | None = None


TASKS = {
  t.name: t for t in (
    Task("digits_mlp", "digits MLP (the sweep's task)",
         dict(model="mlp", model_args="", dataset="digits", steps=300,
              batch_size=128), scale=1.0),
    Task("char_lstm", "char-LSTM",
         dict(model="charlm",
              model_args="embed_dim=32,hidden_size=128,num_layers=1",
              dataset="text", seq_len=64, steps=300, batch_size=64)),
    Task("digits_cnn", "digits CNN (never tuned on)",
         dict(model="cnn", model_args="", dataset="digits", steps=300,
              batch_size=128)),
  )
}


def train_once(task: Task, method: str, args: str, optimizer: str,
               lr: float, out_dir: str) -> dict:
  """One ``train.run``: the held-out accuracy and loss (NaN: diverged)."""
  cfg = train.Config(
    compressor=method, compressor_args=args, optimizer=optimizer, lr=lr,
    schedule="constant", num_devices=8, seed=0, checkpoint_every=0,
    keep_checkpoints=1, eval_examples=512, progress=False, plot=False,
    out_dir=out_dir, **task.config)
  start = time.perf_counter()
  try:
    r = train.run(cfg)
    acc, loss = r["eval_accuracy"], r["eval_loss"]
  except FloatingPointError:
    acc = loss = float("nan")
  return {"accuracy": 100 * acc, "loss": loss,
          "seconds": time.perf_counter() - start}


def dense_scale(task: Task, lrs: dict, tmp: str) -> tuple[float, list]:
  """The task's rate scale: dense at lr.json's dense rate times each of
  :data:`DENSE_SCALES`, the one of the lowest held-out loss (the task's
  own scale where it has one: dense is then run at it alone)."""
  entry = lrs["dense"]
  rows = []
  for s in (DENSE_SCALES if task.scale is None else (task.scale,)):
    r = train_once(task, "dense", "", optimizer_flag(entry["optimizer"]),
                   entry["lr"] * s, os.path.join(tmp, f"scale-{s:g}"))
    rows.append({"scale": s, "lr": entry["lr"] * s, **r})
    print(f"  {task.name}: dense at {entry['lr'] * s:.4g}: accuracy "
          f"{r['accuracy']:.1f} loss {r['loss']:.3f}", flush=True)
  ok = [r for r in rows if math.isfinite(r["loss"])]
  scale = min(ok, key=lambda r: r["loss"])["scale"]
  if task.scale is None and scale == DENSE_SCALES[-1]:
    print(f"  {task.name}: dense's best rate is the grid's largest: widen "
          "DENSE_SCALES", flush=True)
  return scale, rows


def measure(names, task_names, tmp: str, lr_times: float = 1.0) -> dict:
  """Every (method, task) at the registry's defaults and lr.json's rate
  times the task's scale (and ``lr_times``; dense's stays)."""
  import jaxcomm  # pylint: disable=import-outside-toplevel
  lrs = train.measured_lr()
  out = {"tasks": {}, "rows": []}
  for tname in task_names:
    task = TASKS[tname]
    scale, sweep = dense_scale(task, lrs, os.path.join(tmp, tname))
    out["tasks"][tname] = {"label": task.label, "scale": scale,
                           "dense_sweep": sweep, **task.config}
    for name in names:
      m = jaxcomm.registry.get(name, "compressor")
      entry = lrs[m.name]
      if entry["lr"] is None:
        print(f"  {tname}: {m.name}: lr.json has no rate", flush=True)
        continue
      opt = optimizer_flag(entry["optimizer"])
      lr = entry["lr"] * scale * (1.0 if m.name == "dense" else lr_times)
      r = train_once(task, m.name, "", opt, lr,
                     os.path.join(tmp, tname, m.name))
      out["rows"].append({"task": tname, "method": m.name,
                          "defaults": dict(m.required()), "optimizer": opt,
                          "lr": lr, **r})
      print(f"  {tname}: {m.name:>24} {opt:>8} lr {lr:<8.4g} accuracy "
            f"{r['accuracy']:5.1f} loss {r['loss']:.3f} "
            f"({r['seconds']:.0f} s)", flush=True)
  return out


def table(result: dict) -> str:
  """Accuracy per (method, task), its difference from dense's, and
  whether the method is within :data:`POINTS` on every task."""
  tasks = sorted(result["tasks"], key=lambda t: list(TASKS).index(t)
                 if t in TASKS else len(TASKS))
  by = {(r["method"], r["task"]): r for r in result["rows"]}
  methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
  head = ("| method (registry defaults) | then | "
          + " | ".join(f"{result['tasks'][t]['label']} | vs dense"
                       for t in tasks) + " | within 2 |")
  lines = [head, "|---|---|" + "---:|---:|" * len(tasks) + "---|"]
  for name in methods:
    first = next(by[(name, t)] for t in tasks if (name, t) in by)
    args = ", ".join(f"{k}={v!r}" for k, v in first["defaults"].items())
    cells, worst = [], 0.0
    for t in tasks:
      r, d = by.get((name, t)), by.get(("dense", t))
      if r is None or d is None:
        cells += ["—", "—"]
        continue
      diff = r["accuracy"] - d["accuracy"]
      if not math.isfinite(diff):
        diff = -math.inf
      worst = min(worst, diff)
      cells += [("diverged" if not math.isfinite(r["accuracy"])
                 else f"{r['accuracy']:.1f}"),
                "—" if name == "dense" else f"{diff:+.1f}"]
    opt = {"momentum": "momentum SGD", "sgd": "SGD"}[first["optimizer"]]
    rate = first["lr"] / result["tasks"][first["task"]]["scale"]
    lines.append(f"| `{name}({args})` | {opt}, {rate:g} | "
                 + " | ".join(cells) + " | "
                 + ("yes" if worst >= -POINTS else f"**no** ({worst:+.1f})")
                 + " |")
  return "\n".join(lines)


def describe(result: dict) -> str:
  """The table with the settings it was measured at."""
  lines = ["## Every compressor at its defaults, on three tasks\n",
           "Held-out accuracy (%) after 300 steps on 8 simulated CPU "
           "devices, each compressor at its registry defaults before the "
           "optimizer lr.json names, at lr.json's rate times the task's "
           "scale (`python -m benchmarks.defaults`). Scales: 1 on the "
           "digits MLP (lr.json's own task), else the best of dense at "
           "lr.json's dense rate times 1/3, 1, 3, 10, 30 and 100 (by "
           "held-out loss):"]
  for t in sorted(result["tasks"], key=lambda t: list(TASKS).index(t)
                  if t in TASKS else len(TASKS)):
    info = result["tasks"][t]
    lines.append(f"- {info['label']}: x{info['scale']:g} ("
                 + ", ".join(f"{r['lr']:.3g}: {r['accuracy']:.1f}%"
                             for r in info["dense_sweep"]) + ")")
  return "\n".join(lines) + "\n\n" + table(result)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", default=None,
                 help="comma-separated registry names (default: every "
                 "compressor); dense is always run")
  p.add_argument("--tasks", default=",".join(TASKS),
                 help=f"comma-separated, of {', '.join(TASKS)}")
  p.add_argument("--out", default="docs/benchmarks/defaults.md",
                 help="where the markdown table goes (the json beside it)")
  p.add_argument("--lr-times", type=float, default=1.0,
                 help="multiply every method's rate but dense's (how far "
                 "the rate explains a gap: --tasks char_lstm --methods "
                 "topk --lr-times 3)")
  p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                 help="train nothing: merge these runs' json (tasks run "
                 "in separate processes; where two hold the same method and "
                 "task, the first) into --out")
  args = p.parse_args(argv)
  if args.merge:
    result = {"tasks": {}, "rows": []}
    for path in args.merge:
      with open(path, encoding="utf-8") as f:
        part = json.load(f)
      for k, v in part["tasks"].items():
        result["tasks"].setdefault(k, v)
      seen = {(r["method"], r["task"]) for r in result["rows"]}
      # Each process runs dense too: the first file's row (and task) is
      # kept; give a rerun's file first.
      result["rows"] += [r for r in part["rows"]
                         if (r["method"], r["task"]) not in seen]
    return write(result, args.out)
  train.configure_devices(train.Config(num_devices=8))
  import jaxcomm  # pylint: disable=import-outside-toplevel
  names = (args.methods.split(",") if args.methods
           else jaxcomm.registry.names("compressor"))
  names = ["dense"] + [n for n in names if n != "dense"]
  if args.lr_times != 1.0 and args.out == p.get_default("out"):
    p.error("--lr-times: give --out too (the docs' table is at lr.json's "
            "rates)")
  tasks = args.tasks.split(",")
  unknown = [t for t in tasks if t not in TASKS]
  if unknown:
    p.error(f"--tasks: unknown {unknown}; expected some of {list(TASKS)}")
  with tempfile.TemporaryDirectory() as tmp:
    result = measure(names, tasks, tmp, args.lr_times)
  write(result, args.out)


def write(result: dict, out: str) -> None:
  """Prints the table and writes it to ``out``, the rows beside it."""
  text = describe(result)
  print(text)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    f.write(text + "\n")
  with open(os.path.splitext(out)[0] + ".json", "w",
            encoding="utf-8") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
