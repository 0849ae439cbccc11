"""Your own compressor: a scaled-sign codec in about 30 lines.

A jaxcomm compressor is a codec: a frozen dataclass deriving
``jaxcomm.CodecBase`` with an ``apply`` (encode, exchange, decode) and a
``wire`` (the collectives it issues, in bytes). ``jaxcomm.compressed(codec)``
turns it into an Optax transformation with everything the built-in ones
have: the leaf policy and buckets, error feedback, the dense phase, the
non-finite checks and the per-device state ``DataParallel`` lays out.

The codec here sends, for each value, its sign, packed 32 to a ``uint32``
word, and for each leaf one scale (the mean absolute value, so the signs
keep the leaf's l1 norm, as EF-signSGD does); every device gathers all the
messages and averages their decoded values. The script trains an MLP on
scikit-learn's 8x8 digits with it, checks that the bytes it claims are
what the compiled step moves, and shows error feedback at work: what the
optimizer applied plus what the devices still hold in their residuals adds
up to the gradients they computed. Run it with::

  python examples/custom_codec.py            # 300 steps
  python examples/custom_codec.py --quick    # a short run

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
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn import datasets  # noqa: E402

import jaxcomm  # noqa: E402

BITS = jnp.arange(32, dtype=jnp.uint32)


@dataclasses.dataclass(frozen=True)
class ScaledSignCodec(jaxcomm.CodecBase):
  """Signs packed 32 to a word, one mean-|x| scale per leaf, all-gathered.

  ``x`` is one bucket: the compressed leaves of the gradient (error
  feedback added) laid end to end as a flat float32 array; ``ctx.layout``
  says where each leaf lies in it.
  """

  name = "scaled_sign"

  def apply(self, x, state, ctx):
    lay, size = ctx.layout, x.shape[0]
    scale = lay.reduce(lambda v: jnp.mean(jnp.abs(v), axis=-1), x)
    bits = jnp.pad(x >= 0, (0, -size % 32)).reshape(-1, 32)
    words = jnp.sum(bits.astype(jnp.uint32) << BITS, axis=1)  # disjoint bits
    message = jnp.concatenate(
      [words, jax.lax.bitcast_convert_type(scale, jnp.uint32)])
    # One all-gather of every device's message (typed as the same value on
    # every device, as the averaged update must be).
    gathered = jaxcomm.collectives.all_gather(message, ctx.axis_name)

    def decode(msg):
      signs = ((msg[:words.size, None] >> BITS) & 1).reshape(-1)[:size]
      scale = jax.lax.bitcast_convert_type(msg[words.size:], jnp.float32)
      return lay.broadcast(scale) * (2.0 * signs - 1.0)

    mean = jnp.mean(jax.vmap(decode)(gathered), axis=0)
    sent = lay.broadcast(scale) * jnp.where(x >= 0, 1.0, -1.0)
    # The residual x - sent is kept by compressed() (error feedback).
    return jaxcomm.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    # An all-gather's payload is its gathered result: n messages of
    # ceil(size / 32) sign words and one scale word per leaf.
    words = -(-layout.size // 32) + layout.num_segments
    return [("all-gather", 4 * n * words)]


def scaled_sign(**options):
  """The codec as an Optax transformation (error feedback on by default)."""
  return jaxcomm.compressed(ScaledSignCodec(), **options)


# ------------------------------------------------------------- training --

def init_mlp(key, sizes=(64, 256, 256, 10)):
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) * m ** -0.5,
           "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def loss_fn(params, batch):
  x = batch["x"]
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  logits = x @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["y"]).mean()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--lr", type=float, default=0.2)
  ap.add_argument("--quick", action="store_true",
                  help="a short run (the test suite's)")
  args = ap.parse_args(argv)
  steps = 60 if args.quick else args.steps

  mesh = jaxcomm.parallel.make_mesh()  # every device on axis "data"
  n = mesh.shape["data"]
  x, y = datasets.load_digits(return_X_y=True)
  x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
  rng = np.random.default_rng(0)

  # Every leaf compressed (min_size=0: the biases too), so that the
  # conservation check below covers the whole model; plain SGD after.
  compressor = scaled_sign(policy=jaxcomm.LeafPolicy(min_size=0))
  tx = optax.chain(compressor, optax.sgd(args.lr))
  dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
  params0 = init_mlp(jax.random.key(0))
  params, opt_state = dp.init(params0)

  # The mean of the devices' gradients: the gradient of the loss on the
  # whole batch (each device's loss is a mean over as many rows).
  full_grad = jax.jit(jax.grad(loss_fn))
  grad_sum = jax.tree.map(lambda p: np.zeros(p.shape), params0)
  first = None
  for step in range(steps):
    idx = rng.choice(len(x), 32 * n)
    batch = {"x": x[idx], "y": y[idx]}
    g = jax.device_get(full_grad(params, batch))
    grad_sum = jax.tree.map(lambda s, v: s + v, grad_sum, g)
    params, opt_state, metrics = dp.step(params, opt_state, batch)
    loss = float(metrics["loss"])
    first = loss if first is None else first
    if (step + 1) % (steps // 4) == 0:
      print(f"step {step + 1:4d}  train loss {loss:.3f}")

  # Bytes: the codec's claim against the compiled step's collectives.
  claim = jaxcomm.wire.summarize(
    jaxcomm.wire.claimed(compressor, params0, n), n, params=params0)
  compiled = jaxcomm.wire.report(dp.lower(params, opt_state, batch).compile(),
                                 params0)
  print(f"bytes per device per step: claimed {claim.total_sent:,.0f}, "
        f"compiled {compiled.total_sent:,.0f}, dense "
        f"{compiled.dense_sent:,.0f}: {compiled.ratio:.1f}x fewer")

  # Error feedback conserves the gradient: summed over the steps, what SGD
  # applied (params0 - params) / lr plus the devices' mean residual equals
  # the sum of the mean gradients, up to float32 rounding.
  applied = jax.tree.map(
    lambda a, b: (np.asarray(a, np.float64) - np.asarray(b)) / args.lr,
    params0, jax.device_get(params))
  state = jaxcomm.compress_states(opt_state)[0]
  # Per leaf, [n, *shape]: one residual per device.
  residual = jaxcomm.spec_of(compressor).leaves_of(state.residual, params0)
  flat = lambda t: np.concatenate([np.ravel(v) for v in jax.tree.leaves(t)])
  total = flat(grad_sum)
  held = np.concatenate([np.ravel(np.mean(np.asarray(r), 0))
                         for r in residual])
  gap = np.linalg.norm(flat(applied) - total) / np.linalg.norm(total)
  kept = np.linalg.norm(flat(applied) + held - total) / np.linalg.norm(total)
  print(f"error feedback: applied updates alone differ from the summed "
        f"gradients by {gap:.1%}; with the residuals by {kept:.1e}")
  print(f"loss: {first:.3f} -> {loss:.3f}")


if __name__ == "__main__":
  main()
