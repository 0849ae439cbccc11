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

With ``error_feedback="ef21"`` (Richtarik et al. 2021) the codec compresses
the change of a per-device gradient estimate instead::

  x  = g - h_i               what the estimate misses
  r  = codec.apply(x)
  h_i' = h_i + r.sent        this device's estimate
  u  = h' = h + r.mean       the aggregate (= mean_i h_i'), identical
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import sys
import warnings
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm import _policy
from jaxcomm import _vma
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
    layout: the bucket's static :class:`jaxcomm._buckets.Layout` (for flat
      codecs; None for codecs that take a list of leaves).
  """

  axis_name: Any
  num_devices: int
  device_index: jax.Array
  step: jax.Array
  key: jax.Array
  layout: Any = None


class CodecResult(NamedTuple):
  """What a codec returns for one step.

  Attributes:
    mean: the decoded average over devices; identical (and typed invariant)
      on every device. A flat ``[size]`` buffer for a flat codec, a list of
      leaves otherwise.
    sent: what this device's own message decodes to (same form as
      ``mean``); the error-feedback residual is ``x - sent``.
    state: the codec's new state.
  """

  mean: Any
  sent: Any
  state: Any


@dataclasses.dataclass(frozen=True)
class Codec:
  """A compressor's math and exchange, in the form :func:`compressed` takes.

  :func:`compressed` lays the compressed leaves into flat float32 buckets
  (:mod:`jaxcomm._buckets`) and calls the codec once per bucket. A *flat*
  codec (``flat=True``) works on the bucket itself: ``init(layout)``,
  ``apply(x, state, ctx)`` with ``x`` the ``[layout.size]`` buffer and
  ``ctx.layout`` its layout, ``wire(layout, n)``; per-leaf semantics go
  through the layout's group views, one op per group of equal shapes, so
  the program does not grow with the number of leaves. A codec with
  ``flat=False`` gets the bucket's leaves as a list (``init(shapes)``,
  ``apply(xs, ...)``, ``wire(shapes, n)``), which costs ops per leaf.

  Attributes:
    name: the public name, used in messages.
    init: ``init(layout | shapes) -> state``.
    apply: ``apply(x | xs, state, ctx) -> CodecResult`` (error feedback
      already added to the input).
    wire: ``wire(layout | shapes, n) -> [(kind, payload_bytes), ...]``, the
      collectives ``apply`` issues on ``n`` devices, in HLO terms
      (``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter``,
      ``collective-permute``). Checked against the compiled HLO in tests.
    accepts: ``accepts(shape) -> bool``, the codec's own leaf rule.
    flat: whether the codec works on flat buckets (see above).
    message: for gossip (:func:`jaxcomm.choco`), flat stateless codecs
      only: ``message(x, ctx) -> (words, sent)``, this device's compressed
      message as one ``uint32`` array (what travels to a neighbour) and
      what it decodes to; no collective. None: the codec cannot gossip.
    decode: ``decode(words, ctx) -> float32[layout.size]``, a received
      message decoded (``decode(message(x)[0]) == message(x)[1]``).
    wire_at: for a codec whose exchange changes with the step (DGC's
      warm-up stages, behind a ``lax.switch``): ``wire_at(layout | shapes,
      n, step)``, what that step moves. None: ``wire``, every step.
  """

  name: str
  init: Callable[[Any], Any]
  apply: Callable[[Any, Any, Context], CodecResult]
  wire: Callable[[Any, int], list[Collective]]
  accepts: Callable[[Shape], bool] = lambda shape: True
  flat: bool = False
  message: Callable[[Any, Context], tuple[Any, Any]] | None = None
  decode: Callable[[Any, Context], Any] | None = None
  wire_at: Callable[[Any, int, int], list[Collective]] | None = None


class CompressStats(NamedTuple):
  """Per-step statistics kept in the state.

  Attributes:
    residual_norm: L2 norm of this device's error-feedback residual after the
      step (0 without error feedback).
    nonfinite_steps: steps skipped because some device's gradient, or what
      the compressor made of it (the average, the residual), held a NaN or
      Inf (residuals and codec state were left unchanged).
  """

  residual_norm: jax.Array
  nonfinite_steps: jax.Array


class CompressState(NamedTuple):
  """State of a compressor built by :func:`compressed`.

  Attributes:
    count: steps taken (int32).
    residual: error-feedback residual per bucket (flat float32, per
      device); empty without error feedback. ``Spec.leaves_of`` (through
      :func:`spec_of`) gives it back per leaf.
    momentum: momentum-correction buffer ``u`` per bucket (per device);
      empty unless ``momentum`` is set.
    codec: the codec's own state, one per bucket (a tuple).
    key: PRNG key data (uint32[2]), split every step, identical everywhere.
    stats: :class:`CompressStats`.
    estimate: EF21's gradient estimate ``h_i`` per bucket (per device);
      empty unless ``error_feedback="ef21"``.
    estimate_mean: EF21's aggregate ``h = mean_i h_i`` per bucket
      (replicated), the update every step returns; empty unless EF21.
  """

  count: jax.Array
  residual: tuple
  momentum: tuple
  codec: tuple
  key: jax.Array
  stats: CompressStats
  estimate: tuple = ()
  estimate_mean: tuple = ()


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

  def layouts(self, params) -> tuple[_buckets.Layout, ...]:
    """The buckets of the compressed leaves of ``params``."""
    leaves = jax.tree.leaves(params)
    comp = _policy.select(leaves, self.paths(params), _policy.COMPRESS)
    return _buckets.plan([tuple(l.shape) for l in comp],
                         self.policy.bucket_bytes)

  def leaves_of(self, buffers, params) -> list:
    """Per-bucket buffers (a state's ``residual`` or ``momentum``) back as
    one array per compressed leaf, in ``jax.tree.leaves`` order. Leading
    axes (e.g. the device axis of a stored state) are kept."""
    layouts = self.layouts(params)
    out = {}
    for lay, buf in zip(layouts, buffers):
      for j, leaf in zip(lay.leaves, lay.split(buf)):
        out[j] = leaf
    return [out[j] for j in sorted(out)]

  def wire(self, params, n: int, step: int | None = None
           ) -> list[Collective]:
    """Collectives a step issues on ``n`` devices.

    Args:
      params: the parameters (or gradients, or their shapes).
      n: the number of devices along the data axis.
      step: the step counter: the collectives that step moves (the dense
        phase's psums before ``start_step``, the codec's after). None: every
        collective the compiled step holds (with ``start_step > 0``, both
        phases' behind a ``lax.cond``), as the compiled HLO lists them.
    """
    leaves = jax.tree.leaves(params)
    paths = self.paths(params)
    out = []
    dense_phase = self.start_step > 0 and (step is None
                                           or step < self.start_step)
    codec_phase = step is None or step >= self.start_step
    for lay in self.layouts(params):
      if dense_phase:
        out.append(("all-reduce", 4 * lay.size))
      if codec_phase:
        arg = lay if self.codec.flat else list(lay.shapes)
        if step is not None and self.codec.wire_at is not None:
          out.extend(self.codec.wire_at(arg, n, step))
        else:
          out.extend(self.codec.wire(arg, n))
    dense = sum(_policy.real_size(l) for l in _policy.select(leaves, paths,
                                                    _policy.DENSE))
    # The fused dense psum always carries one extra float32: the flag that
    # tells every device whether some device saw a non-finite value.
    out.append(("all-reduce", 4 * (dense + 1)))
    return [(k, b) for k, b in out if b > 0]


def _check_axis_name(axis_name) -> None:
  """``axis_name`` must be None, a name, or a non-empty tuple of names."""
  ok = axis_name is None or isinstance(axis_name, str) or (
    isinstance(axis_name, (tuple, list)) and len(axis_name) > 0
    and all(isinstance(a, str) for a in axis_name))
  if not ok:
    raise ValueError(
      "axis_name must be a mesh axis name (a str), a non-empty tuple of "
      f"them, or None for one device without collectives; got {axis_name!r}")


def safe_norm(xs) -> jax.Array:
  """L2 norm of a list of arrays, scaled by ``max |x|`` so that it does not
  overflow float32 for finite inputs (``|x| ~ 1e20`` squares to inf)."""
  xs = [x for x in xs if x.size]
  if not xs:
    return jnp.zeros([], jnp.float32)
  m = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in xs]))
  safe = jnp.where((m > 0) & jnp.isfinite(m), m, 1.0)
  total = sum(jnp.sum(jnp.square(x / safe)) for x in xs)
  return jnp.where(m > 0, safe * jnp.sqrt(total), m)


def _as_real(x: jax.Array) -> jax.Array:
  """A dense leaf as float32 values for the fused psum: complex leaves as
  interleaved (real, imaginary) pairs."""
  if _policy.is_complex(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1).astype(
      jnp.float32).reshape(-1)
  return jnp.ravel(x).astype(jnp.float32)


def _from_real(flat: jax.Array, like: jax.Array) -> jax.Array:
  """Inverse of :func:`_as_real` in ``like``'s shape and dtype."""
  if _policy.is_complex(like):
    pairs = flat.reshape(tuple(like.shape) + (2,))
    return jax.lax.complex(pairs[..., 0], pairs[..., 1]).astype(like.dtype)
  return flat.reshape(like.shape).astype(like.dtype)


def _materialized(x: jax.Array, count: jax.Array) -> jax.Array:
  """``x`` unchanged, but computed once into its own buffer.

  The averaged bucket is split into one output per leaf; XLA would fuse
  the codec's decode (unpacking, scaling, the outer products of PowerSGD)
  into every leaf's slice, one copy of it per leaf: the program and its
  compile time then grow with the number of leaves (an int8 update on a
  289-leaf transformer compiled 12,001 ops, 289 fusions of 37). A scatter
  needs its operand in a buffer, so a one-element scatter-add of 0 at a
  position past the end (``size + min(count, 0)``, which XLA cannot fold:
  it depends on the step counter) makes the decode run once, and the
  leaves are plain slices of it. ``optimization_barrier`` does not do this
  on CPU (it is removed before fusion). Cost: one more pass over the
  bucket; on ResNet-18 shapes it cuts compile time for every compressor.
  """
  if x.size == 0:
    return x
  past_end = x.shape[0] + jnp.minimum(count, 0)
  return x.at[past_end].add(jnp.zeros((), x.dtype), mode="drop")


def _apply_codec(codec: Codec, layout, x, state, ctx):
  """Runs the codec on one bucket; returns flat (mean, sent, state)."""
  ctx = ctx._replace(layout=layout)
  if codec.flat:
    res = codec.apply(x, state, ctx)
    return res.mean, res.sent, res.state
  res = codec.apply(layout.split(x), state, ctx)
  return (_buckets.flatten(res.mean), _buckets.flatten(res.sent), res.state)


def compressed(
  codec: Codec,
  *,
  axis_name="data",
  error_feedback: bool = True,
  momentum: float | None = None,
  momentum_masking: bool = True,
  clip_norm: float | None = None,
  lr_schedule: Callable[[jax.Array], jax.Array] | None = None,
  residual_decay: float = 1.0,
  start_step: int = 0,
  policy: _policy.LeafPolicy | None = None,
  seed: int = 0,
  **unknown,
) -> optax.GradientTransformationExtraArgs:
  """Builds a compressing GradientTransformation from a :class:`Codec`.

  The compressed leaves are laid into flat float32 buckets
  (``policy.bucket_bytes``); error feedback, momentum, clipping and the
  codec run on whole buckets, so the traced program does not grow with the
  number of leaves.

  Args:
    codec: the compressor's math and exchange.
    axis_name: the data axis to average over (a name, a tuple of names, or
      None for one device without collectives).
    error_feedback: ``True``: keep per device what was not sent and add it
      to the next step's gradient (Seide et al. 2014; Karimireddy et al.
      2019). ``"ef21"``: EF21 (Richtarik et al. 2021): each device keeps a
      gradient estimate ``h_i`` and sends the compressed change
      ``C(g_i - h_i)``; the update is the aggregate ``h = mean_i h_i``,
      kept replicated. For contractive compressors (top-k, signs, low
      rank); not with ``lr_schedule``. ``False``: none.
    momentum: if set, DGC's momentum correction (Lin et al. 2018): the codec
      compresses the accumulated velocity ``v += u``, ``u = m u + g``;
      use a downstream optimizer without momentum. Implies error feedback.
      With ``error_feedback="ef21"`` it is EF21-SGDM (Fatkhullin et al.
      2023): each device's momentum ``u = m u + g`` replaces ``g``, so the
      codec sends ``C(u_i - h_i)`` (no masking, no residual).
    momentum_masking: zero ``u`` where this device sent a coordinate (DGC's
      momentum factor masking). Only used with ``momentum``.
    clip_norm: local gradient clipping by global norm before accumulation,
      with the threshold scaled by ``num_devices ** -0.5`` (DGC, survey eq.
      14), so the summed gradient's norm stays within ``clip_norm``.
    lr_schedule: if given, the residual is rescaled by ``lr_{t-1} / lr_t``
      each step, so that mass delayed across a learning-rate change moves
      the parameters as much as it would have when it was computed.
    residual_decay: ``beta`` in ``x = beta e + g``: the residual decays by
      this factor each step before the gradient is added (SparseLoCo's
      error-feedback decay, Sarfi et al. 2025: with pseudo-gradients that
      repeat a direction sync after sync, an undecayed residual sends it
      many times over). ``1.0`` (the default) keeps every residual whole;
      below 1 the decayed part is dropped by design. Needs
      ``error_feedback=True`` (or ``momentum``).
    start_step: exchange dense means (no compression, residual untouched)
      while ``count < start_step``.
    policy: which leaves to compress and how to bucket them
      (:class:`jaxcomm.LeafPolicy`).
    seed: seed of the PRNG key kept in the state.
    **unknown: refused (a ValueError naming them): the compressor
      factories forward their ``**options`` here.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`CompressState`.
  """
  if unknown:
    raise ValueError(
      f"{codec.name}: unknown option(s) {', '.join(sorted(unknown))}; the "
      "options every compressor takes are start_step, clip_norm, momentum, "
      "momentum_masking, lr_schedule, residual_decay and seed")
  policy = _policy.as_policy(policy)
  _check_axis_name(axis_name)
  _checks.error_feedback(error_feedback)
  ef21 = error_feedback == _checks.EF21
  use_momentum = momentum is not None
  if ef21 and lr_schedule is not None:
    raise ValueError(
      f"{codec.name}: error_feedback='ef21' takes no lr_schedule: EF21 keeps "
      "gradient estimates, not delayed mass to rescale")
  if use_momentum:
    _checks.number("momentum", momentum, 0.0, 1.0)
  if clip_norm is not None:
    _checks.number("clip_norm", clip_norm, 0.0, None, lo_open=True)
  start_step = _checks.integer("start_step", start_step, 0)
  if lr_schedule is not None and not callable(lr_schedule):
    raise ValueError(f"lr_schedule must be callable, got {lr_schedule!r}")
  keep_residual = error_feedback is True or (use_momentum and not ef21)
  residual_decay = _checks.number("residual_decay", residual_decay, 0.0,
                                  1.0)
  if not isinstance(residual_decay, jax.core.Tracer) and \
      float(residual_decay) != 1.0 and not keep_residual:
    raise ValueError(
      f"{codec.name}: residual_decay={residual_decay!r} decays the "
      "error-feedback residual, which needs error_feedback=True (or "
      f"momentum); got error_feedback={error_feedback!r}")
  spec = Spec(codec=codec, policy=policy, axis_name=axis_name,
              start_step=start_step)

  def codec_init(layout):
    return codec.init(layout if codec.flat else list(layout.shapes))

  def init_fn(params):
    layouts = spec.layouts(params)
    zeros = tuple(jnp.zeros((lay.size,), jnp.float32) for lay in layouts)
    return CompressState(
      count=jnp.zeros([], jnp.int32),
      residual=zeros if keep_residual else (),
      momentum=zeros if use_momentum else (),
      codec=tuple(codec_init(lay) for lay in layouts),
      key=jax.random.PRNGKey(seed),
      stats=CompressStats(residual_norm=jnp.zeros([], jnp.float32),
                          nonfinite_steps=jnp.zeros([], jnp.int32)),
      estimate=zeros if ef21 else (),
      estimate_mean=zeros if ef21 else (),
    )

  opts = _Options(codec=codec, axis_name=axis_name, clip_norm=clip_norm,
                  lr_schedule=lr_schedule, momentum=momentum,
                  momentum_masking=momentum_masking,
                  keep_residual=keep_residual, use_momentum=use_momentum,
                  start_step=start_step, ef21=ef21,
                  residual_decay=residual_decay)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    n = _core.check_axis(axis_name, codec.name, grads=updates)
    if params is not None:
      _check_like_params(updates, params, codec.name)
    leaves, treedef = jax.tree.flatten(updates)
    _warn_if_wide(leaves, codec.name)
    paths = spec.paths(updates)
    layouts = spec.layouts(updates)
    _check_state(state, layouts, keep_residual, use_momentum, ef21,
                 codec.name)
    _check_codec_state(state.codec, layouts, codec_init, codec.name)
    comp = _policy.select(list(range(len(leaves))), paths, _policy.COMPRESS)
    dense_idx = [i for i, p in enumerate(paths) if p == _policy.DENSE]
    # One flat float32 buffer per bucket (equal shapes side by side).
    g = [_buckets.flatten([leaves[comp[j]] for j in lay.leaves])
         for lay in layouts]
    dense = _buckets.flatten([_as_real(leaves[i]) for i in dense_idx])

    key, step_key = jax.random.split(state.key)
    ctx = Context(axis_name=axis_name, num_devices=n,
                  device_index=_core.axis_index(axis_name), step=state.count,
                  key=step_key)
    g, xs, u, residual = accumulate(opts, g, state, n)
    mean, sent, codec_state, in_dense = exchange(opts, layouts, xs, g,
                                                 state.codec, ctx)
    new_res, new_u = update_memory(opts, xs, sent, u, residual, in_dense)
    new_h, mean = update_estimates(opts, state, g, sent, mean, in_dense)
    any_bad, dense_mean = agree_finite(
      opts, [x for x in g + [dense] if x.size], mean,
      new_res if keep_residual else new_h if ef21 else sent, dense, n)

    keep = lambda new, old: jax.tree.map(
      lambda a, b: jnp.where(any_bad, b, a), new, old)
    new_res = keep(tuple(new_res), state.residual)
    new_u = keep(tuple(new_u), state.momentum)
    codec_state = keep(tuple(codec_state), state.codec)
    new_h = keep(tuple(new_h), state.estimate)
    new_hmean = keep(tuple(mean), state.estimate_mean) if ef21 else ()
    # EF21's statistic: what this device's estimate misses of its gradient.
    missed = [x - s for x, s in zip(xs, sent)] if ef21 else list(new_res)

    out = list(leaves)
    nan = jnp.float32(jnp.nan)
    for lay, m in zip(layouts, mean):
      m = _materialized(jnp.where(any_bad, nan, m), state.count)
      for j, leaf in zip(lay.leaves, lay.split(m)):
        i = comp[j]
        out[i] = leaf.astype(leaves[i].dtype)
    if dense_idx:
      dense_mean = jnp.where(any_bad, nan, dense_mean)
      offset = 0
      for i in dense_idx:
        size = _policy.real_size(leaves[i])
        out[i] = _from_real(dense_mean[offset:offset + size], leaves[i])
        offset += size

    new_state = CompressState(
      count=optax.safe_increment(state.count),
      residual=new_res,
      momentum=new_u,
      codec=codec_state,
      key=key,
      stats=CompressStats(
        residual_norm=safe_norm(missed),
        nonfinite_steps=state.stats.nonfinite_steps
        + any_bad.astype(jnp.int32)),
      estimate=new_h,
      estimate_mean=new_hmean,
    )
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformationExtraArgs(
    _Init(init_fn, spec), update_fn)



# ------------------------------------------------------------- stages ----
# compressed()'s update in named stages, each a function of static options
# and arrays (testable alone): accumulate -> exchange -> update_memory ->
# agree_finite; the update then keeps or rolls back the state and splits
# the averaged buckets into the leaves.


@dataclasses.dataclass(frozen=True)
class _Options:
  """The static configuration of one :func:`compressed` transform."""

  codec: Codec
  axis_name: Any
  clip_norm: float | None
  lr_schedule: Callable | None
  momentum: Any
  momentum_masking: bool
  keep_residual: bool
  use_momentum: bool
  start_step: int
  ef21: bool = False
  residual_decay: Any = 1.0


def accumulate(opts: _Options, g: list, state: CompressState, n: int):
  """What the codec compresses this step, per bucket.

  Local clipping (DGC: threshold ``clip_norm / sqrt(n)``), the residual
  rescaled by ``lr_{t-1} / lr_t``, then ``x = e + g`` (error feedback) or
  ``u = m u + g; x = e + u`` (momentum correction).

  Returns:
    ``(g, xs, u, residual)``: the clipped gradients, the codec's inputs,
    the new momentum (empty without it) and the rescaled residual.
  """
  step = state.count
  if opts.clip_norm is not None and g:
    norm = safe_norm(g)
    limit = opts.clip_norm / jnp.sqrt(jnp.float32(n))
    scale = jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-30))
    g = [x * scale for x in g]
  residual = list(state.residual)
  if opts.lr_schedule is not None and residual:
    prev = jnp.asarray(opts.lr_schedule(jnp.maximum(step - 1, 0)),
                       jnp.float32)
    cur = jnp.asarray(opts.lr_schedule(step), jnp.float32)
    ratio = jnp.where(step > 0, prev / jnp.where(cur == 0, 1.0, cur), 1.0)
    residual = [r * ratio for r in residual]
  if not (isinstance(opts.residual_decay, float)
          and opts.residual_decay == 1.0) and residual:
    residual = [r * opts.residual_decay for r in residual]
  if opts.ef21:
    # EF21, or with momentum EF21-SGDM: the momentum stands for g.
    u = ([opts.momentum * m + x for m, x in zip(state.momentum, g)]
         if opts.use_momentum else [])
    xs = [x - h for x, h in zip(u or g, state.estimate)]
  elif opts.use_momentum:
    u = [opts.momentum * m + x for m, x in zip(state.momentum, g)]
    xs = [r + m for r, m in zip(residual, u)]
  elif opts.keep_residual:
    u = []
    xs = [r + x for r, x in zip(residual, g)]
  else:
    u = []
    xs = list(g)
  return g, xs, u, residual


