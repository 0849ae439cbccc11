"""Sparsifying compressors: top-k, random-k, threshold, DGC, gTop-k, CSC.

Each is a :class:`jaxcomm.Codec` wrapped by :func:`jaxcomm.compressed`, which
adds error feedback (on by default: the unsent coordinates stay in the
residual), momentum correction, clipping and non-finite handling; the codecs
here only select coordinates and exchange them.

========= ============================== ==================================
name      selection                      exchange (per device, n devices)
========= ============================== ==================================
topk      k largest ``|x|``              all-gather of n (index, value)
                                         messages: ``n k (4 + b)`` bytes
randomk   k coordinates from a key       psum of k values, no indices:
          shared by all devices          ``4 k`` bytes
threshold ``|x| >= value``, at most      all-gather as top-k, capacity
          ``capacity`` (static)          ``ceil(capacity_ratio * L)``
dgc       sampled threshold + warm-up    all-gather as top-k (per stage)
          of the density
gtopk     k largest ``|x|``, globally    ``log2 n`` permutes of k pairs
          re-sparsified to k             and one broadcast of k pairs
csc       top chunks by global L1 norm   psum of chunk norms + psum of
                                         the chosen chunks (no n in it)
========= ============================== ==================================

``b`` is the index width: the smallest unsigned dtype that holds the total
number of compressed elements (:func:`jaxcomm.collectives.index_dtype`).
``k = max(1, ceil(ratio * L))`` per leaf of ``L`` elements
(``granularity="leaf"``, as DGC), or over all compressed leaves flattened
together (``granularity="model"``); ``k`` never exceeds ``L``.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _compressor
from jaxcomm.collectives import _core
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import topk as _topk

_GRANULARITIES = ("leaf", "model")
DGC_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)


# ------------------------------------------------------------- helpers ----

def _check_ratio(name: str, ratio) -> float:
  if isinstance(ratio, jax.core.Tracer):
    raise ValueError(
      f"{name} sets the message size and must be static (a Python number); "
      f"list it in optax.inject_hyperparams(static_args=...)")
  if isinstance(ratio, bool):
    raise ValueError(f"{name} must be a number in (0, 1], got {ratio!r}")
  try:
    r = float(ratio)
  except (TypeError, ValueError):
    raise ValueError(
      f"{name} must be a number in (0, 1], got {ratio!r}") from None
  if not 0.0 < r <= 1.0:   # also rejects NaN
    raise ValueError(f"{name} must be in (0, 1], got {ratio!r}")
  return r


def _check_granularity(granularity):
  if granularity not in _GRANULARITIES:
    raise ValueError(
      f"granularity must be one of {_GRANULARITIES}, got {granularity!r}")
  return granularity


def _check_int(name, value, lo):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
  return int(value)


def num_selected(ratio: float, size: int) -> int:
  """``k = max(1, ceil(ratio * size))``, at most ``size``.

  A relative slack of 1e-9 keeps ``0.1 * 30`` at 3 (not 4).
  """
  return max(1, min(size, math.ceil(ratio * size * (1 - 1e-9))))


def _sizes(shapes) -> list[int]:
  return [int(np.prod(s)) for s in shapes]


def _segment_sizes(shapes, granularity) -> list[int]:
  sizes = _sizes(shapes)
  return sizes if granularity == "leaf" else [sum(sizes)]


def _flat_segments(xs, granularity) -> list[jax.Array]:
  flats = [jnp.ravel(x) for x in xs]
  return flats if granularity == "leaf" else [jnp.concatenate(flats)]


def _split(flat: jax.Array, xs) -> list[jax.Array]:
  out, offset = [], 0
  for x in xs:
    out.append(flat[offset:offset + x.size].reshape(x.shape))
    offset += x.size
  return out


def _offsets(sizes) -> list[int]:
  return [int(o) for o in np.cumsum([0] + list(sizes))[:-1]]


def _to_global(indices, sizes):
  """Per-segment int32 indices (``L_j`` = unused) -> one global space."""
  total = sum(sizes)
  return jnp.concatenate([jnp.where(i < s, i + o, total) for i, s, o in
                          zip(indices, sizes, _offsets(sizes))])


def _sparse_exchange(indices, values, sizes, xs, ctx):
  """sparse psum of per-segment pairs; returns (mean, sent) per leaf."""
  total = sum(sizes)
  gi = _to_global(indices, sizes)
  gv = jnp.concatenate(values)
  summed = _sparse.sparse_psum(gi, gv, total, ctx.axis_name)
  sent = jnp.zeros((total,), jnp.float32).at[gi].set(gv, mode="drop")
  return _split(summed / ctx.num_devices, xs), _split(sent, xs)


# -------------------------------------------------------------- top-k ----

def _local_topk(xs, ratio, granularity):
  """Each segment's k largest |x|: (indices, values, segment sizes)."""
  segs = _flat_segments(xs, granularity)
  idx, val = [], []
  for seg in segs:
    v, i = _topk.topk_abs(seg, num_selected(ratio, seg.shape[0]))
    idx.append(i)
    val.append(v)
  return idx, val, [s.shape[0] for s in segs]


