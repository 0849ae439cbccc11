"""Data-parallel plumbing: meshes, per-device state, train steps, multi-host.

jaxcomm's optimizer state is partly per device (error-feedback residuals,
local momenta: every device keeps its own) and partly replicated (step
counters, PRNG keys, PowerSGD's Q, a downstream optimizer's moments). This
module owns that layout so users never hand-write it:

* :func:`state_layout` finds which state leaves are per device by tracing
  ``tx.update`` once inside ``shard_map`` and reading which outputs JAX types
  as varying over the data axis;
* per-device leaves are stored with a leading axis of size ``n`` sharded over
  the data axis (so orbax saves every device's residual), replicated leaves
  as they are;
* :class:`DataParallel` turns ``loss_fn`` and ``tx`` into a jitted
  ``shard_map`` train step with params replicated, the batch sharded, the
  state laid out as above and ``check_vma`` on;
* :func:`pmap_train_step` is the same step through ``jax.pmap``;
* :func:`initialize` starts many processes through ``jax.distributed``;
* :func:`resize_state` moves a state to a different device count without
  losing residual mass.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm.collectives import _core
from jaxcomm.collectives import _signs
from jaxcomm.transforms import _local

# ----------------------------------------------------------------- meshes --

def make_mesh(num_devices: int | None = None, axis_name: str = "data", *,
              model: int = 1, model_axis: str = "model", devices=None):
  """A mesh whose data axis is ``axis_name`` (Auto axis types).

  Args:
    num_devices: devices on the data axis (default: all devices / model).
    axis_name: name of the data axis.
    model: size of an optional second axis (e.g. for tensor parallelism);
      1 gives a one-axis mesh. Compression runs over the data axis only.
    model_axis: name of that second axis.
    devices: devices to use (default ``jax.devices()``).
  """
  devices = list(devices if devices is not None else jax.devices())
  if model < 1:
    raise ValueError(f"model must be >= 1, got {model}")
  if num_devices is None:
    num_devices = len(devices) // model
  if num_devices < 1 or num_devices * model > len(devices):
    raise ValueError(
      f"num_devices={num_devices} x model={model} needs "
      f"{num_devices * model} devices, have {len(devices)}")
  devices = devices[:num_devices * model]
  if model == 1:
    shape, names = (num_devices,), (axis_name,)
  else:
    shape, names = (num_devices, model), (axis_name, model_axis)
  return jax.make_mesh(shape, names, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def make_pod_mesh(num_slices: int | None = None, *, slow_axis: str = "dcn",
                  fast_axis: str = "ici", devices=None):
  """A ``(slow_axis, fast_axis)`` mesh: one row per slice or host.

  Devices are grouped by their ``slice_index`` where it tells several
  slices apart (TPU multislice: ICI inside a slice, DCN between slices),
  else by ``process_index`` (a GPU cluster with one process per host: NVLink
  inside, the network between); ``num_slices`` instead cuts the devices,
  in order, into that many equal groups (one process driving several
  hosts, or simulated CPU devices). Each group is one row along
  ``slow_axis``, its devices in order along ``fast_axis``. Use
  ``axis_name=(slow_axis, fast_axis)`` in :class:`DataParallel`, dense
  averaging over ``fast_axis`` and compression over ``slow_axis``.
  """
  devices = list(devices if devices is not None else jax.devices())
  if num_slices is not None:
    num_slices = _checks.integer("num_slices", num_slices, 1)
    if len(devices) % num_slices:
      raise ValueError(f"num_slices={num_slices} does not divide the "
                       f"{len(devices)} devices")
    per = len(devices) // num_slices
    groups = [devices[i * per:(i + 1) * per] for i in range(num_slices)]
  else:
    # slice_index where it tells slices apart (CPU and single-slice
    # devices may report 0 for all), else the process (host).
    slices = {getattr(d, "slice_index", None) for d in devices}
    key = ((lambda d: d.slice_index) if None not in slices
           and len(slices) > 1 else (lambda d: d.process_index))
    by = {}
    for d in devices:
      by.setdefault(key(d), []).append(d)
    groups = [by[k] for k in sorted(by)]
    if len({len(g) for g in groups}) != 1:
      raise ValueError(
        "slices (or hosts) hold different numbers of devices "
        f"{[len(g) for g in groups]}: pass num_slices or devices")
  arr = np.empty((len(groups), len(groups[0])), dtype=object)
  for i, g in enumerate(groups):
    for j, d in enumerate(g):
      arr[i, j] = d
  return jax.sharding.Mesh(arr, (slow_axis, fast_axis),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)


class ShardedExchangeState(NamedTuple):
  """State of :func:`sharded_exchange`: the inner compressor's, for this
  device's share of the flattened gradient."""

  inner: optax.OptState


