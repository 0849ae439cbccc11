"""The advisor's tables: which method pays on a pod, and how its model
compares with measured steps.

For ResNet-18 (CIFAR, 11.2M params) and the char-LM, on 8 hosts of 8
accelerators (fast axis: 800 Gbit/s, 5 us; slow axis between hosts at 1,
10 and 100 Gbit/s, 50 us), prints ``jaxcomm.advise``'s predicted
communication per step for dense, bf16, PowerSGD r1/r4, top-k 1%/0.1%,
onebit, local SGD H=8 and DiLoCo H=50, adds the compute overhead measured
on an H100 for ResNet-18 (docs/benchmarks/overhead_h100.md; none for the
char-LM, whose overhead was not measured there) and names the fastest
within an eval-loss budget of 0.05 (gaps measured on the char-LM,
docs/benchmarks/convergence.md).

Then it puts the model next to the step times ``benchmarks/network.py``
measured on the rate-limited loopback (4 processes, 1 Gbit/s, one device
each; docs/benchmarks/network.md), priced for that setting: one axis of 4,
and the loopback shared by all 4 (its bandwidth divided by 4).

And next to the two-level run (``benchmarks/network.py --hosts 2``): 2
namespaces ("hosts") of 2 processes each, loopback inside a host, each
host's link to the other limited to 1 Gbit/s each way, the pod recipe (a
dense mean inside each host, the method between hosts). There both
processes of a host send their exchange over its one link at once: the
slow axis is priced with ``shared=2``. The measured step without a limit
(compute, the mean inside the host, the exchange at full speed) is given
as the overhead, so the model's column is that step plus the predicted
seconds between hosts at 1 Gbit/s.

For a sharded model (the transformer LM split over fsdp=8 inside each of
8 slices), it prices the step of ``DataParallel(..., auto_axes=("fsdp",))``.

Run: ``python -m benchmarks.advisor [--out docs/benchmarks/advisor.md]``.
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxcomm import advise  # noqa: E402
from jaxcomm import wire  # noqa: E402

BUDGET = 0.05
HOSTS, PER_HOST = 8, 8
# ms over the dense mean's update, ResNet-18 shapes, one H100
# (docs/benchmarks/overhead_h100.md; README "On an H100").
H100_OVERHEAD_MS = {"bf16 cast": 0.0, "powersgd r1": 0.42,
                    "powersgd r4": 2.7, "topk 1%": 2.0, "topk 0.1%": 2.0,
                    "onebit": 1.09}
# Measured on the loopback in one run (docs/benchmarks/network.md, first
# table): ResNet-18 shapes, 4 processes, 1 Gbit/s, median seconds per step.
MEASURED_4P_1G = {"dense": 2.296, "bf16 cast": 1.452, "powersgd r4": 0.186,
                  "topk 1%": 0.577, "onebit": 0.743}


def _shapes(model: str) -> dict:
  """Params as ShapeDtypeStructs (no arrays are made)."""
  if model == "resnet18":
    from benchmarks._common import resnet18_shapes  # pylint: disable=import-outside-toplevel
    shapes = resnet18_shapes()
  else:
    import models  # pylint: disable=import-outside-toplevel
    _, params, _ = models.functional(models.create("charlm"))
    shapes = {jax.tree_util.keystr(p): x.shape
              for p, x in jax.tree_util.tree_leaves_with_path(params)}
  return {k: jax.ShapeDtypeStruct(tuple(s), jnp.float32)
          for k, s in shapes.items()}


def pod_tables() -> str:
  out = []
  for model in ("resnet18", "charlm"):
    params = _shapes(model)
    n_params = sum(int(x.size) for x in params.values())
    over = ({k: v / 1e3 for k, v in H100_OVERHEAD_MS.items()}
            if model == "resnet18" else None)
    for gbit in (1.0, 10.0, 100.0):
      axes = [advise.Axis("dcn", HOSTS, wire.CostModel.link(gbit, 50.0)),
              advise.Axis("ici", PER_HOST, wire.CostModel.link(800.0, 5.0))]
      rows = advise.advise(params, axes, overhead_s=over, budget=BUDGET)
      out += _section(f"{model} ({n_params:,} params), {HOSTS} hosts x "
                      f"{PER_HOST}, {gbit:g} Gbit/s between hosts", rows)
  return "\n".join(out)


def _section(title: str, rows) -> list:
  """A priced table under its title, and the advisor's pick."""
  best = advise.recommend(rows, BUDGET)
  return [f"### {title}\n", advise.table(rows, BUDGET),
          f"\nWithin a loss gap of {BUDGET}: **{best.name}** "
          f"({best.total_s * 1e3:.2f} ms per step).\n"]