def _topk_codec(ratio, granularity) -> _compressor.Codec:

  def apply(xs, state, ctx):
    idx, val, sizes = _local_topk(xs, ratio, granularity)
    mean, sent = _sparse_exchange(idx, val, sizes, xs, ctx)
    return _compressor.CodecResult(mean=mean, sent=sent, state=state)

  def wire(shapes, n):
    sizes = _segment_sizes(shapes, granularity)
    k = sum(num_selected(ratio, s) for s in sizes)
    return _sparse.sparse_psum_wire(k, sum(sizes), n)

  return _compressor.Codec(name=f"topk({ratio})", init=lambda shapes: (),
                           apply=apply, wire=wire)


def topk(ratio: float, *, granularity: str = "leaf", axis_name="data",
         error_feedback: bool = True, policy=None, seed: int = 0):
  """Top-k sparsification: each device sends its k largest coordinates.

  .. math::
    x_i = g_i + e_i, \\quad s_i = x_i \\odot \\mathbb{1}[\\,|x_i|
    \\geq |x_i|_{(k)}], \\quad u = \\frac{1}{n}\\sum_i s_i, \\quad
    e_i \\leftarrow x_i - s_i

  Every device selects the ``k = max(1, ceil(ratio * L))`` entries of
  largest magnitude (exact, :func:`jaxcomm.kernels.topk_abs`; ties: lower
  index first), sends ``(index, value)`` pairs with indices in the smallest
  unsigned dtype that fits, and the sum is rebuilt from an all-gather of all
  messages (:func:`jaxcomm.collectives.sparse_psum`): ``n k (4 + b)`` bytes
  gathered per device, which grows with ``n``. With error feedback (the
  default) what was not sent is kept and added to the next gradient.

  Args:
    ratio: fraction of coordinates sent, in ``(0, 1]`` (static).
    granularity: ``"leaf"`` (k per leaf) or ``"model"`` (one k over all
      compressed leaves flattened together).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates (Stich et al. 2018).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused by top-k itself).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example::

    tx = optax.chain(jaxcomm.topk(0.01), optax.sgd(0.1))

  References:
    Aji et al, `Sparse Communication for Distributed Gradient Descent
    <https://arxiv.org/abs/1704.05021>`_, 2017.
    Stich et al, `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, 2018.
  """
  ratio = _check_ratio("ratio", ratio)
  _check_granularity(granularity)
  return _compressor.compressed(_topk_codec(ratio, granularity),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed)


# ------------------------------------------------------------ random-k ----

def randomk_indices(key, ratio: float, sizes: Sequence[int]) -> list:
  """The coordinates random-k sends for a step key (same on every device).

  Segment ``j`` draws ``k_j`` distinct indices with
  ``jax.random.choice(jax.random.fold_in(key, j), L_j, (k_j,),
  replace=False)``.
  """
  return [jax.random.choice(jax.random.fold_in(key, j), size,
                            (num_selected(ratio, size),), replace=False
                            ).astype(jnp.int32)
          for j, size in enumerate(sizes)]


