"""The low-rank allreduce of PowerSGD, and the orthogonalizations it uses.

One round of the exchange, for every matrix ``M_i`` (device ``i``'s local
matrix) of a step at once::

  P   = sum_i M_i Q          one fused psum for the P's of all matrices
  P   = orth(P)              identical on every device
  Q_i = M_i^T P
  Q   = sum_i Q_i            one fused psum for the Q's of all matrices
  mean   = P Q^T / n         the decoded average (replicated)
  sent_i = P Q_i^T           device i's own share: sum_i sent_i = n * mean

The matrices come in batches of equal shape, ``[G, n, m]`` (PowerSGD's
codec takes them as free views of its flat bucket): a batch's products are
one batched matmul. Whatever the number of matrices or batches, a round
issues exactly two all-reduces.

Finite inputs far from 1 stay finite wherever their sums over devices do:
``Q``'s columns are divided by a power of two near their largest magnitude
before ``M Q`` (a warm-started ``Q`` carries the scale of the gradients,
so ``M Q`` would carry it squared), which changes no orthogonalization's
result (``eps`` is rescaled to match), and Householder QR scales ``P``'s
columns the same way.
"""

from __future__ import annotations

import math
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxcomm.collectives import _core
from jaxcomm.kernels import _dispatch

ORTHOGONALIZATIONS = ("gram_schmidt", "householder", "cholesky")


def pow2_scale(x: jax.Array, axis=None) -> jax.Array:
  """A power of two ``s`` with ``s <= max |x| < 2 s`` along ``axis`` (kept
  as size-1 axes), 1 where that maximum is zero, subnormal or not finite.

  Dividing by it is exact (no rounding) and brings the largest magnitude
  into ``[1, 2)``, so that squares and products of the scaled values
  cannot overflow float32.
  """
  mx = jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None)
  # Keep the exponent bits only (3 ops; frexp and ldexp expand to ~60):
  # 2^floor(log2 mx) for a normal mx, 0 for zero or subnormal, inf for
  # inf or NaN.
  bits = jax.lax.bitcast_convert_type(mx.astype(jnp.float32), jnp.int32)
  s = jax.lax.bitcast_convert_type(bits & 0x7F800000, jnp.float32)
  return jnp.where((s > 0) & jnp.isfinite(s), s, jnp.ones_like(s))


def _normalize(col, eps):
  """``col / (|col| + eps)`` along axis -2, scale-safe; zero stays zero.

  The column is first divided by its largest magnitude so that squaring
  cannot underflow or overflow; an all-zero column gives zeros, never NaN.
  """
  s = jnp.max(jnp.abs(col), axis=-2, keepdims=True)
  safe_s = jnp.where(s > 0, s, 1.0)
  scaled = col / safe_s
  norm = jnp.sqrt(jnp.sum(scaled * scaled, axis=-2, keepdims=True))
  denom = norm + eps / safe_s
  return jnp.where((s > 0) & (denom > 0), scaled / jnp.where(denom > 0, denom,
                                                             1.0), 0.0)


def gram_schmidt(p: jax.Array, eps=0.0) -> jax.Array:
  """Orthonormal columns by modified Gram-Schmidt, batched over leading axes.

  .. math::
    q_k = \\frac{v_k}{\\lVert v_k \\rVert + \\epsilon},\\quad
    v_k = p_k - \\sum_{j<k} (q_j^\\top p_k)\\, q_j

  Each column is normalized, then projected out of all later columns at
  once (``r`` vectorized passes over the ``n x r`` block). A column that is
  zero after projection stays zero (no NaN); ``eps`` is PyTorch's
  ``orthogonalization_epsilon``.

  Args:
    p: ``(..., n, r)``.
    eps: added to each column's norm before dividing (may be traced): a
      scalar, or one value per column broadcastable to ``(..., 1, r)``.

  Returns:
    ``(..., n, r)`` with orthonormal (or zero) columns.
  """
  r = p.shape[-1]
  eps = jnp.asarray(eps)
  cols = []
  rest = p
  for k in range(r):
    q = _normalize(rest[..., :, :1], eps[..., k:k + 1] if eps.ndim else eps)
    cols.append(q)
    rest = rest[..., :, 1:]
    if k + 1 < r:
      coef = jnp.einsum("...nk,...nj->...kj", q, rest)
      rest = rest - q * coef
  return jnp.concatenate(cols, axis=-1)


