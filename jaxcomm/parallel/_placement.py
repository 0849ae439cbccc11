"""Placing arrays on a mesh: replicated params, sharded batches."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


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
  """Places a pytree replicated on every device of ``mesh``.

  Each process passes the same values; works across processes.

  Args:
    tree: a pytree of arrays (host or device), the same on every process.
    mesh: the mesh to place on.

  Returns:
    ``tree`` as global ``jax.Array`` leaves, replicated (``P()``).
  """
  sharding = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: _global(x, sharding), tree)


def shard_batch(batch, mesh, axis_name: str = "data"):
  """Turns this process's slice of a batch into global arrays.

  Leading axes are split over ``axis_name``. On one process pass the whole
  global batch; on many, each process passes its own contiguous slice.

  Args:
    batch: a pytree of arrays whose leading axis (the examples) splits
      evenly over this process's devices of ``axis_name``.
    mesh: the mesh.
    axis_name: the axis (or tuple of axes) the examples are split over.

  Returns:
    ``batch`` as global ``jax.Array`` leaves sharded ``P(axis_name)``.

  Raises:
    ValueError: naming the leaf, when a leading axis does not split
      evenly; or when ``axis_name`` is not an axis of ``mesh``.

  Examples:
    >>> import numpy as np, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> batch = jaxcomm.parallel.shard_batch({"x": np.zeros((16, 3))}, mesh)
    >>> batch["x"].shape, batch["x"].sharding.shard_shape((16, 3))
    ((16, 3), (2, 3))
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