def exchange_share(params, fast_size: int) -> dict:
  """What :func:`sharded_exchange`'s compressor sees on each device: one
  float32 vector ``{"share": ...}`` of ``ceil(n / fast_size)`` values for
  ``n`` floating values in ``params`` (abstract; for ``wire.claimed``)."""
  d = _checks.integer("fast_size", fast_size, 1)
  leaves = jax.tree.leaves(params)
  bad = [str(x.dtype) for x in leaves if not _core.is_inexact(x)]
  if bad:
    raise ValueError("sharded_exchange: every gradient leaf must be "
                     f"floating, got {bad}")
  n = sum(int(np.prod(np.shape(x))) for x in leaves)
  return {"share": jax.ShapeDtypeStruct((-(-n // d),), jnp.float32)}


def sharded_exchange(compressor: optax.GradientTransformation,
                     fast_axis: str = "ici", *, fast_size: int
                     ) -> optax.GradientTransformation:
  """Runs ``compressor`` between hosts once per host, not once per device.

  In the pod recipe (``mean_gradients(axis_name="ici")`` then a compressor
  over "dcn") every device of a host exchanges the same averaged values
  between hosts: a host's link carries ``d`` copies for ``d`` devices, and
  each device compresses the whole gradient. Here the devices of a host
  split the work, as the 2D-torus all-reduce does (Mikami et al. 2018,
  "Massively Distributed SGD": reduce-scatter along one dimension,
  all-reduce along the other, all-gather back), with the compressor's
  exchange in the middle: the gradient is flattened (float32), averaged and
  scattered over ``fast_axis`` (one reduce-scatter: device ``j`` of ``d``
  gets the ``j``-th ``1/d`` of it, zero-padded to a multiple of ``d``), the
  compressor runs on that share between hosts, and the shares are gathered
  back over ``fast_axis`` (one all-gather). Each device's error feedback
  covers its own share.

  The compressor sees one flat vector (a single leaf, ``{"share": v}``,
  see :func:`exchange_share`), so methods defined per matrix lose their
  structure: a compressor that compresses some of ``params`` but would
  pass the share through dense (PowerSGD, which takes matrices only, or a
  leaf policy) is refused at ``init``. Elementwise and sparsifying
  compressors (cast, top-k, DGC, onebit, the quantizers) work, with
  top-k's ``k`` taken over each share; the dense mean works too.

  Args:
    compressor: a jaxcomm compressor whose ``axis_name`` is the slow axis
      (e.g. ``jaxcomm.topk(0.01, axis_name="dcn")``).
    fast_axis: the mesh axis inside a host.
    fast_size: its size, ``mesh.shape[fast_axis]`` (the state's shape
      depends on it, and ``init`` may run outside the mesh).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; all floating gradients
    come back as the mean update in their own shapes and dtypes.

  Example::

    tx = optax.chain(
      jaxcomm.parallel.sharded_exchange(
        jaxcomm.topk(0.01, axis_name="dcn"), fast_size=mesh.shape["ici"]),
      optax.sgd(0.1))
    dp = DataParallel(loss_fn, tx, mesh, axis_name=("dcn", "ici"))
  """
  # pylint: disable=import-outside-toplevel
  from jaxcomm import _compressor
  spec = _compressor.spec_of(compressor)
  if not isinstance(fast_axis, str):
    raise ValueError(f"fast_axis must be one mesh axis name, got "
                     f"{fast_axis!r}")
  d = _checks.integer("fast_size", fast_size, 1)
  slow = spec.axis_name
  if slow is None or fast_axis in _core._names(slow):
    raise ValueError(
      f"the compressor's axis_name={slow!r} must be the slow axis, other "
      f"than fast_axis={fast_axis!r}")

  def init_fn(params):
    share = exchange_share(params, d)
    from jaxcomm import _policy  # pylint: disable=import-outside-toplevel
    # Sharding must not silently turn a compressing compressor dense.
    if (_policy.COMPRESS in spec.paths(params)
        and spec.paths(share) != [_policy.COMPRESS]):
      raise ValueError(
        f"sharded_exchange: {spec.codec.name} would not compress this "
        f"device's share (a vector of {share['share'].shape[0]} values): "
        "its leaf policy or the method itself (PowerSGD takes matrices "
        "only) passes it through dense. Use the compressor after "
        f"mean_gradients(axis_name={fast_axis!r}) instead")
    return ShardedExchangeState(compressor.init(
      jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), share)))

  def update_fn(updates, state, params=None, **extra):
    del params
    size = _core.check_axis(fast_axis, "sharded_exchange", grads=updates)
    if size != d:
      raise ValueError(f"sharded_exchange: fast_size={d} but axis "
                       f"{fast_axis!r} has {size} devices")
    share = exchange_share(updates, d)["share"].shape[0]
    leaves, treedef = jax.tree.flatten(updates)
    flat = _buckets.flatten(leaves)
    n = flat.shape[0]
    flat = jnp.pad(flat, (0, share * d - n))
    mine = jax.lax.psum_scatter(flat, fast_axis, tiled=True) / d
    out, inner = compressor.update({"share": mine}, state.inner, None,
                                   **extra)
    full = _core.all_gather(out["share"], fast_axis, tiled=True)[:n]
    pieces = _buckets.unflatten(full, [x.shape for x in leaves])
    return (treedef.unflatten([p.astype(x.dtype)
                               for p, x in zip(pieces, leaves)]),
            ShardedExchangeState(inner))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _data_size(mesh, axis_name) -> int:
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  for name in names:
    if name not in mesh.shape:
      raise ValueError(
        f"axis_name={name!r} is not an axis of the mesh {dict(mesh.shape)}")
  return int(np.prod([mesh.shape[n] for n in names]))


def _global(x, sharding):
  """A global array from a value identical on every process."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def replicate(tree, mesh):
  """Places a pytree replicated on every device of ``mesh``."""
  sharding = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: _global(x, sharding), tree)


def shard_batch(batch, mesh, axis_name: str = "data"):
  """Turns this process's slice of a batch into global arrays.

  Leading axes are split over ``axis_name``. On one process pass the whole
  global batch; on many, each process passes its own contiguous slice.
  """
  n = _data_size(mesh, axis_name)
  per_process = max(1, n // jax.process_count())
  _check_leading(batch, per_process,
                 f"the batch's leading axis (the examples) must split evenly "
                 f"over the {per_process} devices of axis {axis_name!r}"
                 f"{' on this process' if jax.process_count() > 1 else ''}: "
                 f"use a batch size that is a multiple of {per_process}",
                 multiple=True)
  sharding = NamedSharding(mesh, P(axis_name))
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
    batch)


def _check_leading(tree, n: int, what: str, *, multiple: bool,
                   name: str = "batch") -> None:
  """Every leaf of ``tree`` has a leading axis equal to (or, with
  ``multiple``, a multiple of) ``n``; the error names the leaf."""
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    shape = tuple(np.shape(x))
    lead = shape[0] if shape else None
    ok = lead is not None and (lead % n == 0 and lead > 0 if multiple
                               else lead == n)
    if not ok:
      raise ValueError(
        f"{name} leaf {jax.tree_util.keystr(path) or '(root)'} has shape "
        f"{shape}: {what}")


# ----------------------------------------------------------- state layout --

def _abstract(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def local_params(tx: optax.GradientTransformation, params) -> bool:
  """Whether ``tx`` lets params differ between devices (a local-update
  optimizer: :func:`jaxcomm.local_sgd`, :func:`jaxcomm.diloco`, ...), so
  that :class:`DataParallel` keeps them per device."""
  return bool(_local.local_states(jax.eval_shape(tx.init,
                                                 _abstract(params))))


def _names(axis_name) -> tuple:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _axes_of(b, axis_name):
  """The mesh axes a layout leaf's leading axis is sharded over: all data
  axes (``True``), a set of axes (data axes in their order, then model
  axes sorted), or none (``False``)."""
  if b is True:
    return axis_name
  if not b:
    return None
  names = _names(axis_name)
  return tuple(a for a in names if a in b) + tuple(
    sorted(a for a in b if a not in names))


def _spec_axes(spec) -> set:
  out = set()
  for e in spec:
    if e is None:
      continue
    out |= set(e) if isinstance(e, tuple) else {e}
  return out


def param_specs(params, mesh, axis_name="data"):
  """Each params leaf's PartitionSpec over the mesh's non-data axes (its
  NamedSharding on ``mesh``; ``P()`` for host arrays and replicated ones).

  Raises a ValueError naming a leaf sharded over a data axis: data
  parallelism replicates params over those.
  """
  names = set(_names(axis_name))

  def spec(path, x):
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding) or \
        tuple(sh.mesh.axis_names) != tuple(mesh.axis_names):
      return P()
    used = _spec_axes(sh.spec)
    if used & names:
      raise ValueError(
        f"params leaf {jax.tree_util.keystr(path)} is sharded as {sh.spec}, "
        f"over the data axis {sorted(used & names)}: shard params over "
        "model axes only (data parallelism replicates them over the data "
        "axes)")
    return sh.spec

  return jax.tree_util.tree_map_with_path(spec, params)


def _local_shape(shape, spec, mesh) -> tuple:
  """The shape of one device's block of a global ``shape`` split by
  ``spec``."""
  out = list(shape)
  for i, e in enumerate(spec):
    if e is None:
      continue
    k = int(np.prod([mesh.shape[a] for a in (e if isinstance(e, tuple)
                                             else (e,))]))
    if out[i] % k:
      raise ValueError(f"dimension {i} of shape {tuple(shape)} does not "
                       f"split over {e} ({k} devices)")
    out[i] //= k
  return tuple(out)


def _with_data(spec, axis_name) -> P:
  """``spec`` with a leading axis over the data axes (per-device rows)."""
  return P(axis_name, *spec)


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
  def one(x, axes):
    missing = tuple(sorted(axes - _core.varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(one, tree, want)


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
    want = _local._join_vma([jax.eval_shape(b, *operands)
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
                 specs=None):
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
  """
  n = _data_size(mesh, axis_name)
  names = _names(axis_name)
  _check_nnx_params(params, "state_layout")
  if specs is None:
    specs = param_specs(params, mesh, axis_name)
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
  state_abs = jax.eval_shape(tx.init, local_abs)
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
      grads = jax.tree.map(lambda g: g[0], grads)
      state = to_local(state, layout)
      extra = {}
      if per_device_params:
        params = jax.tree.map(lambda g: g[0], params)
        extra = {"value": _core.pvary(jnp.zeros([], jnp.float32), axis_name)}
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


def state_specs(layout, axis_name: str = "data"):
  """PartitionSpecs for a state laid out by :func:`state_layout`."""
  return jax.tree.map(lambda b: _leaf_spec(b, axis_name), layout)


def _map_laid_out(fn, state, layout, who: str):
  try:
    return jax.tree.map(fn, state, layout)
  except ValueError:
    _check_state_tree(state, layout, who)  # names what does not fit
    raise


def to_local(state, layout):
  """Inside shard_map: drops the leading size-1 axis of per-device leaves."""
  return _map_laid_out(lambda x, b: x[0] if b else x, state, layout,
                       "to_local")


def to_global(state, layout):
  """Inside shard_map: adds the leading axis back to per-device leaves."""
  return _map_laid_out(lambda x, b: x[None] if b else x, state, layout,
                       "to_global")


def init_state(tx: optax.GradientTransformation, params, mesh,
               axis_name: str = "data", layout=None, specs=None):
  """``tx.init(params)`` laid out for :class:`DataParallel` on ``mesh``.

  Per-device leaves get a leading axis of one row per device (every device
  starts from the same value) sharded over the data axes they vary over;
  the rest is replicated. With params sharded over model axes (``specs``,
  default :func:`param_specs`), ``tx.init`` runs on each device's block.
  """
  _check_nnx_params(params, "init_state")
  if specs is None:
    specs = param_specs(params, mesh, axis_name)
  if layout is None:
    layout = state_layout(tx, params, mesh, axis_name, specs=specs)
  if any(sp != P() for sp in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))):
    placed = jax.tree.map(
      lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), params,
      specs)
    init = jax.shard_map(lambda p: to_global(tx.init(p), layout), mesh=mesh,
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


# ------------------------------------------------------------ train steps --

class DataParallel:
  """A jitted shard_map train step for any optax transformation.

  Params are replicated, the batch is split over the data axis, the
  optimizer state is laid out by :func:`state_layout`, and ``check_vma``
  stays on, so a transform that left devices disagreeing would fail to
  trace. Gradients are taken with respect to a device-varying view of the
  params: each device gets its *local* gradient and only ``tx`` decides what
  crosses the wire (differentiating through replicated params directly would
  let JAX insert its own dense psum).

  Example::

    mesh = jaxcomm.parallel.make_mesh()
    tx = optax.chain(jaxcomm.powersgd(rank=4), optax.sgd(0.1))
    dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    params, opt_state = dp.init(params)
    params, opt_state, metrics = dp.step(params, opt_state, batch)

  With a local-update optimizer (:func:`jaxcomm.local_sgd`,
  :func:`jaxcomm.adacomm`, :func:`jaxcomm.overlap_local_sgd`,
  :func:`jaxcomm.diloco`) params differ between devices between syncs:
  ``init`` returns them per device (a leading axis of size n sharded over
  the data axis, like per-device state; ``per_device_params`` is True), the
  step passes each device its own row and the loss as ``value``, and
  :meth:`synchronized` gives the model to evaluate or export.

  Mutable model state and randomness (BatchNorm statistics, dropout) are
  optional arguments of :meth:`step`: with ``model_state=`` the loss is
  called as ``loss_fn(params, batch, model_state=...)`` and returns
  ``(out, new_model_state)`` (``out`` is what it returns without:
  ``loss``, or ``(loss, aux)`` with ``has_aux``); the new state's floating
  leaves are averaged over the data axes (one fused all-reduce; BatchNorm's
  running statistics become the device mean) and ``step`` returns it as a
  fourth value. With ``rng=key`` the loss gets ``rng=`` this device's key,
  ``jax.random.fold_in(key, i)`` for its index ``i`` along the data axes,
  so dropout masks differ between devices; pass a new key each step (e.g.
  ``jax.random.fold_in(base, step)``) for them to differ between steps::

    def loss_fn(params, batch, model_state, rng):
      logits, new_state = apply(params, model_state, batch["x"], rng)
      return cross_entropy(logits, batch["y"]), new_state

    params, opt_state, metrics, model_state = dp.step(
      params, opt_state, batch, model_state=model_state,
      rng=jax.random.fold_in(key, t))

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``) on the device's local batch; ``model_state`` and ``rng``
      keyword arguments when :meth:`step` is given them (above). With Flax
      NNX, ``params`` is ``nnx.state(model, nnx.Param)`` (from
      ``graphdef, params = nnx.split(model, nnx.Param)``) and the loss
      calls ``nnx.merge(graphdef, params)``.
    tx: the optimizer.
    mesh: a mesh with an axis named ``axis_name``.
    axis_name: the data axis, or a tuple of them (e.g. ``("dcn", "ici")``
      on a pod: the batch is split over all of them, per-device state and
      params are laid out over all of them, and each compressor averages
      over the axes it was built with, so ``optax.chain(
      jaxcomm.mean_gradients(axis_name="ici"), jaxcomm.powersgd(2,
      axis_name="dcn"), ...)`` compresses only between slices).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux leaves are
      averaged over devices.
    donate: donate params and state buffers to the step.
    block: wait for the previous step's params and state before
      dispatching the next step. ``None`` (default): on a mesh of several
      CPU devices only. XLA's CPU collectives rendezvous every simulated
      device; with many steps queued (a loop that never reads a result)
      a device can reach a collective while the others still work through
      earlier steps on few cores, and XLA aborts the process after its
      collective timeout ("Termination timeout for all reduce ... 40
      seconds exceeded"). One step in flight keeps every wait within one
      step; the host still prepares the next batch meanwhile. ``False``
      dispatches freely (JAX's asynchronous default; then raise
      ``--xla_cpu_collective_timeout_seconds`` and
      ``--xla_cpu_collective_call_terminate_timeout_seconds`` in
      ``XLA_FLAGS`` before JAX starts, as train.py and the tests do);
      ``True`` blocks on any backend.
  """

  def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation,
               mesh, axis_name: str = "data", *, has_aux: bool = False,
               donate: bool = True, block: bool | None = None):
    _data_size(mesh, axis_name)
    self.loss_fn = loss_fn
    self.tx = tx
    self.mesh = mesh
    self.axis_name = axis_name
    self.has_aux = has_aux
    self.donate = donate
    self.layout = None
    self.per_device_params = False
    self.param_specs = None
    self._steps = {}
    if block is not None:
      _checks.boolean("block", block)
    self.block = (block if block is not None else
                  self.num_devices > 1 and all(
                    d.platform == "cpu" for d in mesh.devices.flat))

  @property
  def num_devices(self) -> int:
    return _data_size(self.mesh, self.axis_name)

  def init(self, params):
    """Replicated params and the laid-out optimizer state."""
    _check_nnx_params(params, "DataParallel.init")
    for path, x in jax.tree_util.tree_leaves_with_path(params):
      dtype = jnp.result_type(x)
      if not (jnp.issubdtype(dtype, jnp.floating)
              or jnp.issubdtype(dtype, jnp.complexfloating)):
        raise ValueError(
          f"params leaf {jax.tree_util.keystr(path)} is {dtype}: DataParallel "
          "differentiates every params leaf, and only floating (or complex) "
          "leaves have gradients; keep integer state (counters, indices) "
          "out of params, e.g. in the batch or closed over by loss_fn")
    self.param_specs = param_specs(params, self.mesh, self.axis_name)
    self.per_device_params = local_params(
      self.tx, jax.tree.map(
        lambda x, sp: jax.ShapeDtypeStruct(
          _local_shape(np.shape(x), sp, self.mesh), jnp.result_type(x)),
        params, self.param_specs))
    self.layout = state_layout(self.tx, params, self.mesh, self.axis_name,
                               per_device_params=self.per_device_params,
                               specs=self.param_specs)
    state = init_state(self.tx, params, self.mesh, self.axis_name,
                       self.layout, specs=self.param_specs)
    host = jax.device_get(params)
    if self.per_device_params:
      return self.place_params(jax.tree.map(
        lambda x: np.broadcast_to(np.asarray(x)[None],
                                  (self.num_devices,) + np.shape(x)),
        host)), state
    return self.place_params(host), state

  def _param_shardings(self):
    wrap = ((lambda sp: _with_data(sp, self.axis_name))
            if self.per_device_params else (lambda sp: sp))
    return jax.tree.map(lambda sp: NamedSharding(self.mesh, wrap(sp)),
                        self.param_specs,
                        is_leaf=lambda x: isinstance(x, P))

  def place_params(self, host_params):
    """Host params as this step's inputs: split over model axes as given to
    :meth:`init`, and per device (a leading axis of size n over the data
    axis) for a local-update optimizer, else replicated over the data
    axis."""
    return jax.tree.map(_global, host_params, self._param_shardings())

  def synchronized(self, params):
    """The model to evaluate or export: ``params`` themselves when they are
    replicated; with per-device params (local-update optimizers) their
    device average, replicated (exactly the common value when every device
    holds the same one, as right after a sync)."""
    if not self.per_device_params:
      return params
    return synchronized(params, self.mesh, self.param_specs)

  def shard_batch(self, batch):
    """This process's slice of a batch as global arrays (see shard_batch)."""
    return shard_batch(batch, self.mesh, self.axis_name)

  def _build(self, with_state: bool, with_rng: bool):
    axis, layout, tx = self.axis_name, self.layout, self.tx
    loss_fn, has_aux = self.loss_fn, self.has_aux

    per_device = self.per_device_params

    def step(params, state, batch, *extra):
      local = to_local(state, layout)
      if per_device:
        params = jax.tree.map(lambda x: x[0], params)
      kwargs = {}
      extra = list(extra)
      if with_state:
        kwargs["model_state"] = extra.pop(0)
      if with_rng:
        # This device's key: i along the data axes folded into the step's.
        kwargs["rng"] = jax.random.fold_in(extra.pop(0),
                                           _core.axis_index(axis))

      def loss_and_more(p):
        inside = dict(kwargs)
        if with_state:
          # Fresh nodes, made inside the differentiated function: a Flax
          # NNX Variable (BatchNorm's statistics) may be updated only at
          # the trace level that made it.
          inside["model_state"] = jax.tree.map(lambda x: x,
                                               kwargs["model_state"])
        out = loss_fn(p, batch, **inside)
        new_model_state = None
        if with_state:
          if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
              "loss_fn: with model_state it must return (out, "
              "new_model_state), where out is the loss (or (loss, aux) "
              f"with has_aux); got {type(out).__name__}")
          out, new_model_state = out
        loss, aux = out if has_aux else (out, {})
        return loss, (aux, new_model_state)

      (loss, (aux, new_model_state)), grads = jax.value_and_grad(
        loss_and_more, has_aux=True)(_core.pvary(params, axis))
      extra = {"value": loss} if per_device else {}
      updates, new_local = tx.update(grads, local, params, **extra)
      new_params = _local.apply_updates(params, updates, new_local)
      if per_device:
        new_params = jax.tree.map(lambda x: x[None], new_params)
      # Local-update steps send nothing between syncs, not even the loss:
      # their metrics stay per device (a leading axis of size n).
      reduce = ((lambda a: jnp.asarray(a)[None]) if per_device
                else (lambda a: jax.lax.pmean(a, axis)))
      metrics = {"loss": reduce(loss)}
      if has_aux:
        metrics["aux"] = jax.tree.map(reduce, aux)
      out = (new_params, to_global(new_local, layout), metrics)
      if with_state:
        out += (_device_mean(new_model_state, axis),)
      return out

    specs = state_specs(layout, axis)
    p_spec = jax.tree.map(
      lambda sp: _with_data(sp, axis) if per_device else sp,
      self.param_specs, is_leaf=lambda x: isinstance(x, P))
    m_spec = P(axis) if per_device else P()
    extra_specs = (P(),) * (with_state + with_rng)
    mapped = jax.shard_map(
      step, mesh=self.mesh, in_specs=(p_spec, specs, P(axis)) + extra_specs,
      out_specs=(p_spec, specs, m_spec) + ((P(),) if with_state else ()))
    donated = (0, 1, 3) if with_state else (0, 1)
    return jax.jit(mapped, donate_argnums=donated if self.donate else ())

  def _prepare(self, params, state, batch, model_state, rng):
    """Checks the inputs and returns the built step and its arguments."""
    if self.layout is None:
      raise ValueError("call DataParallel.init(params) before step()")
    if model_state is not None and self.per_device_params:
      raise ValueError(
        "model_state is not supported with a local-update optimizer "
        "(per-device params): its steps send nothing between syncs, and "
        "model_state is averaged over the devices every step")
    _check_state_tree(state, self.layout, "DataParallel.step")
    for name, tree in (("params", params), ("state", state),
                       ("model_state", model_state)):
      if any(isinstance(x, jax.Array) and x.is_deleted()
             for x in jax.tree.leaves(tree)):
        raise ValueError(
          f"{name} holds buffers donated to an earlier step (DataParallel "
          "donates params, state and model_state by default): pass the "
          "ones that step returned, or build DataParallel(..., "
          "donate=False)")
    kind = (model_state is not None, rng is not None)
    if kind not in self._steps:
      self._steps[kind] = self._build(*kind)
    if self.num_devices > 1:
      if not all(isinstance(x, jax.Array) and len(x.devices()) > 1
                 for x in jax.tree.leaves(batch)):
        batch = self.shard_batch(batch)
      if model_state is not None and not all(
          isinstance(x, jax.Array) and len(x.devices()) > 1
          for x in jax.tree.leaves(model_state)):
        model_state = replicate(model_state, self.mesh)
    extra = tuple(x for x in (model_state, rng) if x is not None)
    return self._steps[kind], (params, state, batch) + extra

  def step(self, params, state, batch, *, model_state=None, rng=None):
    """One step: ``(params, state, metrics)``, plus the new model state as
    a fourth value when ``model_state`` is given; batch from
    :meth:`shard_batch` (plain host arrays are sharded here). Metrics are
    device averages; with a local-update optimizer (``per_device_params``)
    they are per device (leading axis n), since those steps send nothing
    between syncs.

    Args:
      params: the params :meth:`init` (or the previous step) returned.
      state: the optimizer state, likewise.
      batch: the global batch; its leading axes are split over the data
        axes.
      model_state: mutable non-parameter model state (e.g. BatchNorm
        statistics, ``nnx.state(model, nnx.BatchStat)``), replicated;
        ``loss_fn`` gets it as ``model_state=`` and returns ``(out,
        new_model_state)``; the new state's floating leaves are averaged
        over the data axes, others must come out equal on every device.
      rng: a PRNG key for this step; ``loss_fn`` gets ``rng=
        jax.random.fold_in(rng, i)`` on the device of index ``i`` along the
        data axes.
    """
    fn, args = self._prepare(params, state, batch, model_state, rng)
    if self.block:
      # The previous step's outputs: at most one step queued (see block).
      jax.block_until_ready((params, state, model_state))
    return fn(*args)

  def lower(self, params, state, batch, *, model_state=None, rng=None):
    """The lowered step (for :func:`jaxcomm.wire.report`)."""
    fn, args = self._prepare(params, state, batch, model_state, rng)
    return fn.lower(*args)


