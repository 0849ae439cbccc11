"""Measured step times of real processes on a rate-limited network.

``make bench-network`` (or ``python -m benchmarks.network``) runs one
process per simulated host, each with one CPU device, joined by
``jax.distributed`` (gloo collectives) inside a fresh network namespace whose
loopback is rate-limited with ``tc ... tbf`` (see ``benchmarks/_netns.py``).
For each link rate, process count and gradient shape set it times the
data-parallel train step of every compressor that exists in ``jaxcomm``
(dense mean, bf16 cast, PowerSGD rank 4, top-k 1% with error feedback,
DGC 0.1%, onebit) and, with the optional ``torch`` extra, PyTorch DDP on the
same shapes in the same namespace, with and without its PowerSGD hook, for
two bucket sizes, each under a timeout.

Gradient shapes: ResNet-18 for CIFAR (:data:`RESNET18_SHAPES`, 11,173,962
parameters) and the default language model (``models.create("charlm")``).
The loss is synthetic, ``sum_j a |w_j|^2 / 2 + c sum(w_j)`` with per-device
scalars ``a, c``, so its gradient has exactly those shapes and costs almost
nothing to compute: the step time is communication plus the compressor's
own arithmetic. (No time-to-target-loss here: the loss is not a learning
problem.)

Next to each measurement it prints what :class:`jaxcomm.wire.CostModel`
predicts for the bytes the compressor claims, twice: for ``n`` hosts each
with its own link of the given rate, and for the namespace's loopback, which
is one medium shared by all processes (``n`` senders at once: the per-host
model with bandwidth ``B / n``).

With ``--hosts H`` the processes are split over ``H`` namespaces ("hosts",
``_netns.Hosts``): loopback inside a host, each host's link to the others
rate-limited each way. The mesh is ("dcn", "ici"), every compressor runs
as the pod recipe (a dense mean over "ici", then the method over "dcn";
``dense-flat`` and the local methods run over both axes at once), and
the table adds the bytes each host's link carried per step (its filter's
counters) against the claimed collectives.

With ``--hosts H --fsdp`` the model is sharded: the transformer LM split
by its logical axes over each host's processes (FSDP on the fast
loopback), each method between hosts on every device's shards
(``DataParallel(auto_axes=("fsdp",))``), next to ``plain-fsdp``, the jit
step with XLA's own float32 all-reduce.

Prints markdown tables, writes ``runs/bench/network.{json,md,png}``
(``network-Hhosts.*`` with hosts). If
network namespaces cannot be used (no root, no iproute2, a sandbox that
forbids them) it says so and exits 0.

This module is the driver and the command line; the gradient shapes and
the methods are in ``benchmarks/network_methods.py``, the worker processes
in ``benchmarks/network_workers.py``, the tables and the plot in
``benchmarks/network_report.py``.

Example::

  sudo .venv/bin/python -m benchmarks.network --quick
  sudo .venv/bin/python -m benchmarks.network \\
      --processes 2,4 --rates none,1,10 --models resnet18,charlm
  sudo .venv/bin/python -m benchmarks.network --hosts 2 --processes 4 \\
      --rates none,1 --models resnet18 --torch no
  sudo .venv/bin/python -m benchmarks.network --hosts 2 --processes 4 \\
      --fsdp --models transformer --rates none,1 --torch no \\
      --methods plain-fsdp,dense,bf16,int8,topk1%+ef,powersgd4,diloco50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

from benchmarks import _netns
from benchmarks.network_methods import FLAT_METHODS
from benchmarks.network_methods import GOSSIP_METHODS
from benchmarks.network_methods import LOCAL_METHODS  # noqa: F401
from benchmarks.network_methods import METHODS
from benchmarks.network_methods import PLAIN_FSDP
from benchmarks.network_methods import RESNET18_SHAPES
from benchmarks.network_methods import SHARDED
from benchmarks.network_methods import SURVEY_METHODS
from benchmarks.network_methods import TRANSFORMER  # noqa: F401
from benchmarks.network_methods import _torch_layout
from benchmarks.network_methods import model_shapes
from benchmarks.network_report import _fmt
from benchmarks.network_report import _median
from benchmarks.network_report import _predictions  # noqa: F401
from benchmarks.network_report import _rate_key
from benchmarks.network_report import _rate_label
from benchmarks.network_report import link_table
from benchmarks.network_report import plot
from benchmarks.network_report import table
from benchmarks.network_report import targets
from benchmarks.network_workers import _go_path
from benchmarks.network_workers import _jax_worker
from benchmarks.network_workers import _torch_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ driver --

def _env():
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split()
    if "xla_force_host_platform_device_count" not in f)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


class _Ports:
  def __init__(self):
    self.next = random.randint(20000, 40000)

  def take(self) -> int:
    self.next += 1
    return self.next


def _worker_argv(kind, pid, nproc, port, out, a, **kw):
  argv = [sys.executable, "-m", "benchmarks.network", f"--worker={kind}",
          f"--pid={pid}", f"--nproc={nproc}", f"--port={port}",
          f"--out={out}", f"--steps={a.steps}", f"--warmup={a.warmup}",
          f"--init-timeout={a.init_timeout}"]
  return argv + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]


def _run_jax(ns, ports, a, nproc, rates, model, tmp) -> list[dict]:
  """All methods at all rates for one (processes, model).

  One process group per attempt: each method is compiled once, then timed
  at every rate (the driver changes the loopback's rate between them while
  the workers wait). A method that makes no progress for ``a.timeout``
  seconds (a hang) or crashes is recorded as such; the methods after it run
  in a fresh group.
  """
  remaining = list(a.methods)
  rows = []
  attempt = 0
  while remaining:
    attempt += 1
    out = os.path.join(tmp, f"jax-{model}-{nproc}-{attempt}.jsonl")
    port = ports.take()
    hosts = getattr(ns, "n", 1)
    # Processes numbered host by host: pids [h p, (h + 1) p) on host h.
    cmds = [ns.command(_worker_argv(
      "jax", pid, nproc, port, out, a, model=model,
      methods=",".join(remaining), local_devices=1, nrates=len(rates),
      hosts=hosts, coordinator=ns.address(0), fsdp_mode=int(a.fsdp)),
      host=pid // (nproc // hosts)) for pid in range(nproc)]
    group = _netns.Group(cmds, env=_env(), cwd=ROOT)
    seen, last, timed_out = 0, time.monotonic(), False
    # With hosts: the bytes through each host's link while a method was
    # timed at a rate, read when its record arrives (the workers then
    # compile the next method or wait for the next go: no traffic).
    link = {}
    while group.running():
      recs = _netns.read_json_lines(out)
      for r in recs[seen:]:
        last = time.monotonic()
        if (hosts > 1 and r.get("times") and ns.rate is not None):
          link[(r["method"], r["ri"])] = ns.sent()
          print(f"    bytes each host sent through its link: "
                f"{link[(r['method'], r['ri'])]}", flush=True)
        if r.get("event") == "ready":
          ns.set_rate(rates[r["ri"]])
          open(_go_path(out, r["mi"], r["ri"]), "w").close()
          print(f"  {r['method']} at {_rate_label(rates[r['ri']])}",
                flush=True)
      seen = len(recs)
      if time.monotonic() - last > a.timeout:
        timed_out = True
        group.kill()
        break
      time.sleep(0.05)
    codes, outs = group.finish()
    for pid, text in enumerate(outs):
      with open(f"{out}.{pid}.log", "w") as f:
        f.write(text)
    recs = _netns.read_json_lines(out)
    started = [r["method"] for r in recs if r.get("event") == "start"]
    for m in list(remaining):
      done = [r for r in recs if r.get("method") == m and
              r.get("event") is None]
      for r in done:
        rate = rates[r["ri"]] if "ri" in r else None
        rows.append(dict(r, model=model, procs=nproc, rate=rate,
                         hosts=hosts))
        if (r.get("method"), r.get("ri")) in link:
          rows[-1]["link_bytes"] = link[(r["method"], r["ri"])]
          rows[-1]["link_steps"] = a.warmup + len(r["times"])
      complete = (any("skipped" in r or "error" in r for r in done)
                  or len({r.get("ri") for r in done}) == len(rates))
      if complete:
        remaining.remove(m)
      elif m in started:
        # Started, did not finish every rate: a hang or a crash.
        why = (f"no progress for {a.timeout:.0f} s (hang?)" if timed_out
               else f"exit codes {codes}: " + _tail(outs))
        got = {r.get("ri") for r in done}
        for ri, rate in enumerate(rates):
          if ri not in got:
            rows.append({"method": m, "error": why, "model": model,
                         "procs": nproc, "rate": rate})
        print(f"  {m}: {why}", flush=True)
        remaining.remove(m)
        break
    if not started and remaining:
      why = f"exit codes {codes}: " + _tail(outs)
      for m in remaining:
        rows.append({"method": m, "error": why, "model": model,
                     "procs": nproc, "rate": None})
      print(f"  workers failed before any method: {why}", flush=True)
      break
  return rows


def _tail(outs) -> str:
  """The most telling line of the workers' output (an error if any)."""
  keys = ("what():", "Error:", "error:", "Timeout", "Aborted")
  for o in outs:
    for line in reversed((o or "").strip().splitlines()):
      if any(k in line for k in keys):
        return line.strip()[-300:]
  return (outs[0] or "").strip()[-300:] if outs else ""


