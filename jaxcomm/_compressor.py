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

``error_feedback="diana"`` (Mishchenko et al. 2019) is the same path for
unbiased codecs, with the shifts moved by ``alpha = shift_rate`` and the
update taken before they move::

  x  = g - h_i               c_i = C(x), unbiased
  r  = codec.apply(x)
  u  = h + r.mean            ghat = h + mean_i c_i
  h_i' = h_i + alpha r.sent;  h' = h + alpha r.mean
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _policy
from jaxcomm._codec import Codec
from jaxcomm._codec import CodecBase  # noqa: F401 (the codec API)
from jaxcomm._codec import CodecResult  # noqa: F401 (the codec API)
from jaxcomm._codec import Collective  # noqa: F401
from jaxcomm._codec import CompressState
from jaxcomm._codec import CompressStats
from jaxcomm._codec import Context
from jaxcomm._codec import Spec
from jaxcomm._codec import _Init
from jaxcomm._codec import spec_of  # noqa: F401
from jaxcomm._stages import _Options
from jaxcomm._stages import accumulate
from jaxcomm._stages import agree_finite
from jaxcomm._stages import agree_model
from jaxcomm._stages import exchange
from jaxcomm._stages import narrow_casts
from jaxcomm._stages import safe_norm
from jaxcomm._stages import shifted
from jaxcomm._stages import update_estimates
from jaxcomm._stages import update_memory
from jaxcomm._states import compress_states  # noqa: F401
from jaxcomm._states import states_of  # noqa: F401
from jaxcomm._states import stats  # noqa: F401
from jaxcomm.collectives import _core


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
  A bucket of 2^31 values or more has no int32 position past its end: it is
  returned as it is (correct, at the fused decode's compile cost).
  """
  if x.size == 0 or x.shape[0] >= jnp.iinfo(jnp.int32).max:
    return x
  past_end = x.shape[0] + jnp.minimum(count, 0)
  return x.at[past_end].add(jnp.zeros((), x.dtype), mode="drop")


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
  shift_rate: float | None = None,
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
      rank); not with ``lr_schedule``. ``"diana"``: DIANA (Mishchenko et
      al. 2019; Horvath et al. 2019), for unbiased compressors (QSGD,
      TernGrad without clipping): each device keeps a shift ``h_i`` and
      sends ``c_i = C(g_i - h_i)``; the update is ``h + mean_i c_i``, then
      ``h_i += shift_rate c_i`` and ``h += shift_rate mean_i c_i``. Refused
      for a codec that is not ``unbiased`` or whose exchange is not the
      mean of what was sent; not with ``lr_schedule`` or ``momentum``
      (DIANA's momentum is heavy ball on the update: chain an optimizer
      with momentum after the compressor). ``False``: none.
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
    shift_rate: DIANA's ``alpha`` in ``(0, 1]`` (only with
      ``error_feedback="diana"``; None there: 0.5). The theory (Mishchenko
      et al. 2019, Theorem 2) asks ``alpha <= 1 / (omega + 1)`` for a
      compressor of variance ``E||C(x) - x||^2 <= omega ||x||^2``; with a
      fixed gradient the shift's error ``g_i - h_i`` shrinks by ``1 -
      alpha`` a step in expectation, and its second moment contracts for
      ``alpha < 2 / (omega + 1)``. 0.5 fits ``omega <= 1`` (natural
      compression's is 1/8); pass a smaller rate for coarser quantizers.
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

  Raises:
    TypeError: when ``codec`` is not a :class:`Codec`.
    ValueError: naming the argument, for an unknown option, an option out
      of range or not finite (``momentum``, ``clip_norm``,
      ``residual_decay``, ``shift_rate``, ``start_step``), a ``seed`` that
      is not an int ``>= 0``, a ``policy`` that is not a
      :class:`LeafPolicy`, or options that do not go together (EF21 or
      DIANA with a codec that does not fit them, with ``lr_schedule``,
      DIANA with ``momentum``, ``shift_rate`` without DIANA,
      ``residual_decay`` without a residual). The update raises a
      ValueError when called outside a context that binds ``axis_name``,
      with gradients JAX already summed over it, or with a state made
      for other gradients.

  Examples:
    Top-k's codec (taken from the factory's compressor) with a leaf
    policy that compresses even a 4-value leaf, on 8 devices. Device
    ``i`` (1 to 8) has the gradient ``[i, -i, 0.1, 0.2]``: each sends its
    two largest values, the update is their mean, and error feedback
    keeps what was not sent.

    >>> import jax, jax.numpy as jnp, numpy as np, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> codec = jaxcomm.spec_of(jaxcomm.topk(0.5)).codec
    >>> tx = jaxcomm.compressed(codec, axis_name="data",
    ...                         policy=jaxcomm.LeafPolicy(min_size=1))
    >>> mesh = jaxcomm.parallel.make_mesh()     # 8 devices on "data"
    >>> def step(g):
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None, :4]
    >>> i = jnp.arange(1.0, 9.0)[:, None]
    >>> grads = jnp.concatenate([i, -i, 0 * i + 0.1, 0 * i + 0.2], axis=1)
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(update, np.float64).round(3))
    [ 4.5 -4.5  0.   0. ]
    >>> print(np.asarray(residual[7], np.float64).round(3))
    [0.  0.  0.1 0.2]
  """
  _codec.check_codec(codec)
  if unknown:
    raise ValueError(
      f"{codec.name}: unknown option(s) {', '.join(sorted(unknown))}; the "
      "options every compressor takes are start_step, clip_norm, momentum, "
      "momentum_masking, lr_schedule, residual_decay, shift_rate and seed")
  policy = _policy.as_policy(policy)
  _checks.axis_name(axis_name)
  _checks.error_feedback(error_feedback)
  ef21 = error_feedback == _checks.EF21
  diana = error_feedback == _checks.DIANA
  # EF21 and DIANA keep per-device estimates h_i and their mean h.
  estimates = ef21 or diana
  use_momentum = momentum is not None
  if ef21 and not codec.mean_of_sent:
    raise ValueError(
      f"{codec.name}: error_feedback='ef21' needs an exchange whose result "
      "is the mean of what the devices sent (EF21 keeps h = mean_i h_i); "
      f"{codec.name}'s is not (it votes, re-compresses or re-rounds on the "
      "way): use error_feedback=True")
  if diana and not (codec.unbiased and codec.mean_of_sent):
    why = []
    if not codec.unbiased:
      why.append("its messages are biased (E[C(x)] != x: deterministic "
                 "rounding, selection or unscaled sampling)")
    if not codec.mean_of_sent:
      why.append("its exchange is not the mean of what the devices sent "
                 "(it votes, re-compresses or re-rounds on the way)")
    raise ValueError(
      f"{codec.name}: error_feedback='diana' needs an unbiased codec whose "
      "exchange returns the mean of what the devices sent (DIANA's shifts "
      "learn g_i from unbiased differences and keep h = mean_i h_i); "
      f"{codec.name}: {'; '.join(why)}. Use error_feedback=True, or 'ef21' "
      "for a contractive codec")
  if estimates and lr_schedule is not None:
    raise ValueError(
      f"{codec.name}: error_feedback={error_feedback!r} takes no "
      "lr_schedule: it keeps gradient estimates, not delayed mass to "
      "rescale")
  if diana and use_momentum:
    raise ValueError(
      f"{codec.name}: error_feedback='diana' takes no momentum: DIANA's "
      "momentum is heavy ball on the update it returns (Mishchenko et al. "
      "2019); chain an optimizer with momentum after the compressor")
  if shift_rate is not None:
    if not diana:
      raise ValueError(
        f"{codec.name}: shift_rate={shift_rate!r} is DIANA's step for its "
        "shifts and needs error_feedback='diana'; got "
        f"error_feedback={error_feedback!r}")
    _checks.number("shift_rate", shift_rate, 0.0, 1.0, lo_open=True)
  shift = (DIANA_SHIFT_RATE if shift_rate is None else shift_rate) \
    if diana else 1.0
  if use_momentum:
    _checks.number("momentum", momentum, 0.0, 1.0)
  if clip_norm is not None:
    _checks.number("clip_norm", clip_norm, 0.0, None, lo_open=True)
  start_step = _checks.step("start_step", start_step)
  seed = _checks.seed("seed", seed)
  if lr_schedule is not None and not callable(lr_schedule):
    raise ValueError(f"lr_schedule must be callable, got {lr_schedule!r}")
  keep_residual = error_feedback is True or (use_momentum and not estimates)
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
    return codec.init(layout)

  def init_fn(params):
    layouts = spec.layouts(params)
    check = getattr(codec, "check_layouts", None)
    if check is not None:
      check(layouts)
    zeros = tuple(jnp.zeros((lay.stored_size,), jnp.float32)
                  for lay in layouts)
    return CompressState(
      count=jnp.zeros([], jnp.int32),
      residual=zeros if keep_residual else (),
      momentum=zeros if use_momentum else (),
      codec=tuple(codec_init(lay) for lay in layouts),
      key=jax.random.PRNGKey(seed),
      stats=CompressStats(residual_norm=jnp.zeros([], jnp.float32),
                          nonfinite_steps=jnp.zeros([], jnp.int32)),
      estimate=zeros if estimates else (),
      estimate_mean=zeros if estimates else (),
    )

  opts = _Options(codec=codec, axis_name=axis_name, clip_norm=clip_norm,
                  lr_schedule=lr_schedule, momentum=momentum,
                  momentum_masking=momentum_masking,
                  keep_residual=keep_residual, use_momentum=use_momentum,
                  start_step=start_step, estimates=estimates,
                  residual_decay=residual_decay, shift_rate=shift)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    n = _core.check_axis(axis_name, codec.name, grads=updates)
    if params is not None:
      _check_like_params(updates, params, codec.name)
    leaves, treedef = jax.tree.flatten(updates)
    _warn_if_wide(leaves, codec.name)
    paths = spec.paths(updates)
    layouts = spec.layouts(updates)
    _check_state(state, layouts, keep_residual, use_momentum, estimates,
                 codec.name)
    _check_codec_state(state.codec, layouts, codec_init, codec.name)
    stored = state
    state = state._replace(**{f: tuple(
      b if lay.stored_size == lay.size else b[:lay.size]
      for b, lay in zip(getattr(state, f), layouts))
      for f in _codec.BUFFER_FIELDS})
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
    # A codec that wants_gradient sees the step's fresh term too (DGC's
    # momentum u where there is one, else g) as ctx.grad.
    mean, sent, codec_state, in_dense = exchange(opts, layouts, xs, g,
                                                 state.codec, ctx,
                                                 fresh=u or g)
    new_res, new_u = update_memory(opts, xs, sent, u, residual, in_dense)
    new_h, new_hmean, mean = update_estimates(opts, state, g, sent, mean,
                                              in_dense)
    # Without a residual or estimates, what was sent is checked only where
    # the mean is not its device mean: otherwise a non-finite value sent
    # is non-finite in the mean too, and checking it would keep a dense
    # buffer of a sparse message alive for nothing.
    kept = (new_res if keep_residual else new_h if estimates
            else [] if codec.mean_of_sent else sent)
    # The compressed gradients are checked through the codec's inputs
    # (exchanged=xs): x = e + g (or e + u, g - h_i) with a finite state is
    # non-finite wherever g is, and x's check is read as x is made. A check
    # of g itself was scheduled after the exchange on TPU, holding the
    # gradient buffer through it (sharded on two v5e slices: AdaComp 1.40x
    # -> 1.09x the plain step's memory, DeMo 1.71x -> 1.40x; AdaComp in
    # block mode on v6e 1.62x -> 1.78x, the compiler's own scheduling).
    any_bad, dense_mean = agree_finite(
      opts, [dense] if dense.size else [],
      list(mean) + _narrow_casts(layouts, mean, [leaves[i] for i in comp]),
      kept, dense, n, exchanged=xs)

    keep = lambda new, old: jax.tree.map(
      lambda a, b: jnp.where(any_bad, b, a), new, old)
    # The bucket buffers are padded back to their stored width first and a
    # skipped step keeps the stored state itself (the argument): the
    # step-width copy of the old buffer is then dead once read, not held
    # through the exchange (AdaComp sharded on two v5e slices: 1.68x ->
    # 1.40x the plain step's memory, DeMo 1.97x -> 1.71x).
    new_res = keep(_stored(new_res, layouts), stored.residual)
    new_u = keep(_stored(new_u, layouts), stored.momentum)
    codec_state = keep(tuple(codec_state), state.codec)
    new_h = keep(_stored(new_h, layouts), stored.estimate)
    new_hmean = keep(_stored(new_hmean, layouts), stored.estimate_mean)
    # EF21's and DIANA's statistic: what this device's estimate misses of
    # its gradient.
    missed = ([x - shifted(opts, s) for x, s in zip(xs, sent)] if estimates
              else list(new_res))

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


def _narrow_casts(layouts, mean: list, comp_leaves: list) -> list:
  """What the float32 means become in the leaves' own narrower dtypes
  (float16, bfloat16, float8): per bucket, each leaf's largest ``|mean|``
  cast to its dtype (:func:`jaxcomm._stages.narrow_casts`). A mean finite
  in float32 can round to inf in the leaf's dtype (FetchSGD's and ATOMO's
  decoded values exceed the gradients'); the finite check must see that,
  or the update leaves inf with the step counted as taken. One reduction
  per group and one cast per narrow dtype per bucket; nothing for float32
  leaves."""
  out = []
  for lay, m in zip(layouts, mean):
    dtypes = [comp_leaves[j].dtype for j in lay.leaves]
    if not any(jnp.issubdtype(d, jnp.floating) and jnp.finfo(d).bits < 32
               for d in dtypes):
      continue
    out += narrow_casts(lay.reduce(lambda v: jnp.max(jnp.abs(v), axis=-1),
                                   m, pad=0.0), dtypes)
  return out


def narrow_overflow(axis_name, peaks: jax.Array, dtypes) -> jax.Array | None:
  """Whether an update computed in float32 overflows a leaf's narrower
  dtype when cast to it, for a transform that casts its update after
  :func:`compressed` ran (the whole optimizers scale the exchanged
  momentum by their learning rate, Adam's denominator, a trust ratio).

  Args:
    axis_name: the data axis (the decision is also taken over the model
      axes of a sharded step: :func:`jaxcomm._stages.agree_model`).
    peaks: ``[len(dtypes)]`` float32, each leaf's ``max |update|``, the
      same on every device of the data axes (computed from exchanged,
      replicated values); a NaN read as an Inf.
    dtypes: the leaves' dtypes.

  Returns:
    A bool scalar, or None (static) when no leaf is narrower than float32.
  """
  casts = narrow_casts(peaks, dtypes)
  if not casts:
    return None
  bad = jnp.zeros([], bool)
  for c in casts:
    bad = bad | ~jnp.all(jnp.isfinite(c))
  return agree_model(axis_name, bad)


def skip_step(new: CompressState, old: CompressState,
              skip: jax.Array) -> CompressState:
  """``new`` (the state :func:`compressed`'s update returned) as a skipped
  step leaves it where ``skip``: residuals, momenta, estimates and codec
  state as in ``old`` (the state the update was given), the step counted
  in ``nonfinite_steps`` unless the update counted it already. The step
  counter and key move on, as on any skipped step.

  For a transform that finds, after :func:`compressed` took its step, that
  its own update is not finite in the leaves' dtypes
  (:func:`narrow_overflow`).

  Args:
    new: the state after the step.
    old: the state before it.
    skip: a bool scalar, the same on every device.

  Returns:
    A :class:`CompressState`.
  """
  keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(skip, y, x), a, b)
  counted = new.stats.nonfinite_steps > old.stats.nonfinite_steps
  fields = {f: keep(getattr(new, f), getattr(old, f))
            for f in _codec.BUFFER_FIELDS + ("codec",)}
  return new._replace(
    **fields,
    stats=new.stats._replace(nonfinite_steps=new.stats.nonfinite_steps
                             + (skip & ~counted).astype(jnp.int32)))