def _device_mean(tree, axis_name):
  """Inside shard_map: ``tree``'s floating leaves averaged over
  ``axis_name`` (those that vary over it, in one fused float32 psum,
  cast back), the other leaves as they are; a non-floating leaf that
  varies over ``axis_name`` is refused by name (its mean is not a value of
  its dtype)."""
  names = set(_names(axis_name))
  paths, leaves = [], []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if names & _core.varying_axes(x):
      if not _core.is_inexact(x):
        raise ValueError(
          f"model_state leaf {jax.tree_util.keystr(path)} "
          f"({jnp.result_type(x)}) differs between devices after the step, "
          "and only floating leaves are averaged: keep it equal on every "
          "device (e.g. a counter that does not read the batch) or make it "
          "floating")
      paths.append(path)
      leaves.append(x)
  n = _core.axis_size(axis_name)
  summed = _core.fused_psum(leaves, axis_name)
  means = {jax.tree_util.keystr(p): (s / n).astype(x.dtype)
           for p, s, x in zip(paths, summed, leaves)}
  return jax.tree_util.tree_map_with_path(
    lambda p, x: means.get(jax.tree_util.keystr(p), x), tree)


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


def synchronized(params, mesh, specs=None):
  """Per-device params (leading device axis) -> their device average,
  replicated on ``mesh`` (split over model axes as ``specs`` say); where
  every device holds the same value, that value exactly (a mean of equal
  floats may round)."""
  rep = (NamedSharding(mesh, P()) if specs is None else jax.tree.map(
    lambda sp: NamedSharding(mesh, sp), specs,
    is_leaf=lambda x: isinstance(x, P)))

  def one(x):
    first = x[0]
    same = jnp.all(x == first[None])
    mean = jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype)
    return jnp.where(same, first, mean)

  return jax.jit(lambda p: jax.tree.map(one, p), out_shardings=rep)(params)


