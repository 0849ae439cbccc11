"""Per-device optimizer state: which leaves are per device, and their
layout (a leading device axis sharded over the data axes). The specs of
params and of one device's blocks are :mod:`jaxcomm.parallel._specs`
(importable from here too)."""

from __future__ import annotations

import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import _codec
from jaxcomm import _local_engine
from jaxcomm import _stages
from jaxcomm import _vma
from jaxcomm.collectives import _core
from jaxcomm.parallel._placement import _data_size
from jaxcomm.parallel._placement import _global
from jaxcomm.parallel._resize import _check_state_tree
from jaxcomm.parallel._specs import _axes_of
from jaxcomm.parallel._specs import _copies  # noqa: F401
from jaxcomm.parallel._specs import _local_shape
from jaxcomm.parallel._specs import _names
from jaxcomm.parallel._specs import _spec_axes
from jaxcomm.parallel._specs import _with_data
from jaxcomm.parallel._specs import contract  # noqa: F401
from jaxcomm.parallel._specs import copied
from jaxcomm.parallel._specs import expand
from jaxcomm.parallel._specs import expand_specs
from jaxcomm.parallel._specs import missing_axes  # noqa: F401
from jaxcomm.parallel._specs import own
from jaxcomm.parallel._specs import param_specs
from jaxcomm.parallel._specs import restrict
from jaxcomm.parallel._specs import shard_shapes  # noqa: F401
from jaxcomm.parallel._specs import shard_splits

# ----------------------------------------------------------- state layout --

