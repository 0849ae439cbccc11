"""The stages of one :func:`jaxcomm.compressed` update, each a function of
static options and arrays: error feedback in, the codec's exchange, the
residual out, and the one non-finite decision."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _vma
from jaxcomm._codec import Codec
from jaxcomm._codec import CompressState
from jaxcomm._codec import Context
from jaxcomm.collectives import _core

# ------------------------------------------------------------- stages ----
# compressed()'s update in named stages, each a function of static options
# and arrays (testable alone): accumulate -> exchange -> update_memory ->
# agree_finite; the update then keeps or rolls back the state and splits
# the averaged buckets into the leaves.



# The data axes of the step tx.update runs in, set at trace time by
# jaxcomm.parallel (block mode's update, the update on shards, the layout
# probe): every other manual axis holds blocks of the same model.
_STEP_DATA_AXES: contextvars.ContextVar = contextvars.ContextVar(
  "jaxcomm_step_data_axes", default=None)


@contextlib.contextmanager
def one_model(data_axes):
  """Within: ``tx.update`` runs in a step whose data axes are
  ``data_axes``; every other manual mesh axis (FSDP, tensor) splits one
  model into blocks, so the non-finite decision (:func:`agree_finite`)
  covers them too: a step is skipped on every block or on none."""
  names = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  token = _STEP_DATA_AXES.set(names)
  try:
    yield
  finally:
    _STEP_DATA_AXES.reset(token)


def model_axes(axis_name) -> tuple:
  """The manual mesh axes here that hold blocks of one model: those not
  among the step's data axes (:func:`one_model`) nor ``axis_name``; empty
  outside such a step."""
  data = _STEP_DATA_AXES.get()
  if data is None:
    return ()
  mesh = jax.sharding.get_abstract_mesh()
  own = set(data) | set(_core._names(axis_name))
  manual = jax.sharding.AxisType.Manual
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
               if t == manual and a not in own)


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


def _apply_codec(codec: Codec, layout, x, state, ctx):
  """Runs the codec on one bucket; returns flat (mean, sent, state)."""
  res = codec.apply(x, state, ctx._replace(layout=layout))
  return res.mean, res.sent, res.state


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
  # EF21 or DIANA: per-device estimates h_i and their mean h, moved by
  # shift_rate times what was sent (1 for EF21).
  estimates: bool = False
  residual_decay: Any = 1.0
  shift_rate: Any = 1.0


def _is_one(value) -> bool:
  return isinstance(value, (int, float)) and float(value) == 1.0


def shifted(opts: _Options, x: jax.Array) -> jax.Array:
  """``shift_rate * x`` (``x`` itself for EF21's rate 1, exactly)."""
  if _is_one(opts.shift_rate):
    return x
  return x * jnp.asarray(opts.shift_rate, x.dtype)


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
  if opts.estimates:
    # EF21 and DIANA: the codec gets g - h_i. With momentum (EF21 only)
    # it is EF21-SGDM: the momentum stands for g.
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
             ctx: Context, fresh: list | None = None):
  """The codec on every bucket, or the exact dense mean while
  ``count < start_step`` (nothing left behind, codec state untouched).
  ``fresh``: per bucket, the step's new contribution to ``x`` (default
  ``g``), handed to a codec that ``wants_gradient`` as ``ctx.grad``.

  Returns:
    ``(mean, sent, codec_state, in_dense)`` per bucket.
  """
  n = ctx.num_devices

  grads = (g if fresh is None else fresh) if opts.codec.wants_gradient \
    else [None] * len(xs)

  def compress_branch(_):
    outs = [_apply_codec(opts.codec, lay, x, cs, ctx._replace(grad=gr))
            for lay, x, cs, gr in zip(layouts, xs, codec_state, grads)]
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
             if opts.momentum_masking and not opts.estimates else list(u))
    if opts.start_step > 0:
      new_u = [jnp.where(in_dense, jnp.zeros_like(m), m) for m in new_u]
  return new_res, new_u


def update_estimates(opts: _Options, state: CompressState, g: list,
                     sent: list, mean: list, in_dense):
  """The estimates of EF21 and DIANA, with ``alpha = shift_rate`` (1 for
  EF21): ``h_i' = h_i + alpha sent`` per device, ``h' = h + alpha mean``
  (replicated, so ``h = mean_i h_i`` where the exchange is the mean of
  what was sent), and the update ``h + mean``: EF21's ``h'``, DIANA's
  ``ghat = h + mean_i C(g_i - h_i)``. In the dense phase both are set to
  the exact gradients (``h_i' = g_i``, ``h' = mean_i g_i``, the update the
  exact mean), which starts from exact estimates.

  Returns:
    ``(new_estimates, new_aggregate, update)`` per bucket; ``([], [],
    mean)`` unless EF21 or DIANA.
  """
  if not opts.estimates:
    return [], [], mean
  new_h = [h + shifted(opts, s) for h, s in zip(state.estimate, sent)]
  update = [h + m for h, m in zip(state.estimate_mean, mean)]
  new_mean = (list(update) if _is_one(opts.shift_rate) else
              [h + shifted(opts, m)
               for h, m in zip(state.estimate_mean, mean)])
  if opts.start_step > 0:
    new_h = [jnp.where(in_dense, x, h) for x, h in zip(g, new_h)]
    new_mean = [jnp.where(in_dense, m, h) for m, h in zip(mean, new_mean)]
    update = [jnp.where(in_dense, m, u) for m, u in zip(mean, update)]
  return new_h, new_mean, update


