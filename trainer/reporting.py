"""A training run's reports: the summary table (:func:`summary_table`), the
last printed line (:func:`summary_line`), the loss curves
(:func:`plot_curves`), and the files a run leaves in its ``--out-dir``
(:func:`write_outputs`)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from trainer.accounting import _fmt_bytes
from trainer.checkpoints import atomic_write


def _ratio_text(r: dict[str, Any]) -> str:
  """The compression ratio, or why there is none (one device: nothing
  crosses the wire, compressed or not)."""
  if not r["dense_bytes_per_step"]:
    return "- (one device: no traffic)"
  return f"{r['compression_ratio']:,.1f}x"


def summary_table(results: list[dict[str, Any]]) -> str:
  """A markdown table: final figures next to wire bytes/step vs dense."""
  rows = ["| model | compressor | args | devices | steps | train loss | "
          "eval loss | eval acc | bytes/step/device | dense bytes/step | "
          "ratio | steps/s |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    args = ",".join(f"{k}={v}" for k, v in r["compressor_args"].items())
    rows.append(
      f"| {r['model']} | {r['compressor']} | {args or '-'} | "
      f"{r['num_devices']} | {r['steps']} | {r['train_loss']:.4f} | "
      f"{r['eval_loss']:.4f} | {r['eval_accuracy']:.4f} | "
      f"{r['bytes_per_step']:,.0f} | {r['dense_bytes_per_step']:,.0f} | "
      f"{_ratio_text(r)} | {r['steps_per_s']:.1f} |")
  return "\n".join(rows)


def plot_curves(histories: dict[str, list[dict]], path: str,
                title: str | None = None) -> None:
  """Loss against step and against bytes sent per device (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for label, hist in histories.items():
    steps = [h["step"] for h in hist]
    loss = [h["loss"] for h in hist]
    mb = [h["bytes_total"] / 2**20 for h in hist]
    a.plot(steps, loss, label=label, lw=1)
    b.plot(mb, loss, label=label, lw=1)
  a.set_xlabel("step")
  b.set_xlabel("MiB sent per device (cumulative)")
  b.set_xscale("log")
  for ax in (a, b):
    ax.set_ylabel("train loss")
    ax.grid(alpha=0.3)
  a.legend(fontsize=7)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summary_line(r: dict[str, Any]) -> str:
  """The run's last printed line: figures and what crossed the wire (on one
  device nothing does, so there is no ratio to give)."""
  if r["dense_bytes_per_step"]:
    where = (f" between {r['slices']} slices" if r.get("slices", 1) > 1
             else "")
    wire = (f"{_fmt_bytes(r['bytes_per_step'])} sent per device per step"
            f"{where} vs "
            f"{_fmt_bytes(r['dense_bytes_per_step'])} dense "
            f"({r['compression_ratio']:.1f}x less)")
  else:
    wire = "one device: nothing crosses the wire"
  if r.get("sent_fraction") is not None:
    wire += (f"; a device sent on {100 * r['sent_fraction']:.1f}% of "
             "steps")
  return (f"{r['model']} on {r['dataset']}, {r['num_devices']} devices, "
          f"{r['steps']} steps in {r['train_time_s']:.0f}s "
          f"({r['wall_time_s']:.0f}s with set-up): held-out loss "
          f"{r['eval_loss']:.4f}, accuracy {r['eval_accuracy']:.4f}; "
          f"{wire}. Outputs: {r['out_dir']}")


def write_outputs(result: dict[str, Any], history: list[dict[str, Any]], *,
                  out_dir: str, metrics_path: str, label: str,
                  plot: bool) -> None:
  """Writes ``summary.md``, ``result.json`` and (with ``plot``)
  ``curves.png`` into ``out_dir``; a run that recorded no train loss at its
  last step leaves those of an earlier run as they were (and says so).

  Args:
    result: the run's final figures.
    history: the records of its ``metrics.jsonl``.
    out_dir: where the files go.
    metrics_path: the run's ``metrics.jsonl`` (named in the note).
    label: the curve's label.
    plot: whether to draw the curves.
  """
  summary_path = os.path.join(out_dir, "summary.md")
  if (not math.isfinite(result["train_loss"])
      and os.path.exists(summary_path)):
    print(f"note: {metrics_path} records no train loss at step "
          f"{result['steps']}: {summary_path} and result.json are left as "
          "they were")
    return
  table = summary_table([result])
  atomic_write(summary_path, table + "\n")
  with open(os.path.join(out_dir, "result.json"), "w") as f:
    json.dump(result, f, indent=1)
  if plot and history:
    plot_curves({label: history}, os.path.join(out_dir, "curves.png"))