def exchange(opts: _Options, layouts, xs: list, g: list, codec_state,
             ctx: Context):
  """The codec on every bucket, or the exact dense mean while
  ``count < start_step`` (nothing left behind, codec state untouched).

  Returns:
    ``(mean, sent, codec_state, in_dense)`` per bucket.
  """
  n = ctx.num_devices

  def compress_branch(_):
    outs = [_apply_codec(opts.codec, lay, x, cs, ctx)
            for lay, x, cs in zip(layouts, xs, codec_state)]
    return ([o[0] for o in outs], [o[1] for o in outs],
            tuple(o[2] for o in outs))

  def dense_branch(_):
    mean = [_core.psum(x, opts.axis_name) / n for x in g]
    return mean, list(g), codec_state

  if not g:
    return [], [], codec_state, jnp.zeros([], bool)
  if opts.start_step <= 0:
    return (*compress_branch(None), jnp.zeros([], bool))
  in_dense = ctx.step < opts.start_step
  # Both branches must agree in type: where the codec makes a state leaf
  # vary over the axis (a per-device statistic), the dense branch's
  # unchanged leaf is marked varying too.
  want = jax.eval_shape(compress_branch, None)[2]

  def dense_typed(_):
    mean, sent, cs = dense_branch(None)
    return mean, sent, jax.tree.map(_vma.match_varying, cs, want)

  mean, sent, new_cs = jax.lax.cond(in_dense, dense_typed, compress_branch,
                                    None)
  return mean, sent, new_cs, in_dense


