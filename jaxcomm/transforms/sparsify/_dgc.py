"""Deep Gradient Compression (Lin et al. 2018): a sampled threshold, a
warm-up of the density, momentum correction and masking, local clipping."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import topk as _topk
from jaxcomm.transforms.sparsify._sparsification import DGC_WARMUP_DENSITIES
from jaxcomm.transforms.sparsify._sparsification import _leaf_rows
from jaxcomm.transforms.sparsify._sparsification import _local_topk
from jaxcomm.transforms.sparsify._sparsification import _num_pairs
from jaxcomm.transforms.sparsify._sparsification import _segments
from jaxcomm.transforms.sparsify._sparsification import _sparse_exchange
from jaxcomm.transforms.sparsify._sparsification import num_selected

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

  def count(t):
    # One fused pass over x (the predicate of threshold_select).
    above = jnp.abs(x).astype(jnp.float32) >= t
    return jnp.sum(above, dtype=jnp.int32)

  def cond(c):
    _, _, _, n_sel, r = c
    return ((n_sel > hi_bound) | (n_sel < lo_bound)) & (r < max_rounds)

  def body(c):
    t, lo, hi, n_sel, r = c
    many = n_sel > hi_bound
    lo = jnp.where(many, t, lo)           # t too low: too many selected
    hi = jnp.where(many, hi, t)           # t too high: too few
    bracketed = (lo > 0) & jnp.isfinite(hi)
    t = jnp.where(bracketed, jnp.sqrt(lo * hi),
                  jnp.where(many, t * 1.3, t * 0.8))
    return t, lo, hi, count(t), r + 1

  zero = t0 * 0.0                           # (typed as t0 under shard_map)
  init = (t0, zero, zero + jnp.inf, count(t0), zero.astype(jnp.int32))
  t, _, _, _, _ = jax.lax.while_loop(cond, body, init)
  cap = dgc_capacity(k, length)
  vals, idx, n_sel = _topk.threshold_select(x, t, cap)
  if cap > k:
    # Unused slots hold value 0 and index L: they rank last.
    _, pos = jax.lax.top_k(jnp.where(idx < length, jnp.abs(vals), -1.0), k)
    pos = jnp.sort(pos)
    vals, idx = vals[pos], idx[pos]
  return vals, idx, n_sel, t


def dgc_bucket_sample(key, sizes, density: float, sample_ratio: float):
  """Where DGC's bucket selection samples: per leaf, ``s_j =
  dgc_sample_size(density, L_j, sample_ratio)`` positions, all leaves in
  one draw.

  Leaf ``j`` takes slots ``[S_j, S_j + s_j)`` of ``jax.random.randint(key,
  (S,), 0, m)`` (``S = sum_j s_j``, ``m`` the slot's leaf size ``L_j``:
  uniform positions with replacement), or, where ``s_j = L_j``, its own
  positions ``0 .. L_j - 1`` (the whole leaf). Static ``sizes`` (bucket
  order); returns ``(positions int32[S], sample sizes)``.
  """
  ss = [dgc_sample_size(density, int(n), sample_ratio) for n in sizes]
  ends = np.cumsum(ss)
  total = int(ends[-1])
  slot = jnp.arange(total, dtype=jnp.int32)
  row = _topk.segment_ids((0,) + tuple(int(e) for e in ends))
  size = jnp.asarray(np.asarray(sizes, np.int64), jnp.int32)[row]
  local = slot - jnp.asarray(ends - np.asarray(ss), jnp.int32)[row]
  full = jnp.asarray(np.asarray([s == n for s, n in zip(ss, sizes)]))[row]
  drawn = jax.random.randint(key, (total,), 0, size, jnp.int32)
  return jnp.where(full, local, drawn), ss


def _sampled_select_bucket(x, layout, density, key, sample_ratio,
                           max_rounds):
  """DGC's sampled selection (:func:`sampled_select`) of every leaf of the
  bucket, in one program whatever the number of leaves.

  Per leaf: the threshold ``t`` = the ``ceil(k s / L)``-th largest ``|x|``
  of its sample (:func:`dgc_bucket_sample`: one draw for all leaves); the
  adjustment rounds of :func:`sampled_select` (all leaves in one loop; a
  leaf whose count is within bounds stops changing); its first
  ``ceil(1.3 k)`` entries ``>= t`` by index (one
  :func:`jaxcomm.kernels.topk.compact_segments`), cut to the ``k`` of
  largest magnitude (lower index first among ties), in index order. The
  sample's order statistics and the cut are one sort each over all
  leaves.

  Returns:
    ``(values, indices)``: values and bucket positions (``layout.size``:
    unused), ``sum_j k_j`` pairs, leaf by leaf.
  """
  bounds, sizes = _leaf_rows(layout)
  nrows = len(sizes)
  ks = [num_selected(density, n) for n in sizes]
  starts = np.asarray(bounds[:-1], np.int64)
  mag = jnp.abs(x).astype(jnp.float32)
  # Thresholds: each leaf's sample sorted by (leaf, -|x|) in one sort.
  pos, ss = dgc_bucket_sample(key, sizes, density, sample_ratio)
  send = np.cumsum(ss)
  srow = _topk.segment_ids((0,) + tuple(int(e) for e in send))
  svals = mag[jnp.asarray(starts, jnp.int32)[srow] + pos]
  _, svals = jax.lax.sort((srow, -svals), num_keys=2)
  kps = [min(s, max(1, math.ceil(k * s / n))) for s, k, n in
         zip(ss, ks, sizes)]
  t0 = -svals[jnp.asarray(send - np.asarray(ss) + np.asarray(kps) - 1,
                          jnp.int32)]
  rows_k = np.asarray(ks, np.float64)
  hi_bound = jnp.asarray(1.3 * rows_k, jnp.float32)
  lo_bound = jnp.asarray(0.8 * rows_k, jnp.float32)
  # Each element's row, once: every round is then one pass over the bucket
  # whatever the number of rows.
  row = _topk.segment_ids(bounds)

  def above(t):
    return mag >= t[row]

  def count(t):
    return _topk.segment_counts(_topk.pack_mask(above(t)), bounds)

  def active(c):
    _, _, _, n_sel, r = c
    return (((n_sel > hi_bound) | (n_sel < lo_bound))
            & (r < max_rounds))

  def body(c):
    t, lo, hi, n_sel, r = c
    on = active(c)
    many = n_sel > hi_bound
    lo2 = jnp.where(many, t, lo)
    hi2 = jnp.where(many, hi, t)
    bracketed = (lo2 > 0) & jnp.isfinite(hi2)
    t2 = jnp.where(bracketed, jnp.sqrt(lo2 * hi2),
                   jnp.where(many, t * 1.3, t * 0.8))
    new = (t2, lo2, hi2, count(t2), r + 1)
    return tuple(jnp.where(on, a, b) for a, b in zip(new, c))

  zero = t0 * 0.0                           # (typed as t0 under shard_map)
  init = (t0, zero, zero + jnp.inf, count(t0), zero.astype(jnp.int32))
  t = jax.lax.while_loop(lambda c: jnp.any(active(c)), body, init)[0]
  caps = [dgc_capacity(k, n) for k, n in zip(ks, sizes)]
  vals, gi, _ = _topk.compact_segments(x, _topk.pack_mask(above(t)),
                                       bounds, tuple(caps))
  # The cut, every leaf at once: sort the candidates by (leaf, -|v|,
  # index), keep each leaf's first k, sort the kept back by (leaf, index)
  # and read each leaf's first k slots.
  total = layout.size
  cend = np.cumsum(caps)
  crow = _topk.segment_ids((0,) + tuple(int(e) for e in cend))
  real = gi < total
  neg = jnp.where(real, -jnp.abs(vals), 1.0)    # unused slots rank last
  crow, _, gi, vals = jax.lax.sort((crow, neg, gi, vals), num_keys=3)
  rank = jnp.arange(int(cend[-1]), dtype=jnp.int32) - jnp.asarray(
    cend - np.asarray(caps), jnp.int32)[crow]
  keep = rank < jnp.asarray(np.asarray(ks, np.int64), jnp.int32)[crow]
  order_key = jnp.where(keep, gi, total + 1)
  _, gi, vals = jax.lax.sort((crow, order_key, vals), num_keys=2)
  take = np.concatenate([c0 + np.arange(k) for c0, k in
                         zip(cend - np.asarray(caps), ks)]) if nrows else \
    np.zeros((0,), np.int64)
  take = jnp.asarray(take, jnp.int32)
  return vals[take], gi[take]


@dataclasses.dataclass(frozen=True)
class DgcCodec(_codec.CodecBase):
  """DGC's selection (sampled threshold or exact top-k per leaf) and sparse
  exchange, one stage per density behind a ``lax.switch`` on the step.

  Attributes:
    ratio: the target density (the last stage's; named in ``name``).
    densities: the density of each stage, the warm-up's then ``ratio``
      (:func:`dgc_densities`; ``(ratio,)`` without warm-up).
    steps_per_stage: steps each warm-up stage is held (>= 1).
    sample_ratio: fraction of each leaf sampled for the threshold.
    exact: exact top-k instead of the sampled threshold.
    max_rounds: bound on the threshold adjustment rounds.
  """

  ratio: float
  densities: tuple[float, ...]
  steps_per_stage: int
  sample_ratio: float
  exact: bool
  max_rounds: int

  @property
  def name(self):
    return f"dgc({self.ratio})"

  def _stage(self, density, x, ctx):
    if self.exact:
      gv, gi = _local_topk(x, _segments(ctx.layout), density)
    else:
      gv, gi = _sampled_select_bucket(x, ctx.layout, density, ctx.key,
                                      self.sample_ratio, self.max_rounds)
    return _sparse_exchange(gv, gi, ctx)

  def apply(self, x, state, ctx):
    densities = self.densities
    if len(densities) == 1:
      mean, sent = self._stage(densities[0], x, ctx)
    else:
      stage = jnp.minimum(ctx.step // self.steps_per_stage,
                          len(densities) - 1)
      branches = [lambda x, d=d: self._stage(d, x, ctx) for d in densities]
      mean, sent = jax.lax.switch(stage, branches, x)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    segs = _segments(layout)
    out = []
    for d in self.densities:
      out += _sparse.sparse_psum_wire(_num_pairs(segs, d), layout.size, n)
    return out

  def wire_at(self, layout, n, step):
    # ``step`` is the global step count, as ``ctx.step``.
    densities = self.densities
    stage = min(max(step, 0) // self.steps_per_stage,
                len(densities) - 1) if len(densities) > 1 else 0
    return _sparse.sparse_psum_wire(
      _num_pairs(_segments(layout), densities[stage]), layout.size, n)


@_registry.method(
    gap=(
      "0.1% of coordinates a step (DGC's ratio), the rest in its "
      "corrected momentum; short on the char-LSTM"),
    paper="Lin et al. 2018",
    summary=(
      "DGC: momentum correction, masking, local clipping, warm-up, "
      "sampled threshold"),
    defaults={"ratio": 0.001},
    static=("ratio", "sample_ratio"))
@_compressor.shared_options
def dgc(ratio: float | None = None, *, momentum: float | None = 0.9,
        clip_norm: float | None = None,
        warmup_steps_per_stage: int | None = None,
        warmup_densities: Sequence[float] = DGC_WARMUP_DENSITIES,
        sample_ratio: float | None = None, exact: bool = False,
        max_rounds: int | None = None,
        axis_name="data", error_feedback: bool = True, policy=None,
        seed: int = 0, **options):
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
  threshold of ``sampled_select`` in ``jaxcomm/transforms/sparsify/_dgc.py``
  (``exact=False``; the samples of all leaves come from one draw,
  ``dgc_bucket_sample``, and all leaves are selected together) or exact
  top-k.

  Departs from the paper in the exchange of the warm-up: message sizes must
  be static, so each stage has its own exchange (capacity sized for that
  stage's density) behind a ``lax.switch`` on the step. Every step moves only
  its stage's message, but the compiled step holds all stages' all-gathers,
  and ``wire`` (like the HLO) lists them all: the steady-state cost is the
  last entry. With warm-up on 8 devices the first stage (density 0.25) moves
  ``8 * 0.25 * (4 + b)`` bytes per element, more than a dense psum: warm-up
  trades bytes for accuracy early in training.

  The static arguments default to None (meaning the values below), so that
  ``optax.inject_hyperparams(jaxcomm.dgc)`` injects only what it is given.

  Args:
    ratio: target density in ``(0, 1]`` (static; default 0.001, the
      paper's).
    momentum: momentum ``m`` of the correction, in ``[0, 1]`` (None:
      plain error feedback); forwarded to :func:`jaxcomm.compressed`.
    clip_norm: local clipping norm, ``> 0`` (None: no clipping); forwarded
      to :func:`jaxcomm.compressed`.
    warmup_steps_per_stage: steps per warm-up stage (static int >= 0;
      default 0, no warm-up).
    warmup_densities: warm-up densities (static, decreasing).
    sample_ratio: fraction of each leaf sampled for the threshold (static;
      default 0.01).
    exact: exact top-k instead of the sampled threshold (static).
    max_rounds: bound on the threshold adjustment rounds (static; default
      10).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent (the paper's accumulation).
      ``False`` needs ``momentum=None``: momentum correction accumulates
      the velocity in the residual.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the PRNG key (the threshold's samples).
    **options: ``start_step``, ``momentum_masking``, ``lr_schedule``,
      ``residual_decay`` and ``shift_rate``, the options every compressor
      takes (besides ``momentum`` and ``clip_norm`` above), forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``ratio``, ``sample_ratio`` or
      warm-up density outside ``(0, 1]`` (or traced), a negative
      ``warmup_steps_per_stage`` or ``max_rounds``, an ``exact`` that is
      not a bool, ``error_feedback`` other than True with ``momentum``
      set, or an ``axis_name``, ``error_feedback``, ``policy``,
      ``momentum``, ``clip_norm`` or option that
      :func:`jaxcomm.compressed` refuses.

  Examples:
    Density 0.25 of 8 values (2 per device; the sample is then the whole
    leaf, so the threshold is exact) with the default momentum 0.9.
    Device ``i`` (1 to 8) has the gradient ``i * [4, -3, 2, 1, 0, ...]``
    twice. The first step sends ``4, -3`` (``u`` and ``v`` are zeroed
    there); at the second, ``v`` holds ``4, -3`` there again but ``2 +
    (0.9 * 2 + 2) = 5.8`` at the third coordinate, so ``4`` and ``5.8``
    travel:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.dgc(0.25, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   second, state = tx.update(g[0], state)
    ...   return first, second
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array(
    ...   [4.0, -3, 2, 1, 0, 0, 0, 0])
    >>> first, second = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(first).round(3))
    [ 18.  -13.5   0.    0.    0.    0.    0.    0. ]
    >>> print(np.asarray(second).round(3))
    [18.   0.  26.1  0.   0.   0.   0.   0. ]

    In training, an optimizer without momentum follows it:

    >>> opt = optax.chain(jaxcomm.dgc(0.001, momentum=0.9), optax.sgd(0.1))

  References:
    Lin et al, `Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training <https://arxiv.org/abs/1712.01887>`_,
    2018.
  """
  pick = lambda v, d: d if v is None else v
  ratio = _checks.ratio("ratio", pick(ratio, 0.001))
  sample_ratio = _checks.ratio("sample_ratio", pick(sample_ratio, 0.01))
  warmup_steps_per_stage = _checks.step(
    "warmup_steps_per_stage", pick(warmup_steps_per_stage, 0))
  max_rounds = _checks.integer("max_rounds", pick(max_rounds, 10), 0)
  try:
    warm = tuple(_checks.ratio("warmup_densities", d)
                 for d in warmup_densities)
  except TypeError:
    raise ValueError(
      f"warmup_densities must be a sequence of numbers in (0, 1], got "
      f"{warmup_densities!r}") from None
  if not isinstance(exact, bool):
    raise ValueError(f"exact must be a bool, got {exact!r}")
  _checks.error_feedback(error_feedback)
  if error_feedback is not True and momentum is not None:
    raise ValueError(
      f"error_feedback={error_feedback!r} needs momentum=None: DGC's "
      "momentum correction accumulates the velocity in the classic residual "
      f"(got momentum={momentum!r})")
  densities = (dgc_densities(ratio, warm) if warmup_steps_per_stage
               else (ratio,))
  codec = DgcCodec(ratio, densities, max(warmup_steps_per_stage, 1),
                   sample_ratio, exact, max_rounds)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback,
                                momentum=momentum,
                                clip_norm=clip_norm,
                                policy=policy, seed=seed, **options)


__all__ = [
  "dgc",
]