def _abstract(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def local_params(tx: optax.GradientTransformation, params) -> bool:
  """Whether ``tx`` lets params differ between devices.

  True for a local-update optimizer (:func:`jaxcomm.local_sgd`,
  :func:`jaxcomm.diloco`, ...): :class:`DataParallel` then keeps params
  per device. Nothing runs (``tx.init`` is traced abstractly).

  Args:
    tx: the optimizer.
    params: the params (arrays or ``jax.ShapeDtypeStruct`` leaves).

  Returns:
    A bool.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxcomm
    >>> params = {"w": jnp.zeros(4)}
    >>> jaxcomm.parallel.local_params(jaxcomm.local_sgd(optax.sgd(0.1), 4),
    ...                               params)
    True
    >>> jaxcomm.parallel.local_params(jaxcomm.topk(0.5), params)
    False
  """
  return bool(_local_engine.local_states(jax.eval_shape(tx.init,
                                                 _abstract(params))))




def _leaf_spec(b, axis_name) -> P:
  axes = _axes_of(b, axis_name)
  return P() if axes is None else P(axes)


def _leaf_size(b, mesh, axis_name) -> int:
  axes = _axes_of(b, axis_name)
  if axes is None:
    return 1
  names = (axes,) if isinstance(axes, str) else tuple(axes)
  return int(np.prod([mesh.shape[a] for a in names]))


def _to_union(tree, want):
  """Each leaf of ``tree`` marked varying over the axes in ``want`` (a
  frozenset per leaf) that it does not vary over yet (type only)."""
  return jax.tree.map(_vma.mark_varying, tree, want)


@contextlib.contextmanager
def _joined_branches():
  """While the layout probe traces: ``jax.lax.cond`` and ``jax.lax.switch``
  type each output as varying over every axis any branch's output varies
  over, where the real ones raise.

  Wrappers that branch on replicated counters (``optax.MultiSteps``,
  ``optax.apply_if_finite``, ``optax.skip_not_finite``) return the inner
  state unchanged in one branch and updated in the other. With the right
  layout both branches agree (a residual enters varying and leaves
  varying); the probe starts from an all-replicated guess, where they do
  not, and ``lax.cond`` would raise before the probe could say which leaves
  vary. Joined branches let it take the union and reach the fixed point;
  the real step then runs the unpatched ``lax.cond`` on the derived layout.
  """
  cond, switch = jax.lax.cond, jax.lax.switch

  def joined(branches, operands):
    want = _vma.union_varying([jax.eval_shape(b, *operands)
                               for b in branches])
    return [lambda *ops, b=b: _to_union(b(*ops), want) for b in branches]

  def joined_cond(pred, true_fun, false_fun, *operands, **kwargs):
    if "operand" in kwargs:
      operands = (kwargs.pop("operand"),)
    t, f = joined((true_fun, false_fun), operands)
    return cond(pred, t, f, *operands, **kwargs)

  def joined_switch(index, branches, *operands, **kwargs):
    if "operand" in kwargs:
      operands = (kwargs.pop("operand"),)
    return switch(index, joined(list(branches), operands), *operands,
                  **kwargs)

  jax.lax.cond, jax.lax.switch = joined_cond, joined_switch
  try:
    yield
  finally:
    jax.lax.cond, jax.lax.switch = cond, switch


def state_layout(tx: optax.GradientTransformation, params, mesh,
                 axis_name: str = "data", *, per_device_params=None,
                 specs=None, auto_axes=()):
  """Which leaves of ``tx``'s state are per device.

  Found by tracing ``tx.update`` in shard_map (no computation runs): a leaf
  is per device if the update makes it vary over ``axis_name`` given local
  gradients, replicated params and the layout found so far (iterated to a
  fixed point). Each layout leaf is ``False`` (replicated), ``True`` (one
  row per device of the data axes) or, with several data axes, the
  frozenset of those it varies over (e.g. ``{"dcn"}`` for a residual kept
  after a mean over ``"ici"``: one row per slice, replicated inside it).

  Args:
    tx: the optimizer (a chain containing jaxcomm compressors, or any
      optax transformation).
    params: the parameters (arrays or ShapeDtypeStructs).
    mesh: the mesh; ``axis_name`` must be one of its axes.
    axis_name: the data axis, or a tuple of data axes.
    per_device_params: whether params differ per device (default:
      :func:`local_params`); then the probe's params vary over the axis and
      it passes the loss as ``value``.
    specs: the params' PartitionSpecs over model axes (default:
      :func:`param_specs`); state is then the state of one device's block
      of the params, and a leaf that varies over a model axis gets one row
      per block too.
    auto_axes: for a step manual over the data axes only
      (:func:`update_on_shards`): the model axes left to the compiler; the
      state is then that of each device's own shards, with params
      replicated over an auto axis updated as one copy per device of it
      (``_specs.expand``).

  Returns:
    A tree like ``tx.init(params)`` with a ``False``, ``True`` or
    frozenset leaf per state leaf (above).

  Raises:
    ValueError: when ``axis_name`` is not an axis of ``mesh``, params hold
      Flax NNX Variables other than ``nnx.Param``, auto axes split no
      params leaf, or ``tx``'s updates differ between devices (replicated
      params would drift apart), naming the leaves.

  Examples:
    Top-k keeps a residual per device; its step counter and key are
    replicated:

    >>> import jax.numpy as jnp, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> tx = jaxcomm.topk(0.5)
    >>> layout = jaxcomm.parallel.state_layout(tx, {"w": jnp.zeros(512)},
    ...                                        mesh)
    >>> layout.residual, layout.count, layout.key
    ((True,), False, False)
  """
  n = _data_size(mesh, axis_name)
  names = _names(axis_name)
  _check_nnx_params(params, "state_layout")
  if specs is None:
    specs = param_specs(params, mesh, axis_name)
  copies = None
  specs_in = specs
  if auto_axes:
    _check_auto_axes_split(params, specs, mesh, auto_axes)
    copies = copied(specs, auto_axes)
    params = expand(_abstract(params), specs, mesh, auto_axes)
    specs = expand_specs(specs, auto_axes)
  model_axes = set()
  for sp in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
    model_axes |= _spec_axes(sp)
  watched = frozenset(names) | frozenset(model_axes)
  if per_device_params is None:
    per_device_params = local_params(tx, params)
  params_abs = _abstract(params)
  is_p = lambda x: isinstance(x, P)
  local_abs = jax.tree.map(
    lambda x, sp: jax.ShapeDtypeStruct(_local_shape(x.shape, sp, mesh),
                                       x.dtype), params_abs, specs)
  # With auto_axes the step runs tx.update inside update_on_shards, which
  # tells compressors how each leaf is split: the probe does the same.
  splits = shard_splits(specs_in, mesh) if auto_axes else None
  if splits is None:
    state_abs = jax.eval_shape(tx.init, own(local_abs, copies))
  else:
    # As init_state runs it: on each device's shards, told the splits
    # (PowerSGD decides on whole matrices and reads its model-axis index).
    def init_block(p):
      with _codec.block_splits(splits):
        return tx.init(own(p, copies))
    # Inputs typed with the specs shard_map splits them by (on a mesh of
    # Explicit axes, shard_map checks an input's sharding against them).
    placed_abs = jax.tree.map(
      lambda x, sp: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=NamedSharding(mesh, sp)),
      params_abs, specs)
    state_abs = jax.eval_shape(jax.shard_map(
      init_block, mesh=mesh, in_specs=(specs,), out_specs=P(),
      check_vma=False), placed_abs)
  leaves, treedef = jax.tree.flatten(state_abs)
  per_device = [frozenset()] * len(leaves)
  grads_abs = jax.tree.map(
    lambda x, sp: jax.ShapeDtypeStruct(
      (n,) + tuple(x.shape), x.dtype,
      sharding=NamedSharding(mesh, _with_data(sp, axis_name))),
    params_abs, specs)
  params_abs = jax.tree.map(
    lambda x, sp: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, sp)),
    params_abs, specs)
  g_specs = jax.tree.map(lambda sp: _with_data(sp, axis_name), specs,
                         is_leaf=is_p)

  def as_layout(axes: frozenset):
    # A frozenset (a pytree leaf, unlike a tuple) for a subset of axes.
    kept = frozenset(a for a in watched if a in axes)
    return True if kept == frozenset(names) else (kept or False)

  drift = []
  for _ in range(len(leaves) + 1):
    found = []
    layout = jax.tree.unflatten(treedef, [as_layout(a) for a in per_device])

    def probe(params, state, grads, layout=layout, found=found):
      grads = own(jax.tree.map(lambda g: g[0], grads), copies)
      state = to_local(state, layout)
      extra = {}
      if per_device_params:
        params = jax.tree.map(lambda g: g[0], params)
        extra = {"value": _core.pvary(jnp.zeros([], jnp.float32), axis_name)}
      params = own(params, copies)
      with _codec.block_splits(splits), _stages.one_model(axis_name):
        updates, new_state = tx.update(grads, state, params, **extra)
      found[:] = [watched & _core.varying_axes(x)
                  for x in jax.tree.leaves(new_state)]
      drift[:] = [jax.tree_util.keystr(path) for path, u in
                  jax.tree_util.tree_leaves_with_path(updates)
                  if _core.is_inexact(u)
                  and frozenset(names) & _core.varying_axes(u)]
      return jnp.zeros([], jnp.float32)

    stacked = jax.tree.unflatten(treedef, [
      jax.ShapeDtypeStruct(
        ((_leaf_size(b, mesh, axis_name),) if b else ()) + tuple(l.shape),
        l.dtype, sharding=NamedSharding(mesh, _leaf_spec(b, axis_name)))
      for l, b in zip(leaves, jax.tree.leaves(layout))])
    fn = jax.shard_map(probe, mesh=mesh,
                       in_specs=(g_specs if per_device_params else specs,
                                 state_specs(layout, axis_name), g_specs),
                       out_specs=P())
    with _joined_branches(), _core.probing():
      jax.eval_shape(fn, grads_abs if per_device_params else params_abs,
                     stacked, grads_abs)
    new = [a | b for a, b in zip(per_device, found)]
    if new == per_device:
      break
    per_device = new
  if drift and not per_device_params:
    raise ValueError(
      f"tx: its updates differ between devices ({', '.join(drift[:5])} "
      f"vary over {axis_name!r}), so replicated params would drift apart "
      "(shard_map's out_specs=P() cannot hold). Something in tx decides "
      "per device after, or instead of, the average: optax.apply_if_finite "
      "(or another lax.cond on the local gradient) wrapped around a jaxcomm "
      "compressor skips on some devices and not others, because its "
      "predicate reads each device's own gradient. Put it after the "
      "compressor, where every device sees the same averaged update "
      "(non-finite on every device when any device's gradient is): "
      "optax.chain(compressor, optax.apply_if_finite(optax.sgd(lr), k)). "
      "A tx without any averaging transform needs one first (e.g. "
      "jaxcomm.mean_gradients()).")
  return jax.tree.unflatten(treedef, [as_layout(a) for a in per_device])