def update_memory(opts: _Options, xs: list, sent: list, u: list,
                  residual: list, in_dense):
  """The new residual ``e' = x - sent`` and momentum (DGC's masking zeroes
  ``u`` where this device sent); in the dense phase the residual is kept
  and the momentum cleared.

  Returns:
    ``(new_residual, new_momentum)``, lists per bucket (empty when off).
  """
  new_res = []
  if opts.keep_residual:
    new_res = [x - s for x, s in zip(xs, sent)]
    if opts.start_step > 0:
      new_res = [jnp.where(in_dense, r, e)
                 for r, e in zip(residual, new_res)]
  new_u = []
  if opts.use_momentum:
    new_u = ([jnp.where(s != 0, 0.0, m) for m, s in zip(u, sent)]
             if opts.momentum_masking and not opts.ef21 else list(u))
    if opts.start_step > 0:
      new_u = [jnp.where(in_dense, jnp.zeros_like(m), m) for m in new_u]
  return new_res, new_u


def update_estimates(opts: _Options, state: CompressState, g: list,
                     sent: list, mean: list, in_dense):
  """EF21's estimates: ``h_i' = h_i + sent`` per device and the aggregate
  ``h' = h + mean`` (the update). In the dense phase both are set to the
  exact gradients (``h_i' = g_i``, ``h' = mean_i g_i``), which starts
  EF21 from exact estimates.

  Returns:
    ``(new_estimates, update)`` per bucket; ``([], mean)`` unless EF21.
  """
  if not opts.ef21:
    return [], mean
  new_h = [h + s for h, s in zip(state.estimate, sent)]
  new_mean = [h + m for h, m in zip(state.estimate_mean, mean)]
  if opts.start_step > 0:
    new_h = [jnp.where(in_dense, x, h) for x, h in zip(g, new_h)]
    new_mean = [jnp.where(in_dense, m, h) for m, h in zip(mean, new_mean)]
  return new_h, new_mean


