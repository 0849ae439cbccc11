"""Hierarchical local SGD (Abad, Ozfatura, Gündüz & Ercetin 2020): frequent
averaging inside a group, rare (compressed) averaging across groups.

On a pod mesh ``(slow, fast)`` a group is one row along ``slow`` (a host
or a slice: the cell of a small base station in the paper), its devices
along ``fast`` (the mobile users). Each device runs ``inner`` alone; every
``period`` steps a group averages its models over ``fast`` (one all-reduce
on the fast links); every ``global_period`` steps the groups' models meet
over ``slow``: the group model's delta from the last global model,
``theta - x_g``, is averaged across groups (optionally through any jaxcomm
compressor on the ``slow`` axis, its error feedback kept from global sync
to global sync, as the paper sparsifies with error accumulation) and
``theta <- theta - mean``; every device restarts from ``theta``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import wire
from jaxcomm._local_engine import LocalSpec
from jaxcomm._local_engine import _check_inner
from jaxcomm._local_engine import _local_engine
from jaxcomm._local_engine import mean_leaves


@dataclasses.dataclass(frozen=True)
class HierarchicalSpec(LocalSpec):
  """Wire accounting of :func:`jaxcomm.hierarchical_sgd`. ``n`` in
  :meth:`wire` is the number of groups (the compressor's axis); the group
  all-reduce's payload does not depend on the group size."""

  global_period: int = 1

  def _group(self, params) -> list:
    size = sum(int(jnp.size(l)) for l in _leaves(params))
    return [("all-reduce", 4 * size)]

  def _global(self, params, n, sync_index) -> list:
    if self.compressor is not None:
      return list(_compressor.spec_of(self.compressor).wire(
        _leaves(params), n, sync_index))
    return self._group(params)

  def wire(self, params, n: int, step: int | None = None,
           splits=None) -> list:
    del splits
    if step is None:
      return self._group(params) * 2 + self._global(params, n, None)
    c = step + 1
    if c % self.global_period == 0:
      return self._group(params) + self._global(
        params, n, c // self.global_period - 1)
    if c % self.period == 0:
      return self._group(params)
    return []

  def bytes_per_step(self, params, n: int, steps: int) -> float:
    total = 0.0
    for s in range(steps):
      total += wire.summarize(self.wire(params, n, s), n).total_sent
    return total / max(steps, 1)


def _leaves(params):
  return jax.tree.leaves(params)


@_registry.method(
    paper="Abad et al. 2020 (hierarchical FL)",
    defaults={"global_period": 4},
    summary=(
      "params averaged inside each group (the fast axis) every `period` "
      "steps; across groups (the slow axis, optionally compressed, error "
      "feedback kept) every `global_period` steps"))
def hierarchical_sgd(inner: optax.GradientTransformation, period: int,
                     global_period: int, *,
                     compressor: optax.GradientTransformation | None = None,
                     axis_name=("dcn", "ici")
                     ) -> optax.GradientTransformationExtraArgs:
  """Hierarchical local SGD: group averages often, global averages rarely.

  .. math::
    x_i \\leftarrow \\frac{1}{|G|}\\sum_{k \\in G} x_k \\ \\text{every }
    H \\text{ steps}, \\qquad
    \\theta \\leftarrow \\theta - \\frac{1}{m}\\sum_{g}
    C(\\theta - x_g),\\ x_i \\leftarrow \\theta \\ \\text{every }
    H_g \\text{ steps}

  (Abad et al. 2020, hierarchical SGD: mobile users' local steps, periodic
  averaging at their small-cell base station, rarer averaging at the macro
  base station.) ``axis_name = (slow, fast)``: groups are rows along
  ``slow``, their devices along ``fast``
  (:func:`jaxcomm.parallel.make_pod_mesh`). A group sync is one float32
  all-reduce over ``fast`` (``4 P`` bytes); a global sync first averages
  the group, then moves the group's delta over ``slow``: a dense
  all-reduce, or ``compressor``'s exchange (built on the ``slow`` axis;
  its error feedback spans global syncs). Steps that sync nothing issue
  no collective. The paper's inter-cell sparsified downlink is not
  modelled: every device restarts from the exact global model.

  Args:
    inner: the optimizer each device runs locally.
    period: steps between group averages (``H``), an int >= 1.
    global_period: steps between global averages (``H_g``), a multiple of
      ``period``.
    compressor: a jaxcomm compressor on the ``slow`` axis (e.g.
      ``jaxcomm.topk(0.05, axis_name="dcn")``), or None.
    axis_name: ``(slow, fast)``, two distinct mesh axis names, or None
      (one device, no exchange).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``anchor`` is the global
    model ``theta``; its ``update`` needs ``params`` and returns updates
    to apply with :func:`jaxcomm.apply_updates`. Build its
    :class:`jaxcomm.parallel.DataParallel` with the same ``axis_name``.

  Raises:
    ValueError: when ``inner`` is not an optax transformation, ``period``
      is not an int >= 1, ``global_period`` is not a positive multiple of
      ``period``, ``axis_name`` is not two distinct axis names (or None),
      or ``compressor`` is not a jaxcomm compressor on the ``slow`` axis;
      at ``update``, when called without ``params`` or where the axes are
      not bound.

  Examples:
    A 2 x 4 mesh of the 8 devices: 2 groups (``"dcn"``) of 4 devices
    (``"ici"``). Device ``i`` fits target ``i`` by SGD at rate 0.5; groups
    average every step, all devices every 2 steps. After step 1 each
    group holds the mean of its ``0.5 i``, 0.75 and 2.75; after step 2
    every device holds the global model (the mean of all eight):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_pod_mesh(2)     # ("dcn", "ici"): 2 x 4
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> def show(x):                               # one value per device
    ...   return np.asarray(x, np.float64).round(3).tolist()
    >>> tx = jaxcomm.hierarchical_sgd(optax.sgd(0.5), 1, 2,
    ...                               axis_name=("dcn", "ici"))
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh,
    ...                                    axis_name=("dcn", "ici"))
    >>> params, state = dp.init({"w": jnp.zeros(())})
    >>> batch = jnp.arange(8.0)                    # one example per device
    >>> params, state, _ = dp.step(params, state, batch)
    >>> show(params["w"])                          # group averages
    [0.75, 0.75, 0.75, 0.75, 2.75, 2.75, 2.75, 2.75]
    >>> params, state, _ = dp.step(params, state, batch)
    >>> show(params["w"])                          # the global average
    [2.625, 2.625, 2.625, 2.625, 2.625, 2.625, 2.625, 2.625]
  """
  _check_inner("inner", inner)
  period = _checks.step("period", period, 1)
  global_period = _checks.integer("global_period", global_period, period)
  if global_period % period:
    raise ValueError(f"global_period must be a multiple of period="
                     f"{period}, got {global_period}")
  if axis_name is None:
    slow = fast = None          # one device: every sync is the identity
  elif (not isinstance(axis_name, tuple) or len(axis_name) != 2
        or not all(isinstance(a, str) and a for a in axis_name)
        or axis_name[0] == axis_name[1]):
    raise ValueError("axis_name must be (slow, fast), two distinct mesh "
                     f"axis names, or None (one device), got {axis_name!r}")
  else:
    slow, fast = axis_name
  if compressor is not None:
    spec = _compressor.spec_of(compressor)   # named if not a compressor
    if spec.axis_name != slow:
      raise ValueError(
        f"compressor averages over axis_name={spec.axis_name!r}; "
        f"hierarchical_sgd compresses across groups: build it with "
        f"axis_name={slow!r}")

  def init_extra(params):
    if compressor is None:
      return {}
    leaves = [jnp.asarray(l) for l in jax.tree.leaves(params)]
    return {"compress": (compressor.init(leaves),)}

  def schedule_fn(count, state, value, ok):
    del value, ok
    glob = count % global_period == 0
    return [glob, (count % period == 0) & ~glob], state.schedule

  def global_sync(xs, anchors, outer, comp_s, sched):
    group = mean_leaves(xs, fast)
    delta = [(a.astype(jnp.float32) - x.astype(jnp.float32))
             for a, x in zip(anchors, group)]
    if compressor is not None:
      mean, c = compressor.update(delta, comp_s[0], list(anchors))
      comp_s = (c,)
    else:
      mean = mean_leaves(delta, slow)
    new = [(a.astype(jnp.float32) - m.astype(jnp.float32)).astype(a.dtype)
           for a, m in zip(anchors, mean)]
    return new, new, outer, comp_s, sched

  def group_sync(xs, anchors, outer, comp_s, sched):
    return anchors, mean_leaves(xs, fast), outer, comp_s, sched

  def merge(count, x, anchor, frag_of):
    del anchor, frag_of
    return x, [count % global_period == 0] * len(x)

  spec = HierarchicalSpec("hierarchical_sgd", period, compressor=compressor,
                          global_period=global_period)
  return _local_engine(inner, method="hierarchical_sgd",
                       axis_name=axis_name, period=period,
                       sync_fns=[global_sync, group_sync],
                       init_extra=init_extra, schedule_fn=schedule_fn,
                       merge=merge, spec=spec, levels=2)


__all__ = [
  "hierarchical_sgd",
]