def consensus_distance(params) -> jax.Array:
  """``max_i |x_i - mean_j x_j|`` over every element of per-device params
  (leading device axis): how far decentralized or local training has let
  the devices drift apart (0 right after a sync)."""
  def one(x):
    x = x.astype(jnp.float32)
    return jnp.max(jnp.abs(x - jnp.mean(x, axis=0, keepdims=True)))
  leaves = jax.tree.leaves(params)
  return jax.jit(lambda ls: jnp.max(jnp.stack([one(x) for x in ls])))(
    leaves) if leaves else jnp.zeros([], jnp.float32)


def pmap_train_step(loss_fn: Callable, tx: optax.GradientTransformation,
                    axis_name: str = "data", *, has_aux: bool = False):
  """The same train step through legacy ``jax.pmap``.

  Every input carries a leading device axis: params and state replicated
  with :func:`pmap_replicate`, the batch reshaped to ``(n, local, ...)``.
  """
  def step(params, state, batch):
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss = out[0] if has_aux else out
    extra = ({"value": loss} if _local.local_states(state) else {})
    updates, state = tx.update(grads, state, params, **extra)
    params = _local.apply_updates(params, updates, state)
    return params, state, {"loss": jax.lax.pmean(loss, axis_name)}

  mapped = jax.pmap(step, axis_name=axis_name)

  def checked(params, state, batch):
    n = jax.local_device_count()
    for name, tree, hint in (
        ("params", params, "replicate params with pmap_replicate"),
        ("state", state, "replicate the state with pmap_replicate"),
        ("batch", batch, "reshape the batch to (devices, examples per "
                         "device, ...)")):
      _check_leading(tree, n, f"pmap_train_step needs a leading device axis "
                     f"of {n} (jax.local_device_count()) on every input: "
                     f"{hint}", multiple=False, name=name)
    return mapped(params, state, batch)

  checked.lower = mapped.lower
  return checked