def _check_auto_axes_split(params, specs, mesh, auto_axes) -> None:
  """Refuses auto axes (of more than one device) that split no params
  leaf: every leaf would be replicated over them and updated as that many
  averaged copies, the work of one device done on each. Host params
  (never placed with a NamedSharding on ``mesh``) are the common cause."""
  used = set()
  for sp in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
    used |= _spec_axes(sp)
  idle = [a for a in auto_axes if mesh.shape[a] > 1 and a not in used]
  if not idle:
    return
  unplaced = [
    jax.tree_util.keystr(path)
    for path, x in jax.tree_util.tree_leaves_with_path(params)
    if not (isinstance(getattr(x, "sharding", None), NamedSharding)
            and tuple(x.sharding.mesh.axis_names) == tuple(
              mesh.axis_names))]
  sizes = {a: int(mesh.shape[a]) for a in idle}
  if unplaced and not used & set(auto_axes):
    cause = (
      f"the params are not placed on this mesh ({', '.join(unplaced[:3])}"
      f"{', ...' if len(unplaced) > 3 else ''} are host or single-device "
      "arrays, read as replicated): place them first, e.g. jax.device_put("
      "params, shardings) with NamedSharding(mesh, P('fsdp', None)) for a "
      "weight split by rows (from your logical axis rules)")
  else:
    cause = (
      "no params leaf's NamedSharding names it: split some leaves over it "
      "(NamedSharding(mesh, P(..., axis, ...))), or drop it from the mesh")
  raise ValueError(
    f"auto_axes: {sizes} split no params leaf, so every leaf would be "
    f"updated as {int(np.prod(list(sizes.values())))} averaged copies; "
    f"{cause}. To average over such an axis as data parallelism, make it a "
    "data axis instead (axis_name=(..., axis)).")


