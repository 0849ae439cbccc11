"""1-bit Adam in place of ``optax.adam``: the same model, both losses.

1-bit Adam (Tang et al. 2021) runs Adam on the exact mean gradient for a
warm-up, then freezes Adam's variance and exchanges the momentum instead of
the gradient, as one sign bit per value with error compensation on the
devices and on the server side (``jaxcomm.onebit_adam(lr,
freeze_step=...)``: a whole optimizer that replaces ``optax.adam``).

This script trains the same MLP on scikit-learn's 8x8 handwritten digits
twice from the same initialization and batches: with ``optax.adam`` after a
dense mean of the gradients (``jaxcomm.mean_gradients()``, what plain data
parallelism does) and with 1-bit Adam. It prints both training losses side
by side, the held-out accuracy of each, and the bytes each device sends per
step in the warm-up and after the freeze.

The variance frozen at ``freeze_step`` divides every later step. A value
whose gradient was always zero in the warm-up (here the weights of the
three pixels that are zero in every image) keeps a zero variance, while the
1-bit momentum there is a sign times a scale, never zero: the paper's step
would move it by about ``lr * scale / eps``. jaxcomm gives such a value no
step (what the exchange sent it stays in the error buffers), so the images
go in whole. Run it with::

  python examples/onebit_adam.py            # 500 steps, freeze at 100
  python examples/onebit_adam.py --quick    # a short run

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


def init_mlp(key, sizes):
  """A plain-pytree MLP: a list of {"w", "b"} layers."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) * m ** -0.5,
           "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def logits_of(params, x):
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])  # no unit without gradient
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits_of(params, batch["x"]), batch["y"]).mean()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=500)
  ap.add_argument("--freeze-step", type=int, default=100,
                  help="Adam warm-up steps before the 1-bit exchange")
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--quick", action="store_true",
                  help="a short run (the test suite's)")
  args = ap.parse_args(argv)
  steps, freeze = (48, 16) if args.quick else (args.steps, args.freeze_step)

  mesh = jaxcomm.parallel.make_mesh()  # every device on axis "data"
  n = mesh.shape["data"]
  x, y = datasets.load_digits(return_X_y=True)
  x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  test, train = order[:360], order[360:]
  rng = np.random.default_rng(1)
  batches = [rng.choice(train, 16 * n) for _ in range(steps)]
  params0 = init_mlp(jax.random.key(0), (x.shape[1], 512, 512, 10))

  # Data-parallel Adam needs the gradients averaged first (a dense float32
  # all-reduce); 1-bit Adam does its own exchange and replaces both.
  optimizers = {
    "adam": optax.chain(jaxcomm.mean_gradients(), optax.adam(args.lr)),
    "1-bit adam": jaxcomm.onebit_adam(args.lr, freeze_step=freeze),
  }
  losses, acc = {}, {}
  for name, tx in optimizers.items():
    dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    params, opt_state = dp.init(params0)
    losses[name] = []
    for idx in batches:
      params, opt_state, metrics = dp.step(
        params, opt_state, {"x": x[idx], "y": y[idx]})
      losses[name].append(float(metrics["loss"]))
    pred = jnp.argmax(jax.jit(logits_of)(params, x[test]), -1)
    acc[name] = float(jnp.mean(pred == y[test]))

  print(f"MLP on {n} devices, 1-bit exchange from step {freeze}")
  every = max(1, steps // 6)
  print(f" step   adam   1-bit adam   (train loss, mean of {every} steps)")
  for t in range(every, steps + 1, every):
    a, b = (np.mean(losses[k][t - every:t]) for k in optimizers)
    print(f"{t:5d}  {a:.3f}        {b:.3f}")
  print(f"held-out accuracy: adam {acc['adam']:.3f}, 1-bit adam "
        f"{acc['1-bit adam']:.3f}")

  # Bytes per device per step, as each optimizer states them (the test
  # suite checks these claims against the compiled programs): the warm-up
  # moves the dense mean, the 1-bit steps about 2 bits per value.
  def sent(tx, step=None):
    return jaxcomm.wire.summarize(
      jaxcomm.wire.claimed(tx, params0, n, step=step), n).total_sent

  onebit = optimizers["1-bit adam"]
  dense = sent(jaxcomm.mean_gradients())
  print(f"bytes per device per step: adam {dense:,.0f}; 1-bit adam "
        f"{sent(onebit, 0):,.0f} in the warm-up, {sent(onebit, freeze):,.0f}"
        f" after: {dense / sent(onebit, freeze):.1f}x fewer")
  first = np.mean(losses["1-bit adam"][:5])
  print(f"loss: {first:.3f} -> {np.mean(losses['1-bit adam'][-5:]):.3f}")


if __name__ == "__main__":
  main()