def _randomk_codec(ratio, granularity) -> _compressor.Codec:

  def apply(xs, state, ctx):
    segs = _flat_segments(xs, granularity)
    sizes = [s.shape[0] for s in segs]
    idx = randomk_indices(ctx.key, ratio, sizes)
    vals = [s[i] for s, i in zip(segs, idx)]
    summed = _core.fused_psum(vals, ctx.axis_name)
    mean = [jnp.zeros((s,), jnp.float32).at[i].set(v / ctx.num_devices)
            for s, i, v in zip(sizes, idx, summed)]
    sent = [jnp.zeros((s,), jnp.float32).at[i].set(v)
            for s, i, v in zip(sizes, idx, vals)]
    mean, sent = jnp.concatenate(mean), jnp.concatenate(sent)
    return _compressor.CodecResult(mean=_split(mean, xs),
                                   sent=_split(sent, xs), state=state)

  def wire(shapes, n):
    del n
    k = sum(num_selected(ratio, s)
            for s in _segment_sizes(shapes, granularity))
    return [("all-reduce", 4 * k)]

  return _compressor.Codec(name=f"randomk({ratio})", init=lambda shapes: (),
                           apply=apply, wire=wire)


def randomk(ratio: float, *, granularity: str = "leaf", axis_name="data",
            error_feedback: bool = True, policy=None, seed: int = 0):
  """Random-k sparsification with a key shared by all devices.

  .. math::
    S \\sim \\mathcal{U}\\binom{[L]}{k}, \\quad
    u_S = \\frac{1}{n}\\sum_i (x_i)_S, \\quad u_{\\bar S} = 0

  All devices draw the same ``k`` coordinates from the step key kept in the
  state (:func:`randomk_indices`), so no index travels: the ``k`` values
  are summed with one plain psum (``4 k`` bytes, independent of ``n``).
  Values are not rescaled by ``L / k``: with error feedback (the default)
  the unsent coordinates are sent later, as in Stich et al.

  Args:
    ratio: fraction of coordinates sent, in ``(0, 1]`` (static).
    granularity: ``"leaf"`` or ``"model"`` (as :func:`topk`).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the shared PRNG key.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example::

    tx = optax.chain(jaxcomm.randomk(0.01), optax.sgd(0.1))

  References:
    Stich et al, `Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>`_, 2018.
  """
  ratio = _check_ratio("ratio", ratio)
  _check_granularity(granularity)
  return _compressor.compressed(_randomk_codec(ratio, granularity),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed)


# ----------------------------------------------------------- threshold ----

def _threshold_codec(value, capacity_ratio) -> _compressor.Codec:

  def apply(xs, state, ctx):
    segs = _flat_segments(xs, "leaf")
    sizes = [s.shape[0] for s in segs]
    idx, val = [], []
    for seg in segs:
      v, i, _ = _topk.threshold_select(
        seg, value, num_selected(capacity_ratio, seg.shape[0]))
      idx.append(i)
      val.append(v)
    mean, sent = _sparse_exchange(idx, val, sizes, xs, ctx)
    return _compressor.CodecResult(mean=mean, sent=sent, state=state)

  def wire(shapes, n):
    sizes = _sizes(shapes)
    cap = sum(num_selected(capacity_ratio, s) for s in sizes)
    return _sparse.sparse_psum_wire(cap, sum(sizes), n)

  return _compressor.Codec(name="threshold", init=lambda shapes: (),
                           apply=apply, wire=wire)


def threshold(value: float, *, capacity_ratio: float = 0.01,
              axis_name="data", error_feedback: bool = True, policy=None,
              seed: int = 0):
  """Threshold sparsification with a bounded message (Strom 2015).

  .. math::
    s_i = x_i \\odot \\mathbb{1}[\\,|x_i| \\geq \\tau\\,] \\text{ (first
    } c \\text{ by index)}, \\quad e_i \\leftarrow x_i - s_i

  Every coordinate with ``|x| >= value`` is sent, up to a static capacity
  of ``c = max(1, ceil(capacity_ratio * L))`` per leaf
  (:func:`jaxcomm.kernels.threshold_select`). When more qualify, the ``c``
  lowest indices are sent and the overflow stays in the residual (with
  error feedback it is sent later; nothing is dropped). ``value`` may be a
  traced array (``optax.inject_hyperparams``).

  Departs from Strom, who sends each selected coordinate as ``+-value``
  (one sign bit beside the index): here the exact value travels (as GRACE's
  ``threshold``), so nothing beyond the unsent coordinates enters the
  residual; the exchange is the all-gather of :func:`topk`.

  Args:
    value: the threshold ``tau > 0``.
    capacity_ratio: the message capacity as a fraction of each leaf, in
      ``(0, 1]`` (static).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent coordinates (Strom's residual).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example::

    tx = optax.chain(jaxcomm.threshold(1e-3), optax.sgd(0.1))

  References:
    Strom, `Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing <https://www.isca-archive.org/interspeech_2015/strom15_interspeech.html>`_,
    2015.
  """
  _compressor._check_float("value", value, 0.0, None, lo_open=True)  # noqa
  if not isinstance(value, jax.core.Tracer) and not math.isfinite(value):
    raise ValueError(f"value must be finite, got {value!r}")
  capacity_ratio = _check_ratio("capacity_ratio", capacity_ratio)
  return _compressor.compressed(_threshold_codec(value, capacity_ratio),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed)


