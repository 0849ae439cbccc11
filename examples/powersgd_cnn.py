"""PowerSGD on a small CNN, its bytes read from the compiled program.

PowerSGD (Vogels et al. 2019) sends each gradient matrix as two thin
factors ``P`` and ``Q`` of rank ``r`` (a convolution kernel
``(h, w, in, out)`` is the matrix ``(h w in, out)``), warm-started from the
last step and with error feedback, in two fused all-reduces. This script
trains a small CNN on scikit-learn's 8x8 handwritten digits with
``jaxcomm.powersgd(rank=2)``, then compiles its train step and the dense
step (``jaxcomm.mean_gradients()``: one float32 all-reduce) and reads the
collectives each holds from the compiled HLO (``jaxcomm.wire.report``).

It prints the loss falling, the held-out accuracy of both runs, and the
two steps' collectives side by side. Run it with::

  python examples/powersgd_cnn.py            # 400 steps
  python examples/powersgd_cnn.py --quick    # a short run

It runs on 8 simulated CPU devices unless ``JAX_PLATFORMS`` names another
platform (e.g. ``JAX_PLATFORMS=cuda`` on a machine with 8 GPUs). Needs
scikit-learn (for the digits).
"""

import os

# Eight simulated CPU devices, set before JAX starts, unless JAX_PLATFORMS
# names another platform or XLA_FLAGS already sets a device count.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and (
    "xla_force_host_platform_device_count" not in _FLAGS):
  os.environ["XLA_FLAGS"] = (
    _FLAGS + " --xla_force_host_platform_device_count=8").strip()
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn import datasets  # noqa: E402

import jaxcomm  # noqa: E402


class CNN(nnx.Module):
  """Two 3x3 convolutions and two dense layers, for 8x8x1 images."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
    self.fc1 = nnx.Linear(4 * 4 * 64, 128, rngs=rngs)
    self.fc2 = nnx.Linear(128, 10, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.conv1(x))
    x = nnx.avg_pool(jax.nn.relu(self.conv2(x)), (2, 2), strides=(2, 2))
    x = jax.nn.relu(self.fc1(x.reshape(x.shape[0], -1)))
    return self.fc2(x)


def digits(seed: int):
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
  y = y.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  return (x[order[360:]], y[order[360:]]), (x[order[:360]], y[order[:360]])


def train(tx, steps, graphdef, params, data, mesh, batch, label):
  """Trains with ``tx``; returns the DataParallel step, its final params
  and state, one batch, the first and last loss and the accuracy."""
  (x_tr, y_tr), (x_te, y_te) = data

  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()

  dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
  params, opt_state = dp.init(params)
  rng = np.random.default_rng(0)  # the same batches for every run
  losses = []
  for step in range(steps):
    idx = rng.choice(len(x_tr), batch)
    b = {"x": x_tr[idx], "y": y_tr[idx]}
    params, opt_state, metrics = dp.step(params, opt_state, b)
    losses.append(float(metrics["loss"]))
    if (step + 1) % (steps // 4) == 0:
      print(f"{label:9s} step {step + 1:4d}  train loss "
            f"{np.mean(losses[-10:]):.3f}")
  logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x_te)
  acc = float(jnp.mean(jnp.argmax(logits, -1) == y_te))
  return dp, params, opt_state, b, losses, acc


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--rank", type=int, default=2)
  ap.add_argument("--quick", action="store_true",
                  help="a short run (the test suite's)")
  args = ap.parse_args(argv)
  steps = 60 if args.quick else args.steps

  mesh = jaxcomm.parallel.make_mesh()  # every device on axis "data"
  graphdef, params = nnx.split(CNN(nnx.Rngs(0)), nnx.Param)
  data = digits(seed=0)
  batch = 16 * mesh.shape["data"]
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"CNN of {n_params:,} params on {mesh.shape['data']} devices")

  # PowerSGD first in the chain: everything after it sees the averaged,
  # decompressed gradient. Small leaves (biases) travel in one fused dense
  # psum; momentum SGD after.
  runs = {
    "powersgd": optax.chain(jaxcomm.powersgd(rank=args.rank),
                            optax.sgd(0.1, momentum=0.9)),
    "dense": optax.chain(jaxcomm.mean_gradients(),
                         optax.sgd(0.1, momentum=0.9)),
  }
  out = {}
  for label, tx in runs.items():
    dp, p, s, b, losses, acc = train(tx, steps, graphdef, params, data,
                                     mesh, batch, label)
    # The compiled step's collectives: each op's kind, payload and group,
    # and the bytes a device sends by ring algorithms.
    report = jaxcomm.wire.report(dp.lower(p, s, b).compile(), params)
    out[label] = (losses, acc, report)

  for label, (_, acc, report) in out.items():
    print(f"\n{label}: held-out accuracy {acc:.3f}; compiled step's "
          f"collectives:\n{report}")
  ps, dense = out["powersgd"][2], out["dense"][2]
  print(f"\nbytes per device per step: powersgd {ps.total_sent:,.0f}, dense "
        f"{dense.total_sent:,.0f}: {dense.total_sent / ps.total_sent:.1f}x "
        "fewer")
  losses = out["powersgd"][0]
  print(f"loss: {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f}")


if __name__ == "__main__":
  main()