def _per_matrix(fn, *xs):
  """``fn`` on a batch of matrices (leading axes), one matrix per call on
  the CPU backend.

  XLA's CPU LAPACK kernels (QR, Cholesky, triangular solve) split a batch
  over the intra-op thread pool and block until it is done. With several
  simulated devices each running one at once, every pool thread can be one
  of those blocked callers and the step never finishes: measured with
  PowerSGD on the transformer LM (d_model >= 224) on 8 CPU devices with 2
  cores, all 8 device threads waiting in the QR kernel's batch map. A
  single matrix per call runs inline; ``lax.map`` keeps the program the
  same size for any batch. Other backends keep the batched call.

  ``lax.map``'s output buffers start as zeros that XLA allocates at the
  top of the step, alive through the backward pass, so ``fn`` should
  return what its caller needs and no more (ATOMO samples its atoms inside
  ``fn``: stacked whole U and V factors were 1.40x the plain FSDP step's
  memory at fsdp=2). Two alternatives were measured on ATOMO's update on
  ResNet-18 shapes, in one process, round-robin, median of 7: ``lax.map``
  578 ms; a ``fori_loop`` writing into buffers made from the input 737
  ms; the calls written out for batches up to 4, 800 ms.
  """
  batch = xs[0].shape[:-2]
  if _dispatch.platform() != "cpu" or math.prod(batch) <= 1:
    return fn(*xs)
  flat = tuple(x.reshape((-1,) + x.shape[len(batch):]) for x in xs)
  out = jax.lax.map(lambda a: fn(*a), flat)
  return jax.tree.map(lambda o: o.reshape(batch + o.shape[1:]), out)


def householder(p: jax.Array, eps=0.0) -> jax.Array:
  """Orthonormal columns by Householder QR (``jnp.linalg.qr``, reduced).

  Stable for any input, including rank-deficient and zero blocks (their
  missing directions are completed to an orthonormal set, so the result is
  always finite). Each column is first divided by a power of two near its
  largest magnitude (exact, and the Q factor of ``P D`` is that of ``P``
  for a positive diagonal ``D``), so finite columns of any magnitude
  cannot overflow. ``eps`` is ignored: Householder reflections never
  divide by a column norm.

  Args:
    p: ``(..., n, r)``.
    eps: unused; accepted for a uniform signature.

  Returns:
    ``(..., n, r)`` with orthonormal columns.
  """
  del eps
  return _per_matrix(lambda m: jnp.linalg.qr(m, mode="reduced")[0],
                     p / pow2_scale(p, axis=-2))


def cholesky(p: jax.Array, eps=0.0) -> jax.Array:
  """Orthonormal columns by Cholesky-QR2, with a Householder fallback.

  .. math::
    G = P^\\top P + \\epsilon I,\\quad G = L L^\\top,\\quad
    Q = P L^{-\\top}

  done twice (CholeskyQR2) to restore orthogonality lost to rounding. The
  Gram matrix squares the condition number, so for ill-conditioned or
  rank-deficient ``P`` (a zero gradient, a matrix of rank below ``r``) the
  factorization fails; then the whole batch is orthogonalized by
  :func:`householder` instead (one ``lax.cond``, no NaN).

  Args:
    p: ``(..., n, r)``.
    eps: added to the Gram matrix's diagonal (may be traced).

  Returns:
    ``(..., n, r)`` with orthonormal columns.
  """
  r = p.shape[-1]
  eye = jnp.eye(r, dtype=p.dtype)
  # Scale each column to unit max-magnitude so the Gram matrix can neither
  # underflow nor overflow (the column space is unchanged).
  s = jnp.max(jnp.abs(p), axis=-2, keepdims=True)
  x = p / jnp.where(s > 0, s, 1.0)

  def chol_qr(x):
    g = jnp.einsum("...nk,...nj->...kj", x, x) + eps * eye
    # x L^{-T} as a matmul with the small r x r inverse: XLA's CPU
    # triangular solve on a tall (n, r) block takes ~16 ms per matrix for
    # n >= 256 (measured), a matmul microseconds.
    def factor(g):
      low = jnp.linalg.cholesky(g)
      return low, jax.lax.linalg.triangular_solve(
        low, jnp.broadcast_to(eye, low.shape), left_side=True, lower=True)
    low, inv = _per_matrix(factor, g)
    y = jnp.einsum("...nk,...jk->...nj", x, inv)
    diag = jnp.diagonal(low, axis1=-2, axis2=-1)
    # Reliable when the Gram matrix is well inside float32's range of
    # condition numbers: smallest pivot^2 above ~1e3 ulp of the largest.
    big = jnp.max(diag, axis=-1)
    small = jnp.min(diag, axis=-1)
    ok = jnp.all(jnp.isfinite(y)) & jnp.all(small * small > 1e-4 * big * big)
    return y, ok

  y, ok1 = chol_qr(x)
  y, ok2 = chol_qr(y)
  return jax.lax.cond(ok1 & ok2, lambda: y, lambda: householder(p))


