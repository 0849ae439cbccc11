"""LUPA-SGD, FedCOM / FedCOMGATE, hierarchical averaging and the simulated
over-the-air aggregations on the digits MLP, 8 simulated CPU devices.

Every row trains the same MLP (64-128-128-10) with the same seed and step
budget; each device draws its batches from its own shard (``models.
partition.dirichlet_split`` at the stated ``alpha``: 0.1 strongly label
skewed, 100 close to i.i.d.). A row gives the final training loss (mean of
the last 20 steps' device-averaged loss), the test accuracy of the
devices' averaged model at a few steps, and the bytes each device sent
(``jaxcomm.wire``'s convention, from the methods' claims, which the tests
check against the compiled HLO; ADACOMM's syncs counted from its state).

Run from the repository root::

  python -m benchmarks.federated                 # about 5 min on 2 cores
  python -m benchmarks.federated --steps 100     # quicker

Writes ``--out`` (default ``runs/federated/table.md``) and prints it.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS",
                      "--xla_force_host_platform_device_count=8")
if __name__ == "__main__":
  from benchmarks._xla import raise_cpu_collective_timeouts
  raise_cpu_collective_timeouts()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jaxcomm  # noqa: E402
import models  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from jaxcomm import wire  # noqa: E402
from models import data  # noqa: E402
from models import partition  # noqa: E402

N = 8
PER_DEVICE = 16
LR = 0.2
EVAL_AT = (30, 60, 100, 200, 300)


def _setup():
  train, test = data.digits()
  m = models.create("mlp", rngs=0)
  fn = models.functional(m)
  loss_fn = models.make_loss_fn("mlp", fn.apply)
  return train, test, fn, loss_fn


def _accuracy(fn, params, test):
  logits = fn.apply(params, test["image"])
  return float(np.mean(np.argmax(np.asarray(logits), -1) == test["label"]))


def _bytes(tx, params, n, steps):
  """Bytes each device sent over ``steps`` steps (None: adacomm, whose
  syncs follow the loss)."""
  try:
    return sum(wire.summarize(wire.claimed(tx, params, n, step=s), n
                              ).total_sent for s in range(steps))
  except ValueError as e:
    if "adacomm" not in str(e):
      raise
    return None


def run(tx, shards, steps, *, mesh=None, axis_name="data", seed=0,
        n_wire=N, wire_tx=None, sent=None):
  train, test, fn, loss_fn = SETUP
  mesh = mesh if mesh is not None else parallel.make_mesh(N)
  dp = parallel.DataParallel(loss_fn, tx, mesh, axis_name=axis_name,
                             has_aux=True, donate=False)
  p, s = dp.init(fn.params)
  gen = partition.device_batches(train, shards, PER_DEVICE, seed=seed)
  losses, accs, syncs = [], {}, 0
  for t in range(steps):
    p, s, m = dp.step(p, s, next(gen))
    losses.append(float(np.mean(np.asarray(m["loss"]))))
    local = jaxcomm.local_states(s)
    if local and any(bool(np.asarray(v).all())
                     for v in jax.tree.leaves(local[0].synced)):
      syncs += 1
    if t + 1 in EVAL_AT or t + 1 == steps:
      avg = dp.synchronized(p) if dp.per_device_params else p
      accs[t + 1] = _accuracy(fn, jax.device_get(avg), test)
  b = sent if sent is not None else _bytes(
    wire_tx if wire_tx is not None else tx, fn.params, n_wire, steps)
  if b is None:   # adacomm: (P + 1) floats per sync, one all-reduce
    size = sum(int(np.size(x)) for x in jax.tree.leaves(fn.params))
    b = syncs * wire.summarize([("all-reduce", 4 * (size + 1))], N
                               ).total_sent
  return {"loss": float(np.mean(losses[-20:])), "acc": accs, "bytes": b,
          "syncs": syncs}


def _row(name, r, extra=""):
  accs = " | ".join(f"{r['acc'].get(s, float('nan')):.3f}"
                    for s in sorted(r["acc"]))
  return (f"| {name} | {r['loss']:.3f} | {accs} | "
          f"{r['bytes'] / 1e6:.2f} | {extra} |")


def _header(steps):
  cols = " | ".join(f"acc@{s}" for s in sorted(set(
    [s for s in EVAL_AT if s <= steps] + [steps])))
  return (f"| method | train loss | {cols} | MB sent / device | notes |\n"
          "|---|---|" + "---|" * (cols.count("|") + 1) + "---|---|")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--out", default="runs/federated/table.md")
  args = ap.parse_args(argv)
  steps = args.steps
  global SETUP
  SETUP = _setup()
  train = SETUP[0]
  labels = train["label"]
  out = []
  t0 = time.time()
  sgd = optax.sgd(LR)

  # 1. LUPA-SGD against fixed periods and ADACOMM (near-i.i.d. split).
  iid = partition.dirichlet_split(labels, N, 100.0, seed=0)
  a = jaxcomm.lupa_increment(2, steps, 20)
  out.append(f"### 1. Adaptive period (alpha=100, {steps} steps, SGD "
             f"{LR})\n")
  out.append(_header(steps))
  for name, tx in [
      ("local_sgd H=1 (synchronous)", jaxcomm.local_sgd(sgd, 1)),
      ("local_sgd H=4", jaxcomm.local_sgd(sgd, 4)),
      ("local_sgd H=16", jaxcomm.local_sgd(sgd, 16)),
      ("adacomm tau0=16", jaxcomm.adacomm(sgd, 16, interval=32)),
      (f"lupa_sgd tau0=2 a={a} (20 rounds)",
       jaxcomm.lupa_sgd(sgd, 2, increment=a)),
      ("lupa_sgd tau0=1 a=2", jaxcomm.lupa_sgd(sgd, 1, increment=2))]:
    r = run(tx, iid, steps)
    out.append(_row(name, r, f"{r['syncs']} syncs"))
    print(out[-1], flush=True)

  # 2. FedCOM / FedCOMGATE / FedAvg / DiLoCo on label-skewed splits.
  for alpha in (0.1, 1.0):
    shards = partition.dirichlet_split(labels, N, alpha, seed=0)
    counts = partition.label_counts(labels, shards, 10)
    top = np.mean(counts.max(1) / counts.sum(1))
    out.append(f"\n### 2. Heterogeneous data: Dirichlet alpha={alpha} "
               f"(largest class {top:.0%} of a shard on average), tau=8, "
               f"{steps} steps\n")
    out.append(_header(steps))
    nest = optax.sgd(0.7, momentum=0.9, nesterov=True)
    for name, tx in [
        ("fedavg (local_sgd H=8)", jaxcomm.local_sgd(sgd, 8)),
        ("fedcom dense", jaxcomm.fedcom(optax.sgd(LR),
            learning_rate=LR, period=8)),
        ("fedcomgate dense", jaxcomm.fedcomgate(optax.sgd(LR),
            learning_rate=LR, period=8)),
        ("fedcom topk 0.1", jaxcomm.fedcom(optax.sgd(LR),
            learning_rate=LR, period=8,
                                           compressor=jaxcomm.topk(0.1))),
        ("fedcomgate topk 0.1", jaxcomm.fedcomgate(optax.sgd(LR),
            learning_rate=LR, period=8, compressor=jaxcomm.topk(0.1))),
        ("fedcom qsgd s=4", jaxcomm.fedcom(optax.sgd(LR),
            learning_rate=LR, period=8,
                                           compressor=jaxcomm.qsgd(4))),
        ("fedcomgate qsgd s=4", jaxcomm.fedcomgate(optax.sgd(LR),
            learning_rate=LR, period=8,
            compressor=jaxcomm.qsgd(4, error_feedback=True))),
        ("diloco (outer Nesterov 0.7)", jaxcomm.diloco(sgd, nest, 8)),
        ("diloco topk 0.1 (outer sgd 1)", jaxcomm.diloco(
          sgd, optax.sgd(1.0), 8, compressor=jaxcomm.topk(0.1)))]:
      r = run(tx, shards, steps)
      out.append(_row(name, r))
      print(out[-1], flush=True)

  # 3. Hierarchical averaging on a 2 x 4 pod mesh (alpha = 1).
  shards = partition.dirichlet_split(labels, N, 1.0, seed=0)
  pod = parallel.make_pod_mesh(2)
  axes = ("dcn", "ici")
  params = SETUP[2].params
  size = sum(int(np.size(x)) for x in jax.tree.leaves(params))
  flat_sync = wire.summarize([("all-reduce", 4 * size)], N).total_sent
  topk = jaxcomm.topk(0.1, axis_name="dcn")
  topk_sync = wire.summarize(jaxcomm.spec_of(topk).wire(
    jax.tree.leaves(params), 2, 0), 2).total_sent
  dense_cross = wire.summarize([("all-reduce", 4 * size)], 2).total_sent
  matched = max(1, round(16 * flat_sync / topk_sync))
  out.append(f"\n### 3. Hierarchical averaging, 2 groups x 4 devices "
             f"(alpha=1, {steps} steps)\n")
  out.append("Cross-group bytes: one flat sync sends "
             f"{flat_sync / 1e3:.1f} kB per device (8-device all-reduce); "
             f"a dense global sync {dense_cross / 1e3:.1f} kB (2-group "
             f"all-reduce), a top-k 0.1 one {topk_sync / 1e3:.1f} kB. The "
             f"last flat row's period ({matched}) matches the top-k "
             "hierarchical row's cross-group bytes.\n")
  out.append(_header(steps).replace("MB sent / device",
                                    "MB sent / device (all links)"))
  rows = [
    ("flat local_sgd H=16", jaxcomm.local_sgd(sgd, 16, axis_name=axes),
     steps // 16 * flat_sync),
    ("hierarchical H=2, H_g=16, dense",
     jaxcomm.hierarchical_sgd(sgd, 2, 16, axis_name=axes),
     steps // 16 * dense_cross),
    ("hierarchical H=2, H_g=16, topk 0.1",
     jaxcomm.hierarchical_sgd(sgd, 2, 16, compressor=topk, axis_name=axes),
     steps // 16 * topk_sync),
    (f"flat local_sgd H={matched}",
     jaxcomm.local_sgd(sgd, matched, axis_name=axes),
     steps // matched * flat_sync)]
  group_sync = wire.summarize([("all-reduce", 4 * size)], 4).total_sent
  for name, tx, cross in rows:
    sent = None
    if "hierarchical" in name:   # group all-reduces (4 devices) + cross
      sent = steps // 2 * group_sync + cross
    r = run(tx, shards, steps, mesh=pod, axis_name=axes, sent=sent)
    out.append(_row(name, r, f"cross-group {cross / 1e6:.2f} MB"))
    print(out[-1], flush=True)

  # 4. Over-the-air aggregation (simulated channel), synchronous steps.
  out.append(f"\n### 4. Simulated over-the-air aggregation (alpha=100, "
             f"{steps} steps; truncation threshold 0.1, Rayleigh fading)\n")
  out.append(_header(steps))
  dense = jaxcomm.mean_gradients()
  r = run(optax.chain(dense, optax.sgd(LR)), iid, steps, wire_tx=dense)
  out.append(_row("exact mean (dense psum), SGD 0.2", r))
  print(out[-1], flush=True)
  for snr in (-30.0, -20.0, -10.0, 0.0, 20.0):
    c = jaxcomm.ota_analog(snr, threshold=0.1)
    r = run(optax.chain(c, optax.sgd(LR)), iid, steps, wire_tx=c)
    out.append(_row(f"ota_analog SNR {snr:+.0f} dB, SGD 0.2", r))
    print(out[-1], flush=True)
  for snr in (-10.0, 0.0, 10.0, 20.0):
    c = jaxcomm.ota_onebit(snr, threshold=0.1)
    r = run(optax.chain(c, optax.sgd(0.01)), iid, steps, wire_tx=c)
    out.append(_row(f"ota_onebit SNR {snr:+.0f} dB, SGD 0.01", r))
    print(out[-1], flush=True)

  out.append(f"\n({time.time() - t0:.0f} s)")
  text = "\n".join(out) + "\n"
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)
  print(text)


SETUP = None

if __name__ == "__main__":
  main()
