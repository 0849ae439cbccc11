"""SIDCo (Abdelmoniem et al., MLSys 2021): a threshold for a target density
from a sparsity-inducing distribution fitted to ``|x|``, with no sort.

Per leaf, stage 1 fits the distribution to all of ``|x|`` and takes its
quantile for density ``d_1``; each later stage fits the exceedances of the
previous threshold, shifted by their minimum (a peaks-over-threshold fit),
and takes the quantile for the next factor of the density. The fits are
closed forms:

* ``"exponential"`` (SIDCo-E): maximum likelihood, ``t = m log(1/d)`` with
  ``m`` the mean;
* ``"gpareto"`` (SIDCo-GP): generalized Pareto by the method of moments
  (mean ``m``, variance ``v``): scale ``a = m (m^2 / v + 1) / 2``, shape
  ``c = (m^2 / v - 1) / 2``, ``t = a (1 - d^c) / c`` (the exponential's
  quantile where ``c -> 0``).

Every stage is a few row reductions per group of equal-shape leaves; the
selection is one packed-mask compaction
(:func:`jaxcomm.kernels.threshold.compact_segments`), so the work does not
depend on ``k``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import _rows
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import threshold as _kthreshold
from jaxcomm.kernels import topk as _topk
from jaxcomm.transforms.sparsify._sparsification import _leaf_rows
from jaxcomm.transforms.sparsify._sparsification import _sparse_exchange
from jaxcomm.transforms.sparsify._sparsification import num_selected

DISTRIBUTIONS = ("exponential", "gpareto")


def stage_densities(ratio: float, stages: int, first_ratio: float
                    ) -> tuple[float, ...]:
  """The density each stage's quantile targets: ``ratio`` in one stage;
  else ``first_ratio``, then ``(ratio / first_ratio)^(1 / (stages - 1))``
  for each later stage (their product is ``ratio``)."""
  if stages == 1 or ratio >= first_ratio:
    return (ratio,)
  q = (ratio / first_ratio) ** (1.0 / (stages - 1))
  return (first_ratio,) + (q,) * (stages - 1)


def capacity(ratio: float, size: int, capacity_factor: float) -> int:
  """Static slots of a leaf's message."""
  return min(size, max(1, math.ceil(capacity_factor
                                    * num_selected(ratio, size))))


def _quantile(dist, mean, var, d):
  """The fitted distribution's value exceeded with probability ``d``."""
  if dist == "exponential":
    return mean * math.log(1.0 / d)
  r = mean * mean / jnp.maximum(var, jnp.finfo(jnp.float32).tiny)
  scale = 0.5 * mean * (r + 1.0)
  shape = 0.5 * (r - 1.0)
  small = jnp.abs(shape) < 1e-6
  safe = jnp.where(small, 1.0, shape)
  return jnp.where(small, scale * math.log(1.0 / d),
                   scale * (1.0 - jnp.power(d, safe)) / safe)


def _row_thresholds(v, sizes, valid, dens, dist):
  """SIDCo's threshold of each row of ``v`` (``[R, W]``, magnitudes), of
  which the first ``sizes`` (``[R]``) entries count (``valid``: that
  mask, or None when every entry does)."""
  keep = (lambda a: a) if valid is None else (
    lambda a: jnp.where(valid, a, 0.0))
  m = jnp.sum(v, axis=1) / sizes
  var = (jnp.sum(keep(jnp.square(v - m[:, None])), axis=1)
         / jnp.maximum(sizes - 1.0, 1.0))
  t = _quantile(dist, m, var, dens[0])
  for d in dens[1:]:
    over = v > t[:, None]
    if valid is not None:
      over = over & valid
    count = jnp.sum(over, axis=1).astype(jnp.float32)
    tmin = jnp.min(jnp.where(over, v, jnp.inf), axis=1)
    y = jnp.where(over, v - tmin[:, None], 0.0)
    n = jnp.maximum(count, 1.0)
    m = jnp.sum(y, axis=1) / n
    dev = jnp.where(over, y - m[:, None], 0.0)
    var = jnp.sum(dev * dev, axis=1) / jnp.maximum(count - 1.0, 1.0)
    # No exceedance left: keep the threshold (nothing more to fit).
    t = jnp.where(count > 0, tmin + _quantile(dist, m, var, d), t)
  return t


