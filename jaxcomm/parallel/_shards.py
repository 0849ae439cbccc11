"""Compression inside a jit step over a sharded model: manual over the data
axes only, the model axes (FSDP, tensor) left to the compiler, and the
optimizer run on each device's own shards.

The train step is ``jax.jit(jax.shard_map(step, axis_names=<data axes>))``:
``loss_fn`` sees whole (logical) arrays and the compiler partitions it over
the auto axes as it would without jaxcomm. The gradient then enters
:func:`update_on_shards`, a nested ``shard_map`` manual over the auto axes:
``tx.update`` sees the device's block of every leaf (as in block mode), its
collectives run over the data axes only, and its per-device state is the
state of that block. Nothing gathers a gradient over the fast axes.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxcomm import _codec
from jaxcomm import _local_engine
from jaxcomm import _stages
from jaxcomm.parallel import _layout
from jaxcomm.parallel._placement import _data_size


def check_auto_axes(mesh, axis_name, auto_axes) -> tuple:
  """``auto_axes`` as a tuple, checked against ``mesh`` and the data axes.

  Every mesh axis must be a data axis or an auto axis: the step is manual
  over the first and leaves the second to the compiler; an axis that is
  neither would have no meaning in it.
  """
  if isinstance(auto_axes, str):
    auto_axes = (auto_axes,)
  try:
    auto_axes = tuple(auto_axes)
  except TypeError:
    raise ValueError(f"auto_axes must be a mesh axis name or a tuple of "
                     f"them, got {auto_axes!r}") from None
  names = _layout._names(axis_name)
  _data_size(mesh, axis_name)
  for a in auto_axes:
    if not isinstance(a, str) or a not in mesh.shape:
      raise ValueError(
        f"auto_axes: {a!r} is not an axis of the mesh {dict(mesh.shape)}")
    if a in names:
      raise ValueError(
        f"auto_axes: {a!r} is also a data axis (axis_name={axis_name!r}); "
        "an axis is either split over the batch and averaged by the "
        "compressor (axis_name) or left to the compiler for the model "
        "(auto_axes), not both")
  if len(set(auto_axes)) != len(auto_axes):
    raise ValueError(f"auto_axes names an axis twice: {auto_axes!r}")
  rest = [a for a in mesh.axis_names if a not in names and a not in auto_axes]
  if rest:
    raise ValueError(
      f"auto_axes: mesh axes {rest} are neither data axes (axis_name="
      f"{axis_name!r}) nor auto axes {auto_axes!r}: name each one in "
      "auto_axes (left to the compiler, e.g. FSDP or tensor axes), or leave "
      "auto_axes out for block mode (every model axis manual, loss_fn on "
      "the device's blocks)")
  for a in auto_axes:
    kind = _axis_type(mesh, a)
    if kind is not None and kind == jax.sharding.AxisType.Manual:
      raise ValueError(f"auto_axes: mesh axis {a!r} is already Manual")
  return auto_axes


def _axis_type(mesh, name):
  types = getattr(mesh, "axis_types", None)
  if types is None:
    return None
  return dict(zip(mesh.axis_names, types)).get(name)


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _typed_as(tree, specs):
  """``tree`` (traced arrays) with each leaf's sharding type over the
  mesh's Explicit axes that of its spec in ``specs``.

  On a mesh with Explicit axes (``jax.make_mesh``'s default) an array's
  type carries its sharding over them, and ``jax.shard_map`` refuses an
  input typed otherwise than its ``in_specs`` (JAX 0.12; 0.10 let it
  through). The copies :func:`expand` broadcasts are typed replicated
  while the update on shards splits them over the auto axes; a gradient
  or state the compiler typed another way gets the same move. Auto axes
  are left to the compiler (resharding may not name them), and a leaf
  already typed as its spec is passed unchanged.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = {a for a in mesh.axis_names
              if _axis_type(mesh, a) == jax.sharding.AxisType.Explicit}
  if not explicit:
    return tree

  def one(x, sp):
    want = _layout.restrict(sp, explicit)
    have = getattr(jax.typeof(x).sharding, "spec", None)
    if have is not None and _layout.restrict(have, explicit) == want:
      return x
    return jax.sharding.reshard(x, want)
  # Specs first: a spec may cover a subtree (in_specs are tree prefixes).
  return jax.tree.map(lambda sp, sub: jax.tree.map(lambda x: one(x, sp), sub),
                      specs, tree, is_leaf=_is_spec)


def update_on_shards(tx, layout, specs, axis_name, auto_axes, mesh=None):
  """The update of a sharded step, run on each device's own shards.

  For a step manual over the data axes only (``jax.shard_map(...,
  axis_names=set(data axes))``): ``tx.update`` and the updates applied on
  each device's own shards of every leaf.

  Every device compresses its own block of each leaf: top-k keeps its
  ratio per block, quantizers and signs scale per block. Compressors are
  told how each leaf is split (``Layout.splits``, from ``specs``): PowerSGD
  uses it to take the low rank of the whole matrix (its ``sharded``
  argument). A leaf replicated over an auto axis (a bias, a
  norm scale) is compressed on every device of that axis from the same
  slice gradient and the copies' results averaged (an all-reduce of that
  leaf over the fast axis, where the plain step all-reduces its gradient
  over every device).

  Args:
    tx: the optimizer.
    layout: :func:`state_layout` of ``tx`` for these params, ``specs`` and
      ``auto_axes``.
    specs: the params' PartitionSpecs (:func:`param_specs`), over
      ``auto_axes`` only.
    axis_name: the data axis or axes (manual in the calling step).
    auto_axes: the mesh axes left to the compiler.
    mesh: the mesh (default: the step's).

  Returns:
    ``update(grads, state, params, **extra) -> (new_params, new_state)``:
    ``grads`` and ``params`` are the whole (logical) arrays the step sees,
    ``state`` the state as the step's ``in_specs`` (:func:`state_specs`
    with ``auto_axes``) give it; ``extra`` (e.g. ``value=`` the loss for a
    local-update optimizer) is passed to ``tx.update`` unchanged.
  """
  keep = set(auto_axes)
  inner_state = jax.tree.map(
    lambda b: _layout.restrict(_layout._leaf_spec(b, axis_name), keep),
    layout)
  specs = jax.tree.map(lambda sp: _layout.restrict(sp, keep), specs,
                       is_leaf=_is_spec)
  wide = _layout.expand_specs(specs, auto_axes)

  copies = _layout.copied(specs, auto_axes)

  def on_block(grads, state, params, extra):
    # A copy of a replicated leaf is the leaf itself: its own shape.
    local = _layout.to_local(state, layout)
    params = _layout.own(params, copies)
    splits = _layout.shard_splits(specs, jax.sharding.get_abstract_mesh())
    with _codec.block_splits(splits), _stages.one_model(axis_name):
      updates, new = tx.update(_layout.own(grads, copies), local, params,
                               **extra)
    new_params = _local_engine.apply_updates(params, updates, new)
    new_params = jax.tree.map(lambda x, c: x[None] if c else x, new_params,
                              copies)
    return new_params, _layout.to_global(new, layout)

  def update(grads, state, params, **extra):
    m = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    mapped = jax.shard_map(
      on_block, mesh=jax.sharding.get_abstract_mesh(),
      in_specs=(wide, inner_state, wide, P()),
      out_specs=(wide, inner_state), axis_names=keep)
    new_params, new_state = mapped(
      _typed_as(_layout.expand(grads, specs, m, auto_axes), wide),
      _typed_as(state, inner_state),
      _typed_as(_layout.expand(params, specs, m, auto_axes), wide), extra)
    return _layout.contract(new_params, specs, m, auto_axes), new_state

  return update