# ----------------------------------------------------------------- DGC ----

def dgc_densities(ratio: float, warmup_densities=DGC_WARMUP_DENSITIES
                  ) -> tuple[float, ...]:
  """The density of each warm-up stage, then ``ratio`` (the last stage)."""
  return tuple(float(d) for d in warmup_densities if d > ratio) + (ratio,)


def dgc_sample_size(density: float, size: int, sample_ratio: float) -> int:
  """Sample size for the threshold estimate.

  ``ceil(sample_ratio * L)`` (DGC's code samples 1%), at least
  ``ceil(2 / density)`` (two expected entries above the threshold) and, a
  departure, at most ``ceil(100 / density)``: a hundred expected entries
  above the threshold already put the count within about 10% (one standard
  deviation) of the target, and a larger random sample costs more than the
  pass over ``x`` it serves (measured: 250k samples of a 25M vector take
  longer than one memory copy of it). Never more than ``L``.
  """
  s = min(math.ceil(sample_ratio * size), math.ceil(100.0 / density))
  return min(size, max(s, math.ceil(2.0 / density)))


def dgc_capacity(k: int, size: int) -> int:
  """Buffer of the threshold selection before the cut to ``k``."""
  return min(size, math.ceil(1.3 * k))


def sampled_select(x: jax.Array, k: int, key, sample_size: int,
                   max_rounds: int = 10):
  """DGC's threshold selection: estimate, adjust, cut to ``k``.

  1. ``t`` = the ``ceil(k s / L)``-th largest ``|x|`` in a uniform sample of
     ``s`` entries (:func:`jaxcomm.kernels.sampled_threshold`; with
     ``s = L`` the exact k-th largest).
  2. While the count ``c = #{|x| >= t}`` is above ``1.3 k`` or below
     ``0.8 k`` (at most ``max_rounds`` times): raise ``t`` by 1.3x / lower
     it by 0.8x until the target is bracketed, then bisect geometrically
     between the closest thresholds known to be too low and too high.
  3. Keep the first ``ceil(1.3 k)`` entries above ``t`` (by index), and of
     those the ``k`` of largest magnitude (lower index first among ties).

  Args:
    x: flat float32 array of length ``L``.
    k: the target count (static).
    key: PRNG key of the sample.
    sample_size: ``s`` (static).
    max_rounds: bound on the adjustment rounds (static).

  Returns:
    ``(values, indices, count, threshold)``: ``k`` pairs (slots beyond the
    count hold index ``L`` and value 0), the count above the final
    threshold before the cut, and that threshold.
  """
  length = x.shape[0]
  t0 = _topk.sampled_threshold(x, k, key, sample_size)
  hi_bound, lo_bound = 1.3 * k, 0.8 * k

  def select(t):
    # One pass over x: the predicate packed into uint32 words; the count is
    # their popcount, and the last round's words feed the compaction.
    words = _topk.threshold_mask_reference(x, t)
    return words, jnp.sum(jax.lax.population_count(words), dtype=jnp.int32)

  def cond(c):
    _, _, _, _, n_sel, r = c
    return ((n_sel > hi_bound) | (n_sel < lo_bound)) & (r < max_rounds)

  def body(c):
    t, lo, hi, _, n_sel, r = c
    many = n_sel > hi_bound
    lo = jnp.where(many, t, lo)           # t too low: too many selected
    hi = jnp.where(many, hi, t)           # t too high: too few
    bracketed = (lo > 0) & jnp.isfinite(hi)
    t = jnp.where(bracketed, jnp.sqrt(lo * hi),
                  jnp.where(many, t * 1.3, t * 0.8))
    words, n_sel = select(t)
    return t, lo, hi, words, n_sel, r + 1

  zero = t0 * 0.0                           # (typed as t0 under shard_map)
  words, n_sel = select(t0)
  init = (t0, zero, zero + jnp.inf, words, n_sel, zero.astype(jnp.int32))
  t, _, _, words, n_sel, _ = jax.lax.while_loop(cond, body, init)
  cap = dgc_capacity(k, length)
  vals, idx, _ = _topk.compact_from_mask(x, words, cap)
  if cap > k:
    # Unused slots hold value 0 and index L: they rank last.
    _, pos = jax.lax.top_k(jnp.where(idx < length, jnp.abs(vals), -1.0), k)
    pos = jnp.sort(pos)
    vals, idx = vals[pos], idx[pos]
  return vals, idx, n_sel, t


