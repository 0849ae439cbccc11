"""DiLoCo (Douillard et al. 2023), Streaming DiLoCo (2025), SparseLoCo's
settings and MuLoCo's recipe (2025): local inner steps, an outer optimizer
on the averaged (optionally compressed) pseudo-gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm._local_engine import LocalSpec
from jaxcomm._local_engine import _check_inner
from jaxcomm._local_engine import _local_engine
from jaxcomm._local_engine import fragment_leaves
from jaxcomm._local_engine import mean_leaves
from jaxcomm.transforms.quantize._integer import _block_int


@_registry.method(
    static=("alpha",),
    paper="Douillard et al. 2023; Streaming DiLoCo 2025; SparseLoCo 2025",
    summary=(
      "the mean pseudo-gradient `theta - x_i` (optionally through any "
      "jaxcomm compressor, its error feedback kept from sync to sync) "
      "drives `outer`; `fragments` blocks of layers synced in turn, each "
      "block's result merged `overlap_steps` later"))
def diloco(inner: optax.GradientTransformation,
           outer: optax.GradientTransformation, period: int, *,
           compressor: optax.GradientTransformation | None = None,
           fragments: int = 1, overlap_steps: int = 0,
           alpha: float | None = None, axis_name="data"
           ) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: local inner steps, an outer optimizer on the mean pseudo-gradient.

  .. math::
    \\Delta = \\frac{1}{n}\\sum_i (\\theta - x_i), \\qquad
    \\theta \\leftarrow \\theta + \\mathrm{outer}(\\Delta), \\qquad
    x_i \\leftarrow \\theta

  (Douillard et al. 2023: ``inner`` AdamW, ``outer`` Nesterov SGD with lr
  0.7 and momentum 0.9, ``period`` H = 500.) ``theta`` is the state's
  ``anchor``, the global model; devices agree with it exactly after each
  sync.

  * ``compressor``: any jaxcomm compressor (``jaxcomm.topk(0.02)``,
    ``jaxcomm.int8()``, …) averages the pseudo-gradients instead of a dense
    all-reduce; its error feedback carries over from sync to sync
    (SparseLoCo is top-k with error feedback on the pseudo-gradient; with
    ``compressor`` set, an outer ``optax.sgd(1.0)`` applies its mean as is).
  * ``fragments > 1`` (Streaming DiLoCo): the leaves are cut into that many
    contiguous blocks of about equal size; block ``f`` syncs at steps
    ``(f + 1) H / F + k H``, so each step moves at most one block, and each
    block has its own outer state (and compressor state).
  * ``overlap_steps = tau > 0``: a block's new global values are merged
    into the local params ``tau`` steps after its sync, ``x <- alpha x +
    (1 - alpha) theta`` (``alpha`` default 0.5; with ``alpha=0`` the devices
    agree exactly after the merge), so the sync's traffic has ``tau``
    steps of compute to hide behind.

  Args:
    inner: the optimizer each device runs locally (AdamW in the paper,
      ``optax.adamw(4e-4)``).
    outer: the optimizer applied to the averaged pseudo-gradient (the
      paper's: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
    period: inner steps between syncs of a fragment (``H``), an int >= 1.
    compressor: a jaxcomm compressor for the pseudo-gradient, on the same
      ``axis_name``, or None.
    fragments: blocks synced in turn (Streaming DiLoCo), ``<= period``
      and at most the number of params leaves.
    overlap_steps: steps between a block's sync and its merge, ``< period``.
    alpha: the merge's weight on the local params, in ``[0, 1]`` (only
      with ``overlap_steps > 0``).
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer, an ``optax.GradientTransformationExtraArgs``;
    its state is a :class:`jaxcomm.LocalState` whose ``anchor`` is ``theta``;
    its ``update`` needs ``params`` and returns updates to apply with
    :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``inner`` or ``outer`` is not an optax
      transformation, ``period`` is not an int >= 1, ``fragments`` not in
      ``[1, period]``, ``overlap_steps`` not in ``[0, period)``, ``alpha``
      is given without ``overlap_steps`` or is not in ``[0, 1]``,
      ``compressor`` is not a jaxcomm compressor or averages over another
      axis, or ``axis_name`` is not a valid axis name; at ``init`` or
      ``update``, when ``fragments`` exceeds the number of params leaves;
      at ``update``, when called without ``params`` or where
      ``axis_name`` is not bound.

  Examples:
    Eight devices fitting targets ``i`` by SGD at rate 0.5, the paper's
    outer Nesterov SGD (rate 0.7, momentum 0.9), ``period=2``. After two
    inner steps device ``i`` holds ``0.75 i``; the mean pseudo-gradient is
    ``theta - 2.625 = -2.625``, and Nesterov's first step moves ``theta``
    by ``0.7 (1 + 0.9) 2.625 = 3.49125``; every device restarts from it:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.mean((params["w"] - x) ** 2)
    >>> def show(x):                               # one value per device
    ...   return np.asarray(x, np.float64).round(3).tolist()
    >>> outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    >>> tx = jaxcomm.diloco(optax.sgd(0.5), outer, period=2)
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(())})
    >>> batch = jnp.arange(8.0)                    # one example per device
    >>> params, state, _ = dp.step(params, state, batch)
    >>> show(params["w"])                          # inner steps, no sync
    [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    >>> params, state, _ = dp.step(params, state, batch)
    >>> show(params["w"])                          # the new global model
    [3.491, 3.491, 3.491, 3.491, 3.491, 3.491, 3.491, 3.491]
    >>> round(float(state.anchor["w"]), 3)
    3.491
  """
  _check_inner("inner", inner)
  _check_inner("outer", outer)
  period = _checks.step("period", period, 1)
  fragments = _checks.integer("fragments", fragments, 1, period)
  overlap_steps = _checks.integer("overlap_steps", overlap_steps, 0,
                                  period - 1)
  if alpha is not None and overlap_steps == 0:
    raise ValueError("alpha weighs the local params in a delayed merge; it "
                     "needs overlap_steps > 0")
  alpha = float(_checks.number("alpha", 0.5 if alpha is None else alpha,
                               0.0, 1.0))
  if compressor is not None:
    _compressor.spec_of(compressor)  # a jaxcomm compressor, named if not
    if getattr(_compressor.spec_of(compressor), "axis_name", axis_name) \
        != axis_name:
      raise ValueError(
        f"compressor averages over axis_name="
        f"{_compressor.spec_of(compressor).axis_name!r} but diloco's "
        f"axis_name is {axis_name!r}: build both on the same data axis")
  _checks.axis_name(axis_name)
  outer = optax.with_extra_args_support(outer)

  groups_of = {}

  def groups(params):
    key = jax.tree.structure(params), tuple(
      int(np.size(l)) for l in jax.tree.leaves(params))
    if key not in groups_of:
      groups_of[key] = fragment_leaves(params, fragments)
    return groups_of[key]

  def init_extra(params):
    leaves = jax.tree.leaves(params)
    gs = groups(params)
    frag = [[jnp.asarray(leaves[j]) for j in g] for g in gs]
    return {
      "outer": tuple(outer.init(f) for f in frag),
      "compress": (tuple(compressor.init(f) for f in frag)
                   if compressor is not None else ())}

  def make_sync(f):
    def sync(xs, anchors, outer_s, comp_s, sched):
      # In float32 at least, complex leaves complex (a float32 cast
      # dropped their imaginary part).
      delta = [(a.astype(w) - x.astype(w)).astype(x.dtype)
               for a, x in zip(anchors, xs)
               for w in [jnp.promote_types(x.dtype, jnp.float32)]]
      if compressor is not None:
        mean, c = compressor.update(delta, comp_s[f], anchors)
        comp_s = tuple(c if k == f else s for k, s in enumerate(comp_s))
      else:
        mean = mean_leaves(delta, axis_name)
      # The pseudo-gradient points like a gradient: theta - x_i.
      u, o = outer.update(list(mean), outer_s[f], list(anchors))
      outer_s = tuple(o if k == f else s for k, s in enumerate(outer_s))
      new = [optax.apply_updates(a, du) for a, du in zip(anchors, u)]
      x_new = xs if overlap_steps else new
      return new, x_new, outer_s, comp_s, sched
    return sync

  spec = LocalSpec("diloco", period, fragments=fragments,
                   compressor=compressor)
  offsets = spec.offsets()

  merge = None
  if overlap_steps:
    def merge(count, x, anchor, frag_of):
      due = [(count - overlap_steps >= off)
             & ((count - overlap_steps - off) % period == 0)
             for off in offsets]
      out, synced = [], []
      for j, (xj, aj) in enumerate(zip(x, anchor)):
        d = due[frag_of[j]]
        mixed = (alpha * xj + (1 - alpha) * aj.astype(xj.dtype)).astype(
          xj.dtype)
        out.append(jnp.where(d, mixed, xj))
        synced.append(d & (alpha == 0.0))
      return out, synced

  # Fragments are cut from the params at init; the engine re-cuts them the
  # same way from the params it is given (same structure and sizes).
  return _local_engine(inner, method="diloco", axis_name=axis_name,
                       period=period, fragments=fragments,
                       sync_fns=[make_sync(f) for f in range(fragments)],
                       init_extra=init_extra, merge=merge, spec=spec)