def agree_finite(opts: _Options, inputs: list, mean: list, kept: list,
                 dense: jax.Array, n: int, exchanged: list = ()):
  """One decision, the same on every device: did any device see a NaN or
  Inf in its gradients (``inputs``: the dense leaves; a compressed
  gradient is seen in the codec's input ``x``, non-finite wherever it is)
  or in what the compressor made of them (``mean``, and ``kept``: the
  residual or estimates, or what was sent where the mean is not its
  device mean), or hand the exchange values whose sum over the ``n``
  devices overflows float32 (``exchanged``: ``|x| > max_float32 / n``, or
  a NaN)? An overflow inside the
  exchange need not show in its outputs (int8's scale became inf and every
  code 0; the residual kept the value for good), so it is caught where it
  enters.

  The flag rides in the fused psum of the dense leaves (one more float32,
  no extra collective). Dense leaves are divided by ``n`` first, so the
  sum does not overflow where the mean would not; a mean that still
  overflows is seen alike on every device (the psum's result is
  replicated) and counts too. Inside a step over a sharded model
  (:func:`one_model`) the decision is also taken over the model axes, so
  that every block of the model skips the step, or none.

  Returns:
    ``(any_bad, dense_mean)``.
  """
  local_bad = jnp.zeros([], bool)
  for x in inputs:
    local_bad = local_bad | ~jnp.all(jnp.isfinite(x))
  limit = jnp.float32(float(jnp.finfo(jnp.float32).max) / max(n, 1))
  for x in exchanged:
    if x.size:
      # A NaN counts as an Inf: XLA's CPU max reduction can skip a NaN.
      mag = jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))
      local_bad = local_bad | ~(jnp.max(mag) <= limit)
  for x in list(mean) + list(kept):
    local_bad = local_bad | ~jnp.all(jnp.isfinite(x))
  flat = jnp.concatenate([dense / n, local_bad.astype(jnp.float32)[None]])
  summed = _core.psum(flat, opts.axis_name)
  dense_mean = summed[:-1]
  any_bad = (summed[-1] > 0) | ~jnp.all(jnp.isfinite(dense_mean))
  return agree_model(opts.axis_name, any_bad), dense_mean


def agree_model(axis_name, flag: jax.Array) -> jax.Array:
  """``flag`` (a bool the same on every device of the data axes) made the
  same on every block of one model too: inside a step over a sharded model
  (:func:`one_model`) it is maxed over the model axes, so a block that is
  bad makes every block skip (one scalar all-reduce over the fast axes);
  elsewhere it is returned as is."""
  model = model_axes(axis_name)
  if not model:
    return flag
  flag = flag.astype(jnp.float32)
  if _core.vma_typed(model[0]):
    flag = _vma.mark_varying(flag, model)
  return _core.pmax(flag, model) > 0


def peak(x: jax.Array) -> jax.Array:
  """``max |x|`` over the last axis, a NaN read as an Inf (XLA's CPU max
  reduction can skip a NaN)."""
  return jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)), axis=-1)


def narrow_casts(peaks: jax.Array, dtypes) -> list:
  """``peaks`` (float32, one ``max |update|`` per leaf) cast to each
  leaf's dtype where it is narrower than float32 (float16, bfloat16,
  float8): one array per narrow dtype, zeros at the other leaves. A cast is
  monotone, so a leaf's update is finite in its dtype iff its peak is: the
  finite check reads these, and an update that a float32 computation keeps
  finite but the leaf's dtype rounds to inf is a non-finite step. Empty
  (nothing to compute) when no leaf is narrower than float32.

  Args:
    peaks: ``[len(dtypes)]`` float32.
    dtypes: the leaves' dtypes, in the order of ``peaks``.

  Returns:
    A list of arrays, one per narrow dtype.
  """
  dtypes = [jnp.dtype(d) for d in dtypes]
  narrow = sorted({d for d in dtypes
                   if jnp.issubdtype(d, jnp.floating)
                   and jnp.finfo(d).bits < 32}, key=str)
  out = []
  for d in narrow:
    mask = np.array([x == d for x in dtypes])
    out.append((peaks if mask.all() else
                jnp.where(mask, peaks, 0.0)).astype(d))
  return out
