"""When gradients are applied: Pipe-SGD, bounded staleness, and Grishchenko
et al.'s sparsified prox with identification.

Two measurements, on 8 simulated CPU devices:

* **Digits MLP** (``models.create("mlp")``, scikit-learn's digits, global
  batch 128, momentum SGD 0.9 at 0.1, the rate ``docs/benchmarks/lr.json``
  gives the dense mean on this model, constant): training loss at a few
  steps and held-out loss/accuracy at the end for the plain mean, Pipe-SGD
  (dense and around int8), and bounded staleness ``tau`` in {0, 1, 2, 4, 8}
  (every device), one tau per device (0..7) and a random tau per device
  and step in [0, 8]. The same rows with momentum SGD at 0.03 (the same
  effective step ``lr / (1 - momentum)`` as the next) and plain SGD at 0.3.
* **Lasso** (``min (1/n) sum_i f_i(x) + l1 |x|_1``, 8 workers holding 40
  rows each, 400 coordinates, 10 nonzero): ``jaxcomm.spy`` dense (p = 1),
  and with and without identification at the same probability p, against
  the solution of 5000 full proximal-gradient steps in numpy: the step
  from which the iterate's support equals the solution's for good, the
  coordinates a worker sends per step at the start and at the end and in
  all (a value and an index, 8 bytes a coordinate, against 4 bytes a
  coordinate for the dense vector), the objective gap, and the SPMD
  simulation's all-reduce bytes read from the compiled HLO.

Run from the repository root::

  python -m benchmarks.delayed                # about 3 min on 2 cores
  python -m benchmarks.delayed --steps 100 --lasso-steps 100   # quicker

The tables are printed and written to ``--out`` (default
``runs/delayed/table.md``).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  from benchmarks._xla import raise_cpu_collective_timeouts
  raise_cpu_collective_timeouts()
  _DEVICES = "--xla_force_host_platform_device_count=8"
  if _DEVICES.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                               + _DEVICES).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jaxcomm  # noqa: E402
import models  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from models import data as mdata  # noqa: E402

N = 8
BATCH = 128


def rows_mlp():
  """(label, exchange-or-wrapper factory) for the MLP table."""
  return [
    ("plain mean", lambda: jaxcomm.mean_gradients()),
    ("pipe_sgd()", lambda: jaxcomm.pipe_sgd()),
    ("int8", lambda: jaxcomm.int8()),
    ("pipe_sgd(int8())", lambda: jaxcomm.pipe_sgd(jaxcomm.int8())),
  ] + [
    (f"stale_sgd(tau={t})", lambda t=t: jaxcomm.stale_sgd(tau=t))
    for t in (0, 1, 2, 4, 8)
  ] + [
    ("stale_sgd(tau=(0..7))",
     lambda: jaxcomm.stale_sgd(tau=tuple(range(N)))),
    ("stale_sgd(tau=None, tau_max=8)",
     lambda: jaxcomm.stale_sgd(tau=None, tau_max=8, seed=0)),
  ]


def train_mlp(make, optimizer, steps: int, marks) -> dict:
  """One run: training loss (mean over devices) at ``marks``, held-out
  loss and accuracy at the end."""
  train_set, test_set = mdata.digits()
  apply, params, _ = models.functional(models.create("mlp", rngs=0))
  loss_of = models.make_loss_fn("mlp", apply)
  mesh = parallel.make_mesh(N)
  tx = optax.chain(make(), optimizer)
  dp = parallel.DataParallel(loss_of, tx, mesh, has_aux=True, donate=False)
  p, s = dp.init(params)
  it = mdata.batches(train_set, BATCH, seed=0, num_shards=N)
  losses = []
  for _ in range(steps):
    p, s, m = dp.step(p, s, next(it))
    losses.append(float(np.mean(jax.device_get(m["loss"]))))
  out = {f"loss@{k}": float(np.mean(losses[k - 10:k])) for k in marks}
  tot, acc, cnt = 0.0, 0.0, 0.0
  for b in mdata.eval_batches(test_set, 360):
    _, met = loss_of(jax.device_get(p), b)
    w = float(b["mask"].sum())
    tot += float(met["loss"]) * w
    acc += float(met["accuracy"]) * w
    cnt += w
  out["eval_loss"] = tot / cnt
  out["eval_accuracy"] = acc / cnt
  out["finite"] = bool(np.all(np.isfinite(losses)))
  return out


def mlp_table(steps: int) -> str:
  marks = [m for m in (50, 100, 200, 300, 500) if m <= steps]
  if steps not in marks:
    marks.append(steps)
  parts = []
  for title, opt in (("momentum SGD 0.9, lr 0.1", optax.sgd(0.1, 0.9)),
                     ("momentum SGD 0.9, lr 0.03", optax.sgd(0.03, 0.9)),
                     ("plain SGD, lr 0.3", optax.sgd(0.3))):
    head = ("| update | " + " | ".join(f"train loss @{k}" for k in marks)
            + " | held-out loss | held-out acc |")
    lines = [f"**{title}** (train loss: mean of the 10 steps before)", "",
             head, "|---|" + "---:|" * (len(marks) + 2)]
    for label, make in rows_mlp():
      r = train_mlp(make, opt, steps, marks)
      cells = [f"{r[f'loss@{k}']:.4f}" for k in marks]
      lines.append(f"| `{label}` | " + " | ".join(cells)
                   + f" | {r['eval_loss']:.4f} | {r['eval_accuracy']:.3f} |")
      print(lines[-1], flush=True)
    parts.append("\n".join(lines))
  return "\n\n".join(parts)


# ----------------------------------------------------------------- lasso ----

D, M, K = 400, 40, 10


def lasso_problem(seed: int = 0):
  r = np.random.RandomState(seed)
  x_true = np.zeros(D)
  x_true[r.choice(D, K, replace=False)] = r.choice([-1, 1], K) * (
    1 + r.rand(K))
  a = r.randn(N * M, D).astype(np.float32) / np.sqrt(M)
  b = (a @ x_true + 0.01 * r.randn(N * M)).astype(np.float32)
  return a, b


def lasso_solution(a, b, gamma, lam, steps=5000):
  """Full proximal gradient on (1/n) sum_i f_i = (1 / 2M n) |Ax - b|^2
  (each f_i the mean over its M rows), float64."""
  a = a.astype(np.float64)
  b = b.astype(np.float64)
  x = np.zeros(D)
  for _ in range(steps):
    g = a.T @ (a @ x - b) / (N * M)
    y = x - gamma * g
    x = np.sign(y) * np.maximum(np.abs(y) - gamma * lam, 0)
  return x


def lasso_loss(p, batch):
  a, b = batch
  return 0.5 * jnp.mean((a @ p["x"] - b) ** 2)


def spy_run(a, b, gamma, lam, prob, identify, steps):
  mesh = parallel.make_mesh(N)
  tx = jaxcomm.spy(gamma, lam, prob, identify=identify, seed=0)
  dp = parallel.DataParallel(lasso_loss, tx, mesh, donate=False)
  p, s = dp.init({"x": jnp.zeros(D, jnp.float32)})
  xs, sent = [], []
  for _ in range(steps):
    p, s, _ = dp.step(p, s, (a, b))
    xs.append(np.asarray(jax.device_get(p["x"]), np.float64))
    sent.append(int(s.sent))
  hlo = jaxcomm.wire.report(dp.lower(p, s, (a, b)),
                            params={"x": jnp.zeros(D)})
  return xs, sent, hlo


def lasso_table(steps: int) -> str:
  a, b = lasso_problem()
  gamma, lam = 0.5, 0.01
  star = lasso_solution(a, b, gamma, lam)
  supp = star != 0
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  obj = lambda x: (0.5 * np.mean((a64 @ x - b64) ** 2)
                   + lam * np.abs(x).sum())
  f_star = obj(star)
  mid = steps // 3
  lines = [f"Lasso: {N} workers x {M} rows, {D} coordinates, solution "
           f"support {int(supp.sum())} of {D} (5000 full prox-gradient "
           f"steps in numpy), step size {gamma}, l1 {lam}, {steps} steps. "
           "A coordinate sent costs a value and an index (8 B); the dense "
           f"vector is {4 * D} B a worker a step.", "",
           "| scheme | p | support = solution's from step | coords / worker "
           "/ step, first 10 | last 10 | coords / worker, total | "
           f"F - F* @{mid} | F - F* @{steps} | SPMD all-reduce / step "
           "(HLO) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for identify, prob in ((False, 1.0), (False, 0.05), (False, 0.2),
                         (True, 0.05), (True, 0.2)):
    xs, sent, hlo = spy_run(a, b, gamma, lam, prob, identify, steps)
    same = [bool(np.array_equal(x != 0, supp)) for x in xs]
    ident = next((t + 1 for t in range(steps) if all(same[t:])), None)
    name = "spy(identify=True)" if identify else "spy(identify=False)"
    lines.append(
      f"| `{name}` | {prob} | {ident if ident else 'never'} | "
      f"{np.mean(sent[:10]) / N:.1f} | {np.mean(sent[-10:]) / N:.1f} | "
      f"{sum(sent) / N:.0f} | {obj(xs[mid - 1]) - f_star:.2e} | "
      f"{obj(xs[-1]) - f_star:.2e} | "
      f"{hlo.payload.get('all-reduce', 0)} B |")
    print(lines[-1], flush=True)
  return "\n".join(lines)


def main(argv=None) -> str:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300,
                 help="MLP training steps per row")
  p.add_argument("--lasso-steps", type=int, default=300,
                 help="spy steps per row")
  p.add_argument("--out", default="runs/delayed/table.md")
  args = p.parse_args(argv)
  if len(jax.devices()) < N:
    raise SystemExit(f"needs {N} devices, have {len(jax.devices())}")
  text = (f"Digits MLP, {N} simulated CPU devices, global batch {BATCH}, "
          f"{args.steps} steps, seed 0.\n\n" + mlp_table(args.steps)
          + "\n\n" + lasso_table(args.lasso_steps) + "\n")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return text


if __name__ == "__main__":
  main()