def agree_finite(opts: _Options, inputs: list, mean: list, kept: list,
                 dense: jax.Array, n: int):
  """One decision, the same on every device: did any device see a NaN or
  Inf in its gradients (``inputs``) or in what the compressor made of
  them (``mean``, and ``kept``: the residual, or what was sent)?

  The flag rides in the fused psum of the dense leaves (one more float32,
  no extra collective). Dense leaves are divided by ``n`` first, so the
  sum does not overflow where the mean would not; a mean that still
  overflows is seen alike on every device (the psum's result is
  replicated) and counts too.

  Returns:
    ``(any_bad, dense_mean)``.
  """
  local_bad = jnp.zeros([], bool)
  for x in inputs:
    local_bad = local_bad | ~jnp.all(jnp.isfinite(x))
  for m, e in zip(mean, kept):
    local_bad = local_bad | ~jnp.all(jnp.isfinite(m)) \
      | ~jnp.all(jnp.isfinite(e))
  flat = jnp.concatenate([dense / n, local_bad.astype(jnp.float32)[None]])
  summed = _core.psum(flat, opts.axis_name)
  dense_mean = summed[:-1]
  any_bad = (summed[-1] > 0) | ~jnp.all(jnp.isfinite(dense_mean))
  return any_bad, dense_mean


