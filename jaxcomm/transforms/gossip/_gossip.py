"""Decentralized methods: D-PSGD (Lian et al. 2017), CHOCO-SGD
(Koloskova et al. 2019) and SGP (Assran et al. 2019). No global sync:
every step each device mixes with its neighbours."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _per_device
from jaxcomm import _policy
from jaxcomm import _registry
from jaxcomm._local_engine import LocalState
from jaxcomm._local_engine import _all_finite
from jaxcomm._local_engine import _check_inner
from jaxcomm._local_engine import _where
from jaxcomm.collectives import _core
from jaxcomm.collectives import _gossip

# ------------------------------------------------------------- D-PSGD ----

@dataclasses.dataclass(frozen=True)
class GossipSpec:
  """Wire accounting of :func:`jaxcomm.dpsgd`: one collective-permute of the
  params (float32) per neighbour of the step's mixing phase."""

  topology: str
  adaptive: bool = False
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None,
           splits=None) -> list:
    del splits  # block semantics: no whole-leaf exchange
    size = sum(int(np.size(l)) for l in jax.tree.leaves(params))
    return _gossip.gossip_wire(self.topology, n, size, step)


def _gossip_inner_step(method, inner, axis_name, updates, state, params,
                       compress_type, extra_args):
  """The step every gossip method starts with: checks (params given, the
  method's own state, gradients not already summed over the axis), the
  local ``inner`` update, and the finiteness guard (a non-finite gradient
  or update, or params that the update takes past their dtype's range,
  keep the inner state and contribute nothing this step).

  Returns:
    ``(n, u, inner_new, ok)``: the axis size, the inner update, the inner
    state to keep and whether the step was finite.
  """
  if params is None:
    raise ValueError(f"jaxcomm.{method} needs params: call "
                     "tx.update(grads, state, params)")
  if not isinstance(state, LocalState) or (
      compress_type is not None
      and not isinstance(state.compress, compress_type)):
    raise ValueError(f"jaxcomm.{method}: state must be the LocalState its "
                     f"init returned, got {type(state).__name__}")
  n = _core.check_axis(axis_name, f"jaxcomm.{method}", grads=updates)
  u, inner_new = inner.update(updates, state.inner, params, **extra_args)
  # The update is checked as it lands, in the params' own dtypes: a
  # float16 param plus a finite float32 step can round to inf.
  ok = _all_finite(jax.tree.leaves(updates)) & _all_finite(
    jax.tree.leaves(u)) & _all_finite(
      jax.tree.leaves(optax.apply_updates(params, u)))
  return n, u, _where(ok, inner_new, state.inner), ok


@_registry.method(
    paper="Lian et al. 2017; Ying et al. 2021",
    summary=(
      "no sync: every step each device mixes its params with its "
      "neighbours', `x_i <- sum_j W_ij x_j` (ring, 2-D torus, hypercube, "
      "one-peer exponential graph), as collective-permutes of one fused "
      "buffer: bytes per device flat in the number of devices"),
    gossip=True)