def state_specs(layout, axis_name: str = "data", *, auto_axes=()):
  """PartitionSpecs for a state laid out by :func:`state_layout`.

  Per-device leaves get ``P(axis_name)`` (or the data axes they vary
  over), replicated ones ``P()``. With ``auto_axes`` (a step manual over
  the data axes only, see :func:`update_on_shards`): the specs for that
  step's ``in_specs``, naming the data axes only; the state's sharding
  over the auto axes stays on the arrays (as :func:`init_state` placed
  them) and is left to the compiler.

  Args:
    layout: :func:`state_layout`'s tree.
    axis_name: the data axis, or a tuple of them.
    auto_axes: the model axes left to the compiler, or ``()``.

  Returns:
    A tree of ``PartitionSpec`` like ``layout``, for ``jax.shard_map``'s
    ``in_specs`` and ``out_specs``.
  """
  if auto_axes:
    keep = set(_names(axis_name))
    return jax.tree.map(
      lambda b: restrict(_leaf_spec(b, axis_name), keep), layout)
  return jax.tree.map(lambda b: _leaf_spec(b, axis_name), layout)


def _map_laid_out(fn, state, layout, who: str):
  try:
    return jax.tree.map(fn, state, layout)
  except ValueError:
    _check_state_tree(state, layout, who)  # names what does not fit
    raise


def to_local(state, layout):
  """Inside shard_map: drops the leading size-1 axis of per-device leaves.

  Args:
    state: the state as the step receives it (:func:`state_specs`).
    layout: :func:`state_layout`'s tree.

  Returns:
    The state ``tx.update`` takes, per-device leaves without their
    leading axis and the rest unchanged.

  Raises:
    ValueError: naming what does not fit when ``state`` does not have
      ``layout``'s structure.
  """
  return _map_laid_out(lambda x, b: x[0] if b else x, state, layout,
                       "to_local")


def to_global(state, layout):
  """Inside shard_map: adds the leading axis back to per-device leaves.

  Args:
    state: the state ``tx.update`` returned.
    layout: :func:`state_layout`'s tree.

  Returns:
    The state as the step returns it (:func:`state_specs`), per-device
    leaves with a leading axis of size 1.

  Raises:
    ValueError: naming what does not fit when ``state`` does not have
      ``layout``'s structure.
  """
  return _map_laid_out(lambda x, b: x[None] if b else x, state, layout,
                       "to_global")