def _stored(bufs, layouts) -> tuple:
  """Bucket buffers of the step's width padded with zeros to their stored
  width (:attr:`jaxcomm._buckets.Layout.stored_size`: whole tiles; the
  step works on their first ``size`` values)."""
  return tuple(b if lay.stored_size == lay.size
               else jnp.pad(b, (0, lay.stored_size - lay.size))
               for b, lay in zip(bufs, layouts))


def _check_state(state, layouts, keep_residual, use_momentum, estimates,
                 name):
  """Names what is wrong when the state does not belong to these grads."""
  _checks.state_type(name, state, CompressState, "compressor")
  want = [(lay.stored_size,) for lay in layouts]
  for field, on in (("residual", keep_residual), ("momentum", use_momentum),
                    ("estimate", estimates),
                    ("estimate_mean", estimates)):
    got = [tuple(x.shape) for x in getattr(state, field)]
    if on and got != want:
      raise ValueError(
        f"{name}: the gradients do not match the state's {field}: the "
        f"compressed leaves need buckets of {want} elements, the state "
        f"holds {got} (gradients of other shapes than the params given to "
        "init, another compressor's state, or a state saved before long "
        "buckets were stored in whole tiles of 1,024: Layout.stored_size)")


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
          "against the params given to init, or a state saved before a "
          "long bucket's server error was stored in whole tiles of 1,024: "
          "Layout.stored_size?)")


