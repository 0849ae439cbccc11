"""Sparsification benchmark: selection speed on a 25M vector, wire bytes.

Run with ``.venv/bin/python -m benchmarks.bench_sparsification``. Prints two
markdown tables:

1. Time to select 0.1% and 1% of a 25M-element float32 vector on this CPU,
   as a ratio to one memory pass over the buffer (``x * 2``, read + write:
   the physical floor is one read), for exact ``lax.top_k``,
   ``lax.approx_max_k``, DGC's sampled-threshold path
   (:func:`jaxcomm.transforms.sparsify._dgc.sampled_select`: sample, count,
   compact, cut), SIDCo's fitted thresholds (no sort, no sample) and
   ``torch.topk`` when PyTorch is importable; with the recall of the true
   top-k mass (``sum |selected| / sum |true top-k|``), then SIDCo's
   achieved count against ``k``.
2. Bytes sent per device per step by each compressor at n = 8 for
   ResNet-18-like parameter shapes, next to the dense float32 psum (from the
   compressors' wire claims, which the test suite checks against compiled
   HLO).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm
from benchmarks._common import resnet18_shapes
from jaxcomm import _buckets
from jaxcomm.transforms.sparsify import _dgc as dgc_mod
from jaxcomm.transforms.sparsify import _sidco
from jaxcomm.transforms.sparsify import _sparsification as sp

SIZE = 25_000_000
RATIOS = (0.001, 0.01)
REPS = 3


def _time(fn, *args) -> float:
  jax.block_until_ready(fn(*args))          # warm-up / compile
  times = []
  for _ in range(REPS):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def _recall(x_abs_sorted_topk_mass, x, idx) -> float:
  idx = np.asarray(idx)
  idx = idx[idx < x.shape[0]]
  return float(np.abs(x[idx]).sum() / x_abs_sorted_topk_mass)


def selection_table() -> str:
  rng = np.random.RandomState(0)
  x_np = rng.randn(SIZE).astype(np.float32)
  x = jnp.asarray(x_np)
  copy_t = _time(jax.jit(lambda v: v * 2.0), x)
  rows = [f"25M float32 on {jax.devices()[0].platform.upper()}: one memory "
          f"pass (x * 2) = {copy_t * 1e3:.1f} ms", "",
          "| method | ratio | k | time (ms) | x copy | recall of top-k mass |",
          "|---|---:|---:|---:|---:|---:|"]
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    torch = None
  a_np = np.abs(x_np)
  density = ["", "SIDCo's achieved selection on the same vector (its "
             "fitted threshold's count before the 2k capacity):", "",
             "| fit | ratio | k | selected | selected / k |",
             "|---|---:|---:|---:|---:|"]
  for ratio in RATIOS:
    k = sp.num_selected(ratio, SIZE)
    true_mass = float(np.partition(a_np, SIZE - k)[SIZE - k:].sum())

    exact = jax.jit(lambda v, k=k: jax.lax.top_k(jnp.abs(v), k)[1])
    approx = jax.jit(lambda v, k=k: jax.lax.approx_max_k(
      jnp.abs(v), k, recall_target=0.95)[1])
    s = dgc_mod.dgc_sample_size(ratio, SIZE, 0.01)
    sampled = jax.jit(lambda v, key, k=k, s=s: dgc_mod.sampled_select(
      v, k, key, s)[1])
    key = jax.random.PRNGKey(0)
    layout = _buckets.plan([(SIZE,)])[0]
    fitted = {dist: jax.jit(
      lambda v, dist=dist, layout=layout, ratio=ratio: _sidco.select(
        v, layout, ratio, 3 if dist == "exponential" else 2, 0.25, dist)[1])
              for dist in _sidco.DISTRIBUTIONS}
    methods = [("lax.top_k (exact)", exact, (x,)),
               ("lax.approx_max_k (0.95)", approx, (x,)),
               ("sampled threshold (DGC)", sampled, (x, key)),
               ("fitted threshold (SIDCo, exponential, 3 stages)",
                fitted["exponential"], (x,)),
               ("fitted threshold (SIDCo, gen. Pareto, 2 stages)",
                fitted["gpareto"], (x,))]
    for name, fn, args in methods:
      t = _time(fn, *args)
      rec = _recall(true_mass, x_np, fn(*args))
      rows.append(f"| {name} | {ratio:g} | {k:,} | {t * 1e3:.1f} | "
                  f"{t / copy_t:.1f} | {rec:.4f} |")
    for dist in _sidco.DISTRIBUTIONS:
      _, _, count = _sidco.select(x, layout, ratio,
                                  3 if dist == "exponential" else 2, 0.25,
                                  dist)
      density.append(f"| {dist} | {ratio:g} | {k:,} | {int(count[0]):,} | "
                     f"{int(count[0]) / k:.3f} |")
    if torch is not None:
      xt = torch.from_numpy(x_np)
      fn = lambda xt=xt, k=k: torch.topk(xt.abs(), k, sorted=False)  # noqa
      fn()
      times = []
      for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
      t = float(np.median(times))
      rows.append(f"| torch.topk | {ratio:g} | {k:,} | {t * 1e3:.1f} | "
                  f"{t / copy_t:.1f} | 1.0000 |")
  if torch is None:
    rows.append("")
    rows.append("torch.topk: PyTorch not importable here (optional extra), "
                "not measured.")
  return "\n".join(rows + density)


def wire_table(n: int = 8) -> str:
  params = {k: jax.ShapeDtypeStruct(v, jnp.float32)
            for k, v in resnet18_shapes().items()}
  count = sum(math.prod(p.shape) for p in params.values())
  configs = [
    ("dense psum (mean_gradients)", jaxcomm.mean_gradients()),
    ("topk(0.001)", jaxcomm.topk(0.001)),
    ("topk(0.001, granularity=model)", jaxcomm.topk(0.001,
                                                    granularity="model")),
    ("randomk(0.001)", jaxcomm.randomk(0.001)),
    ("threshold(capacity_ratio=0.001)", jaxcomm.threshold(
      1e-3, capacity_ratio=0.001)),
    ("dgc(0.001), no warm-up", jaxcomm.dgc(0.001)),
    ("dgc(0.001), warm-up compiled (all stages)", jaxcomm.dgc(
      0.001, warmup_steps_per_stage=1)),
    ("gtopk(0.001)", jaxcomm.gtopk(0.001)),
    ("csc(1024, 0.001)", jaxcomm.csc(1024, 0.001)),
    ("csc(1024, 0.01)", jaxcomm.csc(1024, 0.01)),
  ]
  rows = [f"ResNet-18-like, {count:,} parameters, n = {n} (ring formulas)",
          "", "| compressor | bytes sent / device / step | vs dense |",
          "|---|---:|---:|"]
  for name, tx in configs:
    rep = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, n), n=n,
                                 params=params)
    rows.append(f"| {name} | {rep.total_sent:,.0f} | "
                f"{rep.ratio:,.1f}x less |")
  return "\n".join(rows)


def main():
  print("## Selection on a 25M-element vector\n")
  print(selection_table())
  print("\n## Wire bytes\n")
  print(wire_table())


if __name__ == "__main__":
  main()
