"""Schemes that change *when* gradients are applied: Pipe-SGD's one-step-late
average (Li et al. 2018), bounded staleness simulated in SPMD (Grishchenko
et al. 2018; Bogoychev et al. 2018) and Grishchenko et al.'s sparsified
proximal scheme with identification on L1-regularized problems.

Each keeps what is in flight in its state (the pending averaged gradient,
the ring buffer of local gradients, the workers' points), so a checkpoint
of the optimizer state resumes the schedule exactly: nothing lives outside
the state, and a restored run continues bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.transforms.quantize import _dense


def _exchange_of(exchange, who: str, axis_name="data"):
  """``exchange`` (a jaxcomm compressor) or the dense mean over
  ``axis_name``, and its spec."""
  given = exchange is not None
  if exchange is None:
    exchange = _dense.mean_gradients(axis_name=axis_name)
  if not isinstance(exchange, optax.GradientTransformation):
    raise ValueError(f"{who}: exchange must be a jaxcomm compressor (an "
                     f"optax transformation), got {type(exchange).__name__}")
  try:
    spec = _codec.spec_of(exchange)
  except ValueError:
    raise ValueError(
      f"{who}: exchange must be a jaxcomm compressor (jaxcomm.int8(), "
      "jaxcomm.topk(0.01), jaxcomm.mean_gradients(), ...), not an "
      "optax.chain or an optimizer: the delay applies to the averaged "
      "gradient, before the optimizer") from None
  if given and axis_name not in ("data", spec.axis_name):
    raise ValueError(
      f"{who}: axis_name={axis_name!r} names another axis than the "
      f"exchange's ({spec.axis_name!r}); axis_name is the dense mean's "
      "when no exchange is given")
  return optax.with_extra_args_support(exchange), spec


def _floating(leaf) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _buffers(params, slots: int) -> list:
  """Zeros ``[slots, *shape]`` for each floating leaf of ``params`` (tree
  order); other leaves (integer steps, masks) are never delayed."""
  return [jnp.zeros((slots,) + jnp.shape(p), jnp.result_type(p))
          for p in jax.tree.leaves(params) if _floating(p)]


def _replace_floating(tree, new: list):
  """``tree`` with its floating leaves replaced by ``new`` (tree order)."""
  leaves, treedef = jax.tree.flatten(tree)
  it = iter(new)
  return treedef.unflatten([next(it).astype(x.dtype) if _floating(x) else x
                            for x in leaves])


def _floating_leaves(tree) -> list:
  return [x for x in jax.tree.leaves(tree) if _floating(x)]


# ------------------------------------------------------------ Pipe-SGD ----


class PipeSGDState(NamedTuple):
  """State of :func:`pipe_sgd`.

  Attributes:
    count: steps taken (int32).
    pending: the averaged gradients in flight, one array per floating
      leaf (tree order), ``[width - 1, *shape]`` in the leaf's dtype, the
      same on every device, oldest first: ``[:, 0]`` is what the next step
      applies. Non-floating leaves pass through undelayed.
    inner: the exchange's state (its error feedback, if any).
  """

  count: jax.Array
  pending: Any
  inner: optax.OptState


@_registry.method(
    paper="Li et al. 2018 (Pipe-SGD)",
    summary="the exchange's average applied width - 1 steps late, so the "
    "exchange of step t overlaps step t + 1")
def pipe_sgd(exchange: optax.GradientTransformation | None = None, *,
             width: int = 2,
             axis_name="data") -> optax.GradientTransformationExtraArgs:
  """Pipe-SGD: the averaged gradient is applied ``width - 1`` steps late.

  .. math::
    u_t = \\bar g_{t-K+1}, \\qquad
    \\bar g_s = \\mathrm{exchange}(g_{1,s}, \\dots, g_{n,s})

  with ``K = width`` (Li et al. 2018 use ``K = 2``: the step at ``t``
  applies the all-reduced gradient of ``t - 1``, so the all-reduce of step
  ``t`` can run while step ``t + 1`` computes its gradient). ``exchange``
  is any jaxcomm compressor (the dense mean by default; the paper
  compresses its all-reduce by truncation and scalar quantization, e.g.
  ``jaxcomm.int8()``): it runs on this step's gradient as usual and its
  result goes into the state only; what this step returns is the state's
  oldest pending average. The step's collective therefore feeds no part
  of this step's update: in the compiled program the new params depend on
  no collective (``tests/test_delayed.py`` reads it from the HLO).

  The first ``width - 1`` steps apply zero: nothing has been averaged
  yet when the pipeline starts (the params stay at their initial values
  for one step at ``K = 2``).

  Compose it before the optimizer, around the exchange, as every jaxcomm
  compressor::

    tx = optax.chain(jaxcomm.pipe_sgd(jaxcomm.int8()), optax.sgd(0.1))

  The optimizer then sees the delayed average (the paper's
  ``w_t = w_{t-1} - lr g(w_{t-2})`` with SGD) and keeps its own state
  unchanged; the pending buffer is one averaged gradient, replicated.

  A checkpoint of the state holds ``pending`` and ``count``: a restored
  run applies, at its next step, the average of the step before the save,
  and continues bit for bit as if never stopped. Wire bytes are the
  exchange's (``jaxcomm.wire.claimed(tx, params, n)`` gives its claim).

  Args:
    exchange: a jaxcomm compressor (``jaxcomm.mean_gradients()`` when
      None); its ``axis_name`` is the data axis.
    axis_name: the dense mean's axis when ``exchange`` is None (a given
      exchange keeps its own).
    width: the pipeline width ``K >= 2``: the update is ``K - 1`` steps
      late.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`PipeSGDState`.

  Raises:
    ValueError: naming the argument, when ``width`` is not an int >= 2,
      ``exchange`` is not a jaxcomm compressor (an ``optax.chain`` or an
      optimizer, say), or ``axis_name`` names another axis than a given
      exchange's. The update raises a ValueError for a state that is not
      a :class:`PipeSGDState`, and (through the exchange) outside a
      context that binds the exchange's axis.

  Examples:
    Around a compressor, before the optimizer:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> tx = optax.chain(jaxcomm.pipe_sgd(jaxcomm.topk(0.01)),
    ...                  optax.sgd(0.1))

    Two steps on 8 devices around top-k (half of a 4-value leaf sent).
    Device ``i`` (1 to 8) has the gradient ``[i, -i, 0.1, 0.2]`` at step
    0 and twice it at step 1. Step 0 applies zero (nothing averaged yet);
    step 1 applies step 0's average, ``[4.5, -4.5, 0, 0]``, not its own:

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()           # 8 devices on "data"
    >>> policy = jaxcomm.LeafPolicy(min_size=1)      # compress 4 values
    >>> tx = jaxcomm.pipe_sgd(jaxcomm.topk(0.5, policy=policy))
    >>> def two_steps(g):
    ...   state = tx.init(g[0])
    ...   u0, state = tx.update(g[0], state)
    ...   u1, state = tx.update(2 * g[0], state)
    ...   return u0, u1
    >>> i = jnp.arange(1.0, 9.0)[:, None]
    >>> grads = jnp.concatenate([i, -i, 0 * i + 0.1, 0 * i + 0.2], axis=1)
    >>> u0, u1 = jax.jit(jax.shard_map(
    ...   two_steps, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P())))(grads)
    >>> print(np.asarray(u0).round(3), np.asarray(u1).round(3))
    [0. 0. 0. 0.] [ 4.5 -4.5  0.   0. ]

  References:
    Li et al, `Pipe-SGD: A Decentralized Pipelined SGD Framework for
    Distributed Deep Net Training <https://arxiv.org/abs/1811.03619>`_,
    NeurIPS 2018.
  """
  width = _checks.integer("width", width, 2)
  exchange, spec = _exchange_of(exchange, "pipe_sgd", axis_name)

  def init_fn(params):
    return PipeSGDState(jnp.zeros([], jnp.int32), _buffers(params, width - 1),
                        exchange.init(params))

  def update_fn(updates, state, params=None, **extra):
    _checks.state_type("pipe_sgd", state, PipeSGDState)
    mean, inner = exchange.update(updates, state.inner, params, **extra)
    applied = _replace_floating(mean, [q[0] for q in state.pending])
    pending = [jnp.concatenate([q[1:], m[None].astype(q.dtype)])
               for q, m in zip(state.pending, _floating_leaves(mean))]
    return applied, PipeSGDState(state.count + 1, pending, inner)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, spec), update_fn)


# --------------------------------------------------- bounded staleness ----


class StaleState(NamedTuple):
  """State of :func:`stale_sgd`.

  Attributes:
    count: steps taken (int32), the same on every device.
    history: this device's last ``tau_max + 1`` local gradients, a ring
      buffer per floating leaf (tree order) ``[tau_max + 1, *shape]``: the
      gradient of step ``s`` is in slot ``s mod (tau_max + 1)`` (per
      device). Non-floating leaves pass through undelayed.
    inner: the exchange's state.
  """

  count: jax.Array
  history: Any
  inner: optax.OptState


def _taus(tau, tau_max):
  """Checked ``(tau, tau_max)``: ``tau`` an int, a tuple of ints (one per
  device) or None (random per step), ``tau_max`` an int bound."""
  if tau is None:
    if tau_max is None:
      raise ValueError("tau_max must be given (an int >= 0) when tau is None "
                       "(a random staleness per device and step in "
                       "[0, tau_max])")
    return None, _checks.integer("tau_max", tau_max, 0)
  if isinstance(tau, (list, tuple, np.ndarray)):
    taus = tuple(_checks.integer(f"tau[{i}]", t, 0)
                 for i, t in enumerate(tau))
    if not taus:
      raise ValueError("tau must be an int >= 0, one per device, or None; "
                       "got an empty sequence")
  else:
    taus = _checks.integer("tau", tau, 0)
  top = max(taus) if isinstance(taus, tuple) else taus
  if tau_max is None:
    return taus, top
  tau_max = _checks.integer("tau_max", tau_max, 0)
  if tau_max < top:
    raise ValueError(f"tau_max must be >= max(tau) = {top}, got {tau_max}")
  return taus, tau_max


def staleness(tau, tau_max: int, count, n: int, seed: int = 0) -> jax.Array:
  """The staleness of every device at step ``count``, int32 ``[n]``: the
  fixed ``tau`` (an int or one per device) or, when ``tau`` is None, a draw
  from ``uniform{0..tau_max}`` with the key ``fold_in(PRNGKey(seed),
  count)`` (the same on every device)."""
  if tau is None:
    key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
    return jax.random.randint(key, (n,), 0, tau_max + 1, jnp.int32)
  if isinstance(tau, tuple):
    if len(tau) != n:
      raise ValueError(f"stale_sgd: tau has {len(tau)} entries for {n} "
                       "devices: give one per device along the axis")
    return jnp.asarray(tau, jnp.int32)
  return jnp.full((n,), tau, jnp.int32)


@_registry.method(
    paper="Grishchenko et al. 2018; Bogoychev et al. 2018 (bounded "
    "staleness)",
    summary="each device's gradient reaches the exchange tau_i steps old "
    "(fixed per device or random up to tau_max)")
def stale_sgd(exchange: optax.GradientTransformation | None = None, *,
              tau: int | Sequence[int] | None = 1,
              tau_max: int | None = None,
              seed: int = 0,
              axis_name="data") -> optax.GradientTransformationExtraArgs:
  """Bounded-staleness SGD, simulated in SPMD: gradients ``tau_i`` steps old.

  Device ``i``'s contribution to the average is its gradient of ``tau_i``
  steps ago.

  .. math::
    u_t = \\mathrm{exchange}\\big(g_{1, t - \\tau_1(t)}, \\dots,
                                   g_{n, t - \\tau_n(t)}\\big),
    \\qquad 0 \\le \\tau_i(t) \\le \\tau_{max}

  with ``g_{i,s} = 0`` for ``s < 0``. In an asynchronous parameter server
  (Grishchenko et al. 2018; Bogoychev et al. 2018) a worker's gradient
  reaches the model after other workers' updates: it is stale. Here every
  device steps together and keeps its last ``tau_max + 1`` local gradients
  in a ring buffer (the state's ``history``); each step it writes this
  step's gradient and hands the exchange the one of ``tau_i`` steps ago.
  ``tau`` is fixed per device (an int for all, or one per device along the
  exchange's axis) or, with ``tau=None``, drawn each step from
  ``uniform{0..tau_max}`` per device with a key folded from ``seed`` and
  the step (the same draw on every device; ``staleness``). With a fixed
  ``tau`` every gradient is applied exactly once, ``tau_i`` steps late;
  with a random one a gradient may be applied twice or never (a simulated
  staleness distribution, not a queue). ``tau=0`` is plain synchronous SGD.

  The exchange's bytes are unchanged (``jaxcomm.wire.claimed``); the state
  costs ``tau_max + 1`` gradients per device. A checkpoint holds the ring
  buffer and the step: a restored run hands the exchange exactly the
  gradients the uninterrupted run would, bit for bit. (Resized to another
  device count, ``resize_state`` averages merged devices' buffers: their
  staleness is no longer each device's own.)

  Args:
    exchange: a jaxcomm compressor (``jaxcomm.mean_gradients()`` when
      None).
    axis_name: the dense mean's axis when ``exchange`` is None (a given
      exchange keeps its own).
    tau: an int ``>= 0`` (every device), a sequence of ints (one per
      device along the exchange's axis), or None (random per step).
    tau_max: the bound (the ring buffer holds ``tau_max + 1`` gradients);
      default ``max(tau)``; required when ``tau`` is None.
    seed: the seed of the random staleness (``tau=None``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`StaleState`.

  Raises:
    ValueError: naming the argument, when ``tau`` is not an int >= 0, a
      non-empty sequence of them or None, ``tau_max`` is missing with
      ``tau=None``, not an int >= 0 or below ``max(tau)``, ``seed`` is not
      an int >= 0, ``exchange`` is not a jaxcomm compressor, or
      ``axis_name`` names another axis than a given exchange's. The update
      raises a ValueError when ``tau`` has not one entry per device, and
      for a state that is not a :class:`StaleState`, and when it runs
      outside a context that binds the exchange's axis (a ``shard_map`` or
      :class:`jaxcomm.parallel.DataParallel` step), naming that axis.

  Examples:
    Around a compressor, before the optimizer:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> tx = optax.chain(jaxcomm.stale_sgd(jaxcomm.int8(), tau=1),
    ...                  optax.sgd(0.1))

    Three steps on 8 devices around the dense mean; devices 4 to 7 are
    one step late. Every device's gradient is ``t + 1`` at step ``t``, so
    the average is ``(t + 1 + t) / 2``: at step 0 the late half hands
    zeros (no gradient yet), then its previous step's gradient:

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()           # 8 devices on "data"
    >>> tx = jaxcomm.stale_sgd(tau=(0, 0, 0, 0, 1, 1, 1, 1))
    >>> def three_steps(g):
    ...   state, out = tx.init(g[0]), []
    ...   for t in range(3):
    ...     update, state = tx.update((t + 1) * g[0], state)
    ...     out.append(update)
    ...   return jnp.stack(out)
    >>> updates = jax.jit(jax.shard_map(
    ...   three_steps, mesh=mesh, in_specs=P("data"),
    ...   out_specs=P()))(jnp.ones((8, 2)))
    >>> print(np.asarray(updates).round(3))
    [[0.5 0.5]
     [1.5 1.5]
     [2.5 2.5]]

  References:
    Grishchenko et al, `Asynchronous Distributed Learning with Sparse
    Communications and Identification <https://arxiv.org/abs/1812.03871>`_,
    2018. Bogoychev et al, `Accelerating Asynchronous Stochastic Gradient
    Descent for Neural Machine Translation
    <https://arxiv.org/abs/1808.08859>`_, EMNLP 2018.
  """
  taus, tau_max = _taus(tau, tau_max)
  seed = _checks.seed("seed", seed)
  exchange, spec = _exchange_of(exchange, "stale_sgd", axis_name)
  axis = spec.axis_name
  slots = tau_max + 1

  def init_fn(params):
    return StaleState(jnp.zeros([], jnp.int32), _buffers(params, slots),
                      exchange.init(params))

  def update_fn(updates, state, params=None, **extra):
    _checks.state_type("stale_sgd", state, StaleState)
    n = _core.check_axis(axis, "jaxcomm.stale_sgd")
    t = state.count
    mine = staleness(taus, tau_max, t, n, seed)[_core.axis_index(axis)]
    write = jnp.mod(t, slots)
    read = jnp.mod(t - mine, slots)
    history = [jax.lax.dynamic_update_index_in_dim(
      h, g.astype(h.dtype), write, 0)
               for h, g in zip(state.history, _floating_leaves(updates))]
    old = _replace_floating(updates, [
      jax.lax.dynamic_index_in_dim(h, read, 0, keepdims=False)
      for h in history])
    mean, inner = exchange.update(old, state.inner, params, **extra)
    return mean, StaleState(t + 1, history, inner)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, spec), update_fn)


# ------------------------------- sparse communications, identification ----


class SpyState(NamedTuple):
  """State of :func:`spy`.

  Attributes:
    count: steps taken (int32).
    point: this device's last point ``x_i`` (float32, flat), per device.
    aggregate: the master's ``xbar = mean_i x_i`` (float32, flat),
      replicated.
    sent: coordinates sent by all devices at the last step (int32).
    sent_total: coordinates sent by all devices since init (int32).
  """

  count: jax.Array
  point: jax.Array
  aggregate: jax.Array
  sent: jax.Array
  sent_total: jax.Array


@dataclasses.dataclass(frozen=True)
class SpySpec:
  """Wire accounting of :func:`spy`: one all-reduce of the masked update
  (float32, every coordinate: the SPMD simulation moves it dense) and the
  count of coordinates sent, fused."""

  axis_name: Any
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None, splits=None):
    del n, step, splits
    size = sum(int(np.size(l)) for l in jax.tree.leaves(params))
    return [("all-reduce", 4 * (size + 1))]


def soft_threshold(x, threshold):
  """The prox of ``threshold * ||.||_1``: ``sign(x) max(|x| - t, 0)``."""
  return jnp.sign(x) * jnp.maximum(jnp.abs(x) - threshold, 0.0)


def spy(step_size: float, l1: float, probability: float, *,
        identify: bool = True, seed: int = 0,
        axis_name="data") -> optax.GradientTransformationExtraArgs:
  """Grishchenko et al.'s sparsified proximal gradient with identification.

  For ``min_x (1/n) sum_i f_i(x) + l1 ||x||_1`` (device ``i`` holds
  ``f_i``): the master keeps ``xbar = (1/n) sum_i x_i`` and the point
  ``x = prox(xbar) = soft_threshold(xbar, step_size * l1)``; worker ``i``
  computes its gradient at ``x`` and moves its own ``x_i`` on a random
  subset ``S_i`` of the coordinates only,

  .. math::
    [x_i]_j \\leftarrow [x - \\gamma \\nabla f_i(x)]_j
      \\ (j \\in S_i), \\qquad
    \\Delta_i = x_i^{new} - x_i, \\qquad
    \\bar x \\leftarrow \\bar x + \\tfrac1n \\textstyle\\sum_i \\Delta_i,

  sending only ``[Delta_i]_{S_i}``. With ``identify=False``, each coordinate
  is in ``S_i`` with ``probability`` (the paper's random sparsification).
  With ``identify=True`` (the paper's identification-based sparsification)
  every coordinate in the support of the current point ``x`` is sent and
  the others with ``probability``: once the iterates identify the
  solution's support (the L1 prox makes them sparse), a worker sends
  about ``|supp| + probability (d - |supp|)`` coordinates.

  The update returned is ``prox(xbar_new) - params``: start from params
  with ``params == prox(params)`` (e.g. zeros), and apply with
  ``optax.apply_updates``; no optimizer after it (the step size is
  ``step_size``). Masks come from ``fold_in(fold_in(PRNGKey(seed), step),
  device)``. Simulated in SPMD: the workers step together (the paper's
  asynchronous delays are 0 here) and the exchange is one all-reduce of the
  masked ``Delta`` (dense on the wire; the state counts the coordinates
  the paper would send, ``sent`` and ``sent_total``; a coordinate costs a
  value and an index, 8 bytes).

  A checkpoint holds every worker's point, the aggregate and the counters:
  a restored run continues bit for bit (the masks depend on the step only).

  Args:
    step_size: ``gamma > 0``.
    l1: the L1 weight ``>= 0``.
    probability: the chance a coordinate (outside the support, with
      ``identify``) is sent, in ``(0, 1]``.
    identify: always send the coordinates of the current support.
    seed: the masks' seed.
    axis_name: the data axis.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its ``init`` carries the
    wire claim (``jaxcomm.wire.claimed(tx, params, n)``).

  Raises:
    ValueError: naming the argument, when ``step_size`` is not a finite
      number > 0, ``l1`` not a finite number >= 0, ``probability`` not in
      ``(0, 1]``, ``identify`` not a bool, ``seed`` not an int >= 0, or
      ``axis_name`` invalid. The update raises a ValueError without
      ``params``, for a state that is not a :class:`SpyState`, and when it
      runs outside a context that binds ``axis_name`` (a ``shard_map`` or
      :class:`jaxcomm.parallel.DataParallel` step), naming that axis.

  References:
    Grishchenko et al, `Asynchronous Distributed Learning with Sparse
    Communications and Identification <https://arxiv.org/abs/1812.03871>`_,
    2018.
  """
  _checks.number("step_size", step_size, 0.0, None, lo_open=True,
                 finite=True)
  _checks.number("l1", l1, 0.0, None, finite=True)
  _checks.number("probability", probability, 0.0, 1.0, lo_open=True)
  _checks.boolean("identify", identify)
  seed = _checks.seed("seed", seed)
  _checks.axis_name(axis_name)

  def init_fn(params):
    flat, _ = ravel_pytree(params)
    flat = flat.astype(jnp.float32)
    zero = jnp.zeros([], jnp.int32)
    return SpyState(zero, flat, flat, zero, zero)

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("jaxcomm.spy needs params: call "
                       "tx.update(grads, state, params)")
    _checks.state_type("spy", state, SpyState)
    g, _ = ravel_pytree(updates)
    x, unravel = ravel_pytree(params)
    x32 = x.astype(jnp.float32)
    n = _core.check_axis(axis_name, "jaxcomm.spy")
    i = _core.axis_index(axis_name)
    key = jax.random.fold_in(
      jax.random.fold_in(jax.random.PRNGKey(seed), state.count), i)
    mask = jax.random.uniform(key, x32.shape) < probability
    if identify:
      mask = mask | (x32 != 0)
    target = x32 - step_size * g.astype(jnp.float32)
    delta = jnp.where(mask, target - state.point, 0.0)
    count = jnp.sum(mask).astype(jnp.float32)
    total = _core.psum(jnp.concatenate([delta, count[None]]), axis_name)
    aggregate = state.aggregate + total[:-1] / n
    new = soft_threshold(aggregate, step_size * l1)
    sent = total[-1].astype(jnp.int32)
    out = unravel((new - x32).astype(x.dtype))
    return out, SpyState(state.count + 1, state.point + delta, aggregate,
                         sent, state.sent_total + sent)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, SpySpec(axis_name)), update_fn)


__all__ = [
  "PipeSGDState",
  "SpyState",
  "StaleState",
  "pipe_sgd",
  "spy",
  "stale_sgd",
]