def pmap_replicate(tree, devices=None):
  """Stacks a pytree once per device, for :func:`pmap_train_step`."""
  devices = devices if devices is not None else jax.local_devices()
  return jax.device_put_replicated(tree, devices) if hasattr(
    jax, "device_put_replicated") else jax.tree.map(
      lambda x: jnp.stack([x] * len(devices)), tree)


# ----------------------------------------------------- resizing the state --

_ADDITIVE_FIELDS = ("residual", "server_error", "worker_error")
# Additive leaves whose row k is read only on device k's chunk of the
# flattened buffer (onebit's server error: chunk_length(L, n) elements).
_CHUNK_OWNED_FIELDS = ("server_error",)


def _additive_paths(state) -> list:
  """For each leaf: ``False``, or ``"sum"`` for error-feedback mass
  (summed or split on resize), or ``"owned"`` for mass that device ``k``
  keeps on its own chunk only (re-chunked on resize), or ``("restart",
  v)`` for gossip memory that only holds for the device count it was built
  on (set to ``v`` on every new device)."""
  flags = []

  def visit(x, kind):
    if isinstance(x, (_local.ChocoState, _local.PushSumState)):
      # CHOCO's public copies (and their mixed sum) are what each device's
      # neighbours know of it; push-sum's weight is its share of the mass.
      # Both restart as at init on a new graph (public copies 0, weight 1:
      # the de-biased params become the numerators); the params, which
      # resize_params moves, carry the model.
      for name, y in zip(x._fields, x):
        if name in ("public", "mixed"):
          visit(y, ("restart", 0.0))
        elif name == "weight":
          visit(y, ("restart", 1.0))
        else:
          visit(y, kind)
    elif hasattr(x, "_fields"):
      for name, y in zip(x._fields, x):
        sub = kind
        if name in _CHUNK_OWNED_FIELDS:
          sub = "owned"
        elif name in _ADDITIVE_FIELDS and not kind:
          sub = "sum"
        visit(y, sub)
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