def dpsgd(inner: optax.GradientTransformation, *, topology: str = "ring",
          axis_name="data") -> optax.GradientTransformationExtraArgs:
  """Decentralized SGD: each device mixes its params with its neighbours'.

  .. math::
    x_i \\leftarrow \\sum_j W_{ij} x_j + \\mathrm{inner}(g_i(x_i))

  (Lian et al. 2017.) ``W`` is the doubly stochastic mixing matrix of
  ``topology`` (:func:`jaxcomm.collectives.mixing_matrix`): ``"ring"``,
  ``"torus"``, ``"hypercube"`` (time-varying: one dimension per step) or
  ``"exponential"`` (the one-peer exponential graph, Ying et al. 2021). No
  all-reduce: each step sends the params once per neighbour
  (collective-permutes of one fused float32 buffer), so a device's traffic
  does not grow with the number of devices. Params stay per device and
  never agree exactly; :func:`jaxcomm.parallel.synchronized` gives their
  average and :func:`jaxcomm.parallel.consensus_distance` how far apart
  they are. A device whose gradient is not finite still mixes (the mixing
  stays doubly stochastic) but skips its own update (counted).

  Args:
    inner: the optimizer each device applies to its own gradient.
    topology: the communication graph: ``"ring"``, ``"torus"``,
      ``"hypercube"`` or ``"exponential"``.
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` (``anchor`` and ``synced``
    empty); its ``update`` needs ``params`` and returns updates to apply
    with :func:`jaxcomm.apply_updates` (or ``optax.apply_updates``).

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``topology`` is not one of the four graphs or ``axis_name`` is not a
      valid axis name; at ``update``, when called without ``params``,
      with another optimizer's state, or where ``axis_name`` is not bound
      (or the device count does not fit the graph, e.g. a hypercube on a
      number of devices that is not a power of two).

  Examples:
    Device ``i`` holds ``w = i`` and fits target 0 by SGD at rate 0.5.
    One step on the ring mixes each device's params with its two
    neighbours' (weights 1/3 each, the rows of
    :func:`jaxcomm.collectives.mixing_matrix`) and adds the local update,
    ``x <- W x - 0.5 (x - 0)``; the devices stay apart:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> tx = jaxcomm.dpsgd(optax.sgd(0.5), topology="ring")
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> _, state = dp.init({"w": jnp.zeros(())})
    >>> x = np.arange(8.0)
    >>> params = dp.place_params({"w": x})           # device i: w = i
    >>> params, state, _ = dp.step(params, state, np.zeros(8))
    >>> W = jaxcomm.collectives.mixing_matrix("ring", 8)
    >>> bool(np.allclose(params["w"], W @ x - 0.5 * x))
    True
    >>> np.asarray(params["w"], np.float64).round(3).tolist()
    [2.667, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 0.833]
  """
  _check_inner("inner", inner)
  _checks.choice("topology", topology, _gossip.MIXING_TOPOLOGIES)
  _checks.axis_name(axis_name)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    _, u, inner_new, ok = _gossip_inner_step(
      "dpsgd", inner, axis_name, updates, state, params, None, extra_args)
    p_leaves, treedef = jax.tree.flatten(params)
    mixed = _gossip.gossip_mix(p_leaves, axis_name, topology, state.count)
    u_leaves = jax.tree.leaves(u)
    new = [jnp.where(ok, m + d.astype(m.dtype), m)
           for m, d in zip(mixed, u_leaves)]
    out = jax.tree.unflatten(treedef, [(x - p).astype(p.dtype)
                                       for x, p in zip(new, p_leaves)])
    return out, LocalState(
      count=state.count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, GossipSpec(topology)), update_fn)


# ---------------------------------------------------------- CHOCO-SGD ----

class ChocoState(NamedTuple):
  """CHOCO-SGD's gossip memory (per device).

  ``public`` and ``mixed`` each hold one flat float32 buffer per bucket of
  the compressor's layout, then one for the leaves its policy sends dense.

  Attributes:
    public: ``x_hat_i``, this device's public copy: the sum of every
      message it sent (what its neighbours know of its params).
    mixed: ``s_i = sum_j W_ij x_hat_j``, the neighbours' public copies as
      the mixing weighs them (the self term included): kept as one sum, so
      a device stores two params-sized buffers whatever its degree.
    key: PRNG key data (the same on every device; random-k's coordinates).
  """

  public: Any
  mixed: Any
  key: jax.Array


# The public copies describe the old graph: on another device count they
# restart at 0, as at init (the params, which resize_params moves, carry
# the model).
_per_device.register(ChocoState, public=_per_device.restart(0.0),
                     mixed=_per_device.restart(0.0))