# A GPT-2-small-sized transformer LM (models.TransformerLM), split by its
# logical axes (models.transformer.RULES: "embed" over fsdp).
LM_CONFIG = dict(vocab_size=50304, d_model=768, num_heads=12, num_layers=12,
                 d_ff=3072, max_len=1024)
SLICES, FSDP = 8, 8


def fsdp_tables() -> str:
  """The sharded-model step: the LM's params split over fsdp=8 inside each
  of 8 slices (800 Gbit/s, 5 us), each device compressing its 1/8 share
  across the slices."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from models import transformer  # pylint: disable=import-outside-toplevel
  abstract = nnx.eval_shape(lambda: transformer.TransformerLM(
    **LM_CONFIG, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract, nnx.Param)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        state)
  specs = transformer.partition_specs(params, ("dcn", "fsdp"))
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))
  fsdp = advise.Axis("fsdp", FSDP, wire.CostModel.link(800.0, 5.0))
  out = []
  for gbit in (1.0, 10.0, 100.0):
    axes = [advise.Axis("dcn", SLICES, wire.CostModel.link(gbit, 50.0))]
    rows = advise.advise(params, axes, budget=BUDGET, fsdp=fsdp, specs=specs)
    out += _section(f"transformer LM ({n_params:,} params), {SLICES} "
                    f"slices x fsdp={FSDP}, {gbit:g} Gbit/s between slices",
                    rows)
  return "\n".join(out)


def loopback_check() -> str:
  params = _shapes("resnet18")
  lines = ["| method | measured s | model: 1 Gbit/s per host s | model: "
           "shared loopback (1/4 Gbit/s) s | measured rank | model rank |",
           "|---|---:|---:|---:|---:|---:|"]
  want = set(MEASURED_4P_1G)
  cands = [c for c in advise.default_candidates() if c.name in want]
  per_host = {r.name: r.total_s for r in advise.advise(
    params, [advise.Axis("data", 4, wire.CostModel.link(1.0, 50.0))], cands)}
  shared = {r.name: r.total_s for r in advise.advise(
    params, [advise.Axis("data", 4, wire.CostModel.link(0.25, 50.0))],
    cands)}
  m_rank = {k: i for i, k in enumerate(sorted(MEASURED_4P_1G,
                                              key=MEASURED_4P_1G.get))}
  s_rank = {k: i for i, k in enumerate(sorted(shared, key=shared.get))}
  for k in sorted(MEASURED_4P_1G, key=MEASURED_4P_1G.get):
    lines.append(f"| {k} | {MEASURED_4P_1G[k]:.3f} | {per_host[k]:.3f} | "
                 f"{shared[k]:.3f} | {m_rank[k] + 1} | {s_rank[k] + 1} |")
  return "\n".join(lines)


# Measured in one run of
#   python -m benchmarks.network --hosts 2 --processes 4 --rates none,1 \
#     --models resnet18 --torch no --steps 24 \
#     --methods dense,dense-flat,bf16,powersgd4,topk1%+ef,onebit,localsgd8,\
#     diloco50
# (docs/benchmarks/network.md, "Two hosts"): ResNet-18 shapes, median
# seconds per step (local methods: mean over whole periods), without a
# limit and at 1 Gbit/s between the hosts.
MEASURED_2H = {"dense": (0.389, 1.087), "dense, flat": (0.290, 0.774),
               "bf16 cast": (0.726, 1.075),
               "powersgd r4": (0.607, 0.584), "topk 1%": (0.784, 0.838),
               "onebit": (1.110, 1.062), "local SGD H=8": (0.310, 0.328),
               "DiLoCo H=50": (0.392, 0.423)}
# The char-LM's shapes in one run of the same command with --models charlm
# and dense-sharded added (docs/benchmarks/network.md, "The char-LM on two
# hosts").
MEASURED_2H_CHARLM = {
  "dense": (0.026, 0.073), "dense, flat": (0.020, 0.054),
  "dense, sharded": (0.023, 0.046), "bf16 cast": (0.043, 0.064),
  "powersgd r4": (0.048, 0.047), "topk 1%": (0.045, 0.048),
  "onebit": (0.068, 0.059), "local SGD H=8": (0.030, 0.014),
  "DiLoCo H=50": (0.019, 0.017)}


def two_level_check(model: str, measured: dict) -> str:
  params = _shapes(model)
  names = {c.name: c for c in advise.default_candidates()}
  lines = ["| method | measured, no limit s | measured, 1 Gbit/s s | "
           "model: no-limit step + between hosts s | model / measured | "
           "measured rank | model rank |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  cands = [names[k] for k in measured]
  free = {k: v[0] for k, v in measured.items()}
  # The mean inside a host is part of the measured no-limit step (the
  # overhead here): the fast axis is priced at (almost) nothing.
  axes = [advise.Axis("dcn", 2, wire.CostModel.link(1.0, 50.0), shared=2),
          advise.Axis("ici", 2, wire.CostModel.link(1e6, 0.0))]
  rows = {r.name: r for r in advise.advise(params, axes, cands,
                                           overhead_s=free)}
  pred = {k: r.overhead_s + r.slow_s for k, r in rows.items()}
  meas = {k: v[1] for k, v in measured.items()}
  m_rank = {k: i for i, k in enumerate(sorted(meas, key=meas.get))}
  p_rank = {k: i for i, k in enumerate(sorted(pred, key=pred.get))}
  for k in sorted(meas, key=meas.get):
    lines.append(f"| {k} | {free[k]:.3f} | {meas[k]:.3f} | {pred[k]:.3f} | "
                 f"{pred[k] / meas[k]:.2f} | {m_rank[k] + 1} | "
                 f"{p_rank[k] + 1} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None,
                 help="also write the markdown here")
  args = p.parse_args(argv)
  text = ("## Which method pays where (jaxcomm.advise)\n\n" + pod_tables()
          + "\n## A sharded model: FSDP inside each slice\n\n"
          "`advise(..., fsdp=Axis(\"fsdp\", 8, link), specs=...)`: every "
          "method pays the plain FSDP step's weight all-gather and gradient "
          "reduce-scatter on the fast link (the fast axes column), and each "
          "device sends across the slices what the method claims for its "
          "1/8 share of the gradient (the shards `models.transformer.RULES` "
          "give it). Loss gaps are the char-LM's.\n\n" + fsdp_tables()
          + "\n## The model against measured steps\n\nResNet-18 shapes, 4 "
          "processes on the 1 Gbit/s loopback, one run (the model has no "
          "compute, the measured steps do: on these 2 cores top-k's "
          "selection and onebit's packing cost more than their bytes):\n\n"
          + loopback_check() + "\n\n## Two hosts: the model against "
          "measured steps\n\n2 hosts of 2 processes, 1 Gbit/s between the "
          "hosts each way, the pod recipe, one run of 24 steps per rate per "
          "model (docs/benchmarks/network.md, \"Two hosts\"). The model: "
          "the step measured without a limit plus the predicted seconds "
          "between hosts, each host's link shared by its 2 processes (a "
          "local method's sync divided by its period; dense, flat: one ring "
          "over the 4, one stream per host link; dense, sharded: one share "
          "per process).\n\nResNet-18 shapes:\n\n"
          + two_level_check("resnet18", MEASURED_2H)
          + "\n\nThe char-LM's shapes (steps of a few ms, where 4 processes "
          "on 2 cores make the no-limit step noisy: local SGD's is longer "
          "than at 1 Gbit/s):\n\n"
          + two_level_check("charlm", MEASURED_2H_CHARLM) + "\n")
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text)


if __name__ == "__main__":
  main()