def resize_state(state, layout, num_devices: int):
  """Moves a laid-out state (host arrays) to ``num_devices`` devices.

  Error-feedback mass is conserved: residual-like leaves (fields named
  ``residual`` or ``worker_error``) are summed over groups of old devices
  when shrinking and split evenly when growing, so the total residual is
  unchanged. A ``server_error`` (onebit's) is owned by chunks: device ``k``
  reads only its chunk of it, whose bounds depend on the device count, so
  its total is re-cut into the new devices' chunks (every element lands
  where its new owner reads it). Other per-device leaves (local momenta,
  statistics) are averaged over groups, or copied when growing. CHOCO's
  public copies restart at 0 and push-sum's weight at 1, as at init (they
  describe the old graph). Replicated leaves are unchanged.

  Args:
    state: the state as host (numpy) arrays, e.g. from a checkpoint.
    layout: its :func:`state_layout`.
    num_devices: the new data-axis size. The old and new sizes must divide
      one another.
  """
  num_devices = _checks.integer("num_devices", num_devices, 1)
  _check_state_tree(state, layout, "resize_state")
  leaves, treedef = jax.tree.flatten(state)
  per_device = jax.tree.leaves(layout)
  additive = _additive_paths(state)
  if not (len(leaves) == len(per_device) == len(additive)):
    raise ValueError("layout does not match the state's tree structure")
  out = []
  for x, dev, add in zip(leaves, per_device, additive):
    x = np.asarray(x)
    if not dev:
      out.append(x)
      continue
    if dev is not True:
      raise ValueError(
        f"cannot resize a state leaf laid out over the data axes {dev} only "
        "(several data axes): resize states of one data axis")
    old = x.shape[0]
    new = num_devices
    if old == new:
      out.append(x)
    elif isinstance(add, tuple):
      out.append(np.full((new,) + x.shape[1:], add[1], x.dtype))
    elif add == "owned" and (old % new == 0 or new % old == 0):
      out.append(_rechunk(x, new))
    elif old % new == 0:
      g = x.reshape((new, old // new) + x.shape[1:])
      if add:
        out.append(g.sum(axis=1))
      else:  # a group holding one value keeps it exactly
        same = np.all(g == g[:, :1], axis=1)
        out.append(np.where(same, g[:, 0], g.mean(axis=1)).astype(x.dtype))
    elif new % old == 0:
      rep = np.repeat(x, new // old, axis=0)
      out.append((rep / (new // old)).astype(x.dtype) if add else rep)
    else:
      raise ValueError(
        f"cannot resize a state from {old} to {new} devices: the sizes must "
        "divide one another")
  return jax.tree.unflatten(treedef, out)


def resize_params(params, num_devices: int):
  """Per-device params (host arrays, leading device axis, as a local-update
  optimizer's :class:`DataParallel` holds them) on ``num_devices`` devices:
  averaged over groups of old devices when shrinking, copied when growing,
  so the device average (the synchronised model) is kept."""
  layout = jax.tree.map(lambda _: True, params)
  return resize_state(params, layout, num_devices)


# ------------------------------------------------------------ multi-host --

def _wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Fails with a clear message if ``address`` accepts no TCP connection
  within ``timeout_s`` (JAX itself would abort the process)."""
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(
      f"coordinator_address must be 'host:port', got {address!r}")
  deadline = time.monotonic() + timeout_s
  last = None
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host.strip("[]"), int(port)),
                                    timeout=min(2.0, timeout_s)):
        return
    except OSError as e:
      last = e
      time.sleep(0.2)
  raise ConnectionError(
    f"could not reach the coordinator at {address} within {timeout_s}s "
    f"({last}); is process 0 running and is the address reachable from "
    "this host?")


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_count: int | None = None,
               timeout_s: int = 60) -> None:
  """Joins this process to a multi-process JAX job.

  On TPU pods and SLURM clusters JAX detects everything: call with no
  arguments. Elsewhere pass the coordinator's ``host:port``, the number of
  processes and this process's id. On CPU (``JAX_PLATFORMS=cpu``) the
  collectives run over gloo and ``local_device_count`` sets how many CPU
  devices this process simulates. Must run before any JAX computation.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator.
    num_processes: number of processes in the job.
    process_id: this process's id, in ``[0, num_processes)``.
    local_device_count: CPU devices to simulate in this process.
    timeout_s: how long to wait for the other processes before failing.
  """
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ValueError(
      "pass all of coordinator_address, num_processes and process_id, or "
      "none of them (auto-detection on TPU pods and SLURM)")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(
      f"process_id must be in [0, {num_processes}), got {process_id}")
  if coordinator_address is not None and process_id != 0:
    _wait_for_coordinator(coordinator_address, timeout_s)
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  platforms = jax.config.jax_platforms or ""
  if "cpu" in platforms or platforms == "":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes,
    process_id=process_id, initialization_timeout=int(timeout_s))