def torch_ops(shapes, rank=None) -> list[tuple[str, int]]:
  """The all-reduces DDP issues per step (one fused payload per kind).

  Dense: every gradient in float32. With the PowerSGD hook (PyTorch's
  rule): a tensor viewed as ``(shape[0], rest)`` is compressed when
  ``(n + m) r * 2 < n m``, sending ``P`` (n x r) and ``Q`` (m x r) in two
  all-reduces; the others are all-reduced as they are. Bucketing splits
  these payloads over several calls but does not change their sum.
  """
  if rank is None:
    return [("all-reduce", 4 * sum(math.prod(s) for s in shapes))]
  dense, ps, qs = 0, 0, 0
  for s in shapes:
    s = _torch_layout(s)
    rows_, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
    if len(s) > 1 and (rows_ + cols) * rank * 2 < rows_ * cols:
      ps += 4 * rows_ * rank
      qs += 4 * cols * rank
    else:
      dense += 4 * math.prod(s)
  return [(k, b) for k, b in (("all-reduce", dense), ("all-reduce", ps),
                              ("all-reduce", qs)) if b]


def _run_torch(ns, ports, a, nproc, rate, model, tmp, bucket, hook):
  label = f"torch-ddp{'-powersgd' + str(a.torch_rank) if hook else ''}" \
          f"-b{bucket:g}"
  out = os.path.join(tmp, f"{label}-{model}-{nproc}-{rate}.jsonl")
  port = ports.take()
  cmds = [ns.command(_worker_argv(
    "torch", pid, nproc, port, out, a, model=model, bucket_mb=bucket,
    hook=hook or "none", rank=a.torch_rank, label=label))
    for pid in range(nproc)]
  codes, outs, timed_out = _netns.run_group(cmds, a.torch_timeout,
                                            env=_env(), cwd=ROOT)
  for pid, text in enumerate(outs):
    with open(f"{out}.{pid}.log", "w") as f:
      f.write(text or "")
  recs = _netns.read_json_lines(out)
  ops = torch_ops(model_shapes(model), a.torch_rank if hook else None)
  row = {"method": label, "model": model, "procs": nproc, "rate": rate,
         "torch": True, "bucket_mb": bucket, "devices": nproc, "ops": ops,
         "sent": 2.0 * (nproc - 1) / nproc * sum(b for _, b in ops)}
  final = [r for r in recs if r.get("method") == label]
  if final:
    row.update(final[-1])
  else:
    steps = [r for r in recs if r.get("event") == "step"]
    why = (f"hang: timeout after {a.torch_timeout:.0f} s, {len(steps)} of "
           f"{a.warmup + a.steps} steps done" if timed_out else
           f"exit codes {codes}: " + _tail(outs))
    row["error"] = why
    if steps:
      row["partial_step_times"] = [r["t"] for r in steps]
  return row


