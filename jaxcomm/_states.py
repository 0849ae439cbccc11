"""Finding compressor states in any optimizer state (optax chains, Flax
``TrainState``, ``nnx.Optimizer`` and ``nnx.state`` trees) and their
statistics."""

from __future__ import annotations

import collections.abc
import sys

import jax

from jaxcomm._codec import CompressState
from jaxcomm._codec import CompressStats


def compress_states(opt_state) -> list[CompressState]:
  """Every compressor state in an optimizer state, in order.

  Found inside ``optax.chain``, ``inject_hyperparams``, ``MultiSteps``,
  ``masked`` or any nesting of tuples, named tuples, lists, mappings and
  other pytree nodes (a Flax ``TrainState``, an ``nnx.Optimizer``).

  Flax NNX trees work too: leaves wrapped in ``nnx.Variable`` (what
  ``nnx.Optimizer.opt_state`` holds) come back as arrays, and in
  ``nnx.state(optimizer)``, where NNX has turned every NamedTuple into a
  mapping of its field names and dropped the fields that hold no arrays, a
  mapping with a :class:`CompressState`'s fields (``count``, ``key`` and a
  ``stats`` mapping with :class:`CompressStats`'s fields among them) is read
  back as one: integer-keyed mappings become tuples and dropped fields
  ``()``.

  Args:
    opt_state: an optimizer state (any pytree).

  Returns:
    A list of :class:`jaxcomm.CompressState`, one per compressor found
    (empty when there is none).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxcomm
    >>> tx = optax.chain(jaxcomm.topk(0.1), optax.sgd(0.1))
    >>> states = jaxcomm.compress_states(tx.init({"w": jnp.zeros(512)}))
    >>> len(states), int(states[0].count)
    (1, 0)
  """
  # A CompressState holds buckets, never params-shaped trees: unwrapping
  # its Variables removes only nnx.Optimizer's OptArray wrappers.
  return [_unwrap(s) for s in states_of(
    opt_state, CompressState, from_mapping=_compress_state_from_mapping)]


def _nnx_variable_class():
  """``flax.nnx.Variable`` when Flax NNX is loaded (no NNX object can
  exist otherwise), else None; jaxcomm does not import flax."""
  nnx = sys.modules.get("flax.nnx")
  return getattr(nnx, "Variable", None)


def _unwrap(tree):
  """``tree`` with each ``nnx.Variable`` replaced by its value."""
  var = _nnx_variable_class()
  if var is None:
    return tree
  return jax.tree.map(
    lambda x: x.get_value() if isinstance(x, var) else x, tree,
    is_leaf=lambda x: isinstance(x, var))


def _as_tuples(x):
  """An NNX mapping read back as the tuples it was: integer keys ``0..k``
  give a tuple (missing entries, dropped by NNX for holding no arrays,
  ``()``), string-keyed mappings keep their keys."""
  if isinstance(x, collections.abc.Mapping):
    if x and all(isinstance(k, int) for k in x):
      return tuple(_as_tuples(x[i]) if i in x else ()
                   for i in range(max(x) + 1))
    return {k: _as_tuples(v) for k, v in x.items()}
  return x


def _compress_state_from_mapping(m):
  """The :class:`CompressState` that ``nnx.state`` turned into the mapping
  ``m``, or None when ``m`` is not one."""
  fields = set(CompressState._fields)
  keys = set(m)
  stats_ = m.get("stats") if all(isinstance(k, str) for k in keys) else None
  if not (keys <= fields and {"count", "key", "stats"} <= keys
          and isinstance(stats_, collections.abc.Mapping)
          and set(stats_) == set(CompressStats._fields)):
    return None
  values = {k: _as_tuples(_unwrap(m[k])) if k in m else ()
            for k in CompressState._fields if k != "stats"}
  return CompressState(
    stats=CompressStats(**{k: _unwrap(stats_[k])
                           for k in CompressStats._fields}), **values)


def states_of(opt_state, cls, *, from_mapping=None) -> list:
  """Every node of type ``cls`` in an optimizer state, in order (the one
  state walker: tuples, named tuples, lists, mappings, then any other
  pytree node's children, which covers dataclass states and Flax NNX
  Variables and Pytrees). Found nodes come back as they are;
  ``from_mapping(m)``, when given, may read a mapping as a ``cls`` (or
  return None)."""
  found = []

  def visit(x):
    if isinstance(x, cls):
      found.append(x)
    elif isinstance(x, (tuple, list)):
      for y in x:
        visit(y)
    elif isinstance(x, collections.abc.Mapping):
      read = from_mapping(x) if from_mapping is not None else None
      if read is not None:
        found.append(read)
        return
      for y in x.values():
        visit(y)
    elif x is not None:
      children = jax.tree_util.tree_flatten(
        x, is_leaf=lambda y: y is not x)[0]
      if not (len(children) == 1 and children[0] is x):
        for y in children:
          visit(y)

  visit(opt_state)
  return found


def stats(opt_state) -> list[CompressStats]:
  """Every compressor's statistics in an optimizer state, in order.

  Args:
    opt_state: an optimizer state (any pytree; see
      :func:`jaxcomm.compress_states`).

  Returns:
    A list of :class:`jaxcomm.CompressStats` (residual norm, non-finite
    steps), one per compressor found.
  """
  return [s.stats for s in compress_states(opt_state)]