@dataclasses.dataclass(frozen=True)
class ChocoSpec:
  """Wire accounting of :func:`jaxcomm.choco`: per neighbour, one
  collective-permute of every bucket's compressed message and the dense
  leaves (float32), fused into one buffer."""

  compressor: Any
  topology: str
  adaptive: bool = False
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None,
           splits=None) -> list:
    del splits  # block semantics: no whole-leaf exchange
    del step
    words = _choco_message_words(self.compressor, params, n)
    return _gossip.gossip_wire(self.topology, n, words, None)


def _choco_parts(spec, params):
  """Static split of ``params``' leaves: (paths, layouts, compressed leaf
  indices, dense leaf indices)."""
  leaves = jax.tree.leaves(params)
  paths = spec.paths(params)
  comp = _policy.select(list(range(len(leaves))), paths,
                                    _policy.COMPRESS)
  dense = [i for i, p in enumerate(paths) if p == _policy.DENSE]
  return paths, spec.layouts(params), comp, dense


def _choco_context(n, layout, index, step, key):
  return _compressor.Context(axis_name=None, num_devices=n,
                             device_index=index, step=step, key=key,
                             layout=layout)


def _choco_message_words(spec, params, n: int) -> int:
  """uint32 words of one device's fused CHOCO message."""
  _, layouts, _, dense = _choco_parts(spec, params)
  leaves = jax.tree.leaves(params)
  words = sum(int(np.size(leaves[i])) for i in dense)
  for lay in layouts:
    out = jax.eval_shape(
      lambda x, lay=lay: spec.codec.message(
        x, _choco_context(n, lay, jnp.int32(0), jnp.int32(0),
                          jax.random.PRNGKey(0)))[0],
      jax.ShapeDtypeStruct((lay.size,), jnp.float32))
    words += int(np.size(out))
  return words


# ------------------------------------ compressed gossip, shared helpers ----
# CHOCO-SGD, DCD/ECD-PSGD (jaxcomm.transforms.gossip._dcd) and SQuARM-SGD
# (jaxcomm.transforms.gossip._squarm) all hold their gossip memory as flat
# float32 buffers, one per bucket of the compressor's layout and one for the
# leaves its policy sends dense, and gossip one compressed message per
# buffer.

def check_real_params(method: str, params) -> None:
  """Refuses complex leaves (the messages are real)."""
  for leaf in jax.tree.leaves(params):
    if jnp.iscomplexobj(leaf):
      raise ValueError(f"jaxcomm.{method}: complex params are not "
                       f"supported, got a {leaf.dtype} leaf")


def gossip_compressor(method: str, compressor,
                      takes: str = "jaxcomm.topk (without value_bits), "
                      "jaxcomm.randomk, jaxcomm.ef_signsgd, jaxcomm.stc or "
                      "jaxcomm.sbc"):
  """The spec of ``compressor``, checked to have a gossip message and to
  compress from the first step (``takes``: what the refusal lists)."""
  spec = _compressor.spec_of(compressor)
  if not _codec.can_gossip(spec.codec):
    raise ValueError(
      f"compressor {spec.codec.name} has no gossip message; {method} takes "
      f"{takes}")
  if spec.start_step:
    raise ValueError(f"compressor: {method} compresses from the first step; "
                     f"got start_step={spec.start_step}")
  return spec


def gossip_buffers(spec, params) -> tuple:
  """Zero buffers: one per bucket of ``spec``'s layout of ``params``, then
  one of the dense leaves (empty when there are none)."""
  _, layouts, _, dense = _choco_parts(spec, params)
  leaves = jax.tree.leaves(params)
  sizes = [lay.size for lay in layouts] + [
    sum(int(np.size(leaves[i])) for i in dense)]
  return tuple(jnp.zeros((s,), jnp.float32) for s in sizes)


def to_buffers(spec, params, leaves) -> list:
  """``leaves`` (float32, like ``params``' leaves) as the gossip buffers."""
  _, layouts, comp, dense = _choco_parts(spec, params)
  return [_buckets.flatten([leaves[comp[j]] for j in lay.leaves])
          for lay in layouts] + [_buckets.flatten([leaves[i] for i in dense])]


