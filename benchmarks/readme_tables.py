"""The README's method tables, generated from ``jaxcomm.registry``.

``make docs`` (``python -m benchmarks.readme_tables``) rewrites the blocks
of README.md between ``<!-- registry:FAMILY -->`` and
``<!-- /registry:FAMILY -->``; ``tests/test_registry.py`` fails when a
block is stale. The compressor table's bytes are each compressor's claim
(``jaxcomm.wire.claimed``, which the test battery checks against the
compiled HLO) for ResNet-18's gradient shapes on 8 devices, against the
dense mean's; its learning rates are ``docs/benchmarks/lr.json`` (``make
bench-lr``); its last column is how far each compressor, at those defaults
and that rate, trains from dense on three tasks
(``docs/benchmarks/defaults.json``, ``python -m benchmarks.defaults``),
with the registry's reason (``Method.gap``) where it is more than 2 points.
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp

import jaxcomm
from benchmarks._common import resnet18_shapes
from trainer.config import measured_lr

README = os.path.join(os.path.dirname(os.path.dirname(
  os.path.abspath(__file__))), "README.md")
BYTES_MODEL = "resnet18"
BYTES_DEVICES = 8

_HEADERS = {
  "compressor": ("| factory | what travels | bytes vs dense "
                 f"({BYTES_MODEL}, n={BYTES_DEVICES}) | paper | then (lr from "
                 "the digits sweep) | at these, vs dense (3 tasks) |"
                 "\n|---|---|---:|---|---|---|"),
  "optimizer": "| factory | what it does | paper |\n|---|---|---|",
  "local": "| factory | sync | paper |\n|---|---|---|",
  "delay": "| factory | when the average is applied | paper |\n|---|---|---|",
}


def call(m) -> str:
  """``factory(required..., default=value)`` as a table shows it."""
  parts = []
  for k, p in m.parameters().items():
    if k in m.defaults:
      v = m.defaults[k]
      text = (f"jnp.{v.__name__}" if isinstance(v, type)
              else f"{v!r}")
      parts.append(f"{k}={text}")
    elif p.default is p.empty and p.kind not in (p.VAR_KEYWORD,
                                                 p.VAR_POSITIONAL):
      parts.append(k)
  return f"`{m.attr}({', '.join(parts)})`"


def _bytes_params():
  return {k: jax.ShapeDtypeStruct(v, jnp.float32)
          for k, v in resnet18_shapes().items()}


# Steps averaged for the byte ratio, after any warm-up or dense phase: a
# method whose bytes change with the step (GradiVeQ's periodic full
# gradient, a schedule of densities) is priced by its mean over them, not
# by the sum of every branch its compiled step holds.
_LATE_STEPS = range(10**6, 10**6 + 256)


def _ratio(tx, params) -> str:
  """Dense float32 mean's bytes sent per device / the claim's mean over
  :data:`_LATE_STEPS` (ring formulas, ``jaxcomm.wire.summarize``); a
  data-dependent claim says what it assumes (``wire_condition``)."""
  def sent(step):
    rep = jaxcomm.wire.summarize(
      jaxcomm.wire.claimed(tx, params, BYTES_DEVICES, step),
      n=BYTES_DEVICES, params=params)
    return rep.total_sent, rep.dense_sent
  first, dense = sent(_LATE_STEPS[0])
  if sent(_LATE_STEPS[1])[0] == first == sent(_LATE_STEPS[-1])[0]:
    mean = first
  else:
    mean = sum(sent(s)[0] for s in _LATE_STEPS) / len(_LATE_STEPS)
  cell = f"{dense / mean:.1f}x" if mean else "inf"
  note = getattr(_codec_of(tx), "wire_condition", "")
  return f"{cell} ({note})" if note else cell


def _codec_of(tx):
  try:
    return jaxcomm.spec_of(tx).codec
  except (TypeError, ValueError, AttributeError):
    return None


def _lr_cell(entry: dict | None) -> str:
  """The optimizer to chain after the compressor and the rate the sweep
  chose, as ``docs/benchmarks/lr.json`` records them: ``"sgd momentum
  0.9"`` -> ```optax.sgd(lr, momentum=0.9)```; ``"sgd"`` and ``"sgd
  (momentum inside NAME)"`` (a method that keeps its own momentum) ->
  ```optax.sgd(lr)```, the latter saying why. A null rate: "not swept".

  Raises:
    ValueError: naming an optimizer string this table cannot render.
  """
  if not entry or entry.get("lr") is None:
    return "not swept"
  opt, lr = str(entry["optimizer"]).strip(), entry["lr"]
  plain = re.fullmatch(r"sgd( \((momentum inside \w+)\))?", opt)
  if plain:
    note = f" ({plain.group(2)})" if plain.group(2) else ""
    return f"`optax.sgd({lr:g})`{note}"
  heavy = re.fullmatch(r"sgd momentum ([0-9.]+)", opt)
  if heavy:
    return f"`optax.sgd({lr:g}, momentum={float(heavy.group(1)):g})`"
  raise ValueError(
    f"docs/benchmarks/lr.json: optimizer {opt!r} is none of 'sgd', 'sgd "
    "momentum M' or 'sgd (momentum inside NAME)'")


DEFAULTS_JSON = os.path.join(os.path.dirname(README), "docs", "benchmarks",
                             "defaults.json")
# A compressor within this many accuracy points of dense on every task.
POINTS = 2.0


def worst_gaps(path: str = DEFAULTS_JSON) -> dict[str, tuple[float, str]]:
  """``{method: (accuracy points vs dense, task label)}``: each measured
  method's largest shortfall over the tasks of ``benchmarks/defaults.py``
  (``-inf`` where it diverged); empty when the file is missing."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    result = json.load(f)
  dense = {r["task"]: r["accuracy"] for r in result["rows"]
           if r["method"] == "dense"}
  out = {}
  for r in result["rows"]:
    if r["task"] not in dense:
      continue
    diff = r["accuracy"] - dense[r["task"]]
    diff = diff if diff == diff else -float("inf")   # NaN: diverged
    label = result["tasks"][r["task"]]["label"].split(" (")[0]
    if r["method"] not in out or diff < out[r["method"]][0]:
      out[r["method"]] = (diff, label)
  return out


