"""Decentralized training: CHOCO-SGD gossiping top-k differences on a ring.

With no all-reduce at all, each device trains its own copy of the model
and talks only to its two neighbours on a ring. CHOCO-SGD (Koloskova et
al. 2019) sends each neighbour the top-k of how far the device's model has
moved from the public copy its neighbours keep of it, and pulls its model
towards its neighbours' public copies by ``gamma``
(``jaxcomm.choco(inner, jaxcomm.topk(...), gamma=...)``). The models never
agree exactly; they stay close.

The model is an MLP on scikit-learn's 8x8 handwritten digits, one shard of
the training set per device. The script prints the training loss, how far
the devices' models are from their average (the consensus distance: the
largest difference of any parameter from its device mean), the
held-out accuracy of the average model, and the bytes each device sends
per step read from the compiled step (collective-permutes to its
neighbours) against a dense all-reduce of the gradients. Run it with::

  python examples/gossip_choco.py            # 600 steps
  python examples/gossip_choco.py --quick    # a short run

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
from sklearn import datasets  # noqa: E402

import jaxcomm  # noqa: E402


def init_mlp(key, sizes=(64, 256, 10)):
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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=600)
  ap.add_argument("--ratio", type=float, default=0.1,
                  help="top-k's fraction of each leaf sent per step")
  ap.add_argument("--gamma", type=float, default=0.5,
                  help="consensus step size")
  ap.add_argument("--quick", action="store_true",
                  help="a short run (the test suite's)")
  args = ap.parse_args(argv)
  steps = 80 if args.quick else args.steps

  mesh = jaxcomm.parallel.make_mesh()  # every device on axis "data"
  n = mesh.shape["data"]
  x, y = datasets.load_digits(return_X_y=True)
  x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  test, shards = order[:360], np.array_split(order[360:], n)
  rng = np.random.default_rng(1)

  # Each device: momentum SGD on its own gradient, then CHOCO's gossip of
  # top-k differences with its ring neighbours (no error feedback of the
  # compressor's own: CHOCO's public copies keep what was not sent).
  tx = jaxcomm.choco(optax.sgd(0.05, momentum=0.9),
                     jaxcomm.topk(args.ratio), gamma=args.gamma,
                     topology="ring")
  dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
  params, opt_state = dp.init(init_mlp(jax.random.key(0)))

  @jax.jit
  def accuracy(params):
    pred = jnp.argmax(logits_of(params, x[test]), -1)
    return jnp.mean(pred == y[test])

  print(f"CHOCO-SGD on a ring of {n} devices, top-{args.ratio:.0%} "
        f"differences, gamma {args.gamma}")
  losses = []
  for step in range(steps):
    # Rows [i * 32, (i + 1) * 32) of the batch go to device i: its shard.
    idx = np.concatenate([rng.choice(s, 32) for s in shards])
    params, opt_state, metrics = dp.step(params, opt_state,
                                         {"x": x[idx], "y": y[idx]})
    losses.append(float(jnp.mean(metrics["loss"])))  # a loss per device
    if (step + 1) % (steps // 4) == 0:
      # Per-device params: the largest distance of any value from its
      # device mean, and the average model's accuracy.
      dist = float(jaxcomm.parallel.consensus_distance(params))
      acc = float(accuracy(dp.synchronized(params)))
      print(f"step {step + 1:4d}  train loss {np.mean(losses[-10:]):.3f}"
            f"  consensus distance {dist:.2e}  held-out accuracy {acc:.3f}")

  # Bytes from the compiled step: one collective-permute per neighbour of
  # the packed top-k messages; the dense baseline is an all-reduce of the
  # params' size, what data parallelism would send every step.
  report = jaxcomm.wire.report(
    dp.lower(params, opt_state, {"x": x[idx], "y": y[idx]}).compile(),
    dp.synchronized(params))
  print(f"compiled step's collectives:\n{report}")
  print(f"bytes per device per step: {report.total_sent:,.0f} to its "
        f"neighbours, dense all-reduce {report.dense_sent:,.0f}: "
        f"{report.ratio:.1f}x fewer")
  print(f"loss: {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f}")


if __name__ == "__main__":
  main()