def selection_mask(x, layout, ratio, stages, first_ratio, dist):
  """``|x|`` above SIDCo's threshold of its leaf, flat over the bucket:
  per group of equal-shape leaves, reductions along the rows of its
  ``[G, L]`` view (no scatter); short leaves of similar sizes as rows of
  one zero-padded batch (:mod:`jaxcomm._rows`; the padding counts in no
  statistic)."""
  dens = stage_densities(ratio, stages, first_ratio)
  mag = jnp.abs(x).astype(jnp.float32)
  runs = [(g.offset, g.count, g.leaf_size) for g in layout.groups]
  batches, alone = _rows.plan(runs)
  parts = [None] * len(runs)
  for b in batches:
    # |x| of the gathered rows (a gather from |x| over the bucket would
    # make the compiler hold that whole).
    v = jnp.abs(b.gather(x)).astype(jnp.float32)
    sizes = np.asarray([size for _, _, count, size in b.members
                        for _ in range(count)], np.float32)
    valid = (lax.broadcasted_iota(jnp.int32, v.shape, 1)
             < jnp.asarray(sizes.astype(np.int32))[:, None])
    t = _row_thresholds(v, jnp.asarray(sizes), valid, dens, dist)
    for (i, _, _, _), flat in zip(b.members, b.unpad(v > t[:, None])):
      parts[i] = flat
  views = layout.views(mag)
  for i in alone:
    v = views[i]
    t = _row_thresholds(v, float(v.shape[1]), None, dens, dist)
    parts[i] = (v > t[:, None]).reshape(-1)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def select(x, layout, ratio, stages=3, first_ratio=0.25,
           dist="exponential", capacity_factor=2.0):
  """SIDCo's selection on a bucket: ``(values, positions, counts)``, the
  pairs of every leaf above its threshold (``capacity`` slots per leaf,
  position ``layout.size`` in unused ones) and how many each leaf had
  above it (which may exceed the capacity)."""
  bounds, sizes = _leaf_rows(layout)
  mask = selection_mask(x, layout, ratio, stages, first_ratio, dist)
  caps = tuple(capacity(ratio, n, capacity_factor) for n in sizes)
  vals, gi, counts = _kthreshold.compact_segments(
    x, _topk.pack_mask(mask), bounds, caps)
  return jnp.where(gi < layout.size, vals, 0.0), gi, counts


@dataclasses.dataclass(frozen=True)
class SidcoCodec(_codec.CodecBase):
  """SIDCo: every coordinate above a per-leaf threshold fitted in stages
  (:func:`select`), as (index, value) pairs in a static capacity per leaf,
  summed by a sparse psum.

  Attributes:
    ratio: the target density, in ``(0, 1]``.
    stages: fitting stages, at least 1.
    first_ratio: stage 1's density, in ``(0, 1]``.
    distribution: ``"exponential"`` or ``"gpareto"`` (of
      :data:`DISTRIBUTIONS`).
    capacity_factor: message slots per expected coordinate, at least 1.
  """

  ratio: float
  stages: int = 3
  first_ratio: float = 0.25
  distribution: str = "exponential"
  capacity_factor: float = 2.0

  @property
  def name(self):
    return f"sidco({self.ratio})"

  def check_layouts(self, layouts):
    _checks.selects_one("ratio", self.ratio,
                        [s for lay in layouts for s in lay.sizes], "sidco")

  def _select_pairs(self, x, layout):
    vals, gi, _ = select(x, layout, self.ratio, self.stages,
                         self.first_ratio, self.distribution,
                         self.capacity_factor)
    return vals, gi

  def apply(self, x, state, ctx):
    vals, gi = self._select_pairs(x, ctx.layout)
    mean, sent = _sparse_exchange(vals, gi, ctx)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    _, sizes = _leaf_rows(layout)
    cap = sum(capacity(self.ratio, s, self.capacity_factor) for s in sizes)
    return _sparse.sparse_psum_wire(cap, layout.size, n)


