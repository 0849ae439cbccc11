"""Time to a target loss on a bandwidth-bound model, against the bound where
communication is free.

``python -m benchmarks.time_to_target`` (``make bench-time-to-target``)
trains a wide MLP on digits (64-1024-1024-10, 1.13M params: 4.5 MB of
float32 gradients against about 5 MFLOP of compute per example) with
``train.py`` in ``P`` processes (one CPU device each, joined by
``jax.distributed`` with gloo collectives) inside a network namespace whose
loopback is rate-limited (:mod:`benchmarks._netns`), for each method and
link rate. At 1 Gbit/s a dense step spends most of its time in the
exchange; the benchmark measures that share rather than assuming it.

For each rate it reports:

* the **free-communication step**: the same ``P`` processes, each training
  the same per-device batch through the same dense update path on one
  device of its own (no coordinator: the all-reduce is over a single device,
  a local no-op of the same shape), side by side on the same cores. Its mean
  step time is ``t_free``; the dense step's exchange share is
  ``1 - t_free / t_dense``;
* ``T_free = t_free x`` (dense AdamW's steps to the target - 1): the time
  dense AdamW's training would take if communication cost nothing;
* each method's steps and seconds to the target (from the end of step 1, so
  compilation is left out), as multiples of dense AdamW's seconds
  (``x_dense``) and of ``T_free`` (``x_free``), split into a steps factor
  (its steps over dense's) and a step-time factor (its mean step until the
  target over ``t_free``), with the held-out loss at the end and the bytes
  each device sends per step (the run's mean).

The target is dense AdamW's training loss (mean of the last 20 steps) at two
thirds of its steps, in the same sweep. Each method's learning rate comes
from a separate short run (``--tune``: seed 1, not the measured seed 0; 4
devices in one process, no link; stopped at the target's step, two thirds of
the schedule; the rate with the lowest smoothed loss there wins), written to
``docs/benchmarks/time_to_target_tuning.json``; the structural settings
(ratio, rank, period, bits) are fixed at the methods' usual ones. The three
methods with the lowest ``x_dense`` at the first rate are rerun at seeds 2
and 3 (``--seeds``), against the same target, and the spread is printed.

Needs root and iproute2 (network namespaces) for the measured runs; says so
and exits 0 without them (``--tune`` needs neither). Writes
``time_to_target.{json,md,png}`` to ``--report-dir``: one JSON record per
rate and method with ``rate_gbps``, ``method``, ``seconds_to_target``,
``x_dense`` and ``x_free`` among its keys.

Example::

  sudo .venv/bin/python -m benchmarks.time_to_target --tune
  sudo .venv/bin/python -m benchmarks.time_to_target --rates 1,10 \\
      --report-dir docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from benchmarks import _netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNING_PATH = os.path.join(ROOT, "docs", "benchmarks",
                           "time_to_target_tuning.json")

STEPS = 300
BATCH = 64
TASK = ["--model", "mlp", "--model-args", "hidden_sizes=(1024,1024)",
        "--dataset", "digits", "--batch-size", str(BATCH), "--schedule",
        "cosine", "--eval-examples", "512"]
ADAMW = ["--optimizer", "adamw", "--weight-decay", "1e-4"]
ADAMW_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
PERIOD = 20
# name -> (train.py flags, learning rates the tuning run tries)
METHODS = {
  "dense adamw": (ADAMW + ["--compressor", "dense"], ADAMW_LRS),
  "bf16 -> adamw": (ADAMW + ["--compressor", "cast", "--compressor-args",
                             "dtype=bfloat16"], ADAMW_LRS),
  "int8 -> adamw": (ADAMW + ["--compressor", "int8"], ADAMW_LRS),
  "int4 -> adamw": (ADAMW + ["--compressor", "int4"], ADAMW_LRS),
  "top-k 1% + ef -> adamw": (ADAMW + ["--compressor", "topk",
                                      "--compressor-args", "ratio=0.01"],
                             ADAMW_LRS),
  "powersgd r4 -> adamw": (ADAMW + ["--compressor", "powersgd",
                                    "--compressor-args", "rank=4"],
                           ADAMW_LRS),
  # At the default eps=1e-8 it diverged by step 65 at every rate (pixels
  # that are rarely nonzero have a tiny frozen variance, and the 1-bit
  # exchange gives them their chunk's scale): eps raised as a user would.
  "1-bit adam, eps 1e-5": (["--optimizer", "onebit_adam", "--optimizer-args",
                            "eps=1e-5", "--weight-decay", "1e-4",
                            "--compressor", "dense"], ADAMW_LRS),
  f"diloco H={PERIOD}, int4": (ADAMW + [
    "--local", "diloco", "--local-args", f"period={PERIOD}",
    "--compressor", "int4"], ADAMW_LRS),
  f"streaming diloco H={PERIOD}, int4": (ADAMW + [
    "--local", "diloco", "--local-args",
    f"period={PERIOD},fragments=4,overlap_steps=2", "--compressor", "int4"],
    ADAMW_LRS),
  f"muloco H={PERIOD}": (["--optimizer", "muon", "--local", "muloco",
                          "--local-args", f"period={PERIOD}"],
                         (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)),
  "demo": (["--optimizer", "demo", "--compressor", "dense"],
           (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)),
}
DENSE = "dense adamw"
FREE = "free communication"
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


def _argv(method, lr, seed, out_dir):
  flags, _ = METHODS[method]
  return [sys.executable, os.path.join(ROOT, "train.py"), *TASK, *flags,
          "--lr", repr(lr), "--steps", str(STEPS), "--seed", str(seed),
          "--checkpoint-every", "0", "--no-progress", "--no-plot",
          "--overwrite", "--out-dir", out_dir]


def _read(out_dir) -> dict:
  hist = _netns.read_json_lines(os.path.join(out_dir, "metrics.jsonl"))
  with open(os.path.join(out_dir, "result.json")) as f:
    result = json.load(f)
  t_first = hist[0]["time"]
  return {"history": [{"step": h["step"], "loss": h["loss"],
                       "time": h["time"] - t_first} for h in hist],
          "train_s": hist[-1]["time"] - t_first,
          "step_s": (hist[-1]["time"] - t_first) / max(len(hist) - 1, 1),
          "eval_loss": result["eval_loss"],
          "bytes_per_step": result["bytes_per_step"],
          "dense_bytes_per_step": result["dense_bytes_per_step"]}


# --- the tuning run ----------------------------------------------------------


def tune(methods, out_dir, timeout_s, path) -> dict:
  """Each method's rate: the lowest smoothed train loss at the target's
  step (2/3 of the schedule), seed 1, 4 devices in one process; each
  method's choice is added to the JSON file ``path`` as it is made, and a
  rate whose loss ``path`` already holds is not run again."""
  stop = 2 * STEPS // 3
  chosen = {}
  saved = {}
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
  for m in methods:
    losses = {}
    for lr in METHODS[m][1]:
      if f"{lr:g}" in saved.get(m, {}).get("losses", {}):
        losses[f"{lr:g}"] = saved[m]["losses"][f"{lr:g}"]   # run before
        continue
      run_dir = os.path.join(out_dir, "tune", f"{_slug(m)}-{lr:g}")
      argv = _argv(m, lr, 1, run_dir) + ["--num-devices", "4",
                                         "--stop-after", str(stop)]
      t0 = time.time()
      p = subprocess.run(argv, env=_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout_s)
      if p.returncode != 0:
        losses[f"{lr:g}"] = None
        print(f"  {m} lr {lr:g}: failed ({p.stderr[-300:]})", flush=True)
        continue
      hist = _netns.read_json_lines(os.path.join(run_dir, "metrics.jsonl"))
      loss = _smoothed(hist)[-1]
      losses[f"{lr:g}"] = loss if loss == loss else None  # NaN -> None
      print(f"  {m} lr {lr:g}: smoothed loss {loss:.4f} at step "
            f"{hist[-1]['step']} ({time.time() - t0:.0f} s)", flush=True)
    ok = {k: v for k, v in losses.items() if v is not None}
    if not ok:
      raise RuntimeError(f"every tuning run of {m!r} failed")
    best = min(ok, key=ok.get)
    chosen[m] = {"lr": float(best), "losses": losses}
    edge = best in (f"{METHODS[m][1][0]:g}", f"{METHODS[m][1][-1]:g}")
    chosen[m]["at_grid_edge"] = edge
    print(f"{m}: lr {best}" + (" (at the grid's edge: widen it)" if edge
                                else ""), flush=True)
    if os.path.exists(path):
      with open(path) as f:
        saved = json.load(f)
    saved[m] = chosen[m]
    with open(path, "w") as f:
      json.dump(saved, f, indent=1)
  return chosen


def _slug(name):
  return "".join(c if c.isalnum() or c in "=.-" else "_" for c in name)


# --- the measured runs -------------------------------------------------------


def run_method(ns, port, nproc, method, lr, seed, out_dir, timeout_s):
  """Trains ``method`` in ``nproc`` processes joined over the link."""
  argv = _argv(method, lr, seed, out_dir) + [
    "--num-devices", str(nproc), "--coordinator", f"127.0.0.1:{port}",
    "--num-processes", str(nproc)]
  cmds = [ns.command(argv + ["--process-id", str(i)]) for i in range(nproc)]
  codes, outs, timed_out = _netns.run_group(cmds, timeout_s, env=_env(),
                                            cwd=ROOT)
  if timed_out or any(c != 0 for c in codes):
    return {"error": f"exit codes {codes}"
            f"{' (timeout)' if timed_out else ''}: {(outs[0] or '')[-400:]}"}
  return _read(out_dir)


def run_free(ns, nproc, lr, out_dir, timeout_s):
  """``nproc`` processes side by side, each dense AdamW on the per-device
  batch with its one device (nothing crosses the link)."""
  flags = {"--batch-size": str(BATCH // nproc)}
  cmds = []
  for i in range(nproc):
    argv = _argv(DENSE, lr, 0, os.path.join(out_dir, f"p{i}")) + [
      "--num-devices", "1"]
    for k, v in flags.items():
      argv[argv.index(k) + 1] = v
    cmds.append(ns.command(argv))
  codes, outs, timed_out = _netns.run_group(cmds, timeout_s, env=_env(),
                                            cwd=ROOT)
  if timed_out or any(c != 0 for c in codes):
    return {"error": f"exit codes {codes}"
            f"{' (timeout)' if timed_out else ''}: {(outs[0] or '')[-400:]}"}
  runs = [_read(os.path.join(out_dir, f"p{i}")) for i in range(nproc)]
  return {"step_s": statistics.mean(r["step_s"] for r in runs),
          "step_s_each": [r["step_s"] for r in runs],
          "history": runs[0]["history"], "bytes_per_step": 0.0}


def reach(history, target):
  """``(step, seconds)`` when the smoothed loss first is <= target."""
  for h, s in zip(history, _smoothed(history)):
    if s <= target:
      return h["step"], h["time"]
  return None, None


def score(rows, free, target):
  """Fills each row's steps and seconds to ``target`` and its multiples
  of dense's time and of ``T_free``; returns ``T_free``."""
  dense = next(r for r in rows if r["method"] == DENSE and r["seed"] == 0)
  for r in rows:
    if "history" in r:
      r["steps_to_target"], r["seconds_to_target"] = reach(r["history"],
                                                           target)
  d_steps = dense.get("steps_to_target")
  t_free = free["step_s"] * (d_steps - 1) if d_steps else None
  for r in rows:
    s, n = r.get("seconds_to_target"), r.get("steps_to_target")
    ok = s is not None and dense.get("seconds_to_target")
    r["x_dense"] = s / dense["seconds_to_target"] if ok else None
    r["x_free"] = s / t_free if s is not None and t_free else None
    r["steps_factor"] = ((n - 1) / (d_steps - 1)
                         if n is not None and d_steps else None)
    r["step_time_factor"] = (s / (n - 1) / free["step_s"]
                             if n is not None and n > 1 else None)
    if "history" in r:
      r["breakdown"] = breakdown(r, free)
  return t_free


