"""PartitionSpecs of params and of one device's blocks: the params' specs
over the model axes, a block's shape and splits, specs restricted to some
axes, and the update on shards' copies of leaves replicated over auto axes
(:func:`expand`, :func:`own`, :func:`contract`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import _core

# ------------------------------------------------------------------ specs --


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
  """Each params leaf's PartitionSpec over the mesh's non-data axes.

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct`` leaves).
    mesh: the mesh.
    axis_name: the data axis, or a tuple of them.

  Returns:
    A tree of ``PartitionSpec`` like ``params``, each leaf's
    ``NamedSharding`` spec on ``mesh`` (``P()`` for host arrays, arrays on
    another mesh and replicated ones).

  Raises:
    ValueError: naming a leaf sharded over a data axis (data parallelism
      replicates params over those).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh(4, model=2, model_axis="fsdp")
    >>> w = jax.device_put(jnp.zeros((8, 4)),
    ...                    NamedSharding(mesh, P("fsdp", None)))
    >>> params = {"w": w, "b": jnp.zeros(4)}
    >>> specs = jaxcomm.parallel.param_specs(params, mesh)
    >>> tuple(specs["w"]), tuple(specs["b"])
    (('fsdp', None), ())
    >>> jaxcomm.parallel.shard_shapes(params, specs, mesh)["w"].shape
    (4, 4)
    >>> jaxcomm.parallel.shard_splits(specs, mesh)   # leaves: b, w
    [(), ((0, ('fsdp',), 2),)]
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


def shard_shapes(params, specs, mesh):
  """One device's shards of ``params`` split by ``specs`` on ``mesh``.

  What a compressor in the update on shards (or block mode) works on,
  e.g. for :func:`jaxcomm.wire.claimed`.

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct`` leaves).
    specs: their ``PartitionSpec`` tree (:func:`param_specs`).
    mesh: the mesh.

  Returns:
    ``params``' structure with ``jax.ShapeDtypeStruct`` leaves of one
    device's block shapes.
  """
  return jax.tree.map(
    lambda x, sp: jax.ShapeDtypeStruct(_local_shape(np.shape(x), sp, mesh),
                                       jnp.result_type(x)), params, specs,
    is_leaf=lambda x: isinstance(x, P) and not hasattr(x, "shape"))


def shard_splits(specs, mesh) -> list:
  """Per params leaf, how the whole leaf is split into one device's block.

  What compressors see inside :func:`update_on_shards`
  (``Layout.splits``), and what :func:`jaxcomm.wire.claimed` takes as
  ``splits=`` to claim the bytes of one device's blocks.

  Args:
    specs: the params' ``PartitionSpec`` tree (:func:`param_specs`).
    mesh: the mesh.

  Returns:
    A list in the ``jax.tree.leaves`` order of ``specs``. Per leaf, a
    tuple of ``(dim, axes, size)``, one for each dimension a spec entry
    splits over mesh axes (``size`` the devices along them); ``()`` for a
    whole leaf.
  """
  shape = dict(mesh.shape)
  out = []
  for sp in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
    entry = []
    for i, e in enumerate(tuple(sp)):
      if e is None:
        continue
      axes = tuple(e) if isinstance(e, tuple) else (e,)
      size = 1
      for a in axes:
        size *= int(shape[a])
      entry.append((i, axes, size))
    out.append(tuple(entry))
  return out


def _with_data(spec, axis_name) -> P:
  """``spec`` with a leading axis over the data axes (per-device rows)."""
  return P(axis_name, *spec)


def restrict(spec: P, keep) -> P:
  """``spec`` naming only the axes in ``keep`` (the others dropped, a
  dimension left with none becomes ``None``)."""
  out = []
  for e in spec:
    if e is None:
      out.append(None)
      continue
    kept = tuple(a for a in (e if isinstance(e, tuple) else (e,))
                 if a in keep)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def missing_axes(spec, auto_axes) -> tuple:
  """The auto axes a leaf's ``spec`` does not split it over."""
  used = _spec_axes(spec)
  return tuple(a for a in auto_axes if a not in used)


def expand_specs(specs, auto_axes):
  """Each leaf's spec for the update on shards: a leaf replicated over some
  auto axes gets a leading axis of one copy per device of those axes
  (``P(missing, *spec)``), so that every device updates a block of its
  own (see :func:`expand`)."""
  def one(sp):
    miss = missing_axes(sp, auto_axes)
    if not miss:
      return sp
    return P(miss[0] if len(miss) == 1 else miss, *sp)
  return jax.tree.map(one, specs, is_leaf=lambda x: isinstance(x, P))


def _copies(spec, mesh, auto_axes) -> int:
  return int(np.prod([mesh.shape[a] for a in missing_axes(spec, auto_axes)]))


def expand(tree, specs, mesh, auto_axes):
  """``tree`` (params or gradients: host, global or traced arrays, or
  ShapeDtypeStructs) with every leaf replicated over some auto axes
  broadcast to one copy per device of those axes (:func:`expand_specs`).

  Inside the update on shards each copy is one device's own: a replicated
  leaf (a bias, a norm scale, anything no dimension of which is split) is
  compressed on every device of the fast axes from the same slice
  gradient, and :func:`contract` averages the copies' results, so the
  state each device keeps stays the state of its own (virtual) block and
  every update stays one value per leaf.
  """
  def one(x, sp):
    # An axis of size 1 still gets its (single) copy: expand_specs names
    # it, whatever its size.
    if not missing_axes(sp, auto_axes):
      return x
    shape = (_copies(sp, mesh, auto_axes),) + tuple(np.shape(x))
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(shape, x.dtype)
    if isinstance(x, jax.core.Tracer):
      return jnp.broadcast_to(x[None], shape)
    return np.broadcast_to(np.asarray(jax.device_get(x))[None], shape)
  return jax.tree.map(one, tree, specs)


def copied(specs, auto_axes):
  """Per leaf: whether :func:`expand` gives it copies (a bool tree)."""
  return jax.tree.map(lambda sp: bool(missing_axes(sp, auto_axes)), specs,
                      is_leaf=lambda x: isinstance(x, P))


def own(tree, copies):
  """Inside the update on shards: each copy (a leading axis of size 1)
  as the leaf itself."""
  if copies is None:
    return tree

  def one(x, c):
    if not c:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[0]
  return jax.tree.map(one, tree, copies)


def contract(tree, specs, mesh, auto_axes):
  """Inverse of :func:`expand` inside the step: the copies of each expanded
  leaf averaged (exactly their common value where they agree, as after a
  dense mean; the first for non-floating leaves)."""
  def one(x, sp):
    if not missing_axes(sp, auto_axes):
      return x
    # Reductions over the copies' axis only (all-reduces over the auto
    # axes; reading one copy, x[0], would gather them): where the largest
    # and smallest copy agree, that value, exactly.
    if jnp.iscomplexobj(x):
      return jax.lax.complex(one(jnp.real(x), sp), one(jnp.imag(x), sp))
    hi = jnp.max(x, axis=0)
    if not _core.is_inexact(x):
      return hi
    lo = jnp.min(x, axis=0)
    mean = jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype)
    return jnp.where(hi == lo, hi, mean)
  return jax.tree.map(one, tree, specs)