def from_buffers(spec, params, bufs):
  """The update ``bufs - params`` as a tree like ``params`` (each leaf in
  its own dtype)."""
  p_leaves, treedef = jax.tree.flatten(params)
  _, layouts, comp, dense = _choco_parts(spec, params)
  out = [jnp.zeros_like(p) for p in p_leaves]
  for lay, x in zip(layouts, bufs[:-1]):
    for j, leaf in zip(lay.leaves, lay.split(x)):
      i = comp[j]
      out[i] = (leaf - p_leaves[i].astype(jnp.float32)).astype(
        p_leaves[i].dtype)
  offset = 0
  for i in dense:
    size = int(np.size(p_leaves[i]))
    leaf = bufs[-1][offset:offset + size].reshape(p_leaves[i].shape)
    out[i] = (leaf - p_leaves[i].astype(jnp.float32)).astype(
      p_leaves[i].dtype)
    offset += size
  return jax.tree.unflatten(treedef, out)


def compressed_gossip(spec, params, values, n, axis_name, topology, step,
                      key):
  """One compressed gossip round of ``values`` (the buffers of
  :func:`to_buffers`): each bucket compressed by ``spec``'s codec, the
  dense buffer sent as float32, all fused into one ``uint32`` message sent
  once per neighbour of the fixed ``topology``.

  Returns:
    ``(own, mixed)``: per buffer, what this device's message decodes to
    (``C(values)``) and ``sum_j W_ij C(values_j)`` (self term included).
  """
  _, layouts, _, _ = _choco_parts(spec, params)
  codec = spec.codec
  index = _core.axis_index(axis_name)
  words, own = [], []
  for lay, x in zip(layouts, values):
    w, q = codec.message(x, _choco_context(n, lay, index, step, key))
    words.append(w)
    own.append(q)
  own.append(values[-1])
  words.append(_core.to_words(own[-1]))
  sizes = [int(w.shape[0]) for w in words]
  msg = jnp.concatenate(words) if words else jnp.zeros((0,), jnp.uint32)

  def decode(flat):
    parts = _buckets.unflatten(flat, [(s,) for s in sizes])
    out = [codec.decode(w, _choco_context(n, lay, index, step, key))
           for lay, w in zip(layouts, parts[:-1])]
    return out + [_core.from_words(parts[-1], jnp.float32)]

  return own, _gossip.gossip_messages(msg, own, decode, axis_name, topology)


CHOCO_TOPOLOGIES = ("ring", "torus")


@_registry.method(
    paper="Koloskova et al. 2019",
    summary=(
      "decentralized SGD gossiping compressed differences `q = C(x - "
      "x_hat)` (top-k, random-k or EF-signSGD messages, one permute per "
      "neighbour); ring or torus"),
    gossip=True)