def breakdown(r, free):
  """Where a run's seconds to the target went: ``compute`` (its steps at
  the free-communication step time), ``every_step`` (what its typical step,
  the median, takes beyond that: per-step collectives and waiting) and
  ``bursts`` (the rest: steps far above the median, a local method's
  syncs)."""
  n, s = r.get("steps_to_target"), r.get("seconds_to_target")
  if n is None or n < 3:
    return None
  h = r["history"][:n]
  d = sorted(b["time"] - a["time"] for a, b in zip(h, h[1:]))
  med = d[len(d) // 2]
  compute = (n - 1) * free["step_s"]
  every = (n - 1) * med - compute
  return {"compute_s": compute, "every_step_s": every,
          "bursts_s": s - compute - every, "median_step_s": med}


def _fmt(v, d=2):
  return "—" if v is None else f"{v:,.{d}f}"


def table(rows) -> str:
  lines = ["| method | seed | lr | steps to target | s to target | "
           "x dense | x T_free | steps x | step time x | train s | "
           "held-out loss | bytes/step/device |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['method']} | {r['seed']} | {r['lr']:g} | "
                   f"{r['error'][:160].replace('|', '/')} |||||||||")
      continue
    lines.append(
      f"| {r['method']} | {r['seed']} | {r['lr']:g} | "
      f"{r.get('steps_to_target') or '—'} | "
      f"{_fmt(r.get('seconds_to_target'), 1)} | {_fmt(r.get('x_dense'))} | "
      f"{_fmt(r.get('x_free'))} | {_fmt(r.get('steps_factor'))} | "
      f"{_fmt(r.get('step_time_factor'))} | {_fmt(r['train_s'], 1)} | "
      f"{_fmt(r['eval_loss'], 4)} | {r['bytes_per_step']:,.0f} |")
  return "\n".join(lines)


def breakdown_table(rows) -> str:
  lines = ["| method | s to target | compute s | every step s | bursts s | "
           "median step ms |", "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    b = r.get("breakdown")
    if r["seed"] != 0 or not b:
      continue
    lines.append(f"| {r['method']} | {r['seconds_to_target']:.1f} | "
                 f"{b['compute_s']:.1f} | {b['every_step_s']:.1f} | "
                 f"{b['bursts_s']:.1f} | {1e3 * b['median_step_s']:.1f} |")
  return "\n".join(lines)


def spread(rows) -> str:
  """Mean and range over seeds of the methods run at several seeds."""
  by = {}
  for r in rows:
    by.setdefault(r["method"], []).append(r)
  lines = ["| method | seeds | s to target (mean, min-max) | x dense | "
           "x T_free | held-out loss |", "|---|---:|---:|---:|---:|---:|"]
  for m, rs in by.items():
    if len(rs) < 2:
      continue
    ok = [r for r in rs if r.get("seconds_to_target") is not None]
    if not ok:
      lines.append(f"| {m} | {len(rs)} | not reached | — | — | — |")
      continue
    s = [r["seconds_to_target"] for r in ok]
    xd = [r["x_dense"] for r in ok]
    xf = [r["x_free"] for r in ok]
    ev = [r["eval_loss"] for r in rs]
    lines.append(
      f"| {m} | {len(ok)} of {len(rs)} reached | {statistics.mean(s):.1f} "
      f"({min(s):.1f}-{max(s):.1f}) | {statistics.mean(xd):.2f} "
      f"({min(xd):.2f}-{max(xd):.2f}) | {statistics.mean(xf):.2f} "
      f"({min(xf):.2f}-{max(xf):.2f}) | {statistics.mean(ev):.4f} "
      f"({min(ev):.4f}-{max(ev):.4f}) |")
  return "\n".join(lines)


def plot(sweeps, path) -> None:
  """Loss against wall-clock seconds, one panel per rate, a dashed line at
  ``T_free`` and a dotted one at the target."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(sweeps), figsize=(6.5 * len(sweeps), 4.6),
                           squeeze=False)
  for ax, sw in zip(axes[0], sweeps):
    for r in sw["rows"]:
      if "history" not in r or r["seed"] != 0:
        continue
      h = r["history"][1:]
      ax.plot([x["time"] for x in h], _smoothed(r["history"])[1:],
              lw=1.3 if r["method"] == DENSE else 1, label=r["method"],
              color="black" if r["method"] == DENSE else None)
    if sw.get("t_free"):
      ax.axvline(sw["t_free"], ls="--", color="gray",
                 label=f"T_free = {sw['t_free']:.1f} s")
    ax.axhline(sw["target"], ls=":", color="gray", label="target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("wall-clock seconds (from the end of step 1)")
    ax.set_ylabel(f"train loss (mean of {SMOOTH} steps)")
    ax.set_title(f"{sw['procs']} processes, {sw['rate']:g} Gbit/s: dense "
                 f"step {100 * sw['share']:.0f}% exchange")
    ax.grid(alpha=0.3, which="both")
  axes[0][-1].legend(fontsize=7, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tune", action="store_true",
                 help="run the tuning runs (seed 1, no link) and write "
                      "--tuning; nothing is timed")
  p.add_argument("--tuning", default=TUNING_PATH,
                 help="the tuning runs' chosen rates (JSON)")
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--rates", default="1,10", help="Gbit/s, comma-separated")
  p.add_argument("--methods", default=";".join(METHODS),
                 help="';'-separated names (dense adamw is always run)")
  p.add_argument("--seeds", default="2,3",
                 help="extra seeds for the top 3 methods at the first rate "
                      "('' for none)")
  p.add_argument("--free-repeats", type=int, default=3,
                 help="free-communication runs per rate; the median "
                      "run's step is t_free")
  p.add_argument("--timeout", type=float, default=900.0)
  p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench"))
  p.add_argument("--report-dir", default=os.path.join(ROOT, "runs",
                                                      "bench"))
  a = p.parse_args(argv)
  methods = [m for m in a.methods.split(";") if m]
  unknown = [m for m in methods if m not in METHODS]
  if unknown:
    p.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
  os.makedirs(a.out_dir, exist_ok=True)
  if not a.tune and DENSE not in methods:
    methods.insert(0, DENSE)
  if a.tune:
    tune(methods, a.out_dir, a.timeout, a.tuning)
    print(f"wrote {a.tuning}")
    return 0
  with open(a.tuning) as f:
    lrs = {m: v["lr"] for m, v in json.load(f).items()}
  missing = [m for m in methods if m not in lrs]
  if missing:
    p.error(f"no tuned rate for {missing} in {a.tuning}: run --tune first")
  reason = _netns.unavailable()
  if reason:
    print(f"time-to-target benchmark skipped: {reason}. Nothing was "
          "measured.")
    return 0
  os.makedirs(a.report_dir, exist_ok=True)
  port = random.randint(20000, 40000)
  t0 = time.time()
  nproc = a.processes
  sweeps = []
  seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
  with _netns.Namespace() as ns:
    for k, rate in enumerate(float(x) for x in a.rates.split(",")):
      ns.set_rate(rate)
      base = os.path.join(a.out_dir, "time_to_target", f"{rate:g}")
      print(f"[{time.time() - t0:6.0f}s] {rate:g} Gbit/s, {FREE} ...",
            flush=True)
      frees = []
      for rep in range(a.free_repeats):
        free = run_free(ns, nproc, lrs[DENSE],
                        os.path.join(base, f"free{rep}"), a.timeout)
        if "error" in free:
          raise RuntimeError(f"the free-communication run failed: "
                             f"{free['error']}")
        frees.append(free)
      # Its step time moves by about 20% run to run on shared cores: the
      # median run is the bound.
      free = sorted(frees, key=lambda f: f["step_s"])[len(frees) // 2]
      free["step_s_runs"] = [f["step_s"] for f in frees]
      rows = []
      for m in methods:
        port += 1
        print(f"[{time.time() - t0:6.0f}s] {rate:g} Gbit/s, {m} ...",
              flush=True)
        r = run_method(ns, port, nproc, m, lrs[m], 0,
                       os.path.join(base, _slug(m)), a.timeout)
        rows.append(dict(r, method=m, seed=0, lr=lrs[m], rate_gbps=rate))
      dense = rows[0]
      if "error" in dense:
        raise RuntimeError(f"dense AdamW failed: {dense['error']}")
      target = _smoothed(dense["history"])[2 * len(dense["history"]) // 3
                                           - 1]
      score(rows, free, target)
      if k == 0 and seeds:
        top = sorted((r for r in rows if r.get("x_dense") is not None
                      and r["method"] != DENSE),
                     key=lambda r: r["x_dense"])[:3]
        for r0 in top:
          for s in seeds:
            port += 1
            print(f"[{time.time() - t0:6.0f}s] {rate:g} Gbit/s, "
                  f"{r0['method']} seed {s} ...", flush=True)
            r = run_method(ns, port, nproc, r0["method"], r0["lr"], s,
                           os.path.join(base, f"{_slug(r0['method'])}-s{s}"),
                           a.timeout)
            rows.append(dict(r, method=r0["method"], seed=s, lr=r0["lr"],
                             rate_gbps=rate))
      t_free = score(rows, free, target)
      share = 1 - free["step_s"] / dense["step_s"]
      sweeps.append({"rate": rate, "procs": nproc, "rows": rows,
                     "free": free, "t_free": t_free, "target": target,
                     "share": share})
  md = []
  for sw in sweeps:
    dense = sw["rows"][0]
    md += [f"### {sw['procs']} processes at {sw['rate']:g} Gbit/s", "",
           f"- dense AdamW step: {1e3 * dense['step_s']:.1f} ms; "
           f"free-communication step t_free: {1e3 * sw['free']['step_s']:.1f}"
           f" ms (processes: "
           + ", ".join(f"{1e3 * x:.1f}" for x in sw["free"]["step_s_each"])
           + "; the median of runs at "
           + ", ".join(f"{1e3 * x:.1f}" for x in sw["free"]["step_s_runs"])
           + f"); exchange share of the dense step: "
           f"**{100 * sw['share']:.1f}%**",
           f"- target: train loss {sw['target']:.4f} (dense AdamW's, mean "
           f"of {SMOOTH} steps, at step {2 * STEPS // 3}); dense reaches it "
           f"at step {dense.get('steps_to_target')}; T_free = "
           f"{_fmt(sw['t_free'], 1)} s against dense's "
           f"{_fmt(dense.get('seconds_to_target'), 1)} s", "",
           table(sw["rows"]), ""]
    md += ["Where the seconds to the target went (compute: its steps at "
           "t_free; every step: its median step beyond t_free; bursts: the "
           "rest, e.g. syncs):", "", breakdown_table(sw["rows"]), ""]
    sp = spread(sw["rows"])
    if sp.count("\n") > 1:
      md += ["Seeds (the three lowest x dense, same target):", "", sp, ""]
  head = (f"wide MLP (64-1024-1024-10) on digits, {STEPS} steps, global "
          f"batch {BATCH}, {nproc} processes with one CPU device each on a "
          f"rate-limited loopback; {time.time() - t0:.0f} s in all")
  text = head + "\n\n" + "\n".join(md)
  print("\n" + text)
  stem = os.path.join(a.report_dir, "time_to_target")
  with open(stem + "_tables.md", "w") as f:
    f.write(text + "\n")
  records = []
  for sw in sweeps:
    for r in sw["rows"]:
      rec = {k: v for k, v in r.items() if k != "history"}
      rec.update(exchange_share=sw["share"], t_free=sw["t_free"],
                 free_step_s=sw["free"]["step_s"], target=sw["target"],
                 processes=sw["procs"])
      records.append(rec)
  with open(stem + ".json", "w") as f:
    json.dump(records, f, indent=1)
  try:
    plot(sweeps, stem + ".png")
    print(f"plot: {stem}.png")
  except Exception as e:  # pylint: disable=broad-except
    print(f"plot failed: {type(e).__name__}: {e}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