def _check_state(state, layouts, keep_residual, use_momentum, ef21, name):
  """Names what is wrong when the state does not belong to these grads."""
  if not isinstance(state, CompressState):
    raise ValueError(
      f"{name}: state must be the CompressState this compressor's init "
      f"returned, got {type(state).__name__}")
  want = [(lay.size,) for lay in layouts]
  for field, on in (("residual", keep_residual), ("momentum", use_momentum),
                    ("estimate", ef21), ("estimate_mean", ef21)):
    got = [tuple(x.shape) for x in getattr(state, field)]
    if on and got != want:
      raise ValueError(
        f"{name}: the gradients do not match the state's {field}: the "
        f"compressed leaves need buckets of {want} elements, the state "
        f"holds {got} (gradients of other shapes than the params given to "
        "init, or another compressor's state)")


def _warn_if_wide(leaves, name) -> None:
  """float64 gradients (``jax_enable_x64``) are averaged in float32: say so
  once per trace rather than return float32 accuracy in a float64 dtype."""
  wide = sorted({str(jnp.result_type(x)) for x in leaves
                 if jnp.result_type(x) in (jnp.float64, jnp.complex128)})
  if wide:
    warnings.warn(
      f"{name}: {'/'.join(wide)} gradients are compressed and averaged in "
      "float32 (the buckets and the fused psum are float32); the update is "
      "cast back to the gradients' dtype but carries float32 accuracy",
      stacklevel=3)