def _dgc_codec(ratio, densities, steps_per_stage, sample_ratio, exact,
               max_rounds) -> _compressor.Codec:

  def select(seg, density, key):
    size = seg.shape[0]
    k = num_selected(density, size)
    if exact:
      return _topk.topk_abs(seg, k)
    vals, idx, _, _ = sampled_select(
      seg, k, key, dgc_sample_size(density, size, sample_ratio), max_rounds)
    return vals, idx

  def stage_fn(density):
    def run(xs, ctx):
      segs = _flat_segments(xs, "leaf")
      sizes = [s.shape[0] for s in segs]
      idx, val = [], []
      for j, seg in enumerate(segs):
        v, i = select(seg, density, jax.random.fold_in(ctx.key, j))
        idx.append(i)
        val.append(v)
      return _sparse_exchange(idx, val, sizes, xs, ctx)
    return run

  def apply(xs, state, ctx):
    if len(densities) == 1:
      mean, sent = stage_fn(densities[0])(xs, ctx)
    else:
      stage = jnp.minimum(ctx.step // steps_per_stage, len(densities) - 1)
      branches = [lambda xs, f=stage_fn(d): f(xs, ctx) for d in densities]
      mean, sent = jax.lax.switch(stage, branches, list(xs))
    return _compressor.CodecResult(mean=list(mean), sent=list(sent),
                                   state=state)

  def wire(shapes, n):
    sizes = _sizes(shapes)
    out = []
    for d in densities:
      k = sum(num_selected(d, s) for s in sizes)
      out += _sparse.sparse_psum_wire(k, sum(sizes), n)
    return out

  return _compressor.Codec(name=f"dgc({ratio})", init=lambda shapes: (),
                           apply=apply, wire=wire)


def dgc(ratio: float = 0.001, *, momentum: float | None = 0.9,
        clip_norm: float | None = None, warmup_steps_per_stage: int = 0,
        warmup_densities: Sequence[float] = DGC_WARMUP_DENSITIES,
        sample_ratio: float = 0.01, exact: bool = False, max_rounds: int = 10,
        axis_name="data", policy=None, seed: int = 0):
  """Deep Gradient Compression (Lin et al. 2018).

  .. math::
    u_i \\leftarrow m u_i + \\mathrm{clip}(g_i), \\quad v_i \\leftarrow
    v_i + u_i, \\quad s_i = \\mathrm{sparse}(v_i), \\quad
    u = \\frac{1}{n}\\sum_i s_i, \\quad
    v_i, u_i \\leftarrow 0 \\text{ where } s_i \\neq 0

  The four techniques of the paper, the first three through
  :func:`jaxcomm.compressed`:

  * **momentum correction**: the accumulated velocity ``v`` is sparsified
    (``momentum``; use a downstream optimizer *without* momentum, e.g.
    ``optax.sgd(lr)``);
  * **momentum factor masking**: sent coordinates are zeroed in ``u`` (and
    in ``v``, as the residual);
  * **local gradient clipping** (``clip_norm``): each device clips its
    gradient to ``clip_norm * n^(-1/2)`` by global norm before accumulating;
  * **warm-up**: the density goes through ``warmup_densities`` (those above
    ``ratio``), each held for ``warmup_steps_per_stage`` steps, then stays at
    ``ratio`` (0: no warm-up).

  Selection per leaf (``k = max(1, ceil(density * L))``) uses the sampled
  threshold of :func:`sampled_select` (``exact=False``) or exact top-k.

  Departs from the paper in the exchange of the warm-up: message sizes must
  be static, so each stage has its own exchange (capacity sized for that
  stage's density) behind a ``lax.switch`` on the step. Every step moves only
  its stage's message, but the compiled step holds all stages' all-gathers,
  and ``wire`` (like the HLO) lists them all: the steady-state cost is the
  last entry. With warm-up on 8 devices the first stage (density 0.25) moves
  ``8 * 0.25 * (4 + b)`` bytes per element, more than a dense psum: warm-up
  trades bytes for accuracy early in training.

  Args:
    ratio: target density in ``(0, 1]`` (static; the paper uses 0.001).
    momentum: momentum ``m`` of the correction (None: plain error feedback).
    clip_norm: local clipping norm (None: no clipping).
    warmup_steps_per_stage: steps per warm-up stage (static int >= 0).
    warmup_densities: warm-up densities (static, decreasing).
    sample_ratio: fraction of each leaf sampled for the threshold (static).
    exact: exact top-k instead of the sampled threshold (static).
    max_rounds: bound on the threshold adjustment rounds (static).
    axis_name: the data axis (a name, a tuple of names, or None).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the PRNG key (the threshold's samples).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example::

    tx = optax.chain(jaxcomm.dgc(0.001, momentum=0.9), optax.sgd(0.1))

  References:
    Lin et al, `Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training <https://arxiv.org/abs/1712.01887>`_,
    2018.
  """
  ratio = _check_ratio("ratio", ratio)
  sample_ratio = _check_ratio("sample_ratio", sample_ratio)
  warmup_steps_per_stage = _check_int("warmup_steps_per_stage",
                                      warmup_steps_per_stage, 0)
  max_rounds = _check_int("max_rounds", max_rounds, 0)
  try:
    warm = tuple(_check_ratio("warmup_densities", d)
                 for d in warmup_densities)
  except TypeError:
    raise ValueError(
      f"warmup_densities must be a sequence of numbers in (0, 1], got "
      f"{warmup_densities!r}") from None
  if not isinstance(exact, bool):
    raise ValueError(f"exact must be a bool, got {exact!r}")
  densities = (dgc_densities(ratio, warm) if warmup_steps_per_stage
               else (ratio,))
  codec = _dgc_codec(ratio, densities, max(warmup_steps_per_stage, 1),
                     sample_ratio, exact, max_rounds)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=True, momentum=momentum,
                                momentum_masking=True, clip_norm=clip_norm,
                                policy=policy, seed=seed)


