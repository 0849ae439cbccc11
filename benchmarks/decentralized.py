"""Decentralized compression on a convex task: DCD-PSGD, ECD-PSGD, CHOCO-SGD
and SQuARM-SGD against D-PSGD, on 8 simulated CPU devices.

The task is least squares, ``y = x W* + noise`` (``x`` in R^64, ``y`` in
R^16: 1,040 params with the bias), each device drawing its own batches of
8 examples from one shared distribution, plain SGD (SQuARM: Nesterov
momentum SGD) on a ring (``W``: 1/3 self and each neighbour). Every run
uses the same seed, data and step count. Reported per run: the loss of
the devices' average model on a held-out set of 4,096 examples, the
consensus distance ``max_i ||x_i - mean x||`` (:func:`jaxcomm.parallel.
consensus_distance`), and the bytes one device sends per step as the
method claims them (the tests check the claims against the compiled HLO).
A run whose loss turns non-finite or above 1e6 is marked diverged.

Compression levels are random-k ratios with ``unbiased=True`` (scaled by
``size / k``: ``E[C(z)] = z``, the unbiased compression of Tang et al.'s
analysis, its variance ``(1/ratio - 1) ||z||^2``), and top-k (biased).

Run from the repository root::

  python -m benchmarks.decentralized            # about 3 min on 2 cores
  python -m benchmarks.decentralized --steps 100
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS",
                        "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jaxcomm  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from jaxcomm import wire  # noqa: E402

N, D_IN, D_OUT, B = 8, 64, 16, 8
ALL = jaxcomm.LeafPolicy(min_size=1)


def _task(seed: int):
  r = np.random.RandomState(seed)
  w_true = r.randn(D_IN, D_OUT) / np.sqrt(D_IN)
  xe = r.randn(4096, D_IN).astype(np.float32)
  ye = (xe @ w_true + 0.1 * r.randn(4096, D_OUT)).astype(np.float32)
  params = {"b": jnp.zeros((D_OUT,), jnp.float32),
            "w": jnp.asarray(r.randn(D_IN, D_OUT) * 0.1, jnp.float32)}
  return r, w_true, (xe, ye), params


def loss_fn(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def run(tx, steps: int, seed: int = 0, log_every: int = 0) -> dict:
  r, w_true, (xe, ye), params = _task(seed)
  mesh = parallel.make_mesh(N)
  dp = parallel.DataParallel(loss_fn, tx, mesh, donate=False)
  p, s = dp.init(params)
  size = sum(int(np.size(v)) for v in jax.tree.leaves(params))
  per_step = [wire.summarize(wire.claimed(tx, params, N, step=t),
                             N).total_sent for t in range(steps)]
  curve = []
  ev = jax.jit(lambda q: loss_fn(q, (xe, ye)))
  diverged = False
  for t in range(steps):
    x = r.randn(N * B, D_IN).astype(np.float32)
    y = (x @ w_true + 0.1 * r.randn(N * B, D_OUT)).astype(np.float32)
    p, s, _ = dp.step(p, s, (x, y))
    if log_every and ((t + 1) % log_every == 0 or t + 1 == steps):
      mean = jax.tree.map(lambda v: jnp.mean(v, 0), jax.device_get(p))
      loss = float(ev(mean))
      curve.append((t + 1, loss, float(sum(per_step[:t + 1]))))
      if not np.isfinite(loss) or loss > 1e6:
        diverged = True
        break
  jax.block_until_ready(p)
  mean = jax.tree.map(lambda v: jnp.mean(v, 0), jax.device_get(p))
  loss = float(ev(mean))
  dist = float(parallel.consensus_distance(p))
  out = {"loss": loss, "consensus": dist,
         "diverged": diverged or not np.isfinite(loss) or loss > 1e6,
         "bytes_per_step": float(np.mean(per_step)),
         "dense_bytes_per_step": 2 * 4 * size, "curve": curve}
  cs = getattr(s, "compress", None)
  if hasattr(cs, "sends"):
    out["sends"] = np.asarray(cs.sends).tolist()
    out["rounds"] = int(np.asarray(cs.rounds)[0])
    # As run: every synchronization step's 4-byte all-reduce, and the
    # permutes of the exchanges that ran (the claim counts them on every
    # synchronization step).
    claim = wire.claimed(tx, params, N)
    flag = wire.summarize(claim[:1], N).total_sent
    permutes = wire.summarize(claim[1:], N).total_sent
    syncs = sum(1 for b in per_step if b)
    out["bytes_per_step"] = (syncs * flag + out["rounds"] * permutes) / steps
  return out


def methods(lr: float, ratios, steps: int):
  """(table, label, factory) of every run."""
  sgd = optax.sgd(lr)
  rows = [("level", "D-PSGD (dense float32)", lambda: jaxcomm.dpsgd(sgd))]
  for ratio in ratios:
    rk = lambda ratio=ratio: jaxcomm.randomk(ratio, policy=ALL)
    rows += [
      ("level", f"DCD-PSGD, unbiased random-k {ratio}",
       lambda rk=rk: jaxcomm.dcd_psgd(sgd, rk(), unbiased=True)),
      ("level", f"ECD-PSGD, unbiased random-k {ratio}",
       lambda rk=rk: jaxcomm.ecd_psgd(sgd, rk(), unbiased=True)),
      ("level", f"CHOCO (gamma 0.2), random-k {ratio}",
       lambda rk=rk: jaxcomm.choco(sgd, rk(), gamma=0.2)),
    ]
  for ratio in (0.1, 0.01):
    tk = lambda ratio=ratio: jaxcomm.topk(ratio, policy=ALL)
    rows += [
      ("topk", f"DCD-PSGD, top-k {ratio}",
       lambda tk=tk: jaxcomm.dcd_psgd(sgd, tk())),
      ("topk", f"ECD-PSGD, top-k {ratio}",
       lambda tk=tk: jaxcomm.ecd_psgd(sgd, tk())),
      ("topk", f"CHOCO (gamma 0.2), top-k {ratio}",
       lambda tk=tk: jaxcomm.choco(sgd, tk(), gamma=0.2)),
    ]
  nest = optax.sgd(lr, momentum=0.9, nesterov=True)
  for period, c in ((1, 0.0), (4, 0.0), (4, 100.0), (4, 1000.0), (4, 10000.0)):
    rows.append((
      "squarm", f"SQuARM top-k 0.1, H={period}, c_t={c:g}",
      lambda period=period, c=c: jaxcomm.squarm(
        nest, jaxcomm.topk(0.1, policy=ALL), gamma=0.2, period=period,
        threshold=c, learning_rate=lr)))
  rows.append(("squarm", "D-PSGD, Nesterov momentum (dense)",
               lambda: jaxcomm.dpsgd(nest)))
  del steps
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--lr", type=float, default=0.05)
  ap.add_argument("--ratios", default="0.5,0.25,0.1,0.05")
  ap.add_argument("--log-every", type=int, default=25)
  ap.add_argument("--json", default=None, help="write the results here")
  a = ap.parse_args(argv)
  ratios = [float(v) for v in a.ratios.split(",")]
  results = {}
  tables = {"level": [], "topk": [], "squarm": []}
  for table, label, make in methods(a.lr, ratios, a.steps):
    res = run(make(), a.steps, log_every=a.log_every)
    results[label] = res
    loss = "diverged" if res["diverged"] else f"{res['loss']:.4f}"
    cons = ("-" if res["diverged"] or not np.isfinite(res["consensus"])
            else f"{res['consensus']:.4f}")
    extra = ""
    if "sends" in res:
      extra = (f" | {sum(res['sends'])} ({min(res['sends'])}-"
               f"{max(res['sends'])}) | {res['rounds']}")
    tables[table].append(
      f"| {label} | {loss} | {cons} | {res['bytes_per_step']:.0f} | "
      f"{res['bytes_per_step'] / res['dense_bytes_per_step']:.3f}{extra} |")
    print(tables[table][-1], flush=True)
  head = ("| method | eval loss (average model) | consensus distance | "
          "bytes/device/step | vs D-PSGD |")
  print(f"\n{a.steps} steps, lr {a.lr}, 8 devices, ring\n")
  for name, rows in tables.items():
    h = head
    if name == "squarm":
      h = h[:-1] + "| sends (all devices; min-max per device) | exchanges |"
    print(h)
    print("|" + "---|" * (h.count("|") - 1))
    print("\n".join(rows) + "\n")
  if a.json:
    with open(a.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