@_registry.method(
    gap=(
      "as top-k: about 1% above a fitted threshold a step, the rest "
      "delayed in the residual"),
    paper="Abdelmoniem et al. 2021 (SIDCo)",
    summary="pairs above a fitted threshold, no sort, bounded capacity, EF",
    defaults={"ratio": 0.01},
    static=("ratio", "first_ratio", "capacity_factor"))
@_compressor.shared_options
def sidco(ratio: float, *, distribution: str = "exponential",
          stages: int | None = None, first_ratio: float | None = None,
          capacity_factor: float | None = None, axis_name="data",
          error_feedback: bool = True, policy=None, seed: int = 0,
          **options):
  """SIDCo: sparsification by a statistical threshold (no sort, no sample).

  Per leaf, ``|x|`` (``x = g + e``) is fitted by a sparsity-inducing
  distribution in ``stages`` peaks-over-threshold stages (stage 1 at density
  ``first_ratio``, the later ones splitting ``ratio / first_ratio``
  evenly), and every coordinate above the last stage's threshold is sent
  as an exact ``(index, value)`` pair, up to a static capacity of
  ``ceil(capacity_factor * k)`` per leaf (``k = ceil(ratio * L)``). The
  number selected varies from step to step around ``k``; when it exceeds
  the capacity, the first by index travel and the rest stays in the
  residual (nothing is dropped with error feedback). The exchange is the
  all-gather of :func:`jaxcomm.topk`, sized by the capacity.

  Departs from the paper in two stated ways: the number of stages is fixed
  (the paper adapts it every few hundred steps from the achieved density;
  a changing count would recompile the step), and the gamma fit of
  SIDCo-P is not offered (its quantile needs an inverse incomplete gamma
  function).

  Args:
    ratio: the target density, in ``(0, 1]`` (static); one below ``1 /
      L`` for every leaf is refused at init.
    distribution: ``"exponential"`` (SIDCo-E) or ``"gpareto"``
      (SIDCo-GP).
    stages: fitting stages, at least 1 (static; default 3).
    first_ratio: stage 1's density, in ``(0, 1]`` (static; default the
      paper's 0.25).
    capacity_factor: message slots per expected coordinate, at least 1
      (static; default 2).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``ratio`` or ``first_ratio``
      outside ``(0, 1]`` (or traced), a ``distribution`` other than
      ``"exponential"`` or ``"gpareto"``, ``stages`` outside ``[1, 16]``,
      a ``capacity_factor`` below 1 (or traced), or an ``axis_name``,
      ``error_feedback``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses. ``tx.init`` raises one when
      ``ratio`` keeps fewer than one element of every compressed leaf.

  Examples:
    Density 0.25 of 8 values (one stage: ``ratio`` is not below
    ``first_ratio``). Device ``i`` (1 to 8) has the gradient ``i * [8,
    -4, 2, 1, -1, 0.5, 0.5, 0]``: the exponential fit's threshold is
    ``mean |x| * log 4``, ``2.95 i``, and the two values above it travel:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.sidco(0.25, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array(
    ...   [8.0, -4, 2, 1, -1, 0.5, 0.5, 0])
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(update).round(3))
    [ 36. -18.   0.   0.   0.   0.   0.   0.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.sidco(0.01), optax.sgd(0.1))

  References:
    Abdelmoniem et al, `An Efficient Statistical-based Gradient Compression
    Technique for Distributed Training Systems
    <https://arxiv.org/abs/2101.10761>`_, MLSys 2021.
  """
  # Static arguments default to None: optax.inject_hyperparams then keeps
  # them out of the traced hyperparameters unless the caller passes them.
  ratio = _checks.ratio("ratio", ratio)
  first_ratio = _checks.ratio(
    "first_ratio", 0.25 if first_ratio is None else first_ratio)
  _checks.choice("distribution", distribution, DISTRIBUTIONS)
  stages = _checks.integer("stages", 3 if stages is None else stages, 1, 16)
  capacity_factor = _checks.static_number("capacity_factor",
                                          capacity_factor, 2.0, 1.0)
  return _compressor.compressed(
    SidcoCodec(ratio, stages, first_ratio, distribution, capacity_factor),
    axis_name=axis_name, error_feedback=error_feedback, policy=policy,
    seed=seed, **options)


__all__ = ["sidco"]
