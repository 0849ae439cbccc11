"""DCD-PSGD and ECD-PSGD (Tang, Lian, Yan, Zhang & Liu 2018,
"Communication compression for decentralized training"): decentralized SGD
whose neighbours know each other's models only through compressed
messages, on the fixed gossip graphs of :func:`jaxcomm.choco`.

* DCD-PSGD (difference compression): a device compresses the change of its
  model, ``z_i = x_i^{t+1/2} - x_i^t``, applies ``C(z_i)`` to itself and
  sends it; its neighbours add it to their replica of ``x_i``, which stays
  exact.
* ECD-PSGD (extrapolation compression): a device sends the compressed
  extrapolation ``z_i = (1 - t/2) x_i^t + (t/2) x_i^{t+1}``; every device
  keeps an estimate ``y_j = (1 - 2/t) y_j + (2/t) C(z_j)`` of its
  neighbours' models (and its own) and mixes those.

Both keep one params-sized buffer per device: ``sum_j W_ij r_j - x_i``,
``r_j`` being the replica (DCD) or estimate (ECD) of ``x_j``.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _per_device
from jaxcomm import _registry
from jaxcomm._local_engine import LocalState
from jaxcomm._local_engine import _all_finite
from jaxcomm._local_engine import _check_inner
from jaxcomm._local_engine import _where
from jaxcomm.transforms.gossip import _gossip
from jaxcomm.transforms.local import _fedcom
from jaxcomm.transforms.sparsify import _sparsification


class ReplicaState(NamedTuple):
  """The gossip memory of DCD-PSGD and ECD-PSGD (per device).

  ``pull`` holds flat float32 buffers, one per bucket of the compressor's
  layout, then one of the leaves its policy sends dense.

  Attributes:
    pull: ``sum_j W_ij r_j - x_i``, ``r_j`` this device's replica (DCD) or
      estimate (ECD) of device ``j``'s params, its own included: 0 while
      the devices agree (at init).
    key: PRNG key data (the same on every device; random-k's coordinates).
  """

  pull: Any
  key: jax.Array


# The replicas describe the old graph: on another device count they restart
# at the device's own params (pull 0), as at init.
_per_device.register(ReplicaState, pull=_per_device.restart(0.0))


@dataclasses.dataclass(frozen=True)
class UnbiasedRandomk:
  """Random-k scaled by ``size / k`` per segment (leaf, or bucket with
  ``granularity="model"``): ``E[C(x)] = x`` over the step key, the
  unbiased operator of Tang et al.'s analysis. The message is random-k's
  (the values only); the scale is applied where it is decoded."""

  base: Any

  @property
  def name(self):
    return f"unbiased_{self.base.name}"

  def accepts(self, shape) -> bool:
    return self.base.accepts(shape)

  def _scale(self, layout):
    s = np.ones((layout.size,), np.float32)
    for seg in _sparsification._segments(layout, self.base.granularity):
      k = _sparsification.num_selected(self.base.ratio, seg.size)
      s[seg.offset:seg.offset + seg.count * seg.size] = seg.size / k
    return jnp.asarray(s)

  def message(self, x, ctx):
    words, sent = self.base.message(x, ctx)
    return words, sent * self._scale(ctx.layout)

  def decode(self, words, ctx):
    return self.base.decode(words, ctx) * self._scale(ctx.layout)


def _replica_method(method, extrapolate, inner, compressor, topology,
                    unbiased, axis_name, seed):
  _check_inner("inner", inner)
  _checks.axis_name(axis_name)
  # As fedcom: a compressor built on another data axis is refused by name.
  _fedcom._check_compressor(method, compressor, axis_name, False)
  if compressor is None:
    compressor = _sparsification.randomk(1.0, axis_name=axis_name)
  spec = _gossip.gossip_compressor(method, compressor)
  _checks.choice("topology", topology, _gossip.CHOCO_TOPOLOGIES)
  _checks.boolean("unbiased", unbiased)
  if unbiased:
    if not isinstance(spec.codec, _sparsification.RandomkCodec):
      raise ValueError(
        f"unbiased=True rescales jaxcomm.randomk's message (size / k); "
        f"compressor {spec.codec.name} is not random-k")
    spec = dataclasses.replace(spec, codec=UnbiasedRandomk(spec.codec))
  seed = _checks.seed("seed", seed)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    _gossip.check_real_params(method, params)
    return LocalState(count=jnp.zeros([], jnp.int32), anchor=(), synced=(),
                      inner=inner.init(params),
                      skipped=jnp.zeros([], jnp.int32),
                      compress=ReplicaState(
                        pull=_gossip.gossip_buffers(spec, params),
                        key=jax.random.PRNGKey(seed)))

  def update_fn(updates, state, params=None, **extra_args):
    n, u, inner_new, ok = _gossip._gossip_inner_step(
      method, inner, axis_name, updates, state, params, ReplicaState,
      extra_args)
    p_leaves = jax.tree.leaves(params)
    xs = _gossip.to_buffers(spec, params,
                            [p.astype(jnp.float32) for p in p_leaves])
    us = _gossip.to_buffers(spec, params, [
      jnp.where(ok, d, 0).astype(jnp.float32) for d in jax.tree.leaves(u)])
    rs = state.compress
    key, step_key = jax.random.split(rs.key)
    # x^{t+1/2} - x^t: the mixed replicas and the local step.
    step = [d + v for d, v in zip(rs.pull, us)]
    if not extrapolate:
      # DCD: send C(x^{t+1/2} - x^t), apply it here and to the replicas.
      own, mixed = _gossip.compressed_gossip(
        spec, params, step, n, axis_name, topology, state.count, step_key)
      new_x = [x + q for x, q in zip(xs, own)]
      pull = [d + m - q for d, m, q in zip(rs.pull, mixed, own)]
    else:
      # ECD: x^{t+1} = x^{t+1/2}; send C(z), z = x^t + (t/2)(x^{t+1} - x^t);
      # estimates y <- (1 - 2/t) y + (2/t) C(z) (t counts from 1).
      t = (state.count + 1).astype(jnp.float32)
      z = [x + (0.5 * t) * s for x, s in zip(xs, step)]
      _, mixed = _gossip.compressed_gossip(
        spec, params, z, n, axis_name, topology, state.count, step_key)
      new_x = [x + s for x, s in zip(xs, step)]
      a, b = 1.0 - 2.0 / t, 2.0 / t
      pull = [a * (x + d) + b * m - y
              for x, d, m, y in zip(xs, rs.pull, mixed, new_x)]
    out = _gossip.from_buffers(spec, params, new_x)
    # A step whose params or replicas leave the range (ECD's
    # extrapolation grows with t; a float16 param past 65,504) is skipped
    # here and counted: params, replicas and inner state as they were.
    fin = (_all_finite(jax.tree.leaves(out))
           & _all_finite(jax.tree.leaves(optax.apply_updates(params, out)))
           & _all_finite(pull))
    out = _where(fin, out, jax.tree.map(jnp.zeros_like, out))
    pull = _where(fin, tuple(pull), rs.pull)
    inner_new = _where(fin, inner_new, state.inner)
    return out, LocalState(
      count=state.count + 1, anchor=(), synced=(), inner=inner_new,
      skipped=state.skipped + jnp.where(ok & fin, 0, 1).astype(jnp.int32),
      compress=ReplicaState(pull=tuple(pull), key=key))

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, _gossip.ChocoSpec(spec, topology)),
    update_fn)


@_registry.method(
    paper="Tang et al. 2018 (DCD-PSGD)",
    summary=(
      "decentralized SGD gossiping the compressed change of each model, "
      "`C(x^{t+1/2} - x^t)`, applied to the model and its neighbours' "
      "exact replicas; ring or torus"),
    gossip=True)
def dcd_psgd(inner: optax.GradientTransformation, compressor=None, *,
             topology: str = "ring", unbiased: bool = False,
             axis_name="data", seed: int = 0
             ) -> optax.GradientTransformationExtraArgs:
  """DCD-PSGD: decentralized SGD with difference compression.

  Each step, on device ``i`` (Tang et al. 2018, Algorithm 1):

  .. math::
    x_i^{t+1/2} &= \\textstyle\\sum_j W_{ij} \\hat x_j^t
      + \\mathrm{inner}(g_i(x_i^t)) \\\\
    q_i &= C(x_i^{t+1/2} - x_i^t), \\quad x_i^{t+1} = x_i^t + q_i,
      \\quad \\hat x_j^{t+1} = \\hat x_j^t + q_j

  so the replicas ``x_hat_j`` equal the models exactly and only ``q_i``'s
  compact message travels, once per neighbour. The memory is one sum,
  ``sum_j W_ij x_hat_j - x_i``. The paper's caveat: the compression error
  enters the model itself, so DCD needs a compressor of small enough
  error (relative to the graph's spectral gap) or it diverges; see
  :func:`jaxcomm.ecd_psgd`. A device whose gradient is not finite skips
  its own step (counted) but still mixes and sends.

  Args:
    inner: the optimizer each device applies to its own gradient (the
      paper: SGD).
    compressor: a jaxcomm compressor with a gossip message
      (:func:`jaxcomm.topk` without ``value_bits``, :func:`jaxcomm.randomk`,
      :func:`jaxcomm.ef_signsgd`, :func:`jaxcomm.stc`,
      :func:`jaxcomm.sbc`); only its operator, leaf policy and buckets are
      used. Its dense leaves travel as float32 (``C`` is the identity).
      None: every value as float32 (``C`` the identity: D-PSGD).
    topology: a fixed graph, ``"ring"`` or ``"torus"`` (the mixing matrices
      of :func:`jaxcomm.dpsgd`): every neighbour's replica is updated every
      step.
    unbiased: with :func:`jaxcomm.randomk`, scale the message by
      ``size / k`` per segment so that ``E[C(z)] = z`` (the unbiased
      compression the paper's analysis assumes; its variance grows as the
      ratio shrinks).
    axis_name: the data axis (a name, a tuple of names, or None).
    seed: seed of the PRNG key kept in the state, an int >= 0.

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``compress`` is a
    :class:`jaxcomm.ReplicaState`; its ``update`` needs ``params`` and
    returns updates to apply with :func:`jaxcomm.apply_updates` (or
    ``optax.apply_updates``).

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``compressor`` is not a jaxcomm compressor with a gossip message,
      has a ``start_step`` or averages over another axis than
      ``axis_name``, ``topology`` is not ``"ring"`` or ``"torus"``,
      ``unbiased`` is not a bool or is True with a compressor other than
      :func:`jaxcomm.randomk`, ``axis_name`` is not a valid axis name or
      ``seed`` not an int >= 0; at ``init``, when a params leaf is
      complex; at ``update``, when called without ``params``, with
      another optimizer's state, or where ``axis_name`` is not bound.

  Examples:
    Eight devices start from 0 and fit their own random targets ``t_i``
    (4 values each) by SGD at rate 0.5, the changes compressed to top-1
    of 4. Step 1 (the replicas agree at 0): each device moves by
    ``C(0.5 t_i)``, one coordinate. Step 2: ``x^{3/2} = W x^1 - 0.5
    (x^1 - t)`` and each device adds ``C(x^{3/2} - x^1)``, as the numpy
    replay computes:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.sum((params["w"] - x) ** 2)
    >>> policy = jaxcomm.LeafPolicy(min_size=1)      # compress w, 4 values
    >>> tx = jaxcomm.dcd_psgd(optax.sgd(0.5), jaxcomm.topk(0.25, policy=policy))
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(4)})
    >>> t = np.random.RandomState(0).randn(8, 4)     # row i: device i's
    >>> def C(v):                                    # top-1 of each row
    ...   return np.where(np.abs(v) == np.abs(v).max(1, keepdims=True), v, 0)
    >>> W = jaxcomm.collectives.mixing_matrix("ring", 8)
    >>> params, state, _ = dp.step(params, state, t)
    >>> x1 = C(0.5 * t)
    >>> np.count_nonzero(params["w"], axis=1).tolist()
    [1, 1, 1, 1, 1, 1, 1, 1]
    >>> bool(np.allclose(params["w"], x1, atol=1e-6))
    True
    >>> params, state, _ = dp.step(params, state, t)
    >>> x2 = x1 + C(W @ x1 - 0.5 * (x1 - t) - x1)
    >>> bool(np.allclose(params["w"], x2, atol=1e-6))
    True
  """
  return _replica_method("dcd_psgd", False, inner, compressor, topology,
                         unbiased, axis_name, seed)


@_registry.method(
    paper="Tang et al. 2018 (ECD-PSGD)",
    summary=(
      "decentralized SGD gossiping compressed extrapolations `C((1 - t/2) "
      "x^t + (t/2) x^{t+1})`, averaged into estimates of the neighbours' "
      "models; ring or torus"),
    gossip=True)
def ecd_psgd(inner: optax.GradientTransformation, compressor=None, *,
             topology: str = "ring", unbiased: bool = False,
             axis_name="data", seed: int = 0
             ) -> optax.GradientTransformationExtraArgs:
  """ECD-PSGD: decentralized SGD with extrapolation compression.

  Each step ``t = 1, 2, ...``, on device ``i`` (Tang et al. 2018,
  Algorithm 2), with estimates ``y_j^1 = x^1``:

  .. math::
    x_i^{t+1} &= \\textstyle\\sum_j W_{ij} y_j^t
      + \\mathrm{inner}(g_i(x_i^t)) \\\\
    z_i &= (1 - t/2)\\, x_i^t + (t/2)\\, x_i^{t+1} \\\\
    y_j^{t+1} &= (1 - 2/t)\\, y_j^t + (2/t)\\, C(z_j)

  Without compression ``y_j^{t+1} = x_j^{t+1}``; with an unbiased ``C``
  the estimates average the compression noise over steps (its weight
  falls as ``1/t``), so ECD tolerates a much noisier compressor than
  :func:`jaxcomm.dcd_psgd`. The model itself is never compressed. The
  memory is one sum, ``sum_j W_ij y_j - x_i``. The extrapolation grows
  with ``t`` (``t/2`` times the step's change), so the noise of a
  compressor whose error scales with its input grows with the change of
  the model.

  Args:
    inner: the optimizer each device applies to its own gradient (the
      paper: SGD).
    compressor: a jaxcomm compressor with a gossip message
      (:func:`jaxcomm.topk` without ``value_bits``, :func:`jaxcomm.randomk`,
      :func:`jaxcomm.ef_signsgd`, :func:`jaxcomm.stc`,
      :func:`jaxcomm.sbc`); only its operator, leaf policy and buckets are
      used. Its dense leaves travel as float32 (``C`` is the identity).
      None: every value as float32 (``C`` the identity: D-PSGD).
    topology: a fixed graph, ``"ring"`` or ``"torus"`` (the mixing matrices
      of :func:`jaxcomm.dpsgd`): every neighbour's replica is updated every
      step.
    unbiased: with :func:`jaxcomm.randomk`, scale the message by
      ``size / k`` per segment so that ``E[C(z)] = z`` (the unbiased
      compression the paper's analysis assumes; its variance grows as the
      ratio shrinks).
    axis_name: the data axis (a name, a tuple of names, or None).
    seed: seed of the PRNG key kept in the state, an int >= 0.

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``compress`` is a
    :class:`jaxcomm.ReplicaState`; its ``update`` needs ``params`` and
    returns updates to apply with :func:`jaxcomm.apply_updates` (or
    ``optax.apply_updates``).

  Raises:
    ValueError: when ``inner`` is not an optax transformation,
      ``compressor`` is not a jaxcomm compressor with a gossip message,
      has a ``start_step`` or averages over another axis than
      ``axis_name``, ``topology`` is not ``"ring"`` or ``"torus"``,
      ``unbiased`` is not a bool or is True with a compressor other than
      :func:`jaxcomm.randomk`, ``axis_name`` is not a valid axis name or
      ``seed`` not an int >= 0; at ``init``, when a params leaf is
      complex; at ``update``, when called without ``params``, with
      another optimizer's state, or where ``axis_name`` is not bound.

  Examples:
    Eight devices start from 0 (``x^1 = y^1 = 0``) and fit their own
    random targets ``t_i`` (4 values each) by SGD at rate 0.5, the
    extrapolations compressed to top-2 of 4. Two steps follow the
    recurrence above, replayed in numpy (``t = 1``: ``y^2 = -y^1 +
    2 C(z)``, ``z = (x^1 + x^2) / 2``):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.sum((params["w"] - x) ** 2)
    >>> policy = jaxcomm.LeafPolicy(min_size=1)      # compress w, 4 values
    >>> tx = jaxcomm.ecd_psgd(optax.sgd(0.5), jaxcomm.topk(0.5, policy=policy))
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(4)})
    >>> t = np.random.RandomState(0).randn(8, 4)     # row i: device i's
    >>> def C(v):                                    # top-2 of each row
    ...   return np.where(np.abs(v) >= np.sort(np.abs(v), 1)[:, 2:3], v, 0)
    >>> W = jaxcomm.collectives.mixing_matrix("ring", 8)
    >>> x1 = y1 = np.zeros((8, 4))
    >>> params, state, _ = dp.step(params, state, t)
    >>> x2 = W @ y1 - 0.5 * (x1 - t)
    >>> bool(np.allclose(params["w"], x2, atol=1e-6))
    True
    >>> y2 = (1 - 2 / 1) * y1 + (2 / 1) * C((1 - 1 / 2) * x1 + (1 / 2) * x2)
    >>> params, state, _ = dp.step(params, state, t)
    >>> x3 = W @ y2 - 0.5 * (x2 - t)
    >>> bool(np.allclose(params["w"], x3, atol=1e-6))
    True
  """
  return _replica_method("ecd_psgd", True, inner, compressor, topology,
                         unbiased, axis_name, seed)


__all__ = [
  "dcd_psgd",
  "ecd_psgd",
  "ReplicaState",
]