def orthogonalizer(name: str, rank: int) -> Callable:
  """The orthogonalization ``f(p, eps)`` for ``name``; rank 1 normalizes.

  For rank 1 every method reduces to dividing the single column by its norm
  (plus ``eps``), which is what is returned (PowerSGD's rank-1 shortcut).
  """
  if name not in ORTHOGONALIZATIONS:
    raise ValueError(
      f"orthogonalization must be one of {ORTHOGONALIZATIONS}, got {name!r}")
  if rank == 1:
    return _normalize
  return {"gram_schmidt": gram_schmidt, "householder": householder,
          "cholesky": cholesky}[name]


class LowRankResult(NamedTuple):
  """What :func:`lowrank_allreduce` returns.

  Attributes:
    mean: per batch, the decoded average ``sum_k P_k Q_k^T / n``
      ``(G, n, m)`` (replicated).
    sent: per batch, this device's own share ``sum_k P_k Q_{k,i}^T``
      ``(G, n, m)`` (varying).
    q: per batch, the aggregated ``Q`` ``(G, m, r)`` of the first round,
      for the next step's warm start; a column that came out exactly zero
      keeps its previous value (so a zero gradient cannot stall the power
      iteration forever).
    sent_sq: ``sum_j sum_k |Q_{k,i} / norm_scale|^2`` over this device's
      matrices and the rounds: for orthonormal ``P_k`` each round removes
      exactly ``|Q_{k,i}|^2`` from ``|M_i|^2`` (Pythagoras), so
      ``|M - sent|^2 = |M|^2 - sent_sq`` (both over ``norm_scale^2``)
      without another pass over the matrices.
  """

  mean: list
  sent: list
  q: list
  sent_sq: jax.Array


# Outer products P Q^T of rank up to this are written as r broadcast
# multiply-adds, which XLA fuses with their consumers (the residual
# x - sent, the output cast) into one pass over the matrix; a dot would
# materialize the product first. Not on TPU: v6e's compiler materialized
# the broadcasts instead (PowerSGD r4 on the 8.4M MLP, 2 v6e slices:
# temporaries 102.3 MiB with them, 1.19 MiB with the dot; v5e 1.70 ->
# 1.58 MiB; python -m jaxcomm.aot --model mlp --size 1024).
_ELEMENTWISE_MAX_RANK = 8

# Orthogonalizations whose eps is added to a column norm: when Q's columns
# are scaled by d before M Q, P's columns come out scaled by 1/d and eps
# must be too. Householder ignores eps; Cholesky-QR scales each column to
# unit max-magnitude itself, so its input's column scale never matters.
_EPS_PER_COLUMN = (gram_schmidt, _normalize)


def _outer(p, qt, scale=None):
  """``p @ qt`` for ``p (G, n, r)``, ``qt (G, r, m)``; optionally scaled."""
  r = p.shape[-1]
  if _dispatch.platform() == "tpu":
    # At float32 precision, as the multiply-adds (the TPU's default
    # rounds a float32 dot's operands to bfloat16).
    out = jnp.matmul(p, qt, precision=jax.lax.Precision.HIGHEST)
  elif r > _ELEMENTWISE_MAX_RANK:
    out = p @ qt
  else:
    out = p[..., :, 0:1] * qt[..., 0:1, :]
    for k in range(1, r):
      out = out + p[..., :, k:k + 1] * qt[..., k:k + 1, :]
  return out if scale is None else out * scale


def _left(m, q):
  """``M Q`` for a batch: ``(G, n, m) x (G, m, r) -> (G, n, r)``."""
  if m.shape[0] == 1:
    return (m[0] @ q[0])[None]
  return jnp.einsum("bnm,bmr->bnr", m, q)


