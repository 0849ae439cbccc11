"""0/1 Adam against Adam and 1-bit Adam on a held-out teacher-student
classification task (issue 28, part 4), next to a float64 numpy replay of
DeepSpeed's ``ZeroOneAdam`` (tests/ref_zero_one_adam.py) on the same
batches.

Task: a fixed random teacher (32 -> 64 tanh -> 16 logits, label = argmax)
labels 8192 training and 4096 held-out Gaussian inputs; the student is the
same architecture without biases (leaves of 2048 and 1024 elements, which
DeepSpeed's compressed allreduce chunks without padding), trained with
softmax cross-entropy, 8 devices x 32 examples a step, 600 steps, the
variance frozen after 100. The figure is the held-out accuracy, averaged
over the devices' params (they differ between 0/1 Adam's syncs).

  python -m benchmarks.zero_one_gap [--lr 0.01] [--seeds 0,1,2]
"""

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS",
                      "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
  __file__))))

import jaxcomm  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from tests.ref_zero_one_adam import deepspeed_zero_one_adam  # noqa: E402

N, B, D, H, C = 8, 32, 32, 64, 16
STEPS, FREEZE = 600, 100


def task(seed):
  r = np.random.RandomState(seed)
  t1 = r.randn(D, H) / np.sqrt(D)
  t2 = r.randn(H, C) * 2.0 / np.sqrt(H)
  x = r.randn(8192 + 4096, D)
  labels = np.argmax(np.tanh(x @ t1) @ t2, axis=1)
  y = np.eye(C)[labels]
  params = {"w1": (r.randn(D, H) / np.sqrt(D)).astype(np.float32),
            "w2": (r.randn(H, C) / np.sqrt(H)).astype(np.float32)}
  order = [r.randint(0, 8192, N * B) for _ in range(STEPS)]
  batches = [(x[i].astype(np.float32), y[i].astype(np.float32))
             for i in order]
  return params, batches, (x[8192:], labels[8192:])


def loss_fn(p, batch):
  x, y = batch
  logits = jnp.tanh(x @ p["w1"]) @ p["w2"]
  return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits), axis=-1))


def np_grad(p, batch):
  x, y = (np.asarray(a, np.float64) for a in batch)
  h = np.tanh(x @ p["w1"])
  z = h @ p["w2"]
  e = np.exp(z - z.max(1, keepdims=True))
  dz = (e / e.sum(1, keepdims=True) - y) / len(x)
  dh = dz @ p["w2"].T * (1 - h * h)
  return {"w1": x.T @ dh, "w2": h.T @ dz}


def accuracy(p, test):
  """Held-out accuracy (percent) of params with or without a leading
  device axis (averaged over the devices)."""
  x, labels = test
  w1, w2 = (np.asarray(p[k], np.float64) for k in ("w1", "w2"))
  if w1.ndim == 2:
    w1, w2 = w1[None], w2[None]
  return float(np.mean([np.mean(np.argmax(np.tanh(x @ a) @ b, 1) == labels)
                        for a, b in zip(w1, w2)]) * 100)


def run_jax(tx, params, batches):
  dp = parallel.DataParallel(loss_fn, tx, parallel.make_mesh(N),
                             donate=False)
  p, s = dp.init(jax.tree.map(jnp.asarray, params))
  for batch in batches:
    p, s, _ = dp.step(p, s, batch)
  return jax.tree.map(np.asarray, p)


def run_replay(params, batches, lr, step0=1, vfs=FREEZE, **kw):
  per_dev = [[(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
              for i in range(N)] for x, y in batches]
  return deepspeed_zero_one_adam(np_grad, params, per_dev, N, lr,
                                 var_freeze_step=vfs, step0=step0,
                                 keep=False, **kw)


PER_LEAF = jaxcomm.LeafPolicy(bucket_bytes=4)   # one bucket per leaf


def rows(lr):
  mean = jaxcomm.mean_gradients()
  zo = lambda **kw: ("jax", jaxcomm.zero_one_adam(
    lr, var_freeze_step=FREEZE, **kw))
  return [
    ("optax.adam", ("jax", optax.chain(mean, optax.adam(lr)))),
    ("onebit_adam", ("jax", jaxcomm.onebit_adam(lr, freeze_step=FREEZE))),
    ("onebit_adam bias_correction=False", ("jax", jaxcomm.onebit_adam(
      lr, freeze_step=FREEZE, bias_correction=False))),
    ("zero_one_adam", zo()),
    ("zero_one_adam, one bucket per leaf", zo(policy=PER_LEAF)),
    ("DeepSpeed replay (step0=1, DeepSpeed as run)",
     ("np", dict(step0=1))),
    ("DeepSpeed replay (step0=0, vfs=99: jaxcomm's schedule)",
     ("np", dict(step0=0, vfs=FREEZE - 1))),
    ("zero_one_adam local_step_clipper=1", zo(local_step_clipper=1)),
    ("zero_one_adam local_step_scaler=32 (H up to 16)",
     zo(local_step_scaler=32)),
    ("DeepSpeed replay local_step_scaler=32", ("np", dict(
      local_step_scaler=32))),
    ("zero_one_adam var_update_scaler=1000 (variance every warm-up step)",
     zo(var_update_scaler=1000)),
    # The frozen variance without bias correction: 45 variance updates by
    # step 100 (16 + 16 + 13), so sqrt(v) is sqrt(1 - b2**45) = 0.21 of
    # Adam's and the step about 4.8x larger.
    ("zero_one_adam at lr x sqrt(1 - 0.999**45)", ("jax",
     jaxcomm.zero_one_adam(lr * np.sqrt(1 - 0.999 ** 45),
                           var_freeze_step=FREEZE))),
    ("optax.adam at lr / sqrt(1 - 0.999**45)", ("jax", optax.chain(
      mean, optax.adam(lr / np.sqrt(1 - 0.999 ** 45))))),
  ]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--lr", type=float, default=0.01)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--only", default="", help="comma-separated row numbers")
  a = ap.parse_args()
  seeds = [int(s) for s in a.seeds.split(",")]
  data = [task(s) for s in seeds]
  only = {int(i) for i in a.only.split(",") if i}
  print(f"lr {a.lr}, seeds {seeds}: held-out accuracy (%) after {STEPS} "
        f"steps, variance frozen after {FREEZE}")
  for k, (name, (kind, what)) in enumerate(rows(a.lr)):
    if only and k not in only:
      continue
    accs = []
    for params, batches, test in data:
      if kind == "jax":
        p = run_jax(what, params, batches)
      else:
        p = run_replay(params, batches, a.lr, **what)
      accs.append(accuracy(p, test))
    print(f"{k:2d} {name:66s} {np.mean(accs):6.2f}  "
          + " ".join(f"{v:6.2f}" for v in accs), flush=True)


if __name__ == "__main__":
  main()