def init_state(tx: optax.GradientTransformation, params, mesh,
               axis_name: str = "data", layout=None, specs=None, *,
               auto_axes=()):
  """``tx.init(params)`` laid out for :class:`DataParallel` on ``mesh``.

  Per-device leaves get a leading axis of one row per device (every device
  starts from the same value) sharded over the data axes they vary over;
  the rest is replicated. With params sharded over model axes (``specs``,
  default :func:`param_specs`), ``tx.init`` runs on each device's block;
  with ``auto_axes`` (see :func:`state_layout`) on each device's shards.

  Args:
    tx: the optimizer.
    params: the params (replicated over the data axes; placed with a
      ``NamedSharding`` over model axes for a sharded model).
    mesh: the mesh.
    axis_name: the data axis, or a tuple of them.
    layout: :func:`state_layout`'s tree (None: derived here).
    specs: the params' ``PartitionSpec`` tree over model axes (None:
      :func:`param_specs`).
    auto_axes: the model axes left to the compiler, or ``()``.

  Returns:
    The state as global arrays. Per-device leaves have a leading axis of
    one row per device, sharded over the data axes (every row the same
    value); the rest is replicated.

  Raises:
    ValueError: as :func:`state_layout` does when it derives the layout,
      and for Flax NNX Variables other than ``nnx.Param`` in ``params``.

  Examples:
    >>> import jax.numpy as jnp, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> state = jaxcomm.parallel.init_state(jaxcomm.topk(0.5),
    ...                                     {"w": jnp.zeros(512)}, mesh)
    >>> state.residual[0].shape                    # one row per device
    (8, 512)
  """
  _check_nnx_params(params, "init_state")
  if specs is None:
    specs = param_specs(params, mesh, axis_name)
  if layout is None:
    layout = state_layout(tx, params, mesh, axis_name, specs=specs,
                          auto_axes=auto_axes)
  copies = None
  specs_in = specs
  if auto_axes:
    copies = copied(specs, auto_axes)
    params = expand(params, specs, mesh, auto_axes)
    specs = expand_specs(specs, auto_axes)
  if any(sp != P() for sp in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))):
    placed = jax.tree.map(
      lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), params,
      specs)
    splits = shard_splits(specs_in, mesh) if auto_axes else None

    def init_block(p):
      with _codec.block_splits(splits):
        return to_global(tx.init(own(p, copies)), layout)
    init = jax.shard_map(init_block, mesh=mesh,
                         in_specs=(specs,),
                         out_specs=state_specs(layout, axis_name))
    return jax.jit(init)(placed)
  state = jax.device_get(tx.init(jax.device_get(params)))
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    # Traced (jax.eval_shape(lambda: init_state(...)) builds an abstract
    # target for a checkpoint restore): the same layout, as traced ops.
    def place_traced(x, b):
      x = jnp.asarray(x)
      if b:
        x = jnp.broadcast_to(x[None], (_leaf_size(b, mesh, axis_name),)
                             + x.shape)
      return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, _leaf_spec(b, axis_name)))
    return jax.tree.map(place_traced, state, layout)

  def place(x, b):
    sharding = NamedSharding(mesh, _leaf_spec(b, axis_name))
    if not b:
      return _global(x, sharding)
    k = _leaf_size(b, mesh, axis_name)
    return _global(np.broadcast_to(np.asarray(x)[None], (k,) + np.shape(x)),
                   sharding)

  return jax.tree.map(place, state, layout)


def _check_nnx_params(params, who: str) -> None:
  """Refuses Flax NNX Variables other than ``nnx.Param`` in params (a
  whole ``nnx.state(model)``: BatchNorm statistics would be
  differentiated and updated as parameters, RNG keys and counts are not
  even floating)."""
  nnx = sys.modules.get("flax.nnx")
  var = getattr(nnx, "Variable", None)
  if var is None:
    return
  for path, v in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, var))[0]:
    if isinstance(v, var) and not isinstance(v, nnx.Param):
      raise ValueError(
        f"{who}: params leaf {jax.tree_util.keystr(path)} is a flax.nnx "
        f"{type(v).__name__}, not an nnx.Param: the optimizer would "
        "differentiate and update it as a parameter. Pass the parameters "
        "only, graphdef, params, rest = nnx.split(model, nnx.Param, ...) "
        "(or nnx.state(model, nnx.Param)), and merge them in the loss; "
        "BatchNorm statistics (nnx.BatchStat) are model state "
        "(DataParallel.step(model_state=...)), RNG streams stay in `rest` "
        "(DataParallel.step(rng=...) gives each device its own key)")