def _right(m, p):
  """``P^T M`` for a batch: ``(G, n, r), (G, n, m) -> (G, r, m)``.

  Written as ``P^T M`` (not ``M^T P``): XLA's CPU dot is ~20x slower when
  it contracts the major axis of the big operand into a transposed output.
  """
  if m.shape[0] == 1:
    return jnp.einsum("nr,nm->rm", p[0], m[0])[None]
  return jnp.einsum("bnr,bnm->brm", p, m)


# Batches' P blocks are orthogonalized together, zero-padded to the bin's
# largest row count, while the padded bin stays under this many elements or
# pads no batch by more than _PAD_RATIO: one orthogonalization for many
# matrix shapes (ResNet-18's 11 shapes: one), not one per shape.
_PAD_ELEMENTS = 1 << 20
_PAD_RATIO = 4


def _bins(shapes) -> list[list[int]]:
  """Batches ``(G, n, r)`` grouped for one padded orthogonalization each:
  by decreasing ``n``, a batch joins the current bin (of row count ``N``)
  if the bin padded to ``N`` stays under :data:`_PAD_ELEMENTS` elements or
  ``N <= _PAD_RATIO * n``."""
  order = sorted(range(len(shapes)), key=lambda i: -shapes[i][1])
  bins: list[list[int]] = []
  for i in order:
    g, n, r = shapes[i]
    if bins:
      top = shapes[bins[-1][0]][1]
      rows = sum(shapes[j][0] for j in bins[-1]) + g
      if rows * top * r <= _PAD_ELEMENTS or top <= _PAD_RATIO * n:
        bins[-1].append(i)
        continue
    bins.append([i])
  return bins


def _orthogonalize_batches(orthogonalize, ps, eps, per_column):
  """``orthogonalize`` of every batch's ``P``, batches of different row
  counts stacked with zero rows (see :func:`_bins`).

  Zero rows change no orthogonalization: Householder reflections, column
  norms, projections and the Gram matrix all see the same numbers, and the
  padded rows of the result are zero (they are cut off again).
  """
  out: list = [None] * len(ps)
  for members in _bins([tuple(p.shape) for p in ps]):
    if len(members) == 1:
      i = members[0]
      out[i] = orthogonalize(ps[i], eps[i])
      continue
    top = ps[members[0]].shape[1]
    stacked = jnp.concatenate(
      [jnp.pad(ps[i], ((0, 0), (0, top - ps[i].shape[1]), (0, 0)))
       for i in members])
    if per_column:
      e = jnp.concatenate([jnp.broadcast_to(eps[i], (ps[i].shape[0], 1,
                                                     ps[i].shape[2]))
                           for i in members])
    else:
      e = eps[members[0]]
    q = orthogonalize(stacked, e)
    g0 = 0
    for i in members:
      g, n, _ = ps[i].shape
      out[i] = q[g0:g0 + g, :n, :]
      g0 += g
  return out


