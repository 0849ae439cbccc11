"""A Flax NNX transformer trained with FSDP on a pod mesh, int8 across slices.

A pod has two kinds of links: fast ones between the chips of a slice and
slow ones (the data-center network, "dcn") between slices. This script
trains a small character-level transformer language model on the English
help text that ships with Python, on a ``(dcn=2, fsdp=4)`` mesh: the
parameters are split over ``fsdp`` inside each slice (the compiler gathers
and reduces them there, as a MaxText-style trainer lets it), and only the
gradient exchange between the two slices is compressed, to int8 codes with
error feedback (``jaxcomm.int8(axis_name="dcn")``).

It prints the training and held-out loss as they fall, then the bytes each
device sends across ``dcn`` per step, read from the compiled step, next to
what a dense float32 mean of the same shards would send. Run it with::

  python examples/nnx_fsdp_int8.py            # 300 steps, about 2 minutes
  python examples/nnx_fsdp_int8.py --quick    # a short run

It runs on 8 simulated CPU devices unless ``JAX_PLATFORMS`` names another
platform (e.g. ``JAX_PLATFORMS=cuda`` on a machine with 8 GPUs).
``train.py --mesh dcn=2,fsdp=4 --model transformer --compressor int8``
trains the same way from the command line.
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
import pydoc_data.topics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402

VOCAB = 128  # ASCII: each byte of the text is a token


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
    self.proj = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, use_bias=False, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    split = lambda z: z.reshape(b, t, self.heads, d // self.heads)
    att = jax.nn.dot_product_attention(split(q), split(k), split(v),
                                       is_causal=True)
    x = x + self.proj(att.reshape(b, t, d))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class CharTransformer(nnx.Module):
  """Tokens ``(batch, time)`` to next-token logits ``(batch, time, VOCAB)``."""

  def __init__(self, dim: int, heads: int, layers: int, seq_len: int,
               rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Param(init(rngs.params(), (VOCAB, dim)))
    self.pos = nnx.Param(init(rngs.params(), (seq_len, dim)))
    self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
    self.norm = nnx.RMSNorm(dim, rngs=rngs)

  def __call__(self, tokens):
    # The lookup as a one-hot matmul: a gather from a table split over an
    # auto axis inside a shard_map manual over another axis is what XLA's
    # partitioner cannot do; a matmul it partitions like any other.
    x = jax.nn.one_hot(tokens, VOCAB) @ self.embed[...] + self.pos[...]
    for block in self.blocks:
      x = block(x)
    return self.norm(x) @ self.embed[...].T  # head tied to the embedding


def fsdp_spec(x, fsdp: int):
  """FSDP: a matrix split by rows over ``fsdp``; vectors replicated."""
  if x.ndim >= 2 and x.shape[0] % fsdp == 0:
    return P("fsdp", *([None] * (x.ndim - 1)))
  return P()


def text_tokens():
  """Python's own help text (``pydoc_data``) as ASCII byte tokens."""
  topics = pydoc_data.topics.topics
  text = "\n".join(topics[k] for k in sorted(topics))
  return np.frombuffer(text.encode("ascii", "replace"), np.uint8).astype(
    np.int32)


def batches(tokens, batch: int, seq_len: int, seed: int):
  """Endless batches of random windows: inputs and the next tokens."""
  rng = np.random.default_rng(seed)
  while True:
    start = rng.integers(0, len(tokens) - seq_len - 1, batch)
    idx = start[:, None] + np.arange(seq_len + 1)
    window = tokens[idx]
    yield {"x": window[:, :-1], "y": window[:, 1:]}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--quick", action="store_true",
                  help="a short run (the test suite's)")
  ap.add_argument("--lr", type=float, default=3e-3)
  args = ap.parse_args(argv)
  steps = 30 if args.quick else args.steps
  seq_len, batch = 64, 32

  # The pod mesh: 2 slices ("dcn", the slow link) of 4 devices ("fsdp").
  if jax.device_count() < 8:
    raise SystemExit(f"needs 8 devices, found {jax.device_count()}")
  mesh = jax.make_mesh((2, 4), ("dcn", "fsdp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:8])

  # The model's parameters as a pytree (an nnx.State), placed by
  # NamedSharding: matrices split over fsdp, vectors replicated.
  model = CharTransformer(dim=64, heads=4, layers=2, seq_len=seq_len,
                          rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  specs = jax.tree.map(lambda x: fsdp_spec(x, mesh.shape["fsdp"]), params)
  params = jax.tree.map(
    lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), params, specs)
  n_params = sum(x.size for x in jax.tree.leaves(params))

  def loss_fn(params, batch):
    # On whole (logical) arrays: no collective written by hand.
    logits = nnx.merge(graphdef, params)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()

  # int8 codes only across slices; Adam after the exchange. The step is
  # manual over "dcn" and leaves "fsdp" to the compiler (auto_axes); each
  # device compresses its own shards of the gradient.
  compressor = jaxcomm.int8(axis_name="dcn")
  tx = optax.chain(compressor, optax.adam(args.lr))
  dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh, axis_name="dcn",
                                     auto_axes=("fsdp",))
  params, opt_state = dp.init(params)  # shardings kept

  tokens = text_tokens()
  cut = int(0.9 * len(tokens))
  train = batches(tokens[:cut], batch, seq_len, seed=0)
  held_out = jax.device_put(  # split over every device, as a batch is
    next(batches(tokens[cut:], 256, seq_len, seed=1)),
    NamedSharding(mesh, P(("dcn", "fsdp"))))
  eval_loss = jax.jit(loss_fn)
  print(f"{n_params:,} params on a (dcn=2, fsdp=4) mesh; {steps} steps of "
        f"{batch} x {seq_len} characters")

  t0 = time.perf_counter()
  evals = []
  for step in range(steps):
    params, opt_state, metrics = dp.step(params, opt_state, next(train))
    if step % max(1, steps // 6) == 0 or step == steps - 1:
      evals.append(float(eval_loss(params, held_out)))
      print(f"step {step:4d}  train loss {float(metrics['loss']):.3f}  "
            f"held-out {evals[-1]:.3f}")
  print(f"{steps} steps in {time.perf_counter() - t0:.1f} s")

  # Bytes across slices, from the compiled step: the collectives over
  # groups of 2 devices (one per slice) are the dcn exchange; the groups
  # of 4 are FSDP's own, inside a slice.
  compiled = dp.lower(params, opt_state, next(train)).compile()
  across = sum(jaxcomm.wire.sent_bytes(op.kind, op.payload, op.group)
               for op in jaxcomm.wire.collectives(compiled) if op.group == 2)
  # What a dense float32 mean of the same shards sends (its claim), and
  # int8's own claim, from one device's shards of the params.
  shards = jaxcomm.parallel.shard_shapes(params, specs, mesh)
  splits = jaxcomm.parallel.shard_splits(specs, mesh)

  def claim(tx):
    return jaxcomm.wire.summarize(jaxcomm.wire.claimed(
      tx, shards, 2, splits=splits), 2).total_sent

  dense = claim(jaxcomm.mean_gradients(axis_name="dcn"))
  print(f"bytes a device sends across dcn per step: int8 {across:,.0f} "
        f"(claimed {claim(compressor):,.0f}), dense f32 {dense:,.0f}: "
        f"{dense / across:.2f}x fewer")
  print(f"loss: {evals[0]:.3f} -> {evals[-1]:.3f} (held-out)")


if __name__ == "__main__":
  main()
