"""Sketching compressors: FetchSGD (Rothchild et al. 2020).

Each device count-sketches its gradient bucket (Charikar et al. 2002) into
a ``[rows, cols]`` float32 table; sketches are linear, so one all-reduce of
the table averages them: ``4 rows cols`` bytes per device per bucket,
independent of the number of devices and of the model size. Momentum and
error accumulation run on the averaged (replicated) sketch, and the update
is the top-k of the coordinates' estimates recovered from it (Ivkin et al.
2019's heavy hitters).

The count sketch's hash and sign of coordinate ``j`` (its position in the
bucket) in row ``r`` are computed in uint32 arithmetic (mod ``2^32``), with
``fmix`` MurmurHash3's 32-bit finalizer and ``seed`` taken mod ``2^32``::

  c_r    = fmix(seed * 0x9E3779B9 + (r + 1) * 0x85EBCA6B)
  v_r(j) = fmix(fmix(j XOR c_r) + c_r)
  h_r(j) = (v_r(j) >> 1) mod cols          the column
  s_r(j) = +1 if v_r(j) AND 1 else -1      the sign

identical on every device and recomputed each step (no index travels and
none is stored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import _vma
from jaxcomm.collectives import _core
from jaxcomm.kernels import _dispatch
from jaxcomm.kernels import topk as _topk
from jaxcomm.transforms.sparsify._sparsification import _fmix32
from jaxcomm.transforms.sparsify._sparsification import num_selected

DEFAULT_ROWS = 5
# Positions hashed at a time (_sketch_rows, _unsketch): their buffers are
# this long, not the bucket's length. On TPU shorter, and the top-k streamed
# (_unsketch_topk): FetchSGD's block step on the TPU tier 2.20x -> 1.49x
# the plain step's memory per chip, sharded 1.35x -> 1.00x (then 1.00x and
# 0.89x with _cells); on CPU 4096 cost 1.8x the time of 16384 (ResNet-18
# gradient, 424 -> 771 ms).
_CHUNK = 16384
_TPU_CHUNK = 4096
_GOLDEN = 0x9E3779B9
_MIX = 0x85EBCA6B


def _chunk(chunk: int | None) -> int:
  """``chunk``, or the platform's default (:data:`_CHUNK`)."""
  if chunk is not None:
    return chunk
  return _TPU_CHUNK if _dispatch.platform() == "tpu" else _CHUNK


def _streamed() -> bool:
  """Whether the unsketch's top-k is streamed (:func:`_unsketch_topk`):
  on TPU, where it is what fits the step's memory. Elsewhere it measured no
  faster (CPU) or was not measured (GPU), and the whole bucket's top-k
  keeps the GPU's bracketed search."""
  return _dispatch.platform() == "tpu"


def _row_salts(seed, rows: int) -> jax.Array:
  """``c_r`` for ``r = 0 .. rows - 1`` (uint32); ``seed`` may be traced
  (``optax.inject_hyperparams``)."""
  if isinstance(seed, int):
    s = jnp.uint32(seed % 2**32)
  else:
    s = jnp.asarray(seed).astype(jnp.uint32)
  r = jnp.arange(1, rows + 1, dtype=jnp.uint32)
  return _fmix32(s * jnp.uint32(_GOLDEN) + r * jnp.uint32(_MIX))


def sketch_hash(positions: jax.Array, salts: jax.Array, cols: int):
  """The columns ``h_r(j)`` (int32) and signs ``s_r(j)`` (float32) of
  ``positions`` (``[m]``) in every row: two ``[rows, m]`` arrays (see the
  module docstring for the definition)."""
  j = positions.astype(jnp.uint32)[None, :]
  c = salts[:, None]
  v = _fmix32(_fmix32(j ^ c) + c)
  col = ((v >> 1) % jnp.uint32(cols)).astype(jnp.int32)
  sign = jnp.where((v & jnp.uint32(1)) == 1, 1.0, -1.0).astype(jnp.float32)
  return col, sign