def lowrank_allreduce(ms: Sequence[jax.Array], qs: Sequence[jax.Array],
                      axis_name, *, num_devices: int,
                      orthogonalize: Callable, eps=0.0, num_iters: int = 1,
                      norm_scale=1.0) -> LowRankResult:
  """PowerSGD's rank-``r`` allreduce of many matrices with two psums a round.

  .. math::
    P = \\mathrm{orth}\\Big(\\sum_i M_i Q\\Big),\\quad
    Q = \\sum_i M_i^\\top P,\\quad
    \\bar M \\approx \\tfrac{1}{n} P Q^\\top

  Round ``k > 1`` (``num_iters > 1``) runs the same on what the earlier
  rounds left, ``M_i - sent_i``, starting from the previous round's
  aggregated ``Q``, and the approximations are accumulated (the authors'
  alternating left/right multiplications, each followed by one psum). Each
  round is two fused all-reduces of ``sum_j n_j r`` and ``sum_j m_j r``
  float32 values, whatever the number of matrices. Each batch of
  same-shape matrices is one batched matmul.

  Before ``M Q``, ``Q``'s columns are divided by a power of two near their
  largest magnitude (``pow2_scale``; exact), so that a warm-started
  ``Q``, which carries the gradients' scale, does not square it: ``P``'s
  columns come out scaled, which changes no orthogonalization's result
  (the ``eps`` of Gram-Schmidt and of rank 1 is scaled alike). Finite
  gradients whose sum over devices is finite give finite results.

  Args:
    ms: local matrices per batch, ``(G, n, m)`` float32.
    qs: starting ``Q`` per batch, ``(G, m, r)``, identical on every device.
    axis_name: the data axis, or None (one device, no collective).
    num_devices: static size of the axis.
    orthogonalize: ``f(p, eps)`` from ``orthogonalizer``, or any
      function whose result does not change when ``p``'s columns are
      scaled by positive powers of two.
    eps: the orthogonalization epsilon.
    num_iters: rounds per step.
    norm_scale: ``sent_sq`` is of the factors divided by this (pass a
      power of two near ``max |M|`` so that it cannot overflow).

  Returns:
    A ``LowRankResult``.
  """
  ms = list(ms)
  rest = ms
  q_in = list(qs)
  mean = sent = None
  first_q = None
  inv_n = 1.0 / num_devices
  per_column = orthogonalize in _EPS_PER_COLUMN
  sent_sq = jnp.zeros([], jnp.float32)
  for k in range(num_iters):
    scales = [pow2_scale(q, axis=-2) for q in q_in]          # (G, 1, r)
    p_local = [_left(m, q / d) for m, q, d in zip(rest, q_in, scales)]
    ps = _orthogonalize_batches(
      orthogonalize, _core.fused_psum(p_local, axis_name),
      [eps / d if per_column else eps for d in scales], per_column)
    qt_local = [_right(m, p) for m, p in zip(rest, ps)]
    qt_sum = _core.fused_psum(qt_local, axis_name)
    sent_sq = sent_sq + sum(jnp.sum(jnp.square(q / norm_scale))
                            for q in qt_local)
    mine = [_outer(p, qt) for p, qt in zip(ps, qt_local)]
    avg = [_outer(p, qt, inv_n) for p, qt in zip(ps, qt_sum)]
    sent = mine if k == 0 else [a + b for a, b in zip(sent, mine)]
    mean = avg if k == 0 else [a + b for a, b in zip(mean, avg)]
    q_sum = [jnp.swapaxes(qt, -1, -2) for qt in qt_sum]
    if k == 0:
      first_q = q_sum
    if k + 1 < num_iters:
      rest = [m - s for m, s in zip(ms, sent)]
      q_in = q_sum
  keep = [jnp.where(jnp.any(q != 0, axis=-2, keepdims=True), q, old)
          for q, old in zip(first_q, qs)]
  return LowRankResult(mean=mean, sent=sent, q=keep, sent_sq=sent_sq)


# ------------------------------------------- whole matrices under FSDP --

class Split(NamedTuple):
  """How a batch's whole matrices are split into the blocks a device holds
  (inside ``parallel.update_on_shards``).

  Attributes:
    rows: True when the rows are split (any leaf dimension but the last),
      False when the columns are (the last).
    axes: the mesh axes the split runs over (manual in the update).
    size: devices along them.
  """

  rows: bool
  axes: tuple
  size: int


def _piece(x, split: Split):
  """This device's ``1 / size`` share of ``x`` flattened (zero-padded to a
  multiple of ``size``): what it sends of a factor every block of the
  slice holds whole."""
  flat = x.reshape(-1)
  length = _core.padded_length(flat.shape[0], split.size)
  flat = jnp.pad(flat, (0, length - flat.shape[0]))
  share = length // split.size
  return jax.lax.dynamic_slice_in_dim(
    flat, _core.axis_index(split.axes) * share, share)


def _unpiece(share, split: Split, shape):
  """The shares of :func:`_piece` gathered back into ``shape``."""
  whole = _core.all_gather(share, split.axes, tiled=True)
  return whole[:math.prod(shape)].reshape(shape)


def piece_length(size: int, split: Split) -> int:
  """Elements of a :func:`_piece` of a factor of ``size`` elements."""
  return _core.padded_length(size, split.size) // split.size


