"""The models :mod:`jaxcomm.aot` compiles, abstract (no array is
allocated): the repository's transformer LM at named sizes and the tier's
MLP, with their params sharded over a mesh's model axes."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# ------------------------------------------------------------ the models --

# The transformer LM at named sizes (``models.transformer.TransformerLM``):
# d_model, heads, layers, d_ff, vocab, sequence, global batch.
SIZES = {
  "small": dict(d_model=512, num_heads=8, num_layers=4, d_ff=2048,
                vocab_size=8192, max_len=512, batch=16),
  "124m": dict(d_model=768, num_heads=12, num_layers=12, d_ff=3072,
               vocab_size=50304, max_len=1024, batch=16),
  "350m": dict(d_model=1024, num_heads=16, num_layers=24, d_ff=4096,
               vocab_size=50304, max_len=1024, batch=16),
  "1b": dict(d_model=2048, num_heads=16, num_layers=18, d_ff=8192,
             vocab_size=50304, max_len=1024, batch=16),
}


def transformer(mesh: Mesh, size: str = "small", data_axes=("dcn",),
                batch: int | None = None):
  """The repository's transformer LM at a named size, abstract.

  Nothing is allocated: the params are ``jax.ShapeDtypeStruct`` leaves
  sharded over ``mesh``'s model axes by the model's logical rules. Needs
  the repository's ``models`` package (run from the repository root).

  Args:
    mesh: the mesh to shard over.
    size: a key of :data:`SIZES` (``"small"``, ``"124m"``, ``"350m"``,
      ``"1b"``).
    data_axes: the mesh axes that are data axes; every other axis is a
      model axis the params are split over.
    batch: sequences in the global batch (None: the size's).

  Returns:
    ``(loss_fn, params, batch)``: ``loss_fn(params, batch)`` the mean
    next-token cross-entropy, the abstract params, and an abstract token
    batch ``{"x", "y"}`` split over all of ``mesh``'s axes.

  Raises:
    ValueError: when ``size`` is unknown, or the ``models`` package cannot
      be imported.
  """
  if size not in SIZES:
    raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
  try:
    tmod = importlib.import_module("models.transformer")
  except ImportError as e:
    raise ValueError(
      "model 'transformer' needs the repository's models package: run "
      "from the repository root") from e
  cfg = dict(SIZES[size])
  batch_size = cfg.pop("batch")
  if batch is not None:
    batch_size = int(batch)
  return lm(mesh, cfg, batch_size, data_axes, tmod)


def lm(mesh: Mesh, cfg: dict, batch_size: int, data_axes=("dcn",),
       tmod=None):
  """:func:`transformer` at any config: ``cfg`` holds the
  ``TransformerLM`` arguments (no RNGs), ``tmod`` the imported
  ``models.transformer`` (None: imported here)."""
  from flax import nnx
  if tmod is None:
    tmod = importlib.import_module("models.transformer")
  model = nnx.eval_shape(lambda: tmod.TransformerLM(**cfg,
                                                    rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)
  model_axes = [a for a in mesh.axis_names if a not in data_axes]
  specs = tmod.partition_specs(params, model_axes)
  params = jax.tree.map(
    lambda x, sp: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, sp)),
    params, specs, is_leaf=lambda x: isinstance(x, P))

  def loss_fn(p, batch):
    logits = nnx.merge(graphdef, p)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()

  tokens = jax.ShapeDtypeStruct(
    (batch_size, cfg["max_len"]), jnp.int32,
    sharding=NamedSharding(mesh, P(tuple(mesh.axis_names))))
  return loss_fn, params, {"x": tokens, "y": tokens}


def mlp(mesh: Mesh, dim: int = 1024, batch: int = 64, model_axis="fsdp"):
  """A two-layer MLP of ``8 dim^2 + dim`` params, abstract.

  ``w1 (dim, 4 dim)`` is split over ``model_axis`` by rows, ``w2`` by
  columns, and the bias replicated; nothing is allocated.

  Args:
    mesh: the mesh to shard over; it has an axis ``model_axis``.
    dim: the model width.
    batch: rows in the global batch, split over all of ``mesh``'s axes.
    model_axis: the mesh axis the weights are split over.

  Returns:
    ``(loss_fn, params, batch)``: ``loss_fn(params, batch)`` the mean
    squared error, the params as ``jax.ShapeDtypeStruct`` leaves with
    ``NamedSharding``, and an abstract batch ``{"x", "y"}``.

  Examples:
    >>> import jaxcomm, jaxcomm.aot
    >>> mesh = jaxcomm.parallel.make_mesh(4, model=2, model_axis="fsdp")
    >>> loss_fn, params, batch = jaxcomm.aot.mlp(mesh, dim=16, batch=8)
    >>> params["w1"].shape, tuple(params["w1"].sharding.spec)
    ((16, 64), ('fsdp', None))
  """
  sh = lambda *s: NamedSharding(mesh, P(*s))
  params = {
    "w1": jax.ShapeDtypeStruct((dim, 4 * dim), jnp.float32,
                               sharding=sh(model_axis, None)),
    "w2": jax.ShapeDtypeStruct((4 * dim, dim), jnp.float32,
                               sharding=sh(None, model_axis)),
    "b": jax.ShapeDtypeStruct((dim,), jnp.float32, sharding=sh())}
  data = jax.ShapeDtypeStruct((batch, dim), jnp.float32,
                              sharding=sh(tuple(mesh.axis_names), None))

  def loss_fn(p, b):
    h = jax.nn.gelu(b["x"] @ p["w1"]) @ p["w2"] + p["b"]
    return jnp.mean((h - b["y"]) ** 2)

  return loss_fn, params, {"x": data, "y": data}