# -------------------------------------------------------------- gTop-k ----

def _gtopk_codec(ratio, granularity) -> _compressor.Codec:

  def apply(xs, state, ctx):
    idx, val, sizes = _local_topk(xs, ratio, granularity)
    g_idx, g_val, delivered = _sparse.gtopk_psum(idx, val, sizes,
                                                 ctx.axis_name)
    total = sum(sizes)
    summed = jnp.zeros((total,), jnp.float32).at[
      _to_global(g_idx, sizes)].set(jnp.concatenate(g_val), mode="drop")
    mine = [jnp.where(d, v, 0.0) for d, v in zip(delivered, val)]
    sent = jnp.zeros((total,), jnp.float32).at[
      _to_global(idx, sizes)].set(jnp.concatenate(mine), mode="drop")
    return _compressor.CodecResult(
      mean=_split(summed / ctx.num_devices, xs), sent=_split(sent, xs),
      state=state)

  def wire(shapes, n):
    sizes = _segment_sizes(shapes, granularity)
    return _sparse.gtopk_psum_wire([num_selected(ratio, s) for s in sizes],
                                   sizes, n)

  return _compressor.Codec(name=f"gtopk({ratio})", init=lambda shapes: (),
                           apply=apply, wire=wire)


def gtopk(ratio: float, *, granularity: str = "leaf", axis_name="data",
          error_feedback: bool = True, policy=None, seed: int = 0):
  """Global top-k sparsification (Shi et al. 2019).

  .. math::
    \\tilde g = \\operatorname{top}_k\\Big(\\sum_i
    \\operatorname{top}_k(x_i)\\Big) \\text{ (merged pairwise over a
    tree)}, \\quad u = \\tilde g / n

  Each device selects its local top-k; a recursive-doubling exchange
  (:func:`jaxcomm.collectives.gtopk_psum`) adds the sparse vectors pairwise
  in ``log2 n`` rounds and re-sparsifies to ``k`` after every merge, so a
  device sends ``O(k log n)`` bytes instead of top-k's ``O(k n)``. The
  result has ``k`` nonzeros per segment. With error feedback, a device's
  selected values that did not reach the global result (dropped in some
  merge) go back into its residual: ``sent`` is exactly its part of the
  global sum, so gradient mass is conserved.

  Needs a power-of-two number of devices (as the paper's tree).

  Args:
    ratio: fraction of coordinates kept, in ``(0, 1]`` (static).
    granularity: ``"leaf"`` (one tree per leaf, all leaves in the same
      messages) or ``"model"``.
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what did not reach the global sum.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example::

    tx = optax.chain(jaxcomm.gtopk(0.001), optax.sgd(0.1))

  References:
    Shi et al, `A Distributed Synchronous SGD Algorithm with Global Top-k
    Sparsification for Low Bandwidth Networks
    <https://arxiv.org/abs/1901.04359>`_, 2019.
  """
  ratio = _check_ratio("ratio", ratio)
  _check_granularity(granularity)
  return _compressor.compressed(_gtopk_codec(ratio, granularity),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed)


