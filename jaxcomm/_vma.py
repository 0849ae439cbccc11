"""The one compatibility shim for shard_map's varying-axes types.

Inside ``jax.shard_map`` with ``check_vma=True`` every value is typed as
varying over some manual mesh axes. JAX 0.10+ exposes that set as
``aval.manual_axis_type.varying``; earlier JAX as ``aval.vma``. Everything
in jaxcomm that reads or sets that type goes through these functions.
"""

from __future__ import annotations

import inspect
from typing import Any
from typing import Sequence

import jax


def varying_axes(x) -> frozenset:
  """The mesh axes ``x`` is typed as varying over.

  Args:
    x: an array, a tracer, or an abstract value (e.g. from
      ``jax.eval_shape``).

  Returns:
    A frozenset of axis names, empty outside ``jax.shard_map`` or where
    ``check_vma`` is off.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> def f(x):
    ...   axes = jaxcomm.collectives.varying_axes
    ...   print(sorted(axes(x)), sorted(axes(jax.lax.psum(x, "data"))))
    ...   return x
    >>> _ = jax.shard_map(f, mesh=mesh, in_specs=P("data"),
    ...                   out_specs=P("data"))(jnp.zeros(8))
    ['data'] []
  """
  aval = x if hasattr(x, "manual_axis_type") or hasattr(x, "vma") else (
    jax.typeof(x))
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(getattr(mat, "varying", ()) or ())
  return frozenset(getattr(aval, "vma", ()) or ())


def mark_varying(x, axes) -> Any:
  """``x`` typed as varying over ``axes`` too (a type-only cast: no data
  moves)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def match_varying(x, like) -> Any:
  """``x`` typed as varying over every axis ``like`` varies over."""
  return mark_varying(x, varying_axes(like))


def union_varying(trees: Sequence[Any]) -> Any:
  """Per leaf, the union of the axes the leaves of ``trees`` (same
  structure; e.g. several ``lax.switch`` branches' abstract outputs) vary
  over."""
  return jax.tree.map(
    lambda *leaves: frozenset().union(*(varying_axes(l) for l in leaves)),
    *trees)


def _struct_kwarg() -> str:
  params = inspect.signature(jax.ShapeDtypeStruct).parameters
  return "manual_axis_type" if "manual_axis_type" in params else "vma"


_STRUCT_KWARG = _struct_kwarg()


def out_struct(shape, dtype, axes) -> jax.ShapeDtypeStruct:
  """A ``jax.ShapeDtypeStruct`` typed as varying over ``axes``."""
  axes = frozenset(axes)
  typed = (jax.sharding.ManualAxisType(varying=axes)
           if _STRUCT_KWARG == "manual_axis_type" else axes)
  return jax.ShapeDtypeStruct(tuple(shape), dtype, **{_STRUCT_KWARG: typed})


def unchecked(fn, *args) -> Any:
  """``fn(*args)`` with shard_map's varying-axes check off inside it, its
  outputs typed as varying over every axis an argument varies over.

  For JAX's own loops that do not type their carries (on TPU,
  ``jnp.linalg.eigh`` and ``svd`` of a matrix wider than the Jacobi
  solver's take a QDWH path whose ``while`` carry starts invariant: the
  step does not lower inside ``jax.shard_map``). A nested
  ``jax.shard_map`` over no new axes runs ``fn`` on each device's values
  as they are. Outside ``jax.shard_map``, or on invariant arguments, it is
  ``fn(*args)``.
  """
  axes = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(args)))
  if not axes:
    return fn(*args)
  from jax.sharding import PartitionSpec as P
  inner = jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(),
                        in_specs=P(), out_specs=P(), axis_names=frozenset(),
                        check_vma=False)
  return jax.tree.map(lambda o: mark_varying(o, axes), inner(*args))
