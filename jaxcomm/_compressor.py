"""The one mechanism every compressor plugs into.

A compressor is a :class:`Codec`: the local math (encode, decode) and its
exchange over the data axis. :func:`compressed` turns a codec into an Optax
``GradientTransformation`` and adds, written once for all of them:

* the leaf policy (:mod:`jaxcomm._policy`): compressed leaves go to the codec,
  other floating leaves through one fused dense psum, non-floating leaves pass
  through;
* error feedback: ``x = g + e``, ``e' = x - sent`` per device, optionally
  with DGC's momentum correction (``u = m u + g; v += u``) and momentum
  factor masking, local gradient clipping, and LR-aware rescaling of the
  residual (``e *= lr_{t-1} / lr_t``);
* a dense phase before ``start_step`` (PowerSGD's ``start_powerSGD_iter``);
* non-finite handling: if any device's gradient holds a NaN or Inf, every
  device learns it through the fused dense psum (one extra element, no extra
  collective), the residuals and codec state are left unchanged, the step is
  counted, and the update is made non-finite on every device so that
  ``optax.apply_if_finite`` placed after the compressor skips it everywhere;
* statistics (residual norm, non-finite steps), kept in the state.

The data path of one step (per device, inside shard_map or pmap)::

  x  = g + e                 error feedback
  r  = codec.apply(x)        encode -> exchange -> decode
  u  = r.mean                identical on every device
  e' = x - r.sent            what this device failed to send
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _policy
from jaxcomm.collectives import _core

Shape = tuple[int, ...]
# A collective the codec issues: (HLO kind, payload bytes per device).
Collective = tuple[str, int]


class Context(NamedTuple):
  """What a codec knows about the step it runs in.

  Attributes:
    axis_name: the data axis (or None: one device, no collectives).
    num_devices: static number of devices along ``axis_name``.
    device_index: this device's index (int32 array).
    step: the step counter before this step (int32 array).
    key: a PRNG key for this step, identical on every device (a shared key
      for random-k; fold in ``device_index`` for independent noise).
  """

  axis_name: Any
  num_devices: int
  device_index: jax.Array
  step: jax.Array
  key: jax.Array


class CodecResult(NamedTuple):
  """What a codec returns for one step.

  Attributes:
    mean: per compressed leaf, the decoded average over devices; identical
      (and typed invariant) on every device.
    sent: per compressed leaf, what this device's own message decodes to; the
      error-feedback residual is ``x - sent``.
    state: the codec's new state.
  """

  mean: list
  sent: list
  state: Any


@dataclasses.dataclass(frozen=True)
class Codec:
  """A compressor's math and exchange, in the form :func:`compressed` takes.

  Attributes:
    name: the public name, used in messages.
    init: ``init(shapes) -> state`` for the compressed leaves' shapes.
    apply: ``apply(xs, state, ctx) -> CodecResult`` with ``xs`` the float32
      compressed leaves (error feedback already added).
    wire: ``wire(shapes, n) -> [(kind, payload_bytes), ...]``, the collectives
      ``apply`` issues for these shapes on ``n`` devices, in HLO terms
      (``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter``,
      ``collective-permute``). Checked against the compiled HLO in tests.
    accepts: ``accepts(shape) -> bool``, the codec's own leaf rule.
  """

  name: str
  init: Callable[[Sequence[Shape]], Any]
  apply: Callable[[list, Any, Context], CodecResult]
  wire: Callable[[Sequence[Shape], int], list[Collective]]
  accepts: Callable[[Shape], bool] = lambda shape: True


class CompressStats(NamedTuple):
  """Per-step statistics kept in the state.

  Attributes:
    residual_norm: L2 norm of this device's error-feedback residual after the
      step (0 without error feedback).
    nonfinite_steps: steps skipped because some device's gradient held a NaN
      or Inf (residuals and codec state were left unchanged).
  """

  residual_norm: jax.Array
  nonfinite_steps: jax.Array


class CompressState(NamedTuple):
  """State of a compressor built by :func:`compressed`.

  Attributes:
    count: steps taken (int32).
    residual: error-feedback residual per compressed leaf (float32, per
      device); empty without error feedback.
    momentum: momentum-correction buffer ``u`` per compressed leaf (per
      device); empty unless ``momentum`` is set.
    codec: the codec's own state.
    key: PRNG key data (uint32[2]), split every step, identical everywhere.
    stats: :class:`CompressStats`.
  """

  count: jax.Array
  residual: tuple
  momentum: tuple
  codec: Any
  key: jax.Array
  stats: CompressStats


class _Init:
  """The ``init`` of a compressor; also carries what wire accounting needs."""

  def __init__(self, fn, spec):
    self._fn = fn
    self.jaxcomm_spec = spec

  def __call__(self, params):
    return self._fn(params)


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static description of a built compressor (for wire accounting)."""

  codec: Codec
  policy: _policy.LeafPolicy
  axis_name: Any
  start_step: int

  def paths(self, params) -> list[str]:
    return self.policy.plan(params, self.codec.accepts)

  def collectives(self, params, n: int) -> list[Collective]:
    """Collectives one compressed step issues on ``n`` devices."""
    leaves = jax.tree.leaves(params)
    paths = self.paths(params)
    shapes = [tuple(l.shape) for l in _policy.select(leaves, paths,
                                                     _policy.COMPRESS)]
    out = list(self.codec.wire(shapes, n)) if shapes else []
    dense = sum(int(l.size) for l in _policy.select(leaves, paths,
                                                    _policy.DENSE))
    # The fused dense psum always carries one extra float32: the flag that
    # tells every device whether some device saw a non-finite gradient.
    out.append(("all-reduce", 4 * (dense + 1)))
    return [(k, b) for k, b in out if b > 0]


