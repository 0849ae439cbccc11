"""A small decoder-only transformer language model (Flax NNX) with logical
axis names, for training with FSDP / tensor parallelism inside a slice.

Token and position embeddings, ``num_layers`` pre-norm blocks (RMSNorm,
causal multi-head self-attention, RMSNorm, GELU MLP), a final RMSNorm and a
head tied to the token embedding. Every parameter has logical axes
(:data:`LOGICAL_AXES`); :func:`partition_specs` maps them to mesh axes with
rules such as MaxText's (``embed`` over ``fsdp``, ``mlp`` and ``heads``
over ``tensor``), dropping mesh axes the mesh does not have.

References:
  Vaswani et al., `Attention Is All You Need
  <https://arxiv.org/abs/1706.03762>`_, 2017; Radford et al., GPT-2, 2019.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Logical axes of each parameter, by its name in the module tree.
LOGICAL_AXES = {
  "tokens": ("vocab", "embed"),
  "positions": (None, "embed"),
  "wq": ("embed", "heads"),
  "wk": ("embed", "heads"),
  "wv": ("embed", "heads"),
  "wo": ("heads", "embed"),
  "w_in": ("embed", "mlp"),
  "w_out": ("mlp", "embed"),
  "scale": (None,),
}

# Logical axis -> mesh axis (MaxText-style FSDP + tensor parallelism).
RULES = {"embed": "fsdp", "mlp": "tensor", "heads": "tensor", "vocab": None}


def _init(rngs, shape, scale):
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32)
                   * scale)


class _RMSNorm(nnx.Module):
  def __init__(self, dim: int):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    norm = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * norm * self.scale[...]).astype(x.dtype)


class _Block(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, d_ff: int, rngs):
    s = d_model ** -0.5
    self.num_heads = num_heads
    self.norm_attn = _RMSNorm(d_model)
    self.wq = _init(rngs, (d_model, d_model), s)
    self.wk = _init(rngs, (d_model, d_model), s)
    self.wv = _init(rngs, (d_model, d_model), s)
    self.wo = _init(rngs, (d_model, d_model), s)
    self.norm_mlp = _RMSNorm(d_model)
    self.w_in = _init(rngs, (d_model, d_ff), s)
    self.w_out = _init(rngs, (d_ff, d_model), d_ff ** -0.5)

  def __call__(self, x):
    b, t, d = x.shape
    h = self.num_heads
    y = self.norm_attn(x)
    split = lambda z: z.reshape(b, t, h, d // h)
    q, k, v = (split(y @ w[...]) for w in (self.wq, self.wk, self.wv))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // h) ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    x = x + att.reshape(b, t, d) @ self.wo[...]
    y = self.norm_mlp(x)
    return x + jax.nn.gelu(y @ self.w_in[...]) @ self.w_out[...]


class TransformerLM(nnx.Module):
  """Decoder-only transformer: int tokens ``(batch, time)`` to logits
  ``(batch, time, vocab)``.

  Args:
    vocab_size: number of distinct tokens.
    d_model: width of the residual stream (divisible by ``num_heads``).
    num_heads: attention heads.
    num_layers: blocks.
    d_ff: MLP hidden width.
    max_len: longest sequence (learned position embeddings).
    rngs: parameter initialisation RNGs.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = TransformerLM(vocab_size=50, d_model=32, num_heads=4,
    ...                       num_layers=1, d_ff=64, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 50)
  """

  def __init__(self, vocab_size: int = 128, d_model: int = 128,
               num_heads: int = 4, num_layers: int = 2, d_ff: int = 512,
               max_len: int = 256, *, rngs: nnx.Rngs):
    if d_model % num_heads:
      raise ValueError(f"d_model={d_model} must be divisible by "
                       f"num_heads={num_heads}")
    if num_layers < 1:
      raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    self.num_layers = num_layers
    self.tokens = _init(rngs, (vocab_size, d_model), 0.02)
    self.positions = _init(rngs, (max_len, d_model), 0.02)
    for i in range(num_layers):
      setattr(self, f"block_{i}", _Block(d_model, num_heads, d_ff, rngs))
    self.norm = _RMSNorm(d_model)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    table = self.tokens[...]
    # The lookup as a one-hot matmul (as MaxText's iota embedding): XLA's
    # SPMD partitioner aborts on a gather from a table split over an auto
    # axis inside a shard_map manual over another axis (XLA on JAX 0.10).
    onehot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
    x = onehot @ table + self.positions[...][:t][None]
    for i in range(self.num_layers):
      x = getattr(self, f"block_{i}")(x)
    return self.norm(x) @ self.tokens[...].T


def _leaf_name(path) -> str:
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  names = [n for n in names if isinstance(n, str) and n != "value"]
  return names[-1]


def partition_specs(params, mesh_axes, rules=None):
  """Each parameter's ``PartitionSpec`` from its logical axes and ``rules``
  (default :data:`RULES`), naming only mesh axes in ``mesh_axes``."""
  rules = RULES if rules is None else rules

  def spec(path, _):
    logical = LOGICAL_AXES[_leaf_name(path)]
    return P(*[rules.get(a) if rules.get(a) in mesh_axes else None
               for a in logical])

  return jax.tree_util.tree_map_with_path(spec, params)


def sharded(mesh, rngs=0, rules=None, **config):
  """A :class:`TransformerLM` split over ``mesh`` by its logical axes:
  ``(loss_fn, params, specs)``, with ``params`` placed by ``NamedSharding``
  (:func:`partition_specs`) and ``loss_fn(params, {"x", "y"})`` the mean
  next-token cross-entropy on whole arrays (no collective in it)."""
  if not isinstance(rngs, nnx.Rngs):
    rngs = nnx.Rngs(rngs)
  graphdef, params = nnx.split(TransformerLM(**config, rngs=rngs), nnx.Param)
  specs = partition_specs(params, mesh.axis_names, rules)
  placed = jax.tree.map(
    lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), params, specs,
    is_leaf=lambda x: isinstance(x, P))

  def loss_fn(p, batch):
    logits = nnx.merge(graphdef, p)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()

  return loss_fn, placed, specs