def _parse_rates(text):
  return [None if t in ("none", "unlimited", "0") else float(t)
          for t in text.split(",") if t]


def _torch_available() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return importlib.util.find_spec("torch") is not None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--processes", default="2,4")
  p.add_argument("--rates", default=None,
                 help="Gbit/s, comma separated; 'none' = no limit "
                 "(default: none,1,10; with --quick: 1)")
  p.add_argument("--models", default="resnet18,charlm")
  p.add_argument("--methods", default=",".join(
    m for m in METHODS if m not in SURVEY_METHODS + (PLAIN_FSDP,)))
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--torch", choices=("auto", "no"), default="auto")
  p.add_argument("--torch-buckets", default="25,100")
  p.add_argument("--torch-rank", type=int, default=4)
  p.add_argument("--torch-models", default="resnet18")
  p.add_argument("--timeout", type=float, default=300.0,
                 help="seconds without progress before a jaxcomm method "
                 "counts as hung (compiling included)")
  p.add_argument("--torch-timeout", type=float, default=150.0,
                 help="seconds for one PyTorch run (start-up included)")
  p.add_argument("--init-timeout", type=int, default=120)
  p.add_argument("--latency-us", type=float, default=50.0)
  p.add_argument("--hosts", type=int, default=1,
                 help="simulated hosts: > 1 puts the processes, in equal "
                 "numbers, in that many namespaces joined by links "
                 "rate-limited each way (fast loopback inside a host), on "
                 "a ('dcn', 'ici') mesh: a dense mean inside each host, "
                 "then the method between hosts")
  p.add_argument("--fsdp", action="store_true",
                 help="with --hosts > 1: a sharded model, params split over "
                 "each host's processes (FSDP on the fast loopback), the "
                 "method between hosts on each device's shards; "
                 f"'{PLAIN_FSDP}' is the plain jit step")
  p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench"))
  p.add_argument("--quick", action="store_true",
                 help="2 processes, 1 Gbit/s, ResNet-18 shapes, 3 steps")
  # Worker mode (run inside the namespace by the driver).
  p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
  for flag, typ in (("pid", int), ("nproc", int), ("port", int),
                    ("out", str), ("model", str), ("local-devices", int),
                    ("bucket-mb", float), ("hook", str), ("rank", int),
                    ("label", str), ("nrates", int),
                    ("coordinator", str)):
    p.add_argument(f"--{flag}", type=typ, help=argparse.SUPPRESS)
  p.add_argument("--fsdp-mode", type=int, default=0, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker == "jax":
    return _jax_worker(a)
  if a.worker == "torch":
    return _torch_worker(a)

  if a.quick:
    a.processes, a.models, a.steps, a.warmup = "2", "resnet18", 3, 2
  if a.rates is None:
    a.rates = "1" if a.quick else "none,1,10"
  unknown = [m for m in a.methods.split(",") if m not in METHODS]
  if unknown:
    p.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
  a.methods = a.methods.split(",")
  if a.warmup < 1:
    p.error("--warmup must be >= 1")
  procs = [int(x) for x in a.processes.split(",")]
  rates = _parse_rates(a.rates)
  model_names = a.models.split(",")
  use_torch = a.torch == "auto" and _torch_available()
  if a.hosts < 1:
    p.error(f"--hosts must be >= 1, got {a.hosts}")
  if a.hosts > 1:
    bad = [x for x in procs if x % a.hosts or x == a.hosts]
    if bad:
      p.error(f"--processes {bad}: with --hosts {a.hosts} each count must "
              "be a multiple of it, with at least 2 processes per host")
    gossip = [m for m in a.methods if m in GOSSIP_METHODS]
    if gossip:
      p.error(f"--hosts > 1 runs the pod recipe; gossip methods {gossip} "
              "have no such form")
    if use_torch:
      print("note: PyTorch DDP rows are measured on one namespace only "
            "(--hosts 1); skipped")
      use_torch = False
  elif any(m.endswith(SHARDED) for m in a.methods):
    p.error("the -sharded methods split the exchange between hosts over a "
            "host's processes: they need --hosts > 1")
  if a.fsdp:
    if model_names != ["transformer"]:
      p.error("--fsdp trains the transformer LM's step: --models "
              "transformer")
    if a.hosts < 2:
      p.error("--fsdp splits the params over each host's processes: it "
              "needs --hosts > 1")
    bad = [m for m in a.methods if m.endswith(SHARDED)
           or m in FLAT_METHODS or m in GOSSIP_METHODS]
    if bad:
      p.error(f"--fsdp: methods {bad} do not run on a sharded model (each "
              "device already exchanges its own shards between hosts)")
  elif PLAIN_FSDP in a.methods:
    p.error(f"{PLAIN_FSDP} is the plain step of a sharded model: add --fsdp")

  reason = _netns.unavailable()
  if not reason and a.hosts > 1:
    try:
      with _netns.Hosts(a.hosts):
        pass
    except (subprocess.CalledProcessError, OSError) as e:
      reason = f"cannot join namespaces by veth and bridge: {_netns._err(e)}"
  if reason:
    print(f"network benchmark skipped: {reason}. Nothing was measured.")
    return 0

  import jaxcomm  # pylint: disable=import-outside-toplevel
  missing = [m for m in a.methods if not hasattr(jaxcomm, METHODS[m][0])]
  for m in missing:
    print(f"note: jaxcomm.{METHODS[m][0]} does not exist in this checkout; "
          f"{m} is skipped")
  a.methods = [m for m in a.methods if m not in missing]
  if not use_torch:
    print("note: torch is not installed (pip install -e '.[torch]'); the "
          "PyTorch DDP rows are skipped" if a.torch == "auto" else
          "note: PyTorch DDP rows skipped (--torch=no)")
  for m in model_names:
    s = model_shapes(m)
    print(f"{m}: {len(s)} tensors, "
          f"{sum(math.prod(x) for x in s):,} parameters")
  print("resnet18 shapes (kh, kw, in, out) / (in, out) / (c,): "
        + ", ".join("x".join(map(str, s)) for s in RESNET18_SHAPES))

  os.makedirs(a.out_dir, exist_ok=True)
  tmp = os.path.join(a.out_dir, "network-logs")
  os.makedirs(tmp, exist_ok=True)
  for f in os.listdir(tmp):
    os.remove(os.path.join(tmp, f))
  ports = _Ports()
  rows = []
  t_all = time.perf_counter()
  with (_netns.Hosts(a.hosts) if a.hosts > 1
        else _netns.Namespace()) as ns:
    if a.hosts > 1:
      print(f"{a.hosts} hosts ({', '.join(ns.names)}) joined by a bridge; "
            "the rate limits each host's link both ways", flush=True)
    else:
      print(f"namespace {ns.name}: loopback only", flush=True)
    for nproc in procs:
      for model in model_names:
        t0 = time.perf_counter()
        print(f"{nproc} processes, {model} gradients ...", flush=True)
        got = _run_jax(ns, ports, a, nproc, rates, model, tmp) \
          if a.methods else []
        if use_torch and model in a.torch_models.split(","):
          for rate in rates:
            ns.set_rate(rate)
            for bucket in [float(b) for b in a.torch_buckets.split(",")]:
              for hook in (None, "powersgd"):
                got.append(_run_torch(ns, ports, a, nproc, rate, model, tmp,
                                      bucket, hook))
                print(f"  {got[-1]['method']} at {_rate_label(rate)}",
                      flush=True)
        for r in sorted(got, key=lambda r: _rate_key(r["rate"])):
          state = _fmt(_median(r)) + " s" if r.get("times") else \
            (r.get("skipped") or r.get("error"))
          print(f"  {_rate_label(r['rate'])} {r['method']}: {state}",
                flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows += got
  rows.sort(key=lambda r: (r["model"], r["procs"], _rate_key(r["rate"])))
  where = ("a rate-limited loopback" if a.hosts == 1 else
           f"{a.hosts} hosts joined by rate-limited links (loopback inside "
           "each; " + ("the params split over each host's processes, the "
                       "method between hosts on each device's shards)"
                       if a.fsdp else
                       "the method between hosts after a dense mean "
                       "inside)"))
  md = [f"## Measured step times on {where}", "",
        f"Processes {a.processes}; rates (Gbit/s) {a.rates}; one CPU device "
        f"per process; median of {a.steps} steps after {a.warmup} warm-up "
        f"steps at each rate; "
        f"model columns: jaxcomm.wire.CostModel.link(rate, "
        f"{a.latency_us:g} us) on the claimed collectives "
        "(communication only).", "",
        table(rows, a.latency_us), ""]
  if a.hosts > 1:
    md += ["Bytes through each host's link (its tbf counters; TCP/IP "
           "headers included):", "", link_table(rows)]
  else:
    md += ["Targets:", targets(rows)]
  text = "\n".join(md)
  print("\n" + text)
  stem = ("network" if a.hosts == 1 else f"network-{a.hosts}hosts"
          + ("-fsdp" if a.fsdp else ""))
  with open(os.path.join(a.out_dir, f"{stem}.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(a.out_dir, f"{stem}.json"), "w") as f:
    json.dump({"args": {k: v for k, v in vars(a).items()
                        if not k.startswith("_")}, "rows": rows}, f,
              indent=1, default=str)
  try:
    plot(rows, os.path.join(a.out_dir, f"{stem}.png"), a.latency_us)
    print(f"\nplot: {os.path.join(a.out_dir, stem + '.png')}")
  except Exception as e:  # pylint: disable=broad-except
    print(f"plot failed: {type(e).__name__}: {e}")
  print(f"(total {time.perf_counter() - t_all:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
