"""DiLoCo with a compressed pseudo-gradient: 4-bit codes, every 20 steps.

DiLoCo (Douillard et al. 2023) lets each device train alone for ``period``
steps with an inner optimizer (AdamW), then averages the pseudo-gradients
``theta - x_i`` (how far each device moved from the last global model) and
applies them with an outer optimizer (Nesterov SGD). Nothing crosses the
wire between syncs. Here the average itself is compressed too: the
pseudo-gradients travel as int4 codes with error feedback kept from sync to
sync (``compressor=jaxcomm.int4()``).

The model is an MLP on scikit-learn's 8x8 handwritten digits, one shard of
the training set per device. The script prints the training loss and the
held-out accuracy of the global model, the bytes one sync moves against
the dense float32 sync of plain DiLoCo, and the bytes per step against
data-parallel training that averages every step. Run it with::

  python examples/diloco_compressed.py            # 600 steps
  python examples/diloco_compressed.py --quick    # a short run

It runs on 8 simulated CPU devices unless ``JAX_PLATFORMS`` names another
platform (e.g. ``JAX_PLATFORMS=cuda`` on a machine with 8 GPUs). Needs
scikit-learn (for the digits).
``train.py --local diloco --compressor int4`` runs the same from the
command line.
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
from sklearn import datasets  # noqa: E402

import jaxcomm  # noqa: E402


def init_mlp(key, sizes=(64, 256, 256, 10)):
  """A plain-pytree MLP: a list of {"w", "b"} layers."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) * m ** -0.5,
           "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def logits_of(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits_of(params, batch["x"]), batch["y"]).mean()


def digits(n_devices: int, per_device: int, seed: int):
  """Held-out digits, and endless training batches whose rows
  ``[i * per_device, (i + 1) * per_device)`` come from device ``i``'s own
  shard of the training set (the order the data axis splits a batch in)."""
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  test, train = order[:360], order[360:]
  shards = np.array_split(train, n_devices)
  rng = np.random.default_rng(seed + 1)

  def gen():
    while True:
      idx = np.concatenate([rng.choice(s, per_device) for s in shards])
      yield {"x": x[idx], "y": y[idx]}
  return {"x": x[test], "y": y[test]}, gen()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=600)
  ap.add_argument("--period", type=int, default=20,
                  help="inner steps between syncs (H)")
  ap.add_argument("--quick", action="store_true",
                  help="a short run (the test suite's)")
  args = ap.parse_args(argv)
  steps = 100 if args.quick else args.steps
  period = args.period

  mesh = jaxcomm.parallel.make_mesh()  # every device on axis "data"
  n = mesh.shape["data"]
  params = init_mlp(jax.random.key(0))
  test, train = digits(n, per_device=32, seed=0)

  # Inner AdamW on each device alone; every `period` steps the mean
  # pseudo-gradient, as int4 codes (error feedback kept between syncs),
  # drives an outer Nesterov SGD (the paper's lr 0.7, momentum 0.9).
  inner = optax.adamw(3e-3)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  tx = jaxcomm.diloco(inner, outer, period, compressor=jaxcomm.int4())
  dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
  # With a local-update optimizer params are per device (a leading axis of
  # n, one row per device); dp.synchronized gives the global model.
  params, opt_state = dp.init(params)

  @jax.jit
  def accuracy(params):
    pred = jnp.argmax(logits_of(params, test["x"]), -1)
    return jnp.mean(pred == test["y"])

  print(f"DiLoCo on {n} devices, a sync every {period} steps, int4 "
        "pseudo-gradients")
  first = None
  for step in range(steps):
    params, opt_state, metrics = dp.step(params, opt_state, next(train))
    loss = float(jnp.mean(metrics["loss"]))  # one loss per device
    first = loss if first is None else first
    if (step + 1) % (steps // 5) == 0:
      acc = float(accuracy(dp.synchronized(params)))
      print(f"step {step + 1:4d}  train loss {loss:.3f}  held-out "
            f"accuracy {acc:.3f}")

  # Bytes of one sync (the step with index period - 1 syncs): what the
  # int4 compressor claims (the test suite checks every claim against the
  # compiled program) against plain DiLoCo's dense float32 all-reduce and
  # data-parallel training's all-reduce every step.
  def sent(tx, step=None):
    return jaxcomm.wire.summarize(jaxcomm.wire.claimed(
      tx, params_host, n, step=step), n).total_sent

  params_host = jax.device_get(dp.synchronized(params))
  int4_sync = sent(tx, step=period - 1)
  dense_sync = sent(jaxcomm.diloco(inner, outer, period), step=period - 1)
  ddp_step = sent(jaxcomm.mean_gradients())
  print(f"bytes per device per sync: int4 {int4_sync:,.0f}, dense "
        f"{dense_sync:,.0f}: {dense_sync / int4_sync:.2f}x fewer")
  print(f"bytes per device per step: {int4_sync / period:,.0f} against "
        f"{ddp_step:,.0f} averaging every step: "
        f"{ddp_step * period / int4_sync:.0f}x fewer")
  print(f"loss: {first:.3f} -> {loss:.3f}")


if __name__ == "__main__":
  main()
