"""The reports of :mod:`benchmarks.network`: medians of the measured step
times, the cost model's predictions next to them, the markdown tables and
the plot."""

from __future__ import annotations

import math
import statistics


def _rate_key(rate) -> float:
  return math.inf if rate is None else rate


def _rate_label(rate) -> str:
  return "unlimited" if rate is None else f"{rate:g} Gbit/s"


def _median(r):
  """The median step time; for a local-update method (``period > 1``) the
  mean over whole periods, which is what its syncs cost per step."""
  if not r.get("times"):
    return math.nan
  if r.get("period", 1) > 1:
    return statistics.fmean(r["times"])
  return statistics.median(r["times"])


def _predictions(r, rate, latency_us):
  """(own link, shared link) seconds for a row's claimed ops.

  Own link: every process has a link of ``rate`` to itself. Shared: the
  processes that send over one link at once share it: all of them on the
  single loopback, the processes of one host on its link (``--hosts``).
  With hosts, only the ops between hosts are priced (the mean inside a
  host stays on its loopback).
  """
  import jaxcomm  # pylint: disable=import-outside-toplevel
  if rate is None or not r.get("ops"):
    return math.nan, math.nan
  n = r.get("ops_n", r["devices"])
  ops = [tuple(o) for o in r["ops"]]
  period = r.get("period", 1)
  share = r["procs"] // r.get("hosts", 1)
  link = jaxcomm.wire.CostModel.link(rate, latency_us).predict(ops, n)
  shared = jaxcomm.wire.CostModel.link(rate / share,
                                       latency_us).predict(ops, n)
  return link / period, shared / period


def _fmt(x, digits=3):
  return "—" if x is None or (isinstance(x, float) and math.isnan(x)) \
    else f"{x:.{digits}f}"


def table(rows, latency_us) -> str:
  """The markdown table of all rows."""
  lines = [
    "| shapes | procs | link | method | step s (median; local: mean) "
    "| vs dense "
    "| MB sent/device | model: own links s | model: shared link s "
    "| note |",
    "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
  dense = {(r["model"], r["procs"], r["rate"]): _median(r) for r in rows
           if r["method"] == "dense" and r.get("times")}
  for r in rows:
    med = _median(r)
    d = dense.get((r["model"], r["procs"], r["rate"]), math.nan)
    link, shared = _predictions(r, r["rate"], latency_us)
    sent = r.get("sent")
    note = r.get("skipped") or r.get("error") or ""
    if r.get("finite") is False:
      note = (note + " non-finite params").strip()
    lines.append(
      f"| {r['model']} | {r['procs']} | {_rate_label(r['rate'])} "
      f"| {r['method']} | {_fmt(med)} | "
      f"{_fmt(med / d, 2) if d == d and med == med else '—'} | "
      f"{_fmt(sent / 1e6, 2) if sent is not None else '—'} | "
      f"{_fmt(link)} | {_fmt(shared)} | {note.replace('|', '/')[:160]} |")
  return "\n".join(lines)


def link_table(rows) -> str:
  """With hosts: bytes each host's link carried per step, as read from its
  filter's counters, against the claimed collectives.

  Claimed per host: with the mean inside hosts first, every process of a
  host sends its own exchange between hosts (sent per device x processes
  per host); a flat ring over all processes (numbered host by host) leaves
  each host once, carrying one process's ring traffic (sent per device).
  The counters include TCP/IP headers and acknowledgements. Local-update
  methods are left out: their syncs do not fall evenly on the timed steps.
  """
  lines = ["| link | method | MB/step through each host's link: measured "
           "| claimed | measured / claimed |", "|---|---|---:|---:|---:|"]
  for r in rows:
    if not r.get("link_bytes") or r.get("period", 1) != 1:
      continue
    per_host = r["procs"] // r["hosts"]
    flat = r.get("ops_n", r["devices"]) == r["devices"]
    claimed = r["sent"] * (1 if flat else per_host)
    got = statistics.fmean(r["link_bytes"]) / r["link_steps"]
    lines.append(f"| {_rate_label(r['rate'])} | {r['method']} | "
                 f"{got / 1e6:.3f} | {claimed / 1e6:.3f} | "
                 f"{got / claimed:.3f} |")
  return "\n".join(lines)


def targets(rows) -> str:
  """The issue's two ratio targets, from the rows of this run."""
  out = []
  for r in rows:
    if (r["method"] != "powersgd4" or r["model"] != "resnet18"
        or r.get("hosts", 1) > 1
        or r["rate"] != 1.0 or not r.get("times")):
      continue
    key = (r["model"], r["procs"], r["rate"])
    same = [x for x in rows if (x["model"], x["procs"], x["rate"]) == key
            and x.get("times")]
    p = _median(r)
    dense = [_median(x) for x in same if x["method"] == "dense"]
    if dense:
      out.append(f"- {r['procs']} procs, 1 Gbit/s: PowerSGD-4 / dense = "
                 f"{p:.3f} / {dense[0]:.3f} = {p / dense[0]:.2f} "
                 "(target <= 0.2)")
    for x in same:
      if x.get("torch") and "powersgd" in x["method"]:
        t = _median(x)
        out.append(f"- {r['procs']} procs, 1 Gbit/s: jaxcomm PowerSGD-4 / "
                   f"{x['method']} = {p:.3f} / {t:.3f} = {p / t:.2f} "
                   "(target <= 0.8)")
  return "\n".join(out) or "- (no PowerSGD rank 4 measurement at 1 Gbit/s)"


def plot(rows, path, latency_us=50.0) -> None:
  """Step time per method, one panel per gradient shape set, log scale."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  good = [r for r in rows if r.get("times")]
  models = sorted({r["model"] for r in good})
  if not models:
    return
  fig, axes = plt.subplots(len(models), 1, figsize=(11, 4 * len(models)),
                           squeeze=False)
  for ax, model in zip(axes[:, 0], models):
    mine = [r for r in good if r["model"] == model]
    configs = sorted({(r["procs"], -1 if r["rate"] is None else r["rate"])
                      for r in mine})
    methods = list(dict.fromkeys(r["method"] for r in mine))
    width = 0.8 / max(1, len(methods))
    pred_x, pred_y, heights = [], [], []
    for j, m in enumerate(methods):
      xs, ys = [], []
      for i, (p, rate) in enumerate(configs):
        for r in mine:
          rr = -1 if r["rate"] is None else r["rate"]
          if r["method"] == m and r["procs"] == p and rr == rate:
            xs.append(i + j * width)
            ys.append(_median(r))
            shared = _predictions(r, r["rate"], latency_us)[1]
            if shared == shared and shared > 0:
              pred_x.append(xs[-1])
              pred_y.append(shared)
      ax.bar(xs, ys, width, label=m)
      heights += ys
    if pred_x:
      ax.scatter(pred_x, pred_y, marker="_", s=200, color="k", zorder=3,
                 label="model: shared loopback (comm only)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
    ax.set_xticklabels([f"{p} procs\n{_rate_label(None if r < 0 else r)}"
                        for p, r in configs])
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(heights + pred_y) / 3)
    ax.set_ylabel("step time, s (median)")
    ax.set_title(f"{model} gradient shapes, rate-limited loopback")
    ax.legend(fontsize=7, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