def choco(inner: optax.GradientTransformation, compressor, *,
          gamma: float, topology: str = "ring", axis_name="data",
          seed: int = 0) -> optax.GradientTransformationExtraArgs:
  """CHOCO-SGD: decentralized SGD gossiping compressed model differences.

  Each step, on device ``i`` (Koloskova, Stich & Jaggi 2019, Algorithm 2,
  in the memory-efficient form of Koloskova et al. 2020):

  .. math::
    x_i^{+} &= x_i + \\mathrm{inner}(g_i(x_i)) \\\\
    q_i &= C(x_i^{+} - \\hat x_i), \\quad \\hat x_i \\mathrel{+}= q_i,
      \\quad s_i \\mathrel{+}= \\textstyle\\sum_j W_{ij} q_j \\\\
    x_i &\\leftarrow x_i^{+} + \\gamma (s_i - \\hat x_i)

  ``C`` is ``compressor``'s operator: only ``q_i``'s compact message
  travels, once per neighbour (top-k: values and indices; random-k: the
  values, the coordinates coming from a key every device shares;
  EF-signSGD: packed signs and per-leaf scales). The leaves
  ``compressor``'s policy sends dense travel as float32 (``C`` is the
  identity on them). ``s_i = sum_j W_ij x_hat_j`` is kept as one sum, so
  the memory is two params-sized buffers. The public copies start at 0.

  Params stay per device and never agree exactly, as in
  :func:`jaxcomm.dpsgd`. A device whose gradient is not finite skips its
  own step (counted) but still gossips, so every public copy stays what
  its neighbours hold.

  Args:
    inner: the optimizer each device applies to its own gradient.
    compressor: a jaxcomm compressor with a gossip message
      (:func:`jaxcomm.topk` without ``value_bits``, :func:`jaxcomm.randomk`,
      :func:`jaxcomm.ef_signsgd`); only its operator, leaf policy and
      buckets are used (not its error feedback: CHOCO's public copies
      play that role).
    gamma: the consensus step size in ``(0, 1]``; smaller for stronger
      compression (the paper tunes it per compressor).
    topology: a fixed graph, ``"ring"`` or ``"torus"``: the public copies
      must be updated by every neighbour that weighs them, every step.
    axis_name: the data axis (a name, a tuple of names, or None).
    seed: seed of the PRNG key kept in the state, an int >= 0.

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``compress`` is a
    :class:`jaxcomm.ChocoState`; its ``update`` needs ``params`` and
    returns updates to apply with :func:`jaxcomm.apply_updates` (or
    ``optax.apply_updates``).

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``compressor`` is not a jaxcomm compressor with a gossip message or
      has a ``start_step``, ``gamma`` is not in ``(0, 1]``, ``topology``
      is not ``"ring"`` or ``"torus"``, ``axis_name`` is not a valid axis
      name or ``seed`` not an int >= 0; at ``init``, when a params leaf is
      complex; at ``update``, when called without ``params``, with
      another optimizer's state, or where ``axis_name`` is not bound.

  Examples:
    Eight devices start from 0 and fit their own random targets ``t_i``
    (4 values each) by SGD at rate 0.5, so the local step gives
    ``x+ = 0.5 t_i``. Each device sends top-1 of ``x+ - x_hat`` (its
    public copy starts at 0) to its two ring neighbours, and moves by
    ``gamma (sum_j W_ij q_j - q_i)``; the mixing keeps the devices' mean:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.sum((params["w"] - x) ** 2)
    >>> policy = jaxcomm.LeafPolicy(min_size=1)      # compress w, 4 values
    >>> tx = jaxcomm.choco(optax.sgd(0.5), jaxcomm.topk(0.25, policy=policy),
    ...                    gamma=0.5)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(4)})
    >>> t = np.random.RandomState(0).randn(8, 4)     # row i: device i's
    >>> params, state, _ = dp.step(params, state, t)
    >>> np.count_nonzero(state.compress.public[0], axis=1).tolist()  # x_hat
    [1, 1, 1, 1, 1, 1, 1, 1]
    >>> half = 0.5 * t                               # x+, row i: device i
    >>> q = np.where(np.abs(half) == np.abs(half).max(1, keepdims=True),
    ...              half, 0)                        # top-1 of each row
    >>> W = jaxcomm.collectives.mixing_matrix("ring", 8)
    >>> bool(np.allclose(params["w"], half + 0.5 * (W @ q - q), atol=1e-6))
    True
    >>> bool(np.allclose(params["w"].mean(0), half.mean(0), atol=1e-6))
    True
  """
  _check_inner("inner", inner)
  spec = gossip_compressor(
    "choco", compressor, "jaxcomm.topk (without value_bits), "
    "jaxcomm.randomk or jaxcomm.ef_signsgd")
  gamma = _checks.number("gamma", gamma, 0.0, 1.0, lo_open=True)
  _checks.choice("topology", topology, CHOCO_TOPOLOGIES)
  _checks.axis_name(axis_name)
  seed = _checks.seed("seed", seed)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    check_real_params("choco", params)
    zeros = gossip_buffers(spec, params)
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32),
                      compress=ChocoState(public=zeros, mixed=zeros,
                                          key=jax.random.PRNGKey(seed)))

  def update_fn(updates, state, params=None, **extra_args):
    n, u, inner_new, ok = _gossip_inner_step(
      "choco", inner, axis_name, updates, state, params, ChocoState,
      extra_args)
    p_leaves = jax.tree.leaves(params)
    u_leaves = jax.tree.leaves(u)
    half = [p.astype(jnp.float32) + jnp.where(ok, d, 0).astype(jnp.float32)
            for p, d in zip(p_leaves, u_leaves)]
    xs = to_buffers(spec, params, half)
    cs = state.compress
    key, step_key = jax.random.split(cs.key)
    own, mixed_q = compressed_gossip(
      spec, params, [x - p for x, p in zip(xs, cs.public)], n, axis_name,
      topology, state.count, step_key)
    public = [p + q for p, q in zip(cs.public, own)]
    mixed = [m + q for m, q in zip(cs.mixed, mixed_q)]
    new_x = [x + gamma * (m - p) for x, m, p in zip(xs, mixed, public)]
    return from_buffers(spec, params, new_x), LocalState(
      count=state.count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
      compress=ChocoState(public=tuple(public), mixed=tuple(mixed), key=key))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, ChocoSpec(spec, topology)), update_fn)



