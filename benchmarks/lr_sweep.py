"""Which learning rate each compressor wants: a sweep on the digits MLP.

Compressors change the scale of what reaches the optimizer: a sign
compressor hands it +-1 per coordinate (the mean of signs, or a scaled
sign), top-k with error feedback hands it delayed but whole gradient mass,
quantizers an unbiased estimate. So the learning rate that works for the
dense mean is not the one that works for every compressor (signum at the
dense rate stays at chance). This sweep trains the same MLP on the digits
data on 8 simulated CPU devices for each compressor in ``jaxcomm.registry``
with the optimizer its registry line names (momentum SGD, or plain SGD for
the sign methods), over a grid of constant learning rates, and reports the
held-out accuracy of each and the best rate, next to the rate the registry
recommends (the README's table shows it).

Run from the repository root::

  python -m benchmarks.lr_sweep                 # about 10 min on 2 cores
  python -m benchmarks.lr_sweep --methods signum,topk --steps 200

Output: a markdown table on stdout and in ``--out`` (default
``runs/lr_sweep/table.md``), and ``results.json`` beside it.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  from benchmarks._xla import raise_cpu_collective_timeouts
  raise_cpu_collective_timeouts()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import train  # noqa: E402

LRS = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001, 0.0003)

# The registry's optimizer text -> train.py's --optimizer.
# ("sgd (momentum inside dgc)": plain SGD, the method keeps its own).
def optimizer_flag(text: str) -> str:
  """lr.json's optimizer text (``"sgd momentum 0.9"``, ``"sgd"``, ``"sgd
  (momentum inside dgc)"``) as train.py's ``--optimizer``."""
  if text == "sgd momentum 0.9":
    return "momentum"
  if text == "sgd" or text.startswith("sgd (momentum inside "):
    return "sgd"
  raise ValueError(f"lr.json optimizer {text!r}: expected 'sgd', 'sgd "
                   "momentum 0.9' or 'sgd (momentum inside <method>)'")


# Dense's rate is kept unless the method is more than this many accuracy
# points worse there than at its best rate on the sweep...
KEEP_DENSE_POINTS = 1.0
# ... or it collapses (more than this many points below its best) at the
# grid's next larger rate: one step from divergence on the digits, a
# method diverged at dense's rate on the conv net.
MARGIN_POINTS = 10.0


def choose(rows: list[dict], dense_lr: float | None) -> dict | None:
  """The row whose rate lr.json records for one method: the rate of the
  lowest held-out loss, unless the method uses momentum SGD and at
  ``dense_lr`` (dense's own rate) its accuracy is within
  :data:`KEEP_DENSE_POINTS` of the best accuracy it reached: then
  ``dense_lr``, provided the grid's next larger rate does not collapse
  (:data:`MARGIN_POINTS`). On 360 held-out digits a point is 3.6
  examples: rates whose losses differ by that little are not told apart
  by this sweep, and a larger one than dense's, picked by such a
  difference, diverged on a conv net (``benchmarks/defaults.py``); so did
  TernGrad at dense's rate, one grid step from its collapse here. None
  where every rate diverged."""
  ok = [r for r in rows if math.isfinite(r["eval_loss"])]
  if not ok:
    return None
  best = min(ok, key=lambda r: (r["eval_loss"], -r["eval_accuracy"]))
  at_dense = [r for r in ok if r["lr"] == dense_lr
              and r["optimizer"] == "momentum"]
  top = max(r["eval_accuracy"] for r in ok)
  larger = [r for r in rows if r["lr"] > dense_lr]
  above = min(larger, key=lambda r: r["lr"]) if larger else None
  stable = above is None or (math.isfinite(above["eval_loss"]) and 100 * (
    top - above["eval_accuracy"]) <= MARGIN_POINTS)
  if at_dense and stable and (100 * (top - at_dense[0]["eval_accuracy"])
                              <= KEEP_DENSE_POINTS):
    return at_dense[0]
  return best


