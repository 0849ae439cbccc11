"""MGS's merge against layer-wise and whole-model top-k, predicted by the
alpha-beta model (no measurement): the time from the start of the
backward pass until the last message has arrived, for ResNet-18's
compressed leaves in jaxcomm's bucket order.

  python -m benchmarks.mgs [--ratio 0.01] [--backward 0.05]

The backward pass's time is spread over the leaves by size, and the top-k
costs ``--topk-ns`` nanoseconds per element (serial with the backward
pass, as in Shi et al. 2020); each group sends one all-gather of its
pairs (``jaxcomm.mgs``'s plan, ``jaxcomm.transforms.sparsify._mgs.timeline``).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

import jaxcomm
from benchmarks._common import resnet18_shapes
from jaxcomm.transforms.sparsify import _mgs


def _sizes(ratio):
  """ResNet-18's compressed leaves (jaxcomm's default policy), bucket
  order."""
  params = {k: jnp.zeros(v, jnp.float32)
            for k, v in resnet18_shapes().items()}
  spec = jaxcomm.spec_of(jaxcomm.mgs(ratio))
  (layout,) = spec.layouts(params)
  return list(layout.sizes)


def rows(ratio, backward, topk_ns, links, counts):
  sizes = _sizes(ratio)
  out = []
  for gbit, latency in links:
    link = jaxcomm.wire.CostModel.link(gbit, latency)
    for n in counts:
      kw = dict(n=n, ratio=ratio, link=link, backward_seconds=backward,
                topk_seconds_per_element=topk_ns * 1e-9)
      plan = _mgs.merge_plan(sizes, **kw)
      t = {}
      for name, groups in (
          ("layer-wise", [(l, l + 1) for l in range(len(sizes))]),
          ("whole model", [(0, len(sizes))]), ("MGS", plan)):
        t[name] = _mgs.timeline(sizes, groups, **kw)
      out.append((gbit, latency, n, len(sizes), len(plan), t))
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ratio", type=float, default=0.01)
  ap.add_argument("--backward", type=float, default=0.05)
  ap.add_argument("--topk-ns", type=float, default=1.0)
  args = ap.parse_args(argv)
  links = [(1.0, 50.0), (10.0, 50.0), (25.0, 10.0), (100.0, 5.0)]
  print(f"ResNet-18, ratio {args.ratio}, backward {args.backward * 1e3:g} "
        f"ms, top-k {args.topk_ns:g} ns/element; predicted ms from the "
        "start of the backward pass to the last message (communication "
        "not hidden)\n")
  print("| link | n | leaves | MGS groups | layer-wise | whole model | MGS |")
  print("|---|---|---|---|---|---|---|")
  for gbit, lat, n, leaves, groups, t in rows(
      args.ratio, args.backward, args.topk_ns, links, (8, 64)):
    cells = [f"{t[k].comm * 1e3:.2f} ({t[k].exposed * 1e3:.2f})"
             for k in ("layer-wise", "whole model", "MGS")]
    print(f"| {gbit:g} Gbit/s, {lat:g} us | {n} | {leaves} | {groups} | "
          + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