def _cells(col, cols: int) -> jax.Array:
  """The flat cells ``r cols + col[r, m]`` of a ``[rows, m]`` column array.

  The table is written through its flat view by one scatter of 1-D
  indices: on TPU, a scatter per row (or one of (row, column) pairs) cost
  FetchSGD's step 1.49x the plain step's memory (v6e, block), 1.10x with
  the sketching's rows flat, 1.00x with every write flat."""
  return (col + cols * jnp.arange(col.shape[0], dtype=jnp.int32)[:, None]
          ).reshape(-1)


def _accumulate(table, col, sign, values):
  """``table[r, col[r, m]] += sign[r, m] * values[m]`` for every row."""
  rows, cols = table.shape
  return table.reshape(-1).at[_cells(col, cols)].add(
    (sign * values[None, :]).reshape(-1)).reshape(rows, cols)


def _sketch_rows(table, salts, values, chunk: int | None = None):
  """``table[r, h_r(j)] += s_r(j) values[j]`` for every row ``r`` and
  position ``j`` of ``values``, ``chunk`` positions at a time: a chunk's
  hashes live only while its scatter runs (for the whole bucket at once,
  they were ``rows`` index arrays the size of the bucket, plus their
  (row, column) pairs). Positions past the end add zeros."""
  size = values.shape[0]
  chunk = min(_chunk(chunk), size)
  cols = table.shape[1]

  def one_chunk(c, t):
    positions = (c.astype(jnp.uint32) * np.uint32(chunk)
                 + jnp.arange(chunk, dtype=jnp.uint32))
    part = jnp.take(values, positions, mode="fill", fill_value=0)
    col, sign = sketch_hash(positions, salts, cols)
    return _accumulate(t, col, sign, part)

  table = _vma.match_varying(table, values)
  return jax.lax.fori_loop(0, -(-size // chunk), one_chunk, table)


def _exchange_sort(xs: list) -> list:
  """``xs`` (arrays of one shape) sorted element-wise by an odd-even
  transposition network of ``min``/``max``: element-wise, so it fuses
  with what makes the ``xs`` (no ``[rows, size]`` buffer, no sort)."""
  xs = list(xs)
  for rnd in range(len(xs)):
    for i in range(rnd % 2, len(xs) - 1, 2):
      xs[i], xs[i + 1] = (jnp.minimum(xs[i], xs[i + 1]),
                          jnp.maximum(xs[i], xs[i + 1]))
  return xs


def _median_rows(est: list) -> jax.Array:
  """Median over the rows' estimates (a list of arrays): the middle value
  for an odd count, the mean of the two middle values for an even one."""
  rows = len(est)
  if rows == 1:
    return est[0]
  s = _exchange_sort(est)
  mid = rows // 2
  return s[mid] if rows % 2 else 0.5 * (s[mid - 1] + s[mid])


def _estimate(table, salts, positions):
  """The median estimate ``median_r s_r(j) table[r, h_r(j)]`` of each of
  ``positions``."""
  col, sign = sketch_hash(positions.astype(jnp.uint32), salts,
                          table.shape[1])
  return _median_rows([sign[r] * table[r][col[r]]
                       for r in range(table.shape[0])])


def _unsketch(table, salts, size, chunk: int | None = None,
              magnitude: bool = False):
  """Every position's median estimate (:func:`_estimate`; its ``|.|`` with
  ``magnitude``) for ``j < size``, ``chunk`` positions at a time: a
  chunk's ``rows`` gathered estimates live only while its median is taken
  (for the whole bucket at once they were ``rows`` buffers the size of the
  bucket). The last chunk ends at ``size`` (it overlaps the one before,
  rewriting the same values)."""
  chunk = min(_chunk(chunk), size)

  def one_chunk(c, est):
    start = jnp.minimum(c * chunk, size - chunk)
    part = _estimate(table, salts,
                     start + jnp.arange(chunk, dtype=jnp.int32))
    if magnitude:
      part = jnp.abs(part)
    return jax.lax.dynamic_update_slice(est, part, (start,))

  est = _vma.match_varying(_core.zeros_after(size, table), table)
  return jax.lax.fori_loop(0, -(-size // chunk), one_chunk, est)


def _unsketch_topk(table, salts, size: int, k: int, chunk: int | None = None,
                   merge: int = 2) -> jax.Array:
  """The positions ``j < size`` of the ``k`` largest ``|estimate|``
  (:func:`_estimate`) in decreasing order, lower position first among
  ties: :func:`_unsketch` and a top-k, streamed. Chunks of ``max(chunk,
  merge k)`` positions; each chunk's magnitudes are merged with the
  running top ``k`` (a top-k of ``k + chunk`` values, the running ones
  first: they hold lower positions, so ties still resolve to the lower
  one). No buffer of every position's estimate exists, nor the sort of
  every estimate and its index (8 bytes per coordinate) that the TPU
  compiler made of the whole bucket's top-k. Positions past ``size`` in
  the last chunk count as 0 and follow every real one, so they are never
  taken (``k <= size``)."""
  chunk = min(max(_chunk(chunk), merge * k), size)

  def magnitudes(c):
    pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    mag = jnp.abs(_estimate(table, salts, pos))
    return jnp.where(pos < size, mag, 0.0), pos

  def top(mag, pos):
    v, i = _topk.topk_abs(mag, k, nonnegative=True)
    return v, jnp.take(pos, i)

  def merged(c, run):
    mag, pos = magnitudes(c)
    return top(jnp.concatenate([run[0], mag]),
               jnp.concatenate([run[1], pos]))

  first = top(*magnitudes(jnp.int32(0)))
  return jax.lax.fori_loop(1, -(-size // chunk), merged, first)[1]


@dataclasses.dataclass(frozen=True)
class FetchSGDCodec(_codec.CodecBase):
  """Count sketches averaged with one all-reduce, momentum and error in
  sketch space, top-k recovery; the state is ``(S_u, S_e)`` per bucket
  (and the rate ``S_e`` was last kept at, with ``lr_schedule``).

  Attributes:
    k_ratio: fraction of each bucket's coordinates extracted per step.
    rows: rows of the sketch.
    cols: columns of the sketch.
    momentum: ``rho`` of the momentum sketch (may be a traced value).
    momentum_masking: zero the momentum sketch where coordinates were
      extracted.
    lr_schedule: the optimizer's learning-rate schedule, or None (the
      user's callable, compared by identity).
    seed: seed of the sketch's hash (an int, or a traced or array integer).
  """

  k_ratio: float
  rows: int
  cols: int
  momentum: Any = 0.9
  momentum_masking: bool = True
  lr_schedule: Any = None
  seed: Any = 0

  name = "fetchsgd"
  mean_of_sent = False

  def check_layouts(self, layouts):
    # k is taken per bucket.
    _checks.selects_one("k_ratio", self.k_ratio,
                        [lay.size for lay in layouts], "fetchsgd", "bucket")

  def _k_of(self, layout) -> int:
    return num_selected(self.k_ratio, layout.size)

  def init(self, layout):
    k_ratio, rows, cols = self.k_ratio, self.rows, self.cols
    k = self._k_of(layout)
    if cols < k:
      raise ValueError(
        f"fetchsgd: cols={cols} is smaller than k={k} (k_ratio={k_ratio} of "
        f"a bucket of {layout.size} elements): a row of fewer columns than "
        "heavy hitters cannot separate them; use cols >= k (the paper's "
        "sketches have several times k columns) or a smaller k_ratio")
    zeros = jnp.zeros((rows, cols), jnp.float32)
    if self.lr_schedule is None:
      return (zeros, zeros)
    # The rate S_e was last scaled to (0: none yet).
    return (zeros, zeros, jnp.zeros([], jnp.float32))

  def apply(self, x, state, ctx):
    rows, cols, lr_schedule = self.rows, self.cols, self.lr_schedule
    s_u, s_e = state[:2]
    size = ctx.layout.size
    k = self._k_of(ctx.layout)
    salts = _row_salts(self.seed, rows)
    # This device's sketch, then the mean sketch: the one all-reduce.
    local = _sketch_rows(jnp.zeros((rows, cols), jnp.float32), salts, x)
    sketch = _core.psum(local, ctx.axis_name) / ctx.num_devices
    extra = ()
    if lr_schedule is not None:
      # The paper's S_e += lr_t S_u, kept divided by lr_t (the optimizer
      # after the compressor multiplies by lr_t): the carried error is
      # rescaled from the rate it was last kept at (kept in the state, so a
      # skipped step, whose state is rolled back, rescales nothing).
      last = state[2]
      cur = jnp.asarray(lr_schedule(ctx.step), jnp.float32)
      s_e = s_e * jnp.where((last == 0) | (cur == 0), 1.0,
                            last / jnp.where(cur == 0, 1.0, cur))
      extra = (jnp.where(cur == 0, last, cur).astype(jnp.float32),)
    s_u = self.momentum * s_u + sketch
    s_e = s_e + s_u
    # Unsketch: every coordinate's median estimate, then the top-k of
    # their magnitudes (streamed on TPU: _unsketch_topk), then the k signed
    # estimates again (the same arithmetic): no signed copy of the
    # estimates beside their magnitudes.
    if _streamed():
      idx = _unsketch_topk(s_e, salts, size, k)
    else:
      mag = _unsketch(s_e, salts, size, magnitude=True)
      ((_, idx),) = _topk.topk_abs_groups(mag, [(0, 1, size, k)],
                                          nonnegative=True)
      idx = idx.reshape(-1)
    vals = _estimate(s_e, salts, idx)
    delta = _core.zeros_after(size, idx).at[idx].set(vals)
    # Take the extracted mass out of the error sketch (S_e -= S(delta)) and
    # zero the momentum sketch in the cells the extracted coordinates hash
    # to (momentum factor masking in sketch space).
    k_col, k_sign = sketch_hash(idx, salts, cols)
    s_e = _accumulate(s_e, k_col, -k_sign, vals)
    if self.momentum_masking:
      s_u = s_u.reshape(-1).at[_cells(k_col, cols)].set(0.0).reshape(
        rows, cols)
    # A non-finite sketch state (an overflowing sum) makes the step
    # non-finite, so compressed() skips it and keeps the old state.
    ok = jnp.all(jnp.isfinite(s_u)) & jnp.all(jnp.isfinite(s_e))
    delta = jnp.where(ok, delta, jnp.nan)
    return _codec.CodecResult(mean=delta, sent=delta,
                              state=(s_u, s_e) + extra)

  def wire(self, layout, n):
    del layout, n
    return [("all-reduce", 4 * self.rows * self.cols)]


@_registry.method(
    gap=(
      "0.1% of coordinates recovered from a 50,000-column count sketch, "
      "momentum and error in the sketch"),
    paper="Rothchild et al. 2020",
    summary="count sketch, one psum of rows x cols",
    defaults={"k_ratio": 0.001, "cols": 50_000},
    static=("k_ratio",))
@_compressor.shared_options
def fetchsgd(k_ratio: float, *, cols: int, rows: int | None = None,
             momentum: float = 0.9, momentum_masking: bool = True,
             lr_schedule=None, axis_name="data", error_feedback: bool = False,
             policy=None, seed: int = 0, **options):
  """FetchSGD: count sketches averaged with one all-reduce, top-k recovery.

  Momentum and error accumulation run in sketch space (Rothchild et al.).

  .. math::
    S = \\frac{1}{n}\\sum_i \\mathcal{S}(g_i), \\quad
    S_u \\leftarrow \\rho S_u + S, \\quad S_e \\leftarrow S_e + S_u,
    \\quad \\Delta = \\mathrm{Top}_k(\\mathcal{U}(S_e)), \\quad
    S_e \\leftarrow S_e - \\mathcal{S}(\\Delta)

  Each device count-sketches its bucket into ``[rows, cols]`` (hash and
  sign per row from ``seed``, defined in
  ``jaxcomm/transforms/sparsify/_sketch.py``),
  and one psum of the table gives the mean sketch ``S``: ``4 rows cols``
  bytes per device per bucket, flat in ``n`` and in the model size. The
  momentum sketch ``S_u`` and error sketch ``S_e`` are replicated codec
  state (``(S_u, S_e)`` per bucket, ``[rows, cols]`` each). The unsketch
  ``U`` estimates coordinate ``j`` as the median over rows of ``s_r(j)
  S_e[r, h_r(j)]`` (the mean of the two middle values for an even
  ``rows``), and ``Delta`` keeps the ``k = max(1, ceil(k_ratio *
  L))`` largest ``|estimate|`` of the bucket's ``L`` coordinates (ties:
  lower index first), with their estimated values; it is the update, the
  same on every device. Then ``S_e -= S(Delta)`` (Algorithm 1, line 14)
  and, with ``momentum_masking``, ``S_u`` is zeroed in every cell an
  extracted coordinate hashes to (the paper's momentum masking; the
  authors' code does this, and also zeroes ``S_e`` in those cells instead
  of subtracting, noting that subtracting diverged in their runs: here
  the algorithm as printed is followed).

  Departures from the paper, by design:

  * **One round.** The paper's optional second round (each device sending
    its exact values at the k coordinates) needs the gradients kept; here
    ``Delta`` is the sketch's estimate at those coordinates.
  * **k per bucket.** The paper takes the top-k over the whole model; with
    the default leaf policy (one bucket) so does this, and with
    ``LeafPolicy(bucket_bytes=...)`` each bucket has its own sketch and k.
    Leaves the policy keeps dense (small ones) travel exactly, as for every
    compressor.
  * **The learning rate.** The paper accumulates ``S_e += lr S_u`` and
    applies ``Delta``; jaxcomm chains an optimizer after the compressor,
    so ``S_e`` is kept in gradient units and ``optax.sgd(lr)`` after it
    applies ``lr Delta``. With a constant rate this is the paper's
    algorithm exactly (every step is linear in ``S_e``, and the median and
    top-k commute with a positive scale); with a schedule, pass it as
    ``lr_schedule`` too and ``S_e`` is rescaled by ``lr_{t-1} / lr_t``
    each step (the rate it was last kept at is a third state entry), which
    keeps it equal to the paper's ``S_e / lr_t``. The schedule is called
    with the compressor's step count (which also counts skipped steps).

  There is no per-device residual: the error lives in the sketch, so
  ``error_feedback`` must stay False and the exchange declares that its
  mean is not the mean of per-device messages (EF21 is refused). A step on
  which some device's gradient, or the sketch state, is non-finite is
  skipped by :func:`jaxcomm.compressed` with the sketch state unchanged.

  Args:
    k_ratio: fraction of each bucket's coordinates extracted per step, in
      ``(0, 1]`` (static); one keeping less than one element of every
      bucket is refused at init.
    cols: columns of the sketch (static), ``>= 1``; the bucket's ``k`` must
      not exceed it (refused at ``init``, naming ``cols``).
    rows: rows of the sketch (static), ``>= 1``; None: 5.
    momentum: ``rho`` of the momentum sketch, in ``[0, 1)`` (0: none). It
      replaces the shared ``momentum`` option of :func:`jaxcomm.compressed`
      (DGC's per-device momentum): use a downstream optimizer without
      momentum.
    momentum_masking: zero the momentum sketch where coordinates were
      extracted (the paper's masking).
    lr_schedule: the optimizer's learning-rate schedule, if it has one
      (see above); None for a constant rate.
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: must be False (the error feedback is in sketch space).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the sketch's hash (mod ``2^32``) and of the state's key.
    **options: ``start_step``, ``clip_norm``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes (besides
      ``momentum``, ``momentum_masking`` and ``lr_schedule`` above, which
      are FetchSGD's own), forwarded to :func:`jaxcomm.compressed`
      (``residual_decay``, which needs a residual, and ``shift_rate``,
      DIANA's, are refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` with no residual; its ``codec`` holds
    ``(S_u, S_e)`` per bucket (and the rate ``S_e`` was last kept at, with
    ``lr_schedule``).

  Raises:
    ValueError: naming the argument, for a ``k_ratio`` outside ``(0, 1]``
      (or traced), ``cols`` or ``rows`` that is not an int ``>= 1``, a
      ``momentum`` outside ``[0, 1)``, a ``momentum_masking`` that is not
      a bool, an ``lr_schedule`` that is not callable, an
      ``error_feedback`` other than False, a ``seed`` that is not an
      int ``>= 0``, or an ``axis_name``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses. ``tx.init`` raises one when a
      bucket's ``k`` exceeds ``cols``, or ``k_ratio`` keeps fewer than one
      element of every bucket.

  Examples:
    ``k = 2`` of 8 values from a sketch of 5 rows of 64 columns (few
    enough collisions for the medians to be exact). Device ``i`` (1 to 8)
    has the gradient ``i * [4, -3, 2, 1, 0, ...]``: the first update is
    the top 2 of the mean gradient, ``18, -13.5``. With a zero gradient
    next, the error sketch still holds the rest, ``[9, 4.5]``, plus the
    momentum sketch's ``0.9`` times it: ``1.9 * [9, 4.5]`` travels:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.fetchsgd(0.25, cols=64,
    ...                       policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   second, state = tx.update(jnp.zeros_like(g[0]), state)
    ...   return first, second
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array(
    ...   [4.0, -3, 2, 1, 0, 0, 0, 0])
    >>> first, second = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(first).round(3))
    [ 18.  -13.5   0.    0.    0.    0.    0.    0. ]
    >>> print(np.asarray(second).round(3))
    [ 0.    0.   17.1   8.55  0.    0.    0.    0.  ]

    In training, an optimizer without momentum follows it:

    >>> opt = optax.chain(jaxcomm.fetchsgd(0.001, cols=50_000),
    ...                   optax.sgd(0.1))

  References:
    Rothchild et al, `FetchSGD: Communication-Efficient Federated Learning
    with Sketching <https://arxiv.org/abs/2007.07682>`_, ICML 2020.
    Charikar et al, `Finding Frequent Items in Data Streams
    <https://doi.org/10.1007/3-540-45465-9_59>`_, 2002.
    Ivkin et al, `Communication-efficient Distributed SGD with Sketching
    <https://arxiv.org/abs/1903.04488>`_, 2019.
  """
  k_ratio = _checks.ratio("k_ratio", k_ratio)
  cols = _checks.integer("cols", cols, 1)
  rows = _checks.integer("rows", DEFAULT_ROWS if rows is None else rows, 1)
  _checks.decay("momentum", momentum)
  masking = _checks.boolean("momentum_masking", momentum_masking)
  if lr_schedule is not None and not callable(lr_schedule):
    raise ValueError(f"lr_schedule must be callable, got {lr_schedule!r}")
  if error_feedback is not False:
    raise ValueError(
      "fetchsgd: error_feedback must be False: FetchSGD accumulates its "
      "error in sketch space (the error sketch S_e), not in a per-device "
      f"residual; got error_feedback={error_feedback!r}")
  seed = _checks.seed("seed", seed)
  codec = FetchSGDCodec(k_ratio=k_ratio, rows=rows, cols=cols,
                        momentum=momentum, momentum_masking=masking,
                        lr_schedule=lr_schedule, seed=seed)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=False, policy=policy,
                                seed=seed, **options)


__all__ = ["fetchsgd"]