def _check_like_params(updates, params, name):
  """The gradients must have the params' structure and shapes: a gradient
  of another shape would be broadcast silently (and change the residual's
  shape with it)."""
  u_paths = {jax.tree_util.keystr(p): x
             for p, x in jax.tree_util.tree_leaves_with_path(updates)}
  p_paths = {jax.tree_util.keystr(p): x
             for p, x in jax.tree_util.tree_leaves_with_path(params)}
  missing = [k for k in p_paths if k not in u_paths]
  extra = [k for k in u_paths if k not in p_paths]
  if missing or extra:
    what = []
    if missing:
      what.append(f"missing {', '.join(missing[:5])}")
    if extra:
      what.append(f"not in params: {', '.join(extra[:5])}")
    raise ValueError(
      f"{name}: the gradients' leaves do not match the params' "
      f"({'; '.join(what)})")
  for k, g in u_paths.items():
    p = p_paths[k]
    gs, ps = getattr(g, "shape", None), getattr(p, "shape", None)
    if gs is not None and ps is not None and tuple(gs) != tuple(ps):
      raise ValueError(
        f"{name}: gradient leaf {k} has shape {tuple(gs)} but its param has "
        f"shape {tuple(ps)}")


def _describe(tree) -> str:
  if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
    return "()" if not tree else f"a tuple of {len(tree)}"
  return f"a {type(tree).__name__}"


