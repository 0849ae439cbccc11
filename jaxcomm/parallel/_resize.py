"""Moving per-device state and params to another device count."""

from __future__ import annotations

import sys

import jax
import numpy as np

from jaxcomm import _checks
from jaxcomm import _per_device
from jaxcomm.collectives import _signs

# ----------------------------------------------------- resizing the state --

def _kinds(state) -> list:
  """For each leaf: ``False`` (averaged over merged devices, copied to new
  ones), ``"owned"`` or ``("restart", v)``, as its state type registered
  (``jaxcomm._per_device``)."""
  flags = []

  def visit(x, kind):
    if hasattr(x, "_fields"):
      registered = _per_device.kinds(type(x))
      for name, y in zip(x._fields, x):
        visit(y, registered.get(name, kind))
    elif isinstance(x, (tuple, list)):
      for y in x:
        visit(y, kind)
    elif isinstance(x, dict):
      for k in sorted(x):
        visit(x[k], kind)
    elif x is None:
      return
    else:
      # Any other pytree node (a Flax nnx.State or nnx.Param inside an
      # optax state built on NNX params): its children in JAX's order.
      children = jax.tree_util.tree_flatten(
        x, is_leaf=lambda y: y is not x)[0]
      if len(children) == 1 and children[0] is x:
        flags.append(kind)
      else:
        for y in children:
          visit(y, kind)

  visit(state, False)
  return flags


def _rechunk(x: np.ndarray, new: int) -> np.ndarray:
  """Chunk-owned rows ``[old, L]`` -> ``[new, L]``: the total over the old
  rows, each element given to the device whose chunk now holds it
  (``collectives._signs.chunk_length(L, new)`` elements per device), so
  that every element is read again and none is counted twice."""
  total = x.sum(axis=0)
  length = total.shape[-1]
  c = _signs.chunk_length(length, new)
  out = np.zeros((new,) + total.shape, x.dtype)
  for k in range(new):
    out[k, ..., k * c:(k + 1) * c] = total[..., k * c:(k + 1) * c]
  return out


def _containers(tree) -> set:
  """The kinds of pytree nodes in ``tree`` (dict, list, tuple, NamedTuple
  classes, ...)."""
  kinds = set()

  def visit(x):
    if isinstance(x, dict):
      kinds.add(dict)
      for v in x.values():
        visit(v)
    elif isinstance(x, (tuple, list)):
      kinds.add(type(x))
      for v in x:
        visit(v)

  visit(tree)
  return kinds