# ------------------------------------------------- SGP (push-sum SGD) ----

class PushSumState(NamedTuple):
  """SGP's push-sum weight (per device).

  The params a device holds are the de-biased ``z_i = x_i / w_i``.

  Attributes:
    weight: ``w_i``, a float32 scalar: 1 at init; over the devices the
      weights always sum to their number.
  """

  weight: jax.Array


# Push-sum's weight is the device's share of the mass on the old graph: it
# restarts at 1 (the de-biased params become the numerators).
_per_device.register(PushSumState, weight=_per_device.restart(1.0))


@dataclasses.dataclass(frozen=True)
class PushSumSpec:
  """Wire accounting of :func:`jaxcomm.sgp`: one collective-permute of the
  params and the weight (float32) per matching class of the step's
  graph."""

  topology: Any
  adaptive: bool = False
  start_step: int = 0

  def wire(self, params, n: int, step: int | None = None,
           splits=None) -> list:
    del splits  # block semantics: no whole-leaf exchange
    size = sum(int(np.size(l)) for l in jax.tree.leaves(params)) + 1
    return _gossip.push_sum_wire(self.topology, n, size, step)


@_registry.method(
    paper="Assran et al. 2019",
    summary=(
      "stochastic gradient push: push-sum over the directed exponential "
      "graph or any directed graph (`x / w` de-biases column-stochastic "
      "mixing)"),
    gossip=True)