# The options of compressed() that every compressor factory forwards, with
# their defaults (None: not numeric, so optax.inject_hyperparams leaves
# them static unless they are passed).
SHARED_OPTIONS = (("start_step", None), ("clip_norm", None),
                  ("momentum", None), ("momentum_masking", True),
                  ("lr_schedule", None), ("residual_decay", 1.0),
                  ("shift_rate", None))

# DIANA's shift rate when error_feedback="diana" and shift_rate is None.
DIANA_SHIFT_RATE = 0.5


def shared_options(factory):
  """Lists the shared options in a compressor factory's signature.

  A factory that ends in ``**options`` (forwarded to :func:`compressed`)
  gets the shared options (:data:`SHARED_OPTIONS`) as explicit
  keyword-only parameters in its signature, for ``inspect.signature``
  readers (``optax.inject_hyperparams``, train.py's argument check): a
  bare ``**options`` makes ``inject_hyperparams`` pass ``options={}``
  along. The docstring is left as written: the factory documents them
  itself, in one ``**options:`` entry of its ``Args:`` that names each in
  double back-ticks and says they are forwarded to
  :func:`jaxcomm.compressed` (tests/test_docstrings.py checks it).

  Args:
    factory: the compressor factory, ending in ``**options``.

  Returns:
    The factory wrapped: the same call (``start_step=None`` read as 0),
    with the shared options in its ``__signature__``.
  """
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
  return wrapper