def _gap_cell(m, gaps) -> str:
  """``within 2 points``, or the worst shortfall, its task and the
  registry's reason."""
  if m.name not in gaps:
    return "not measured"
  diff, task = gaps[m.name]
  if diff >= -POINTS:
    return "within 2 points"
  figure = "diverged" if diff == -float("inf") else f"{diff:.1f} points"
  return f"{figure} ({task})" + (f": {m.gap}" if m.gap else "")


def table(family: str, params=None) -> str:
  """The markdown table of one family."""
  rows = [_HEADERS[family]]
  if family == "compressor":
    params = _bytes_params() if params is None else params
    lrs = measured_lr()
    gaps = worst_gaps()
  for m in jaxcomm.registry.methods(family):
    cells = [call(m), m.summary]
    if family == "compressor":
      cells += [_ratio(m.make(), params), m.paper,
                _lr_cell(lrs.get(m.name)), _gap_cell(m, gaps)]
    else:
      cells.append(m.paper)
    rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells)
                + " |")
  return "\n".join(rows)


def render(text: str, params=None) -> str:
  """``text`` (README.md) with every registry block regenerated.

  Raises:
    ValueError: if a family's markers are missing.
  """
  for family in jaxcomm.registry.FAMILIES:
    start, end = f"<!-- registry:{family} -->", f"<!-- /registry:{family} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
      raise ValueError(f"README.md has no {start} ... {end} block")
    body = table(family, params)
    text = pattern.sub(lambda _, b=body, s=start, e=end: f"{s}\n{b}\n{e}",
                       text)
  return text


def main(argv=None) -> int:
  del argv
  with open(README, encoding="utf-8") as f:
    old = f.read()
  new = render(old)
  if new != old:
    with open(README, "w", encoding="utf-8") as f:
      f.write(new)
  print(f"{README}: method tables "
        + ("regenerated" if new != old else "already current"))
  return 0


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  sys.exit(main(sys.argv[1:]))