# ----------------------------------------------------------------- CSC ----

def csc_num_chunks(ratio: float, size: int, chunk_size: int) -> int:
  """Chunks exchanged: ``max(1, ceil(ratio * ceil(size / chunk_size)))``."""
  return num_selected(ratio, -(-size // chunk_size))


def _csc_codec(chunk_size, ratio) -> _compressor.Codec:

  def apply(xs, state, ctx):
    flat = _flat_segments(xs, "model")[0]
    m = csc_num_chunks(ratio, flat.shape[0], chunk_size)
    total, chosen = _sparse.chunk_psum(flat, chunk_size, m, ctx.axis_name)
    sent = jnp.where(chosen, flat, 0.0)
    return _compressor.CodecResult(
      mean=_split(total / ctx.num_devices, xs), sent=_split(sent, xs),
      state=state)

  def wire(shapes, n):
    del n
    size = sum(_sizes(shapes))
    return _sparse.chunk_psum_wire(size, chunk_size,
                                   csc_num_chunks(ratio, size, chunk_size))

  return _compressor.Codec(name=f"csc({chunk_size}, {ratio})",
                           init=lambda shapes: (), apply=apply, wire=wire)


def csc(chunk_size: int, ratio: float, *, axis_name="data",
        error_feedback: bool = True, policy=None, seed: int = 0):
  """Coarse-grained sparsification by chunks (CSC, GradientFlow).

  .. math::
    \\nu_c = \\sum_i \\lVert (x_i)_c \\rVert_1, \\quad
    C = \\operatorname{top}_m(\\nu), \\quad
    u_c = \\frac{1}{n} \\sum_i (x_i)_c \\ (c \\in C)

  All compressed leaves are flattened together and cut into chunks of
  ``chunk_size`` (the last one zero-padded: sizes need not divide). The
  chunks' L1 norms are summed over devices, every device picks the same
  ``m = max(1, ceil(ratio * chunks))`` chunks of largest summed norm, and
  only those are summed (:func:`jaxcomm.collectives.chunk_psum`). No
  all-gather and no index: both messages are independent of ``n``. With
  error feedback the other chunks stay in the residual.

  Args:
    chunk_size: elements per chunk (static int >= 1).
    ratio: fraction of chunks exchanged, in ``(0, 1]`` (static).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent chunks.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example::

    tx = optax.chain(jaxcomm.csc(chunk_size=1024, ratio=0.01),
                     optax.sgd(0.1))

  References:
    Sun et al, `Optimizing Network Performance for Distributed DNN Training
    on GPU Clusters: ImageNet/AlexNet Training in 1.5 Minutes
    <https://arxiv.org/abs/1902.06855>`_, 2019.
  """
  chunk_size = _check_int("chunk_size", chunk_size, 1)
  ratio = _check_ratio("ratio", ratio)
  return _compressor.compressed(_csc_codec(chunk_size, ratio),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed)