def sgp(inner: optax.GradientTransformation, *, topology="exponential",
        axis_name="data") -> optax.GradientTransformationExtraArgs:
  """Stochastic gradient push: decentralized SGD over a directed graph.

  Each step, on device ``i`` (Assran et al. 2019, Algorithm 1, push-sum
  of Kempe et al. 2003):

  .. math::
    x_i &= w_i z_i + \\mathrm{inner}(g_i(z_i)) \\\\
    (x_i, w_i) &\\leftarrow \\textstyle\\sum_j p_{ij} (x_j, w_j), \\quad
      z_i = x_i / w_i

  ``p_ji = 1 / (1 + d_i)``: a device keeps one share and pushes one to each
  of its ``d_i`` out-neighbours; no device needs to know who sends to it,
  so links may be one-way and in-degrees unequal (the mixing is only
  column stochastic; dividing by the push-sum weight ``w_i`` removes the
  bias this gives). The params a device holds are ``z_i``; ``w_i`` is in
  the state. Params and weight travel as one float32 buffer, one
  collective-permute per class of edges in which every device sends and
  receives at most once.

  Args:
    inner: the optimizer each device applies to its own gradient.
    topology: ``"exponential"`` (SGP's one-peer directed exponential
      graph: in step ``k`` device ``i`` sends to ``i + 2^(k mod log2 n)``;
      its weights stay 1, so it is D-PSGD on that graph) or a list of
      each device's out-neighbours (a fixed directed graph).
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``compress`` is a
    :class:`jaxcomm.PushSumState`; its ``update`` needs ``params`` and
    returns updates to apply with :func:`jaxcomm.apply_updates` (or
    ``optax.apply_updates``).

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``topology`` is neither ``"exponential"`` nor a list of lists of
      other devices' indices (each once) forming a strongly connected
      graph, or ``axis_name`` is not a valid axis name; at ``update``,
      when called without ``params``, with another optimizer's state,
      where ``axis_name`` is not bound, or when the graph does not fit
      the device count.

  Examples:
    A directed graph with unequal in-degrees: device 0 pushes to 1 and 2,
    device ``i`` to ``i + 1``, device 7 to 0. Device ``i`` holds
    ``z = i`` and fits target 0 by SGD at rate 0.5. A device keeps one
    share of ``(w z + u, w)`` and pushes one to each out-neighbour, as the
    column-stochastic matrix ``P`` below; device 2 receives from two, so
    its weight grows to 4/3, and dividing by the weights de-biases the
    mix:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> graph = [[1, 2], [2], [3], [4], [5], [6], [7], [0]]
    >>> tx = jaxcomm.sgp(optax.sgd(0.5), topology=graph)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> _, state = dp.init({"w": jnp.zeros(())})
    >>> z = np.arange(8.0)
    >>> params = dp.place_params({"w": z})           # device i: z = i
    >>> params, state, _ = dp.step(params, state, np.zeros(8))
    >>> P = np.zeros((8, 8))                         # P[i, j]: j's share to i
    >>> for j, out in enumerate(graph):
    ...   P[[j] + out, j] = 1 / (1 + len(out))
    >>> np.asarray(state.compress.weight, np.float64).round(3).tolist()
    [0.833, 0.833, 1.333, 1.0, 1.0, 1.0, 1.0, 1.0]
    >>> w = P @ np.ones(8)
    >>> bool(np.allclose(params["w"], P @ (z - 0.5 * z) / w))
    True
  """
  _check_inner("inner", inner)
  if isinstance(topology, str):
    _checks.choice("topology", topology, ("exponential",))
  else:
    topology = _gossip.check_directed_graph(topology)
  _checks.axis_name(axis_name)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32),
                      compress=PushSumState(weight=jnp.ones([], jnp.float32)))

  def update_fn(updates, state, params=None, **extra_args):
    _, u, inner_new, ok = _gossip_inner_step(
      "sgp", inner, axis_name, updates, state, params, PushSumState,
      extra_args)
    p_leaves, treedef = jax.tree.flatten(params)
    w = state.compress.weight
    x = [w * p.astype(jnp.float32) + jnp.where(ok, d, 0).astype(jnp.float32)
         for p, d in zip(p_leaves, jax.tree.leaves(u))]
    flat = jnp.concatenate([_buckets.flatten(x, jnp.float32),
                            w.astype(jnp.float32)[None]])
    mixed = _gossip.push_sum_mix(flat, axis_name, topology, state.count)
    new_w = mixed[-1]
    z = _buckets.unflatten(mixed[:-1] / new_w, [p.shape for p in p_leaves])
    out = jax.tree.unflatten(treedef, [
      (zi - p.astype(jnp.float32)).astype(p.dtype)
      for zi, p in zip(z, p_leaves)])
    return out, LocalState(
      count=state.count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
      compress=PushSumState(weight=new_w))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, PushSumSpec(topology)), update_fn)


__all__ = [
  "choco",
  "dpsgd",
  "sgp",
  "ChocoState",
  "PushSumState",
]