def _nnx_classes(tree) -> set:
  """Names of the Flax NNX containers in ``tree`` (Variables such as
  ``OptArray``, ``State``, ``Pytree`` objects such as ``nnx.Optimizer``);
  empty when Flax NNX is not loaded (jaxcomm does not import flax)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return set()
  kinds = tuple(k for k in (getattr(nnx, n, None) for n in (
    "Variable", "State", "Pytree")) if isinstance(k, type))
  names = set()

  def visit(x):
    if isinstance(x, kinds):
      names.add(type(x).__name__)
    children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
    if not (len(children) == 1 and children[0] is x):
      for y in children:
        visit(y)

  visit(tree)
  return names


def _check_state_tree(state, layout, who: str) -> None:
  """Names a state whose tree is not its layout's: an NNX optimizer's
  state, one restored from a checkpoint without a target (orbax then gives
  dicts and lists, a NamedTuple's fields as sorted dict keys, so leaves
  pair up wrongly), or another tree."""
  want = jax.tree.structure(layout)
  got = jax.tree.structure(state)
  if want == got:
    return
  extra = _nnx_classes(state) - _nnx_classes(layout)
  if extra:
    raise ValueError(
      f"{who}: state holds Flax NNX containers "
      f"({', '.join(sorted(extra))}) that its layout does not: an "
      "nnx.Optimizer's opt_state (leaves wrapped in OptArray/OptVariable) "
      "or nnx.state(optimizer) (NamedTuples turned into mappings) is not "
      "the tree tx.init(params) returns, which jaxcomm.parallel lays out. "
      "Keep the optax state itself: graphdef, params = nnx.split(model, "
      "nnx.Param); opt_state = jaxcomm.parallel.init_state(tx, params, "
      "mesh); after training, nnx.update(model, params) (README: Flax NNX "
      "and Linen)")
  _check_restored_structure(state, layout, got, want)


def _check_restored_structure(state, layout, got, want) -> None:
  named = {k for k in _containers(layout) if hasattr(k, "_fields")}
  restored = (not named & _containers(state)
              and {dict, list} & _containers(state))
  if named and restored:
    raise ValueError(
      "state has no NamedTuple nodes where its layout has "
      f"{sorted(k.__name__ for k in named)}: it looks restored from a "
      "checkpoint without a target (orbax then returns plain dicts and "
      "lists). Restore with the abstract state as target, e.g. "
      "ckpt.restore(path, target=jax.eval_shape(lambda: "
      "jaxcomm.parallel.init_state(tx, params, mesh))) on a mesh of the "
      "checkpoint's device count, or the same tree with that count as the "
      "leading axis of the per-device leaves")
  raise ValueError(
    f"state does not have its layout's tree structure: state {got}, layout "
    f"{want}")


def check_like(state, template, who: str) -> None:
  """Names the first leaf of ``state`` whose shape is not ``template``'s
  (arrays or ``jax.ShapeDtypeStruct``: the state the target step's init
  builds), so that a moved state that does not fit is refused before it
  is placed."""
  got = jax.tree_util.tree_flatten_with_path(state)[0]
  want = jax.tree.leaves(template)
  if len(got) != len(want):
    raise ValueError(f"{who}: the state has {len(got)} leaves, the target "
                     f"step's state {len(want)}")
  for (path, x), t in zip(got, want):
    if tuple(np.shape(x)) != tuple(np.shape(t)):
      raise ValueError(
        f"{who}: state{jax.tree_util.keystr(path)} comes out with shape "
        f"{tuple(np.shape(x))}, but the target step's state has "
        f"{tuple(np.shape(t))}: this leaf is laid out or sized otherwise "
        "on the new sizes and cannot be moved there")


def resize_state(state, layout, num_devices: int, *, axis_name="data",
                 model_axes=None, data_size=None, template=None):
  """Moves a laid-out state (host arrays) to ``num_devices`` devices.

  What the state still owes the *averaged* update is kept: compressors
  apply ``mean_i`` of what devices send, so per-device buffers (residuals,
  worker errors, EF21's estimates ``h_i``, local momenta) are averaged over
  each group of merged devices and copied to split ones, which keeps
  ``mean_i b_i`` exactly (and ``h = mean_i h_i``). (Summing residuals
  instead would make a residual deliver n/m times its mass on m devices.)
  A field its state type registered as owned by chunks (onebit's server
  error: device ``k`` holds its chunk's mass in full) has its total re-cut
  into the new devices' chunks; gossip memory (CHOCO's public copies,
  push-sum's weight) restarts as at init. See ``jaxcomm._per_device``.
  Replicated leaves are unchanged.

  Args:
    state: the state as host (numpy) arrays, e.g. from a checkpoint.
    layout: its :func:`state_layout`.
    num_devices: the new data-axis size. The old and new sizes must divide
      one another.
    axis_name: the data axis (one), as in :func:`state_layout`.
    model_axes: ``{axis: size}`` of the model axes, for a state whose
      leaves vary over model axes too (params split over them, block mode or
      ``auto_axes``): their rows are ``(data, *model axes sorted)``, and
      each block's rows are resized over the data axis alone. The model
      axes must keep their sizes (a block's state has its block's shape).
    data_size: the data-axis size the state was laid out for (default:
      read from a leaf laid out over the data axis alone). With
      ``model_axes`` every such leaf must have ``data_size`` times the
      model sizes rows; a state with no data-only leaf needs it given.
    template: optional, the state the target step's init builds (host
      arrays or ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``):
      the result is checked against its shapes, so a leaf laid out or
      sized otherwise on ``num_devices`` (int8's server error lies over
      the data axis only from 2 devices on) is refused by name instead of
      failing where the state is placed.

  Returns:
    The state for ``num_devices`` devices, host arrays, laid out as
    ``layout`` says (per-device leaves with ``num_devices`` rows, times
    the model sizes).

  Raises:
    ValueError: naming what does not fit (a leaf's rows that are not the
      data size times the model sizes, sizes that do not divide, a leaf
      whose shape is not ``template``'s).

  Examples:
    Top-k's residuals on 8 devices (device ``i``'s all ``i``), moved to 4:
    each pair of merged devices keeps their mean, so ``mean_i e_i`` (3.5)
    is unchanged.

    >>> import jax, jax.numpy as jnp, numpy as np, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> tx, params = jaxcomm.topk(0.5), {"w": jnp.zeros(512)}
    >>> layout = jaxcomm.parallel.state_layout(tx, params, mesh)
    >>> state = jax.device_get(jaxcomm.parallel.init_state(tx, params, mesh))
    >>> rows = np.arange(8.0, dtype=np.float32)[:, None] * np.ones((8, 512))
    >>> state = state._replace(residual=(rows.astype(np.float32),))
    >>> small = jaxcomm.parallel.resize_state(state, layout, 4)
    >>> small.residual[0][:, 0].tolist()
    [0.5, 2.5, 4.5, 6.5]
  """
  num_devices = _checks.integer("num_devices", num_devices, 1)
  if data_size is not None:
    data_size = _checks.integer("data_size", data_size, 1)
  model_axes = dict(model_axes or {})
  for a, size in model_axes.items():
    _checks.integer(f"model_axes[{a!r}]", size, 1)
  _check_state_tree(state, layout, "resize_state")
  leaves, treedef = jax.tree.flatten(state)
  per_device = jax.tree.leaves(layout)
  additive = _kinds(state)
  if not (len(leaves) == len(per_device) == len(additive)):
    raise ValueError("layout does not match the state's tree structure")
  if model_axes:
    data_size = _check_rows(leaves, per_device, axis_name, model_axes,
                            data_size, "resize_state")
  out = []
  for x, dev, add in zip(leaves, per_device, additive):
    x = np.asarray(x)
    if not dev:
      out.append(x)
      continue
    blocks = 1
    if dev is not True:
      model = sorted(a for a in dev if a != axis_name)
      unknown = [a for a in model if a not in model_axes]
      if axis_name not in dev or unknown:
        if axis_name not in dev and not unknown:
          out.append(x)   # one row per block, the same on every slice
          continue
        raise ValueError(
          f"cannot resize a state leaf laid out over the axes {sorted(dev)}"
          f" with axis_name={axis_name!r} and model_axes={model_axes}: "
          "name the one data axis, and every model axis with its size")
      blocks = int(np.prod([model_axes[a] for a in model]))
      if x.shape[0] % blocks:
        raise ValueError(
          f"a state leaf has {x.shape[0]} rows, not a multiple of the "
          f"{blocks} blocks of the model axes {model_axes}")
    if blocks > 1:
      rows = x.reshape((x.shape[0] // blocks, blocks) + x.shape[1:])
      moved = np.stack([_resize_rows(rows[:, b], num_devices, add)
                        for b in range(blocks)], axis=1)
      out.append(moved.reshape((-1,) + x.shape[1:]))
    else:
      out.append(_resize_rows(x, num_devices, add))
  out = jax.tree.unflatten(treedef, out)
  if template is not None:
    check_like(out, template, "resize_state")
  return out


def _check_rows(leaves, per_device, axis_name, model_axes, data_size,
                who: str, fix: str = "re-cut it with reshard_state first"):
  """Checks that every per-device leaf has (data size) x (its model
  axes' sizes) rows; returns the data size (given, or read from a leaf
  over the data axis alone)."""
  named = []
  for x, dev in zip(leaves, per_device):
    if not dev:
      continue
    axes = ({axis_name} if dev is True else set(dev))
    model = sorted(a for a in axes if a != axis_name)
    if any(a not in model_axes for a in model):
      continue   # named below, with the axes to give
    blocks = int(np.prod([model_axes[a] for a in model]))
    named.append((int(np.shape(x)[0]), axis_name in axes, blocks, model))
  if data_size is None:
    alone = {rows for rows, data, _, model in named if data and not model}
    if len(alone) > 1:
      raise ValueError(
        f"{who}: leaves over the data axis {axis_name!r} alone have "
        f"{sorted(alone)} rows; they must agree (one data size)")
    if not alone:
      if any(model for _, _, _, model in named):
        raise ValueError(
          f"{who}: with model_axes, pass data_size= (the data-axis "
          f"size the state was laid out for): no leaf lies over "
          f"{axis_name!r} alone to read it from, and a leaf's rows "
          f"(data x {dict(model_axes)}) cannot tell the two apart")
      return None
    data_size = alone.pop()
  for rows, data, blocks, model in named:
    want = (data_size if data else 1) * blocks
    if rows != want:
      raise ValueError(
        f"{who}: a state leaf laid out over "
        f"{([axis_name] if data else []) + model} has {rows} rows, but "
        f"data_size={data_size} x model_axes={dict(model_axes)} gives "
        f"{want}: the state was laid out for other model-axis sizes ({fix})"
        " or another data size")
  return data_size


def _resize_rows(x: np.ndarray, new: int, add) -> np.ndarray:
  """One leaf's rows ``[old, ...]`` on ``new`` devices (see
  :func:`resize_state`)."""
  old = x.shape[0]
  if old == new:
    return x
  if isinstance(add, tuple):
    return np.full((new,) + x.shape[1:], add[1], x.dtype)
  if add == "owned" and (old % new == 0 or new % old == 0):
    return _rechunk(x, new)
  if old % new == 0:
    g = x.reshape((new, old // new) + x.shape[1:])
    if np.issubdtype(x.dtype, np.integer) or x.dtype == bool:
      # Counters (a skipped-step count): the group's largest, not a mean
      # that rounds 1 of 8 down to 0.
      return g.max(axis=1)
    same = np.all(g == g[:, :1], axis=1)   # a group holding one value
    mean = g.astype(np.float64).mean(axis=1)  # keeps it exactly
    return np.where(same, g[:, 0], mean).astype(x.dtype)
  if new % old == 0:
    return np.repeat(x, new // old, axis=0)
  raise ValueError(
    f"cannot resize a state from {old} to {new} devices: the sizes must "
    "divide one another")


def resize_params(params, num_devices: int):
  """Per-device params moved to ``num_devices`` devices.

  The params are averaged over groups of old devices when shrinking and
  copied when growing, so the device average (the synchronised model) is
  kept.

  Args:
    params: per-device params as host arrays, every leaf with the same
      leading device axis (as a local-update optimizer's
      :class:`DataParallel` holds them).
    num_devices: the new number of devices; the old and new numbers must
      divide one another.

  Returns:
    The params with a leading axis of ``num_devices`` rows.

  Raises:
    ValueError: when the leaves do not share one leading (device) axis
      size: params without a device axis would be averaged row by row.

  Examples:
    >>> import numpy as np, jaxcomm
    >>> params = {"w": np.arange(8.0)[:, None]}    # 8 devices' rows
    >>> jaxcomm.parallel.resize_params(params, 2)["w"].tolist()
    [[1.5], [5.5]]
  """
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  sizes = {}
  for path, x in paths:
    shape = np.shape(x)
    sizes.setdefault(shape[0] if shape else None, []).append(
      jax.tree_util.keystr(path))
  if len(sizes) > 1 or None in sizes:
    shown = "; ".join(f"{k}: {', '.join(v[:3])}" for k, v in sizes.items())
    raise ValueError(
      "resize_params needs per-device params (every leaf with the same "
      f"leading device axis); leading sizes by leaf: {shown}. Replicated "
      "params need no resizing")
  layout = jax.tree.map(lambda _: True, params)
  return resize_state(params, layout, num_devices)