def sweep(names, lrs, steps: int, out_root: str) -> list[dict]:
  """One ``train.run`` per (method, learning rate)."""
  import jaxcomm  # pylint: disable=import-outside-toplevel
  rows = []
  for name in names:
    m = jaxcomm.registry.get(name, "compressor")
    optimizer = optimizer_flag(train.measured_lr()[m.name]["optimizer"])
    for lr in lrs:
      cfg = train.Config(
        model="mlp", model_args="", dataset="digits", compressor=m.name,
        compressor_args=",".join(
          f"{k}={getattr(v, '__name__', v)}" for k, v in m.defaults.items()),
        optimizer=optimizer, lr=lr, schedule="constant", steps=steps,
        batch_size=128, num_devices=8, seed=0, checkpoint_every=0,
        keep_checkpoints=1, eval_examples=512, progress=False, plot=False,
        out_dir=os.path.join(out_root, f"{m.name}-{lr:g}"))
      try:
        r = train.run(cfg)
      except FloatingPointError as e:   # diverged: train.run stops on NaN
        print(f"{m.name:>10} {optimizer:>8} lr {lr:<6g} diverged: {e}")
        r = {"eval_loss": float("nan"), "eval_accuracy": float("nan")}
      rows.append({"method": m.name, "optimizer": optimizer, "lr": lr,
                   "eval_loss": r["eval_loss"],
                   "eval_accuracy": r["eval_accuracy"],
                   "recommended_lr": train.measured_lr()[m.name]["lr"]})
      print(f"{m.name:>10} {optimizer:>8} lr {lr:<6g} accuracy "
            f"{r['eval_accuracy']:.3f} loss {r['eval_loss']:.3f}",
            flush=True)
  return rows


def table(rows: list[dict], lrs) -> str:
  """Accuracy per (method, lr); the rate :func:`choose` takes and the
  registry's."""
  head = ("| method | optimizer | " + " | ".join(f"{lr:g}" for lr in lrs)
          + " | chosen lr | registry lr |")
  lines = [head, "|---|---|" + "---:|" * (len(lrs) + 2)]
  for name in dict.fromkeys(r["method"] for r in rows):
    mine = {r["lr"]: r for r in rows if r["method"] == name}
    best = choose(list(mine.values()), train.measured_lr()["dense"]["lr"])
    cells = []
    for lr in lrs:
      if lr not in mine:
        cells.append("—")
        continue
      if not math.isfinite(mine[lr]["eval_loss"]):
        cells.append("NaN")
        continue
      acc = f"{mine[lr]['eval_accuracy']:.3f}"
      cells.append(f"**{acc}**" if mine[lr] is best else acc)
    first = next(iter(mine.values()))
    rec = first["recommended_lr"]
    chosen = "diverged" if best is None else f"{best['lr']:g}"
    lines.append(f"| {name} | {first['optimizer']} | " + " | ".join(cells)
                 + f" | {chosen} | " + ("—" if rec is None else f"{rec:g}")
                 + " |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", default=None,
                 help="comma-separated registry names (default: every "
                 "compressor)")
  p.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LRS),
                 help="comma-separated learning rates")
  p.add_argument("--steps", type=int, default=300,
                 help="training steps per run (constant learning rate)")
  p.add_argument("--out", default="runs/lr_sweep/table.md",
                 help="where the markdown table goes")
  p.add_argument("--write-lr", action="store_true",
                 help="record each method's best rate in "
                 "docs/benchmarks/lr.json (what train.py and the README "
                 "read)")
  args = p.parse_args(argv)
  train.configure_devices(train.Config(num_devices=8))
  import jaxcomm  # pylint: disable=import-outside-toplevel
  names = (args.methods.split(",") if args.methods
           else jaxcomm.registry.names("compressor"))
  lrs = tuple(float(x) for x in args.lrs.split(","))
  with tempfile.TemporaryDirectory() as tmp:
    rows = sweep(names, lrs, args.steps, tmp)
  text = (f"Digits MLP, 8 simulated CPU devices, batch 128, {args.steps} "
          "steps at a constant learning rate, held-out accuracy (512 "
          "examples; NaN: the loss diverged); bold: the rate lr.json takes "
          "(the lowest held-out loss, or dense's rate where the method is "
          "within 1 point of its best there).\n\n" + table(rows, lrs))
  print(text)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text + "\n")
  with open(os.path.join(os.path.dirname(os.path.abspath(args.out)),
                         "results.json"), "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=1)
  if args.write_lr:
    write_best(rows)


def write_best(rows: list[dict]) -> None:
  """Records each swept method's rate (:func:`choose`) in
  ``docs/benchmarks/lr.json``, keeping the other entries."""
  with open(train.MEASURED_LR_PATH, encoding="utf-8") as f:
    data = json.load(f)
  for name in dict.fromkeys(r["method"] for r in rows):
    best = choose([r for r in rows if r["method"] == name],
                  data["dense"]["lr"])
    if best is not None:
      data[name] = {"optimizer": data.get(name, {}).get(
        "optimizer", "sgd momentum 0.9"), "lr": best["lr"]}
  with open(train.MEASURED_LR_PATH, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
    f.write("\n")


if __name__ == "__main__":
  main()
