"""The TPU tier's shape family: abstract models whose shapes no method's
own test chose, drawn with a fixed seed so a failure reproduces.

Each model is ``(loss_fn, params, batch)`` on a ``(dcn, fsdp)`` mesh, the
params ``jax.ShapeDtypeStruct`` leaves with ``NamedSharding`` (a leaf
split over ``fsdp`` where a dimension divides by its size, else
replicated), the loss on whole arrays (the sharded step,
``auto_axes=("fsdp",)``):

* ``odd``: an MLP whose sizes are multiples of neither 8 nor 128 (the
  split dimension 4 times an odd number), so its leaves share no block
  width (the shape that took onebit to 60x the plain step's memory);
* ``small_leaves``: a few hundred leaves of a few hundred values, 1-D
  and 2-D, replicated;
* ``vectors``: 1-D params only, one of them split;
* ``bf16``: ``odd`` with bfloat16 params and data;
* ``conv``: a convolutional net (3x3 kernels, odd channel counts);
* ``transformer``: the repository's transformer LM at a width that is not
  a multiple of 128 (``models.transformer``);
* ``mixed``: odd sizes, 1-D leaves, a bfloat16 leaf and a hundred small
  leaves in one model (the model ``make test`` compiles on);
* ``odd_6m`` (not in :data:`FAMILY`): ``odd`` at 6.1M params, fixed sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import _aot_models

SEED = 48
FAMILY = ("odd", "small_leaves", "vectors", "bf16", "conv", "transformer",
          "mixed")
# Beside the family (benchmarks/tpu_shapes.py): the 6.1M MLP of odd sizes
# that took onebit to 42x the plain step's memory, w1 (1003, 6124).
MODELS = FAMILY + ("odd_6m",)
BATCH = 64


def _odd(rng, lo, hi):
  """An odd number in ``[lo, hi)`` that is not a multiple of 8 or 128."""
  return int(rng.integers(lo // 2, hi // 2)) * 2 + 1


def _leaf(mesh, shape, dtype=jnp.float32, split=None):
  spec = [None] * len(shape)
  if split is not None:
    spec[split] = "fsdp"
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=NamedSharding(mesh, P(*spec)))


def _data(mesh, shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(
      mesh, P(tuple(mesh.axis_names), *([None] * (len(shape) - 1)))))


def _features(x, size):
  """``size`` values read from the batch's mean row, cycled (static)."""
  v = jnp.mean(x.astype(jnp.float32), axis=0).reshape(-1)
  reps = -(-size // v.shape[0])
  return jnp.tile(v, reps)[:size]


def _leaf_loss(p, x):
  """A loss every leaf enters, each through its own product with the
  batch's features: ``sum_l mean(tanh(leaf_l * f_l)^2)``."""
  total = 0.0
  for leaf in jax.tree.leaves(p):
    flat = leaf.astype(jnp.float32).reshape(-1)
    total = total + jnp.mean(jnp.tanh(flat * _features(x, flat.shape[0]))
                             ** 2)
  return total


def _mlp(mesh, rng, dtype, d_in=None, hidden=None, d_out=None):
  d_in = d_in or _odd(rng, 300, 700)
  hidden = hidden or 4 * _odd(rng, 300, 500)
  d_out = d_out or _odd(rng, 200, 500)
  params = {"w1": _leaf(mesh, (d_in, hidden), dtype, split=1),
            "b1": _leaf(mesh, (hidden,), dtype),
            "w2": _leaf(mesh, (hidden, d_out), dtype, split=0),
            "b2": _leaf(mesh, (d_out,), dtype)}

  def loss_fn(p, b):
    h = jax.nn.gelu(b["x"] @ p["w1"] + p["b1"])
    out = (h @ p["w2"] + p["b2"]).astype(jnp.float32)
    return jnp.mean((out - b["y"].astype(jnp.float32)) ** 2)

  batch = {"x": _data(mesh, (BATCH, d_in), dtype),
           "y": _data(mesh, (BATCH, d_out), dtype)}
  return loss_fn, params, batch


def _small_leaves(mesh, rng, count=300):
  params = {}
  for i in range(count):
    size = int(rng.integers(50, 500))
    if rng.random() < 0.5:
      rows = int(rng.integers(2, 12))
      shape = (rows, max(1, size // rows))
    else:
      shape = (size,)
    params[f"p{i:03d}"] = _leaf(mesh, shape)
  return params


def model(mesh, name: str, seed: int = SEED):
  """``(loss_fn, params, batch)``: the family's model ``name``."""
  if name not in MODELS:
    raise ValueError(f"name must be one of {MODELS}, got {name!r}")
  rng = np.random.default_rng([seed, MODELS.index(name)])
  if name == "odd":
    return _mlp(mesh, rng, jnp.float32)
  if name == "odd_6m":
    return _mlp(mesh, rng, jnp.float32, 1003, 4 * 1531, 997)
  if name == "bf16":
    return _mlp(mesh, rng, jnp.bfloat16)
  if name == "small_leaves":
    params = _small_leaves(mesh, rng)
    return (lambda p, b: _leaf_loss(p, b["x"]), params,
            {"x": _data(mesh, (BATCH, 61))})
  if name == "vectors":
    params = {f"v{i:02d}": _leaf(mesh, (_odd(rng, 3, 5000),))
              for i in range(12)}
    params["big"] = _leaf(mesh, (4 * _odd(rng, 20000, 60000),), split=0)
    return (lambda p, b: _leaf_loss(p, b["x"]), params,
            {"x": _data(mesh, (BATCH, 37))})
  if name == "conv":
    return _conv(mesh, rng)
  if name == "transformer":
    return _transformer(mesh, rng)
  if name == "mixed":
    loss_mlp, params, batch = _mlp(mesh, rng, jnp.float32)
    extra = _small_leaves(mesh, rng, count=100)
    extra["half"] = _leaf(mesh, (4 * _odd(rng, 1000, 3000),), jnp.bfloat16,
                          split=0)
    extra["long"] = _leaf(mesh, (_odd(rng, 20000, 40000),))
    params = {"mlp": params, "extra": extra}

    def loss_fn(p, b):
      return loss_mlp(p["mlp"], b) + _leaf_loss(p["extra"], b["x"])

    return loss_fn, params, batch
  raise ValueError(f"name must be one of {FAMILY}, got {name!r}")


def _conv(mesh, rng):
  c1, c2, c3 = _odd(rng, 9, 40), _odd(rng, 40, 80), 4 * _odd(rng, 20, 40)
  params = {"k1": _leaf(mesh, (3, 3, 3, c1)), "k2": _leaf(mesh, (3, 3, c1, c2)),
            "k3": _leaf(mesh, (3, 3, c2, c3), split=3),
            "bias": _leaf(mesh, (c3,)),
            "head": _leaf(mesh, (c3, 10), split=0)}
  dn = ("NHWC", "HWIO", "NHWC")

  def loss_fn(p, b):
    h = b["x"]
    for k, stride in (("k1", 1), ("k2", 2), ("k3", 2)):
      h = jax.lax.conv_general_dilated(h, p[k], (stride, stride), "SAME",
                                       dimension_numbers=dn)
      h = jax.nn.relu(h if k != "k3" else h + p["bias"])
    logits = jnp.mean(h, axis=(1, 2)) @ p["head"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(BATCH),
                                                  b["y"] % 10])

  return loss_fn, params, {"x": _data(mesh, (BATCH, 16, 16, 3)),
                           "y": _data(mesh, (BATCH,), jnp.int32)}


def _transformer(mesh, rng):
  heads = 4
  cfg = dict(d_model=heads * 4 * _odd(rng, 9, 15), num_heads=heads,
             num_layers=2, d_ff=4 * _odd(rng, 100, 160),
             vocab_size=4 * _odd(rng, 200, 300), max_len=32)
  return _aot_models.lm(mesh, cfg, 16)