MULOCO_BITS = (2, 4, 8)


@_registry.method(
    paper="Thérien et al. 2025 (MuLoCo)",
    summary=(
      "DiLoCo with Muon as the inner optimizer and the pseudo-gradients "
      "quantized to 2 bits with error feedback (requantized two-phase "
      "all-reduce)"))
def muloco(inner: optax.GradientTransformation, period: int, *,
           outer: optax.GradientTransformation | None = None,
           bits: int = 2, bucket_size: int | None = None,
           fragments: int = 1, overlap_steps: int = 0,
           axis_name="data") -> optax.GradientTransformationExtraArgs:
  """MuLoCo: DiLoCo with Muon inside and 2-bit pseudo-gradients.

  :func:`jaxcomm.diloco` with ``compressor`` the signed ``bits``-bit block
  quantizer of :func:`jaxcomm.int8` / :func:`jaxcomm.int4` (codes in
  ``[-q, q]``, ``q = 2^(bits-1) - 1``, one scale per ``bucket_size``
  elements, the requantized two-phase all-reduce) with error feedback
  carried from sync to sync, as Thérien et al. quantize the
  pseudo-gradients of DiLoCo-Muon. At 2 bits the codes are ternary
  (``{-1, 0, 1}`` times the block maximum): the symmetric signed code has
  no fourth level. ``inner`` is the local optimizer: Muon in the paper
  (``optax.contrib.muon(lr)``; it runs AdamW on the leaves that are not
  matrices).

  The quantizer keeps the default leaf policy: leaves of fewer than 256
  elements (biases, norms) are averaged exactly.

  Args:
    inner: the local optimizer (``optax.contrib.muon(lr)``, e.g.
      ``optax.contrib.muon(0.02)``).
    period: inner steps between syncs (``H``), an int >= 1.
    outer: the outer optimizer; default Nesterov SGD, rate 0.7, momentum
      0.9 (DiLoCo's).
    bits: 2 (default), 4 or 8: the pseudo-gradient's code width.
    bucket_size: elements per scale, an int >= 1 (default 128).
    fragments: blocks synced in turn (Streaming DiLoCo).
    overlap_steps: steps between a block's sync and its merge.
    axis_name: the data axis (a name, a tuple of names, or None).

  Returns:
    The whole optimizer (a :func:`jaxcomm.diloco`), an
    ``optax.GradientTransformationExtraArgs``; its state is a
    :class:`jaxcomm.LocalState` whose ``compress`` holds the quantizer's
    error feedback; its ``update`` needs ``params`` and returns updates to
    apply with :func:`jaxcomm.apply_updates`.

  Raises:
    ValueError: when ``bits`` is not 2, 4 or 8, ``bucket_size`` is not an
      int >= 1, or for any argument :func:`jaxcomm.diloco` refuses
      (``inner``, ``outer``, ``period``, ``fragments``,
      ``overlap_steps``, ``axis_name``); at ``update``, when called
      without ``params`` or where ``axis_name`` is not bound.

  Examples:
    Eight devices fitting their own random targets ``t_i`` (256 values
    each) by SGD at rate 0.5 (the paper's inner optimizer is Muon), an
    outer SGD at rate 1 so that the sync applies the quantized mean as is,
    ``period=2``. Each device's pseudo-gradient is ``theta - x_i =
    -0.75 t_i``. At the sync every device holds the new global model
    ``theta = 0 - mean``. The two-phase exchange splits the 256 values
    into 8 chunks of 32, one per device, and a block (``bucket_size``
    128) ends at a chunk's end: in each block of 32 the 2-bit code leaves
    three levels, ``{-s, 0, s}``. What the codes left out is kept as error
    feedback (each device's ``residual``, and each chunk owner's
    ``server_error``), so ``n * mean + sum e = sum_i (theta - x_i)``
    to float rounding:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> mesh = jaxcomm.parallel.make_mesh()          # 8 devices on "data"
    >>> def loss_fn(params, x):
    ...   return 0.5 * jnp.sum((params["w"] - x) ** 2)
    >>> tx = jaxcomm.muloco(optax.sgd(0.5), period=2, outer=optax.sgd(1.0))
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros(256)})
    >>> t = np.random.RandomState(0).randn(8, 256)   # row i: device i's
    >>> for _ in range(2):
    ...   params, state, _ = dp.step(params, state, t)
    >>> w = np.asarray(params["w"])                # (8, 256): per device
    >>> bool((w == w[0]).all())                    # synced
    True
    >>> [len(np.unique(block)) for block in w[0].reshape(8, 32)]
    [3, 3, 3, 3, 3, 3, 3, 3]
    >>> c = state.compress[0]                      # the quantizer's state
    >>> kept = (np.asarray(c.residual[0]).sum(0)
    ...         + np.asarray(c.codec[0].server_error).sum(0))
    >>> bool(np.allclose(8 * (0 - w[0]) + kept, (-0.75 * t).sum(0),
    ...                  atol=1e-5))
    True

  References:
    Thérien et al, `MuLoCo: Muon is a practical inner optimizer for
    DiLoCo <https://arxiv.org/abs/2505.23725>`_, 2025.
  """
  if isinstance(bits, bool) or bits not in MULOCO_BITS:
    raise ValueError(f"bits must be one of {MULOCO_BITS}, got {bits!r}")
  if outer is None:
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  codec = _block_int(f"int{bits}", bits, bucket_size, None, True)
  compressor = _compressor.compressed(codec, axis_name=axis_name,
                                      error_feedback=True)
  return diloco(inner, outer, period, compressor=compressor,
                fragments=fragments, overlap_steps=overlap_steps,
                axis_name=axis_name)


__all__ = [
  "diloco",
  "muloco",
]
