"""SQuARM-SGD (Singh, Data, George & Diggavi 2020): decentralized momentum
SGD with compressed, event-triggered gossip. Devices take local (Nesterov)
steps; every ``period`` steps each device whose model moved far enough
from its public copy sends a compressed CHOCO-style difference to its
neighbours, and the others send nothing."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _local_engine
from jaxcomm import _per_device
from jaxcomm import _registry
from jaxcomm._local_engine import LocalState
from jaxcomm._local_engine import _check_inner
from jaxcomm.collectives import _core
from jaxcomm.collectives import _gossip as _gossip_collectives
from jaxcomm.transforms.gossip import _gossip
from jaxcomm.transforms.sparsify import _sparsification


class SquarmState(NamedTuple):
  """SQuARM-SGD's gossip memory and counters (per device).

  Attributes:
    public: ``x_hat_i``, the sum of the messages this device sent (what
      its neighbours know of its params), one flat float32 buffer per
      bucket of the compressor's layout, then one of its dense leaves.
    mixed: ``sum_j W_ij x_hat_j`` (the self term included), like
      ``public``.
    key: PRNG key data (the same on every device; random-k's coordinates).
    sends: int32, how many times this device's trigger fired (it sent a
      message).
    rounds: int32, how many synchronization steps ran the exchange (some
      device's trigger fired); the same on every device.
  """

  public: Any
  mixed: Any
  key: jax.Array
  sends: jax.Array
  rounds: jax.Array


# The public copies describe the old graph; on another device count they
# and the counters restart at 0, as at init.
_per_device.register(SquarmState, public=_per_device.restart(0.0),
                     mixed=_per_device.restart(0.0),
                     sends=_per_device.restart(0.0),
                     rounds=_per_device.restart(0.0))


@dataclasses.dataclass(frozen=True)
class SquarmSpec:
  """Wire accounting of :func:`jaxcomm.squarm`: on a synchronization step, one
  4-byte all-reduce (whether any trigger fired) and, when one did, CHOCO's
  messages (one fused collective-permute per neighbour). Other steps move
  nothing. The claim for a synchronization step is the exchange's (what
  it moves when some device sends)."""

  compressor: Any
  topology: str
  period: int
  adaptive: bool = False
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None,
           splits=None) -> list:
    del splits  # block semantics: no whole-leaf exchange
    if n == 1 or (step is not None and (step + 1) % self.period):
      return []
    words = _gossip._choco_message_words(self.compressor, params, n)
    return [("all-reduce", 4)] + _gossip_collectives.gossip_wire(
      self.topology, n, words, None)


def _dense_if_none(compressor):
  """None: random-k at ratio 1 (its default leaf policy; the small leaves
  go dense), i.e. ``C`` the identity and every value sent as float32."""
  if compressor is None:
    return _sparsification.randomk(1.0)
  return compressor


def _schedule(name, value, lo_open):
  """A float (checked) or a schedule, as a function of the step."""
  if callable(value):
    return lambda c: jnp.asarray(value(c), jnp.float32)
  _checks.number(name, value, 0.0, None, lo_open=lo_open, finite=True)
  return lambda c: jnp.asarray(value, jnp.float32)


@_registry.method(
    paper="Singh et al. 2020",
    summary=(
      "decentralized momentum SGD: local Nesterov steps, and every `period` "
      "steps a compressed CHOCO difference sent only by the devices whose "
      "`||x - x_hat||^2` passes `c_t eta_t^2` (sends counted); ring or "
      "torus"),
    gossip=True)
def squarm(inner: optax.GradientTransformation, compressor=None, *,
           gamma: float, period: int = 1, threshold=0.0,
           learning_rate=None, topology: str = "ring", axis_name="data",
           seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """SQuARM-SGD: momentum SGD with compressed, event-triggered gossip.

  Each step ``t``, on device ``i`` (Singh et al. 2020, Algorithm 1):

  .. math::
    x_i^{t+1/2} &= x_i^t + \\mathrm{inner}(g_i(x_i^t)) \\\\
    \\text{if } (t+1) \\bmod H = 0:\\quad q_i &=
      \\begin{cases} C(x_i^{t+1/2} - \\hat x_i) &
      \\|x_i^{t+1/2} - \\hat x_i\\|^2 > c_t \\eta_t^2 \\\\
      0 & \\text{otherwise (nothing sent)} \\end{cases} \\\\
    \\hat x_j &\\mathrel{+}= q_j, \\quad
    x_i^{t+1} = x_i^{t+1/2} + \\gamma \\textstyle\\sum_j W_{ij}
      (\\hat x_j - \\hat x_i)

  and ``x_i^{t+1} = x_i^{t+1/2}`` on the other steps. ``inner`` is the
  local optimizer: the paper's is Nesterov momentum SGD,
  ``optax.sgd(eta, momentum=beta, nesterov=True)``. ``C`` is
  ``compressor``'s operator (its dense leaves travel as float32); only the
  messages travel, once per neighbour, as in :func:`jaxcomm.choco` (with
  ``period=1`` and ``threshold=0`` this is CHOCO-SGD with ``inner``).

  The trigger is per device; the exchange is collective, so a
  synchronization step first takes the maximum of the triggers (one
  4-byte all-reduce) and runs the permutes only if some device fired; a
  device that did not fire sends an empty (zero) message in that exchange
  (``C(0) = 0`` for every gossip compressor) and is not counted.
  Non-synchronization steps issue no collective: the exchange sits in a
  conditional's branch. ``sends`` and ``rounds`` in the state count the
  messages each device sent and the exchanges that ran.

  Args:
    inner: the local optimizer (the paper: Nesterov momentum SGD).
    compressor: a jaxcomm compressor with a gossip message (as for
      :func:`jaxcomm.choco`); None: every value as float32 (no
      compression).
    gamma: the consensus step size in ``(0, 1]``.
    period: ``H``, steps between synchronization indices (``>= 1``).
    threshold: ``c_t``, a number ``>= 0`` or a schedule of the step; 0
      sends whenever the model moved.
    learning_rate: ``eta_t`` of the trigger, a number ``> 0`` or a
      schedule (``inner``'s learning rate); needed unless ``threshold`` is
      the number 0.
    topology: a fixed graph, ``"ring"`` or ``"torus"``.
    axis_name: the data axis (a name, a tuple of names, or None).
    seed: seed of the PRNG key kept in the state, an int >= 0.

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``compress`` is a
    :class:`jaxcomm.SquarmState`; its ``update`` needs ``params`` and
    returns updates to apply with :func:`jaxcomm.apply_updates` (or
    ``optax.apply_updates``).

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``compressor`` is not a jaxcomm compressor with a gossip message or
      has a ``start_step``, ``gamma`` is not in ``(0, 1]``, ``period`` is
      not an int >= 1, ``threshold`` is neither a finite number >= 0 nor
      a schedule, ``learning_rate`` is missing while ``threshold`` is not
      the number 0 or is neither a finite number > 0 nor a schedule,
      ``topology`` is not ``"ring"`` or ``"torus"``, ``axis_name`` is not
      a valid axis name or ``seed`` not an int >= 0; at ``init``, when a
      params leaf is complex; at ``update``, when called without
      ``params``, with another optimizer's state, or where ``axis_name``
      is not bound.

  Examples:
    Eight devices fit targets ``i`` by SGD at rate ``eta = 0.5``,
    synchronizing every 2 steps with the trigger ``||x - x_hat||^2 >
    c eta^2 = 4 * 0.25 = 1`` (no compressor: every value sent as float32).
    Step 1 sends nothing. At step 2 device ``i`` holds ``0.75 i`` (its
    public copy is still 0), so devices 2 to 7 fire and send it; devices
    0 and 1 send nothing, and every device moves by ``gamma (sum_j W_ij
    q_j - q_i)``:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> tx = jaxcomm.squarm(optax.sgd(0.5), gamma=0.5, period=2,
    ...                     threshold=4.0, learning_rate=0.5)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(())})
    >>> batch = np.arange(8.0)                     # one example per device
    >>> params, state, _ = dp.step(params, state, batch)
    >>> np.asarray(state.compress.rounds).tolist()  # no exchange at step 1
    [0, 0, 0, 0, 0, 0, 0, 0]
    >>> params, state, _ = dp.step(params, state, batch)
    >>> np.asarray(state.compress.sends).tolist()   # who fired at step 2
    [0, 0, 1, 1, 1, 1, 1, 1]
    >>> half = 0.75 * batch                          # x^{t+1/2}
    >>> q = np.where(half ** 2 > 1.0, half, 0)       # what each device sent
    >>> W = jaxcomm.collectives.mixing_matrix("ring", 8)
    >>> bool(np.allclose(params["w"], half + 0.5 * (W @ q - q)))
    True
  """
  _check_inner("inner", inner)
  spec = _gossip.gossip_compressor("squarm", _dense_if_none(compressor))
  gamma = _checks.number("gamma", gamma, 0.0, 1.0, lo_open=True)
  period = _checks.integer("period", period, 1)
  c_t = _schedule("threshold", threshold, lo_open=False)
  if learning_rate is None:
    if callable(threshold) or threshold != 0:
      raise ValueError(
        "learning_rate: the trigger compares ||x - x_hat||^2 with "
        "threshold * learning_rate^2; give the inner optimizer's learning "
        "rate (a number or a schedule)")
    eta_t = lambda c: jnp.float32(0.0)
  else:
    eta_t = _schedule("learning_rate", learning_rate, lo_open=True)
  _checks.choice("topology", topology, _gossip.CHOCO_TOPOLOGIES)
  _checks.axis_name(axis_name)
  seed = _checks.seed("seed", seed)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    _gossip.check_real_params("squarm", params)
    zeros = _gossip.gossip_buffers(spec, params)
    none = jnp.zeros([], jnp.int32)
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32),
                      compress=SquarmState(
                        public=zeros, mixed=zeros,
                        key=jax.random.PRNGKey(seed), sends=none,
                        rounds=none))

  def update_fn(updates, state, params=None, **extra_args):
    n, u, inner_new, ok = _gossip._gossip_inner_step(
      "squarm", inner, axis_name, updates, state, params, SquarmState,
      extra_args)
    p_leaves = jax.tree.leaves(params)
    half = [p.astype(jnp.float32) + jnp.where(ok, d, 0).astype(jnp.float32)
            for p, d in zip(p_leaves, jax.tree.leaves(u))]
    hs = tuple(_core.pvary(h, axis_name)
               for h in _gossip.to_buffers(spec, params, half))
    cs = state.compress
    key, step_key = jax.random.split(cs.key)
    count = state.count
    zero = _core.pvary(jnp.zeros([], jnp.int32), axis_name)
    public0, mixed0 = (_core.pvary(tuple(b), axis_name)
                       for b in (cs.public, cs.mixed))

    def talk(_):
      diff = [h - p for h, p in zip(hs, cs.public)]
      dist = sum(jnp.sum(d * d) for d in diff)
      fire = dist > c_t(count) * eta_t(count) ** 2
      fired = _core.pmax(fire.astype(jnp.int32), axis_name) > 0

      def send(_):
        own, mixed_q = _gossip.compressed_gossip(
          spec, params, [jnp.where(fire, d, 0.0) for d in diff], n,
          axis_name, topology, count, step_key)
        public = tuple(p + q for p, q in zip(cs.public, own))
        mixed = tuple(m + q for m, q in zip(cs.mixed, mixed_q))
        new_x = tuple(h + gamma * (m - p)
                      for h, m, p in zip(hs, mixed, public))
        sent = _core.pvary(fire.astype(jnp.int32), axis_name)
        return new_x, public, mixed, sent, zero + 1

      def quiet(_):
        return hs, public0, mixed0, zero, zero

      return _local_engine.switch(fired.astype(jnp.int32), [quiet, send],
                                  None)

    def idle(_):
      return hs, public0, mixed0, zero, zero

    # Branches typed alike (any extra manual mesh axis included: a
    # block-mode step varies over the model axes too).
    new_x, public, mixed, sent, ran = _local_engine.switch(
      ((count + 1) % period == 0).astype(jnp.int32), [idle, talk], None)
    return _gossip.from_buffers(spec, params, list(new_x)), LocalState(
      count=count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
      compress=SquarmState(public=public, mixed=mixed, key=key,
                           sends=cs.sends + sent, rounds=cs.rounds + ran))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, SquarmSpec(spec, topology, period)),
    update_fn)


__all__ = [
  "squarm",
  "SquarmState",
]