def _check_codec_state(codec_state, layouts, codec_init, name):
  """The codec state must be what ``codec.init`` makes for these buckets
  (another compressor's state, or gradients transposed against the
  params a PowerSGD state was made for, fail here by name)."""
  if not isinstance(codec_state, tuple) or len(codec_state) != len(layouts):
    raise ValueError(
      f"{name}: the state's codec part does not belong to this compressor "
      f"(expected one entry per bucket, {len(layouts)}; got "
      f"{type(codec_state).__name__} of "
      f"{len(codec_state) if isinstance(codec_state, tuple) else '?'}): "
      "another compressor's state?")
  for lay, got in zip(layouts, codec_state):
    want = jax.eval_shape(lambda lay=lay: codec_init(lay))
    w_leaves, w_def = jax.tree.flatten(want)
    g_leaves, g_def = jax.tree.flatten(got)
    if w_def != g_def:
      raise ValueError(
        f"{name}: the state's codec part does not belong to this "
        f"compressor: expected {_describe(want)}, got {_describe(got)} "
        "(another compressor's state?)")
    for w, g in zip(w_leaves, g_leaves):
      if tuple(w.shape) != tuple(jnp.shape(g)):
        raise ValueError(
          f"{name}: the state was made for gradients of other shapes: a "
          f"codec state leaf is {tuple(jnp.shape(g))}, these gradients "
          f"need {tuple(w.shape)} (gradients transposed or reshaped "
          "against the params given to init?)")


