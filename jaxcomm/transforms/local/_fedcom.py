"""FedCOM and FedCOMGATE (Haddadpour, Kamani, Mokhtari & Mahdavi 2021):
federated learning with a compressed model delta, and its gradient-tracking
variant for heterogeneous data.

Round ``r`` on device ``j``, from the global model ``x^r``:

* ``tau`` local SGD steps with rate ``eta``: ``x_j <- x_j - eta d_j``,
  ``d_j = g_j`` (FedCOM) or ``d_j = g_j - delta_j`` (FedCOMGATE);
* the device sends ``Q_j = Q((x^r - x_j) / eta)`` (any jaxcomm compressor,
  or the exact mean without one), the server averages ``Q = mean_j Q_j``
  and steps ``x^{r+1} = x^r - eta gamma Q``;
* FedCOMGATE: ``delta_j <- delta_j + (Q_j - Q) / tau``. With ``delta_j``
  starting at 0, ``mean_j delta_j`` stays 0, and ``delta_j`` tracks device
  ``j``'s average gradient minus the devices' average: the correction
  ``g_j - delta_j`` points each device along the global direction.

Both run on the local-update engine (the round's end is the sync branch;
FedCOMGATE's ``delta_j`` lives per device in ``LocalState.schedule`` and
reaches the local step through the engine's ``correct`` hook).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _policy
from jaxcomm import _registry
from jaxcomm._local_engine import LocalSpec
from jaxcomm._local_engine import _check_inner
from jaxcomm._local_engine import _local_engine
from jaxcomm._local_engine import mean_leaves


class FedcomState(NamedTuple):
  """FedCOMGATE's per-device tracking term.

  Attributes:
    tracking: ``delta_j``, params-shaped (per device; its device mean is
      0 to float rounding).
  """

  tracking: Any


def _sent_leaves(compressor, message, residual):
  """What this device sent, leaf by leaf: ``message - e'`` on the
  compressed leaves (the compressor's residual after a call that started
  from ``e = 0``), the message itself on the leaves it averages exactly."""
  spec = _compressor.spec_of(compressor)
  paths = spec.paths(message)
  comp = [i for i, p in enumerate(paths) if p == _policy.COMPRESS]
  res = spec.leaves_of(residual, message)
  out = list(message)
  for i, e in zip(comp, res):
    out[i] = (message[i] - e.reshape(message[i].shape).astype(
      message[i].dtype))
  return out


def _check_compressor(who, compressor, axis_name, gate):
  if compressor is None:
    return
  spec = _compressor.spec_of(compressor)   # a jaxcomm compressor, or named
  if getattr(spec, "axis_name", axis_name) != axis_name:
    raise ValueError(
      f"compressor averages over axis_name={spec.axis_name!r} but {who}'s "
      f"axis_name is {axis_name!r}: build both on the same data axis")
  if gate:
    ef = getattr(compressor, "arguments", {}).get("error_feedback", True)
    if ef is not True:
      raise ValueError(
        f"{who} reads what each device sent from the compressor's residual "
        "(cleared before every round, so nothing is fed back): build the "
        f"compressor with error_feedback=True, got error_feedback={ef!r}")


def _fedcom(who, inner, learning_rate, period, server_lr, compressor, gate,
            axis_name):
  # In the signature's order: the error names the first wrong argument.
  _check_inner("inner", inner)
  period = _checks.step("period", period, 1)
  eta = float(_checks.number("learning_rate", learning_rate, 0.0,
                             lo_open=True))
  gamma = float(_checks.number("server_lr", server_lr, 0.0, lo_open=True))
  _checks.axis_name(axis_name)
  _check_compressor(who, compressor, axis_name, gate)

  def init_extra(params):
    leaves = [jnp.asarray(l) for l in jax.tree.leaves(params)]
    extra = {}
    if compressor is not None:
      c = compressor.init(leaves)
      if gate and not c.residual:
        raise ValueError(
          f"{who}: the compressor keeps no residual; build it with "
          "error_feedback=True")
      extra["compress"] = (c,)
    if gate:
      extra["schedule"] = FedcomState(tracking=jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)), params))
    return extra

  def correct(updates, state):
    return jax.tree.map(lambda g, d: g - d.astype(g.dtype), updates,
                        state.schedule.tracking)

  def sync(xs, anchors, outer, comp_s, sched):
    msg = [((a.astype(jnp.float32) - x.astype(jnp.float32)) / eta)
           for a, x in zip(anchors, xs)]
    if compressor is not None:
      c0 = comp_s[0]
      # No memory between rounds (the paper's Q): start from e = 0.
      c0 = c0._replace(residual=tuple(jnp.zeros_like(r)
                                      for r in c0.residual))
      mean, c = compressor.update(msg, c0, list(anchors))
      mean = list(mean)
      comp_s = (c,)
      sent = (_sent_leaves(compressor, msg, c.residual) if gate else None)
    else:
      mean = mean_leaves(msg, axis_name)
      sent = msg
    new = [(a.astype(jnp.float32) - eta * gamma * q.astype(jnp.float32)
            ).astype(a.dtype) for a, q in zip(anchors, mean)]
    if gate:
      leaves, treedef = jax.tree.flatten(sched.tracking)
      leaves = [(d + (s - q) / period).astype(d.dtype)
                for d, s, q in zip(leaves, sent, mean)]
      sched = FedcomState(tracking=jax.tree.unflatten(treedef, leaves))
    return new, new, outer, comp_s, sched

  spec = LocalSpec(who, period, compressor=compressor)
  return _local_engine(inner, method=who, axis_name=axis_name,
                       period=period, sync_fns=[sync],
                       init_extra=init_extra, spec=spec,
                       correct=correct if gate else None)


@_registry.method(
    static=("learning_rate", "server_lr"),
    defaults={"learning_rate": 0.1},
    paper="Haddadpour et al. 2021 (FedCOM)",
    summary=(
      "`period` local SGD steps, then the compressed (any jaxcomm "
      "compressor) model delta `(x - x_j) / eta` averaged; the server "
      "steps `x <- x - eta gamma Q`"))
def fedcom(inner: optax.GradientTransformation, period: int, *,
           learning_rate: float, server_lr: float = 1.0,
           compressor: optax.GradientTransformation | None = None,
           axis_name="data") -> optax.GradientTransformationExtraArgs:
  """FedCOM: local SGD rounds, a compressed model delta, a server step.

  .. math::
    Q = \\frac{1}{n}\\sum_j Q\\!\\left(\\frac{x - x_j}{\\eta}\\right),
    \\qquad x \\leftarrow x - \\eta\\gamma Q, \\qquad x_j \\leftarrow x

  (Haddadpour et al. 2021, Algorithm 1.) Each device runs ``period`` plain
  SGD steps of rate ``eta`` from the global model, then sends its delta
  divided by ``eta`` through ``compressor`` (without memory from round to
  round: the compressor's residual, if it keeps one, is cleared before
  each call; ``None``: the exact mean in one fused all-reduce). With
  ``server_lr = 1`` and no compressor it is FedAvg / local SGD.

  Args:
    inner: the local optimizer: ``optax.sgd(learning_rate)`` in the paper
      (another optimizer runs, but the message is still divided by
      ``learning_rate``).
    learning_rate: the local SGD rate ``eta``, > 0.
    period: local steps per round ``tau``.
    server_lr: the server's step ``gamma``, > 0.
    compressor: a jaxcomm compressor on the same ``axis_name`` (e.g.
      ``jaxcomm.qsgd(16)``), or None.
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``anchor`` is the global
    model ``x``; its ``update`` needs ``params`` and returns updates to
    apply with :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``learning_rate`` or ``server_lr`` is not a finite number > 0,
      ``period`` is not an int >= 1, ``compressor`` is not a jaxcomm
      compressor or averages over another axis than ``axis_name``, or
      ``axis_name`` is not a valid axis name; at ``update``, when called without
      ``params`` or where ``axis_name`` is not bound.

  Examples:
    Eight devices fitting their own random targets ``t_j`` (4 values
    each) by SGD at ``eta = 0.5``, rounds of 2 steps, the messages
    through top-1 of 4 (:func:`jaxcomm.topk` at 0.25, with a policy that
    compresses this small leaf). After a round device ``j`` holds
    ``0.75 t_j`` and sends ``Q_j = top1((0 - 0.75 t_j) / 0.5)``; the
    server steps ``x = 0 - 0.5 * 1 * mean_j Q_j`` and every device
    restarts there:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.sum((params["w"] - x) ** 2)
    >>> policy = jaxcomm.LeafPolicy(min_size=1)      # compress w, 4 values
    >>> tx = jaxcomm.fedcom(optax.sgd(0.5), 2, learning_rate=0.5,
    ...                     compressor=jaxcomm.topk(0.25, policy=policy))
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(4)})
    >>> t = np.random.RandomState(0).randn(8, 4)     # row j: device j's
    >>> params, state, _ = dp.step(params, state, t)
    >>> bool(np.allclose(params["w"], 0.5 * t))      # local, apart
    True
    >>> params, state, _ = dp.step(params, state, t)
    >>> def top1(v):                                 # each row's largest
    ...   return np.where(np.abs(v) == np.abs(v).max(1, keepdims=True), v, 0)
    >>> q = top1((0 - 0.75 * t) / 0.5).mean(0)       # the server's Q
    >>> bool(np.allclose(params["w"], 0 - 0.5 * 1.0 * q, atol=1e-6))
    True
    >>> np.asarray(params["w"][0], np.float64).round(3).tolist()
    [0.504, 0.0, 0.0, 0.346]
  """
  return _fedcom("fedcom", inner, learning_rate, period, server_lr, compressor,
                 False, axis_name)


@_registry.method(
    static=("learning_rate", "server_lr"),
    defaults={"learning_rate": 0.1},
    paper="Haddadpour et al. 2021 (FedCOMGATE)",
    summary=(
      "FedCOM with local gradient tracking: local gradients corrected by "
      "`delta_j`, updated by `(Q_j - Q) / tau` after each compressed "
      "round"))
def fedcomgate(inner: optax.GradientTransformation, period: int, *,
               learning_rate: float, server_lr: float = 1.0,
               compressor: optax.GradientTransformation | None = None,
               axis_name="data") -> optax.GradientTransformationExtraArgs:
  """FedCOMGATE: FedCOM with local gradient tracking (heterogeneous data).

  .. math::
    x_j \\leftarrow x_j - \\eta (g_j - \\delta_j), \\qquad
    x \\leftarrow x - \\eta\\gamma Q, \\qquad
    \\delta_j \\leftarrow \\delta_j + \\frac{Q_j - Q}{\\tau}

  (Haddadpour et al. 2021, Algorithm 2.) As :func:`jaxcomm.fedcom`, with
  each local gradient corrected by the device's tracking term ``delta_j``
  (0 at first), which moves after each round by the gap between what the
  device sent, ``Q_j = Q((x - x_j) / eta)``, and the average ``Q``, over
  ``tau``. ``Q_j`` is read from the compressor's residual (``Q_j = m_j -
  e'`` after a call from ``e = 0``), so a compressor must be built with
  ``error_feedback=True``; nothing is fed back from round to round.

  Args:
    inner: the local optimizer: ``optax.sgd(learning_rate)`` in the paper
      (another optimizer runs, but the message is still divided by
      ``learning_rate``).
    learning_rate: the local SGD rate ``eta``, > 0.
    period: local steps per round ``tau``.
    server_lr: the server's step ``gamma``, > 0.
    compressor: a jaxcomm compressor (``error_feedback=True``) on the same
      ``axis_name``, or None.
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``anchor`` is the global
    model ``x`` and whose ``schedule`` is a :class:`jaxcomm.FedcomState`
    (``delta_j``); its ``update`` needs ``params`` and returns updates to
    apply with :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``learning_rate`` or ``server_lr`` is not a finite number > 0,
      ``period`` is not an int >= 1, ``compressor`` is not a jaxcomm
      compressor or averages over another axis than ``axis_name`` or is
      not built with
      ``error_feedback=True``, or ``axis_name`` is not a valid axis name;
      at ``init``, when the compressor keeps no residual; at ``update``,
      when called without ``params`` or where ``axis_name`` is not bound.

  Examples:
    As :func:`jaxcomm.fedcom`'s example: 8 devices, random targets
    ``t_j``, ``eta = 0.5``, rounds of 2 steps, top-1 of 4. Device ``j``
    sent ``Q_j = top1(-1.5 t_j)``; after the round its tracking term is
    ``delta_j = (Q_j - mean_j Q_j) / 2`` (mean 0 over devices), and the
    next local step follows the corrected gradient ``g_j - delta_j``:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.sum((params["w"] - x) ** 2)
    >>> policy = jaxcomm.LeafPolicy(min_size=1)      # compress w, 4 values
    >>> tx = jaxcomm.fedcomgate(optax.sgd(0.5), 2, learning_rate=0.5,
    ...                         compressor=jaxcomm.topk(0.25, policy=policy))
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(4)})
    >>> t = np.random.RandomState(0).randn(8, 4)     # row j: device j's
    >>> for _ in range(2):
    ...   params, state, _ = dp.step(params, state, t)
    >>> def top1(v):                                 # each row's largest
    ...   return np.where(np.abs(v) == np.abs(v).max(1, keepdims=True), v, 0)
    >>> sent = top1(-1.5 * t)                        # Q_j, row j
    >>> delta = np.array(state.schedule.tracking["w"])   # (8, 4): per device
    >>> bool(np.allclose(delta, (sent - sent.mean(0)) / 2, atol=1e-6))
    True
    >>> x = np.array(params["w"])
    >>> params, state, _ = dp.step(params, state, t)
    >>> bool(np.allclose(params["w"], x - 0.5 * ((x - t) - delta), atol=1e-6))
    True
  """
  return _fedcom("fedcomgate", inner, learning_rate, period, server_lr,
                 compressor, True, axis_name)


__all__ = [
  "FedcomState",
  "fedcom",
  "fedcomgate",
]
