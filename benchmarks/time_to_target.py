"""Time to a target loss: real char-LM training on a rate-limited network.

``python -m benchmarks.time_to_target`` (``make bench-time-to-target``)
trains the char-LSTM of the convergence table with ``train.py`` in ``P``
processes (one CPU device each, joined by ``jax.distributed`` with gloo
collectives) inside a network namespace whose loopback is rate-limited
(:mod:`benchmarks._netns`, as ``make bench-network``), for each method and
link rate. From process 0's ``metrics.jsonl`` it reports the training wall
time (from the end of step 1, so compilation is left out), and the seconds
and steps until the training loss (mean of the last 20 steps) first reaches
a target: the smoothed loss of the dense run of the same optimizer (Adam,
or momentum SGD) at two thirds of its steps, found in the same sweep. Bytes
per step are the run's mean (local-update methods send only at syncs).

Methods: dense Adam, PowerSGD rank 4 -> Adam, DiLoCo H=50 (Adam inside,
Nesterov outside), DiLoCo H=50 with SparseLoCo's 2-bit top-k 2%, dense
momentum SGD and local SGD H=8 (momentum SGD on each device). Steps are
fewer than the convergence table's (``--steps``, default 600), so absolute
losses differ from it.

Needs root and iproute2 (network namespaces); says so and exits 0 without
them. Writes ``runs/bench/time_to_target.{json,md}``.

Example::

  sudo .venv/bin/python -m benchmarks.time_to_target --processes 4 \\
      --rates 1,10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from benchmarks import _netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--model-args", "embed_dim=32,hidden_size=96,num_layers=1",
         "--seq-len", "32", "--batch-size", "64", "--eval-examples", "512",
         "--schedule", "cosine"]
ADAM = ["--optimizer", "adam", "--lr", "3e-3"]
MSGD = ["--optimizer", "momentum", "--lr", "3.0"]
METHODS = {
  "dense adam": ADAM + ["--compressor", "dense"],
  "powersgd r4 -> adam": ADAM + ["--compressor", "powersgd",
                                 "--compressor-args", "rank=4"],
  "diloco H=50": ADAM + ["--local", "diloco", "--local-args", "period=50"],
  "diloco H=50 + sparseloco": ADAM + [
    "--local", "diloco", "--local-args",
    "period=50,outer_lr=1,outer_momentum=0", "--compressor", "topk",
    "--compressor-args", "ratio=0.02,value_bits=2,residual_decay=0.95"],
  # The outer rate that closed the gap in the convergence table.
  "diloco H=50 + sparseloco, outer lr 4": ADAM + [
    "--local", "diloco", "--local-args",
    "period=50,outer_lr=4,outer_momentum=0", "--compressor", "topk",
    "--compressor-args", "ratio=0.02,value_bits=2,residual_decay=0.95"],
  "dense momentum sgd": MSGD + ["--compressor", "dense"],
  "local sgd H=8": MSGD + ["--local", "local_sgd", "--local-args",
                           "period=8"],
  # The frontier, against bf16 (the baseline that counts) and dense Adam.
  "bf16 -> adam": ADAM + ["--compressor", "cast",
                          "--compressor-args", "dtype=bfloat16"],
  "int8 -> adam": ADAM + ["--compressor", "int8"],
  "int4 -> adam": ADAM + ["--compressor", "int4"],
  "mxfp8 -> adam": ADAM + ["--compressor", "mx",
                           "--compressor-args", "fmt=mxfp8"],
  "mxfp4 + ef -> adam": ADAM + ["--compressor", "mx", "--compressor-args",
                                "fmt=mxfp4,error_feedback=True"],
  "demo": ["--optimizer", "demo", "--lr", "3e-3", "--compressor", "dense"],
  "muloco H=50": ["--optimizer", "muon", "--lr", "0.02", "--local",
                  "muloco", "--local-args", "period=50"],
  "streaming diloco H=50, mxfp4": ADAM + [
    "--local", "diloco", "--local-args",
    "period=50,fragments=4,overlap_steps=5", "--compressor", "mx",
    "--compressor-args", "fmt=mxfp4"],
}
# Each method's dense baseline (the target and the "vs dense" column).
BASELINE = {"dense adam": "dense adam",
            "powersgd r4 -> adam": "dense adam",
            "diloco H=50": "dense adam",
            "diloco H=50 + sparseloco": "dense adam",
            "diloco H=50 + sparseloco, outer lr 4": "dense adam",
            "dense momentum sgd": "dense momentum sgd",
            "local sgd H=8": "dense momentum sgd",
            "bf16 -> adam": "dense adam", "int8 -> adam": "dense adam",
            "int4 -> adam": "dense adam", "mxfp8 -> adam": "dense adam",
            "mxfp4 + ef -> adam": "dense adam", "demo": "dense adam",
            "muloco H=50": "dense adam",
            "streaming diloco H=50, mxfp4": "dense adam"}
SMOOTH = 20


def _env():
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)
  return env


def _smoothed(history):
  out, window = [], []
  for h in history:
    window.append(h["loss"])
    window = window[-SMOOTH:]
    out.append(sum(window) / len(window))
  return out


def run_one(ns, port, nproc, method, steps, out_dir, timeout_s) -> dict:
  """Trains ``method`` in ``nproc`` processes; the run's figures."""
  argv = [sys.executable, os.path.join(ROOT, "train.py"), *MODEL,
          *METHODS[method], "--steps", str(steps), "--num-devices",
          str(nproc), "--checkpoint-every", "0", "--no-progress",
          "--no-plot", "--overwrite", "--out-dir", out_dir,
          "--coordinator", f"127.0.0.1:{port}", "--num-processes",
          str(nproc)]
  cmds = [ns.command(argv + ["--process-id", str(i)]) for i in range(nproc)]
  t0 = time.time()
  codes, outs, timed_out = _netns.run_group(cmds, timeout_s, env=_env(),
                                            cwd=ROOT)
  if timed_out or any(c != 0 for c in codes):
    tail = (outs[0] or "")[-400:]
    return {"error": f"exit codes {codes}"
            f"{' (timeout)' if timed_out else ''}: {tail}"}
  hist = _netns.read_json_lines(os.path.join(out_dir, "metrics.jsonl"))
  with open(os.path.join(out_dir, "result.json")) as f:
    result = json.load(f)
  t_first = hist[0]["time"]
  return {"history": [{"step": h["step"], "loss": h["loss"],
                       "time": h["time"] - t_first} for h in hist],
          "train_s": hist[-1]["time"] - t_first,
          "eval_loss": result["eval_loss"],
          "bytes_per_step": result["bytes_per_step"],
          "dense_bytes_per_step": result["dense_bytes_per_step"],
          "wall_s": time.time() - t0}