def lowrank_allreduce_whole(ms: Sequence[jax.Array], qs: Sequence[jax.Array],
                            splits: Sequence[Split], axis_name, *,
                            num_devices: int, orthogonalize: Callable,
                            eps=0.0) -> LowRankResult:
  """PowerSGD's allreduce of whole matrices whose blocks lie on several
  devices of a fast (model) axis, with one round of two psums across the
  data axis.

  Each batch's device holds a block of every matrix: rows ``M_b`` (a row
  split) or columns (a column split) of ``M``. The result is the power
  step of the whole matrix summed over the data axis,
  ``P = orth(sum_i M_i Q)``, ``Q = sum_i M_i^T P``, with:

  * a row split: ``P``'s rows stay split (``P_b = M_b Q``, all-reduced
    across the data axis by their own block, ``n_b r`` values), gathered
    over the model axis to be orthogonalized whole, and ``Q = sum_b M_b^T
    P_b`` summed over the model axis, then sent across the data axis as
    ``1 / size`` of it per device (``m r / size`` values) and gathered
    back;
  * a column split: the mirror image (``P`` summed over the model axis and
    sent as ``1 / size`` per device, ``Q``'s rows split).

  Across the data axis a device sends ``(n_b + m / size) r`` (or ``(n /
  size + m_b) r``) values per matrix: a whole-matrix rank-``r`` factor
  pair, each part sent once per slice. The model axis carries the gathers
  and psums of ``r``-wide factors (and ``Q``'s scale, a max).

  Args:
    ms: per batch, this device's blocks ``(G, n_b, m)`` or ``(G, n, m_b)``.
    qs: per batch, the warm start: ``Q`` ``(G, m, r)`` (identical over the
      model axis) for a row split, this block's rows of ``Q`` ``(G, m_b,
      r)`` for a column split.
    splits: per batch, its :class:`Split`.
    axis_name: the data axis, or None.
    num_devices: static size of the data axis.
    orthogonalize: as in :func:`lowrank_allreduce`.
    eps: the orthogonalization epsilon.

  Returns:
    A ``LowRankResult`` of this device's blocks; ``sent_sq`` is 0
    (the rows of a block's ``P`` are not orthonormal on their own: the
    caller measures its error directly).
  """
  inv_n = 1.0 / num_devices
  per_column = orthogonalize in _EPS_PER_COLUMN
  first, scales = [], []
  for m, q, sp in zip(ms, qs, splits):
    d = pow2_scale(q, axis=-2)                                   # (G, 1, r)
    if not sp.rows:
      # Every block's Q rows are scaled alike: their products add up.
      d = jax.lax.pmax(d, sp.axes)
    scales.append(d)
    p_loc = _left(m, q / d)
    first.append(p_loc if sp.rows else _piece(jax.lax.psum(p_loc, sp.axes),
                                              sp))
  summed = _core.fused_psum(first, axis_name)
  ps = []
  for s, m, q, sp in zip(summed, ms, qs, splits):
    if sp.rows:
      ps.append(_core.all_gather(s, sp.axes, axis=1, tiled=True))
    else:
      ps.append(_unpiece(s, sp, (m.shape[0], m.shape[1], q.shape[-1])))
  ps = _orthogonalize_batches(
    orthogonalize, ps, [eps / d if per_column else eps for d in scales],
    per_column)
  second, mine_p, mine_qt = [], [], []
  for p, m, sp in zip(ps, ms, splits):
    if sp.rows:
      nb = m.shape[1]
      p = jax.lax.dynamic_slice_in_dim(
        p, _core.axis_index(sp.axes) * nb, nb, axis=1)
      qt = jax.lax.psum(_right(m, p), sp.axes)        # this slice's Q^T
      second.append(_piece(qt, sp))
    else:
      qt = _right(m, p)                                # (G, r, m_b)
      second.append(qt)
    mine_p.append(p)
    mine_qt.append(qt)
  summed = _core.fused_psum(second, axis_name)
  mean, sent, keep = [], [], []
  for s, p, qt, q_old, sp in zip(summed, mine_p, mine_qt, qs, splits):
    qt_sum = _unpiece(s, sp, qt.shape) if sp.rows else s
    sent.append(_outer(p, qt))
    mean.append(_outer(p, qt_sum, inv_n))
    q_new = jnp.swapaxes(qt_sum, -1, -2)
    keep.append(jnp.where(jnp.any(q_new != 0, axis=-2, keepdims=True),
                          q_new, q_old))
  return LowRankResult(mean=mean, sent=sent, q=keep,
                       sent_sq=jnp.zeros([], jnp.float32))


def whole_wire(shapes: Sequence[tuple], splits: Sequence[Split], rank: int
               ) -> tuple[int, int]:
  """Bytes per device of :func:`lowrank_allreduce_whole`'s two psums
  across the data axis, for batches of blocks ``(G, n_b, m)`` or ``(G, n,
  m_b)``."""
  p_bytes = q_bytes = 0
  for (g, n, m), sp in zip(shapes, splits):
    if sp.rows:
      p_bytes += 4 * g * n * rank
      q_bytes += 4 * piece_length(g * m * rank, sp)
    else:
      p_bytes += 4 * piece_length(g * n * rank, sp)
      q_bytes += 4 * g * m * rank
  return p_bytes, q_bytes