def _check_float(name, value, lo=None, hi=None, lo_open=False):
  if isinstance(value, jax.core.Tracer):
    return
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}") from None
  bad = (lo is not None and (v <= lo if lo_open else v < lo)) or (
    hi is not None and v > hi)
  if bad or v != v:
    lo_s = "(" if lo_open else "["
    raise ValueError(
      f"{name} must be in {lo_s}{lo}, {hi}], got {value!r}")


def _match_varying(x, like):
  """``x`` marked varying over every axis ``like`` (an abstract value)
  varies over."""
  mat = getattr(like, "manual_axis_type", None)
  want = frozenset(mat.varying) if mat is not None else frozenset(
    getattr(like, "vma", ()))
  missing = tuple(sorted(want - _core.varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def compressed(
  codec: Codec,
  *,
  axis_name="data",
  error_feedback: bool = True,
  momentum: float | None = None,
  momentum_masking: bool = True,
  clip_norm: float | None = None,
  lr_schedule: Callable[[jax.Array], jax.Array] | None = None,
  start_step: int = 0,
  policy: _policy.LeafPolicy | None = None,
  seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Builds a compressing GradientTransformation from a :class:`Codec`.

  Args:
    codec: the compressor's math and exchange.
    axis_name: the data axis to average over (a name, a tuple of names, or
      None for one device without collectives).
    error_feedback: keep per device what was not sent and add it to the next
      step's gradient (Seide et al. 2014; Karimireddy et al. 2019).
    momentum: if set, DGC's momentum correction (Lin et al. 2018): the codec
      compresses the accumulated velocity ``v += u``, ``u = m u + g``;
      use a downstream optimizer without momentum. Implies error feedback.
    momentum_masking: zero ``u`` where this device sent a coordinate (DGC's
      momentum factor masking). Only used with ``momentum``.
    clip_norm: local gradient clipping by global norm before accumulation,
      with the threshold scaled by ``num_devices ** -0.5`` (DGC, survey eq.
      14), so the summed gradient's norm stays within ``clip_norm``.
    lr_schedule: if given, the residual is rescaled by ``lr_{t-1} / lr_t``
      each step, so that mass delayed across a learning-rate change moves
      the parameters as much as it would have when it was computed.
    start_step: exchange dense means (no compression, residual untouched)
      while ``count < start_step``.
    policy: which leaves to compress (:class:`jaxcomm.LeafPolicy`).
    seed: seed of the PRNG key kept in the state.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`CompressState`.
  """
  policy = _policy.as_policy(policy)
  if not isinstance(error_feedback, bool):
    raise ValueError(
      f"error_feedback must be a bool, got {error_feedback!r}")
  use_momentum = momentum is not None
  if use_momentum:
    _check_float("momentum", momentum, 0.0, 1.0)
  if clip_norm is not None:
    _check_float("clip_norm", clip_norm, 0.0, None, lo_open=True)
  if not isinstance(start_step, int) or start_step < 0:
    raise ValueError(
      f"start_step must be a non-negative int, got {start_step!r}")
  if lr_schedule is not None and not callable(lr_schedule):
    raise ValueError(f"lr_schedule must be callable, got {lr_schedule!r}")
  keep_residual = error_feedback or use_momentum
  spec = Spec(codec=codec, policy=policy, axis_name=axis_name,
              start_step=start_step)

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    paths = spec.paths(params)
    comp = _policy.select(leaves, paths, _policy.COMPRESS)
    zeros = tuple(jnp.zeros(l.shape, jnp.float32) for l in comp)
    return CompressState(
      count=jnp.zeros([], jnp.int32),
      residual=zeros if keep_residual else (),
      momentum=zeros if use_momentum else (),
      codec=codec.init([tuple(l.shape) for l in comp]),
      key=jax.random.PRNGKey(seed),
      stats=CompressStats(residual_norm=jnp.zeros([], jnp.float32),
                          nonfinite_steps=jnp.zeros([], jnp.int32)),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    n = _core.check_axis(axis_name, codec.name)
    leaves, treedef = jax.tree.flatten(updates)
    paths = spec.paths(updates)
    comp_idx = [i for i, p in enumerate(paths) if p == _policy.COMPRESS]
    dense_idx = [i for i, p in enumerate(paths) if p == _policy.DENSE]
    g = [leaves[i].astype(jnp.float32) for i in comp_idx]
    dense = [leaves[i] for i in dense_idx]
    floats = g + dense
    local_bad = jnp.zeros([], jnp.float32)
    if floats:
      local_bad = 1.0 - jnp.all(jnp.stack(
        [jnp.all(jnp.isfinite(x)) for x in floats])).astype(jnp.float32)

    step = state.count
    key, step_key = jax.random.split(state.key)
    ctx = Context(axis_name=axis_name, num_devices=n,
                  device_index=_core.axis_index(axis_name), step=step,
                  key=step_key)

    # Local gradient clipping (DGC): threshold scaled by n^-1/2.
    if clip_norm is not None and g:
      norm = optax.tree.norm(g)
      limit = clip_norm / jnp.sqrt(jnp.float32(n))
      scale = jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-30))
      g = [x * scale for x in g]

    residual = list(state.residual)
    if lr_schedule is not None and residual:
      prev = jnp.asarray(lr_schedule(jnp.maximum(step - 1, 0)), jnp.float32)
      cur = jnp.asarray(lr_schedule(step), jnp.float32)
      ratio = jnp.where(step > 0, prev / jnp.where(cur == 0, 1.0, cur), 1.0)
      residual = [r * ratio for r in residual]

    if use_momentum:
      u = [momentum * m + x for m, x in zip(state.momentum, g)]
      xs = [r + m for r, m in zip(residual, u)]
    elif keep_residual:
      u = []
      xs = [r + x for r, x in zip(residual, g)]
    else:
      u = []
      xs = g

    def compress_branch(_):
      res = codec.apply(list(xs), state.codec, ctx)
      return list(res.mean), list(res.sent), res.state

    def dense_branch(_):
      # Dense phase: exact mean, nothing left behind, codec state untouched.
      mean = [m / n for m in _core.fused_psum(g, axis_name)]
      return mean, list(g), state.codec

    if g:
      if start_step > 0:
        in_dense = step < start_step
        # Both branches must agree in type: where the codec makes a state
        # leaf vary over the axis (a per-device statistic), the dense
        # branch's unchanged leaf is marked varying too.
        want = jax.eval_shape(compress_branch, None)[2]

        def dense_typed(_):
          mean, sent, cs = dense_branch(None)
          return mean, sent, jax.tree.map(_match_varying, cs, want)

        mean, sent, codec_state = jax.lax.cond(
          in_dense, dense_typed, compress_branch, None)
      else:
        in_dense = jnp.zeros([], bool)
        mean, sent, codec_state = compress_branch(None)
    else:
      in_dense = jnp.zeros([], bool)
      mean, sent, codec_state = [], [], state.codec

    # One fused psum for every dense leaf plus the non-finite flag.
    summed = _core.fused_psum(dense + [local_bad], axis_name)
    any_bad = summed[-1] > 0
    dense_mean = [(s / n).astype(d.dtype) for s, d in zip(summed[:-1], dense)]

    if keep_residual:
      if start_step > 0:
        new_res = [jnp.where(in_dense, r, x - s)
                   for r, x, s in zip(residual, xs, sent)]
      else:
        new_res = [x - s for x, s in zip(xs, sent)]
    else:
      new_res = []
    if use_momentum:
      if momentum_masking:
        new_u = [jnp.where(s != 0, 0.0, m) for m, s in zip(u, sent)]
      else:
        new_u = u
      if start_step > 0:
        new_u = [jnp.where(in_dense, jnp.zeros_like(m), m) for m in new_u]
    else:
      new_u = []

    keep = lambda new, old: jax.tree.map(
      lambda a, b: jnp.where(any_bad, b, a), new, old)
    new_res = keep(tuple(new_res), state.residual)
    new_u = keep(tuple(new_u), state.momentum)
    codec_state = keep(codec_state, state.codec)
    res_norm = (optax.tree.norm(list(new_res)) if new_res
                else jnp.zeros([], jnp.float32))

    out = list(leaves)
    nan = jnp.float32(jnp.nan)
    for i, m in zip(comp_idx, mean):
      out[i] = jnp.where(any_bad, nan, m).astype(leaves[i].dtype)
    for i, m in zip(dense_idx, dense_mean):
      out[i] = jnp.where(any_bad, nan, m).astype(leaves[i].dtype)

    new_state = CompressState(
      count=optax.safe_increment(state.count),
      residual=new_res,
      momentum=new_u,
      codec=codec_state,
      key=key,
      stats=CompressStats(
        residual_norm=res_norm,
        nonfinite_steps=state.stats.nonfinite_steps
        + any_bad.astype(jnp.int32)),
    )
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformationExtraArgs(
    _Init(init_fn, spec), update_fn)


def spec_of(tx) -> Spec:
  """The :class:`Spec` of a compressor built by :func:`compressed`."""
  spec = getattr(getattr(tx, "init", None), "jaxcomm_spec", None)
  if spec is None:
    raise ValueError(
      "tx must be a jaxcomm compressor (built by jaxcomm.compressed or one of "
      f"its factories), got {type(tx).__name__}; wrap only the compressor, "
      "not an optax.chain around it")
  return spec


def stats(opt_state) -> list[CompressStats]:
  """Every :class:`CompressStats` found in an optimizer state, in order."""
  found = []

  def visit(x):
    if isinstance(x, CompressState):
      found.append(x.stats)
      return
    if isinstance(x, (tuple, list)):
      for y in x:
        visit(y)
    elif isinstance(x, dict):
      for y in x.values():
        visit(y)
    elif hasattr(x, "_fields"):
      for y in x:
        visit(y)

  visit(opt_state)
  return found