# The options of compressed() that every compressor factory forwards, with
# their defaults (None: not numeric, so optax.inject_hyperparams leaves
# them static unless they are passed).
SHARED_OPTIONS = (("start_step", None), ("clip_norm", None),
                  ("momentum", None), ("momentum_masking", True),
                  ("lr_schedule", None), ("residual_decay", 1.0))


_OPTIONS_DOC = """\
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` (and
      ``seed`` where not above), forwarded to :func:`jaxcomm.compressed`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.
"""


def shared_options(factory):
  """Gives a factory that ends in ``**options`` (forwarded to
  :func:`compressed`) the shared options as explicit keyword-only
  parameters in its signature, for ``inspect.signature`` readers
  (``optax.inject_hyperparams``, train.py's argument check): a bare
  ``**options`` makes ``inject_hyperparams`` pass ``options={}`` along.

  The factory's docstring gets the one description of ``**options`` and
  its return value, at the end of its ``Args:`` (before ``Example::``)."""
  sig = inspect.signature(factory)
  params = [p for p in sig.parameters.values()
            if p.kind is not p.VAR_KEYWORD]
  have = {p.name for p in params}
  params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                               default=default)
             for name, default in SHARED_OPTIONS if name not in have]

  @functools.wraps(factory)
  def wrapper(*args, **kwargs):
    if "start_step" in kwargs and kwargs["start_step"] is None:
      kwargs["start_step"] = 0
    return factory(*args, **kwargs)

  wrapper.__signature__ = sig.replace(parameters=params)
  doc = wrapper.__doc__ or ""
  if "**options" not in doc:
    cut = doc.find("\n  Example::")
    cut = cut if cut >= 0 else len(doc.rstrip()) + 1
    wrapper.__doc__ = (doc[:cut].rstrip("\n") + "\n" + _OPTIONS_DOC
                       + doc[cut:])
  return wrapper


def spec_of(tx) -> Spec:
  """The :class:`Spec` of a compressor built by :func:`compressed`."""
  spec = getattr(getattr(tx, "init", None), "jaxcomm_spec", None)
  if spec is None:
    raise ValueError(
      "tx must be a jaxcomm compressor (built by jaxcomm.compressed or one of "
      f"its factories), got {type(tx).__name__}; wrap only the compressor, "
      "not an optax.chain around it")
  return spec


def compress_states(opt_state) -> list[CompressState]:
  """Every :class:`CompressState` in an optimizer state, in order: inside
  ``optax.chain``, ``inject_hyperparams``, ``MultiSteps``, ``masked`` or any
  nesting of tuples, named tuples, lists, mappings and other pytree nodes
  (a Flax ``TrainState``, an ``nnx.Optimizer``).

  Flax NNX trees work too: leaves wrapped in ``nnx.Variable`` (what
  ``nnx.Optimizer.opt_state`` holds) come back as arrays, and in
  ``nnx.state(optimizer)``, where NNX has turned every NamedTuple into a
  mapping of its field names and dropped the fields that hold no arrays, a
  mapping with a :class:`CompressState`'s fields (``count``, ``key`` and a
  ``stats`` mapping with :class:`CompressStats`'s fields among them) is read
  back as one: integer-keyed mappings become tuples and dropped fields
  ``()``.
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
  """Every :class:`CompressStats` found in an optimizer state, in order."""
  return [s.stats for s in compress_states(opt_state)]