def reach(history, target):
  """``(step, seconds)`` when the smoothed loss first is <= target."""
  for h, s in zip(history, _smoothed(history)):
    if s <= target:
      return h["step"], h["time"]
  return None, None


def assign_targets(rows) -> None:
  """Sets each row's ``target`` (its baseline's smoothed loss at 2/3 of
  its steps), ``steps_to`` and ``seconds``; rows of one (procs, rate)."""
  for r in rows:
    base = next((x for x in rows if x["method"] == BASELINE[r["method"]]
                 and "history" in x), None)
    if base is None or "history" not in r:
      continue
    r["target"] = _smoothed(base["history"])[
      2 * len(base["history"]) // 3 - 1]
    r["steps_to"], r["seconds"] = reach(r["history"], r["target"])


def table(rows) -> str:
  lines = ["| procs | link | method | target loss | steps to target | "
           "s to target | vs dense | train s | eval loss | "
           "bytes/step/device | note |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    base = next((x for x in rows if x["procs"] == r["procs"]
                 and x["rate"] == r["rate"]
                 and x["method"] == BASELINE[r["method"]]
                 and x.get("seconds")), None)
    rel = (f"{r['seconds'] / base['seconds']:.2f}" if base and
           r.get("seconds") else "—")
    fmt = lambda v, d=1: "—" if v is None else f"{v:.{d}f}"
    lines.append(
      f"| {r['procs']} | {r['rate']:g} Gbit/s | {r['method']} | "
      f"{fmt(r.get('target'), 3)} | {r.get('steps_to') or '—'} | "
      f"{fmt(r.get('seconds'))} | {rel} | {fmt(r.get('train_s'))} | "
      f"{fmt(r.get('eval_loss'), 4)} | "
      f"{r['bytes_per_step']:,.0f} | {r.get('error', '')[:120]} |"
      if "error" not in r else
      f"| {r['procs']} | {r['rate']:g} Gbit/s | {r['method']} | — | — | — "
      f"| — | — | — | — | {r['error'][:160].replace('|', '/')} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", default="4")
  p.add_argument("--rates", default="1,10", help="Gbit/s, comma-separated")
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--methods", default=";".join(METHODS),
                 help="';'-separated names")
  p.add_argument("--timeout", type=float, default=900.0)
  p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench"))
  a = p.parse_args(argv)
  methods = [m for m in a.methods.split(";") if m]
  unknown = [m for m in methods if m not in METHODS]
  if unknown:
    p.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
  reason = _netns.unavailable()
  if reason:
    print(f"time-to-target benchmark skipped: {reason}. Nothing was "
          "measured.")
    return 0
  os.makedirs(a.out_dir, exist_ok=True)
  port = random.randint(20000, 40000)
  rows = []
  t0 = time.time()
  with _netns.Namespace() as ns:
    for nproc in [int(x) for x in a.processes.split(",")]:
      for rate in [float(x) for x in a.rates.split(",")]:
        ns.set_rate(rate)
        for m in methods:
          port += 1
          print(f"[{time.time() - t0:6.0f}s] {nproc} procs, {rate:g} "
                f"Gbit/s, {m} ...", flush=True)
          run_dir = os.path.join(a.out_dir, "time_to_target",
                                 f"{nproc}-{rate:g}-{m.replace(' ', '_')}")
          r = run_one(ns, port, nproc, m, a.steps, run_dir, a.timeout)
          rows.append(dict(r, procs=nproc, rate=rate, method=m))
        assign_targets([r for r in rows
                        if (r["procs"], r["rate"]) == (nproc, rate)])
  md = table(rows)
  head = (f"char-LSTM (embed 32, hidden 96), {a.steps} steps, global batch "
          f"64, one CPU device per process on a rate-limited loopback; "
          f"target: the same optimizer's dense train loss (mean of "
          f"{SMOOTH} steps) at 2/3 of its steps; time from the end of step "
          f"1; "
          f"{time.time() - t0:.0f}s in all")
  print("\n" + head + "\n\n" + md)
  with open(os.path.join(a.out_dir, "time_to_target.md"), "w") as f:
    f.write(head + "\n\n" + md + "\n")
  with open(os.path.join(a.out_dir, "time_to_target.json"), "w") as f:
    json.dump([{k: v for k, v in r.items() if k != "history"}
               for r in rows], f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
