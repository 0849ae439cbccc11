"""Eval loss of the transformer LM trained as a sharded model: FSDP inside
each slice, the compressor across the slices.

Each row is one ``train.py --mesh dcn=2,fsdp=4 --model transformer`` run
(8 simulated CPU devices; the LM split by its logical axes over fsdp, the
batch over dcn then fsdp), same seed, data order, optimizer (Adam), rate
and step budget; ``update_on_shards`` compresses each device's shards
across dcn. Columns: held-out loss and next-character accuracy, bytes each
device sends across dcn per step (the compressor's claim for its shards,
which ``tests/test_shards.py`` checks against the compiled HLO; a local
method's average over the run) and the ratio to the dense float32 mean of
the same shards.

  python -m benchmarks.sharded_convergence --steps 1200 \
      --out docs/benchmarks/sharded_convergence.md
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  from benchmarks._xla import raise_cpu_collective_timeouts
  raise_cpu_collective_timeouts()

import argparse  # noqa: E402
import json  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import train  # noqa: E402

MESH = "dcn=2,fsdp=4"
# (label, train.py flags after the common ones)
METHODS = [
  ("Adam (dense f32)", ["--compressor", "dense"]),
  ("bf16 -> Adam", ["--compressor", "cast", "--compressor-args",
                    "dtype=bfloat16"]),
  ("top-k 1% + EF -> Adam", ["--compressor", "topk", "--compressor-args",
                             "ratio=0.01"]),
  ("PowerSGD r4 (whole matrix) -> Adam", ["--compressor", "powersgd",
                                          "--compressor-args", "rank=4"]),
  ("PowerSGD r4 (per shard) -> Adam", ["--compressor", "powersgd",
                                       "--compressor-args",
                                       "rank=4,sharded=shard"]),
  ("DiLoCo H=50 (Adam inside)", ["--compressor", "dense", "--local",
                                 "diloco", "--local-args", "period=50"]),
  ("SparseLoCo: DiLoCo H=50 + top-k 2%, 2-bit, EF decay 0.95",
   ["--compressor", "topk", "--compressor-args",
    "ratio=0.02,value_bits=2,residual_decay=0.95", "--local", "diloco",
    "--local-args", "period=50,outer_lr=2,outer_momentum=0"]),
]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=1200)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--methods", default=None,
                  help="labels to run, separated by ';'")
  ap.add_argument("--out-dir", default=os.path.join("runs",
                                                    "sharded_convergence"))
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  want = None if a.methods is None else {
    m.strip() for m in a.methods.split(";")}
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  rows = []
  for label, flags in METHODS:
    if want is not None and label not in want:
      continue
    out_dir = os.path.join(a.out_dir, str(len(rows)))
    r = train.main(["--mesh", MESH, "--model", "transformer", "--steps",
                    str(a.steps), "--optimizer", "adam", "--lr", str(a.lr),
                    "--schedule", "cosine", "--seed", str(a.seed),
                    "--checkpoint-every", "0", "--out-dir", out_dir,
                    "--overwrite", *flags])
    rows.append(dict(label=label, eval_loss=r["eval_loss"],
                     eval_accuracy=r["eval_accuracy"],
                     bytes_per_step=r["bytes_per_step"],
                     dense_bytes_per_step=r["dense_bytes_per_step"],
                     num_params=r.get("num_params"),
                     steps_per_s=r["steps_per_s"]))
    print(json.dumps(rows[-1]), flush=True)
  dense = next((r["eval_loss"] for r in rows
                if r["label"].startswith("Adam (dense")), None)
  lines = [f"Transformer LM (train.py's default size), char corpus, "
           f"--mesh {MESH} (8 simulated CPU devices), {a.steps} steps of "
           f"Adam, lr {a.lr} with a cosine schedule, seed {a.seed}; bytes "
           "are each device's across dcn per step.", "",
           "| method | eval loss | vs dense | eval acc | bytes/step/device "
           "| reduction | steps/s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    gap = "" if dense is None else f"{r['eval_loss'] - dense:+.3f}"
    red = (f"{r['dense_bytes_per_step'] / r['bytes_per_step']:.1f}x"
           if r["bytes_per_step"] > 0 else "-")
    lines.append(f"| {r['label']} | {r['eval_loss']:.4f} | {gap} | "
                 f"{r['eval_accuracy']:.4f} | {r['bytes_per_step']:,.0f} | "
                 f"{red} | {r['steps_per_s']:.1f} |")
  text = "\n".join(lines)
  print(text)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return rows


if __name__ == "__main__":
  main()
