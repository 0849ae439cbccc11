"""PowerSGD: rank-``r`` gradient compression by one step of power iteration.

Every compressed leaf is viewed as a matrix ``M`` (reshape rule below) and
replaced by the rank-``r`` approximation ``P Q^T`` that one round of
subspace iteration, warm-started from the previous step's ``Q``, finds for
the *average* matrix over devices. Each device sends ``(n + m) r`` floats per
matrix instead of ``n m``; all matrices of a step travel in two fused
all-reduces (:func:`jaxcomm.collectives.lowrank_allreduce`).

Reshape rule: a leaf of shape ``(d_1, ..., d_k, c)`` is the matrix
``(d_1 ... d_k, c)``; its last axis (a Flax kernel's output features /
channels) gives the columns. For a Flax conv kernel ``(kh, kw, in, out)``
that is ``(kh kw in, out)``: the transpose of PyTorch's
``weight.view(out, -1)`` for the same layer, so the same rank and singular
values as in PyTorch. The reshape is free (row-major, no transpose).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _compressor
from jaxcomm.collectives import _lowrank


class PowerSGDState(NamedTuple):
  """The PowerSGD codec's state (inside ``CompressState.codec``).

  Attributes:
    q: the warm-start ``Q`` per group of same-shape matrices, ``(b, m, r)``
      float32, identical on every device (replicated).
    approx_error: this device's relative approximation error of the last
      compressed step, ``|x_i - sent_i| / |x_i|`` over all compressed leaves
      (per device; 0 before the first compressed step).
    compression_ratio: float32 values a dense psum of the compressed leaves
      would carry over the values PowerSGD carried at the last step (1.0
      until the first compressed step, e.g. during ``start_step``).
  """

  q: tuple
  approx_error: jax.Array
  compression_ratio: jax.Array


def matrix_shape(shape) -> tuple[int, int]:
  """The ``(n, m)`` matrix a leaf of ``shape`` is compressed as."""
  shape = tuple(int(d) for d in shape)
  if not shape:
    return (1, 1)
  return (int(np.prod(shape[:-1], dtype=np.int64)), shape[-1])


def _groups(shapes, batch: bool):
  """Groups of leaf indices compressed together (one per matrix shape).

  Returns ``[(matrix_shape, [leaf indices])]`` in order of first appearance.
  """
  groups: dict = {}
  out = []
  for j, s in enumerate(shapes):
    ms = matrix_shape(s)
    if batch and ms in groups:
      out[groups[ms]][1].append(j)
    else:
      groups[ms] = len(out)
      out.append((ms, [j]))
  return out


def initial_q(seed_key, shapes, rank: int) -> list:
  """The initial ``Q`` of each leaf: ``normal(fold_in(key, j), (m_j, r))``.

  ``j`` is the leaf's index among the compressed leaves (in
  ``jax.tree.leaves`` order); drawn from the same key on every device, so
  ``Q`` starts (and stays) replicated. Batching does not change the draw.
  """
  return [jax.random.normal(jax.random.fold_in(seed_key, j),
                            (matrix_shape(s)[1], rank), jnp.float32)
          for j, s in enumerate(shapes)]


def _powersgd_codec(rank: int, min_compression_rate: float, warm_start: bool,
                    eps, num_iters: int, seed: int, batch: bool,
                    orthogonalization: str) -> _compressor.Codec:
  orth = _lowrank.orthogonalizer(orthogonalization, rank)
  warned: set = set()

  def accepts(shape):
    if len(shape) < 2:
      return False
    n, m = matrix_shape(shape)
    if rank > min(n, m):
      if shape not in warned:
        warned.add(shape)
        warnings.warn(
          f"powersgd: rank={rank} exceeds min(n, m)={min(n, m)} of a leaf "
          f"of shape {shape} (matrix {n}x{m}); it goes through the dense "
          "psum instead", stacklevel=2)
      return False
    return (n + m) * rank * min_compression_rate < n * m

  def init(shapes):
    qs = initial_q(jax.random.PRNGKey(seed), shapes, rank)
    return PowerSGDState(
      q=tuple(jnp.stack([qs[j] for j in idx])
              for _, idx in _groups(shapes, batch)),
      approx_error=jnp.zeros([], jnp.float32),
      compression_ratio=jnp.ones([], jnp.float32))

  def ratio(shapes):
    dense = sum(n * m for n, m in map(matrix_shape, shapes))
    sent = sum((n + m) * rank * num_iters
               for n, m in map(matrix_shape, shapes))
    return dense / max(sent, 1)

  def apply(xs, state, ctx):
    shapes = [tuple(x.shape) for x in xs]
    groups = [idx for _, idx in _groups(shapes, batch)]
    ms = [x.reshape(matrix_shape(x.shape)) for x in xs]
    if warm_start:
      qs = list(state.q)
    else:
      fresh = initial_q(ctx.key, shapes, rank)
      qs = [jnp.stack([fresh[j] for j in idx]) for idx in groups]
    res = _lowrank.lowrank_allreduce(
      ms, qs, groups, ctx.axis_name, num_devices=ctx.num_devices,
      orthogonalize=orth, eps=eps, num_iters=num_iters)
    mean = [m.reshape(s) for m, s in zip(res.mean, shapes)]
    sent = [m.reshape(s) for m, s in zip(res.sent, shapes)]
    # |x - sent|^2 = |x|^2 - |sent|^2: sent is x's orthogonal projection
    # onto span(P) (exact for orthonormal P; rounding can only make it a
    # hair negative, hence the clamp). One pass over x instead of two.
    tot2 = sum(jnp.sum(jnp.square(x)) for x in xs)
    err2 = jnp.maximum(tot2 - res.sent_sq, 0.0)
    rel = jnp.sqrt(err2 / jnp.where(tot2 > 0, tot2, 1.0))
    new_q = tuple(res.q) if warm_start else tuple(qs)
    return _compressor.CodecResult(
      mean=mean, sent=sent,
      state=PowerSGDState(
        q=new_q, approx_error=rel.astype(jnp.float32),
        compression_ratio=jnp.float32(ratio(shapes))))

  def wire(shapes, n):
    del n
    groups = _groups(shapes, batch)
    p_bytes = sum(4 * len(idx) * ms[0] * rank for ms, idx in groups)
    q_bytes = sum(4 * len(idx) * ms[1] * rank for ms, idx in groups)
    return [("all-reduce", p_bytes), ("all-reduce", q_bytes)] * num_iters

  return _compressor.Codec(name="powersgd", init=init, apply=apply,
                           wire=wire, accepts=accepts)


def powersgd(rank: int, *, axis_name="data", start_step: int = 0,
             min_compression_rate: float = 2.0, error_feedback: bool = True,
             warm_start: bool = True, orthogonalization_epsilon=0.0,
             num_iters_per_step: int = 1, seed: int = 0, policy=None,
             batch_same_shape: bool = False,
             orthogonalization: str = "householder"):
  """PowerSGD: rank-``r`` compression by warm-started power iteration.

  .. math::
    P = \\mathrm{orth}\\Big(\\sum_i M_i Q_{t-1}\\Big),\\quad
    Q_t = \\sum_i M_i^\\top P,\\quad
    u = \\tfrac{1}{n} P Q_t^\\top,\\quad
    e_i \\leftarrow M_i - P P^\\top M_i

  ``M_i = g_i + e_i`` is device ``i``'s gradient plus its error-feedback
  residual, viewed as a matrix (a leaf ``(d_1, ..., d_k, c)`` is the matrix
  ``(d_1 ... d_k, c)``: a Flax conv kernel's output channels are the
  columns). Each device sends ``(n + m) r`` float32 values per matrix, in
  two fused all-reduces for all matrices of the step. A leaf is compressed
  when ``(n + m) r \\cdot`` ``min_compression_rate`` ``< n m`` (PyTorch's
  rule) and the :class:`jaxcomm.LeafPolicy` allows it; other floating leaves
  (biases, norms, small matrices) travel in the fused dense psum. A matrix
  with ``min(n, m) < rank`` is never compressed (a warning says so once).

  Where this departs from the paper and from PyTorch's ``PowerSGDState``:

  * the residual is each device's own projection error
    ``(I - P P^T) M_i`` (what its message ``Q_i = M_i^T P`` decodes to is
    ``P Q_i^T``), not ``M_i - P Q^T / n`` as in PyTorch's hook; the sum
    over devices, and hence every update, is the same, and the balance
    ``n u = sum_i P Q_i^T`` is exact;
  * ``num_iters_per_step = k`` runs ``k`` rounds of two psums each; rounds
    after the first compress what the earlier ones left and add up (as the
    authors' ``BasicPowerSGD`` does with its alternating multiplications),
    so ``k`` rounds cost ``k`` times the bytes;
  * the initial ``Q`` of compressed leaf ``j`` (in ``jax.tree.leaves``
    order) is ``jax.random.normal(fold_in(PRNGKey(seed), j), (m, r))``;
    without warm start a fresh one is drawn each step from the step's key
    ``ctx.key`` the same way; both are identical on every device;
  * an orthogonalized column that is exactly zero (zero gradients) stays
    zero instead of turning into NaN, and a ``Q`` column that comes out
    zero keeps its previous value for the next warm start.

  Args:
    rank: the rank ``r`` of the approximation (>= 1).
    axis_name: the data axis (a name, a tuple of names, or None).
    start_step: exchange the dense mean (residual untouched) for the first
      ``start_step`` steps (PyTorch's ``start_powerSGD_iter``).
    min_compression_rate: compress a matrix only if
      ``(n + m) r * min_compression_rate < n m``.
    error_feedback: keep what was not sent per device (the paper's EF).
    warm_start: reuse ``Q`` across steps (power iteration over time).
    orthogonalization_epsilon: added to column norms before dividing
      (Gram-Schmidt, rank 1) or to the Gram matrix's diagonal (Cholesky-QR);
      may be injected as a traced value.
    num_iters_per_step: rounds of the low-rank allreduce per step.
    seed: seed of the initial ``Q`` (and of the transform's step keys).
    policy: a :class:`jaxcomm.LeafPolicy`.
    batch_same_shape: multiply same-shape matrices as one batched matmul
      (PyTorch's ``batch_tensors_with_same_shape``). Off by default, as in
      PyTorch: on CPU stacking the matrices costs a copy that the fewer
      matmul calls do not win back (see ARCHITECTURE.md); on accelerators,
      where each matmul is a kernel launch, turning it on may pay.
    orthogonalization: ``"householder"`` (default: ``jnp.linalg.qr``, the
      fastest and the only one that stays orthonormal for ill-conditioned
      ``P`` in the measurement recorded in ARCHITECTURE.md),
      ``"gram_schmidt"`` (PyTorch's choice) or ``"cholesky"`` (Cholesky-QR2
      with a Householder fallback).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its codec state is a
    :class:`PowerSGDState` with the approximation error and compression
    ratio of the last step.

  Example::

    tx = optax.chain(jaxcomm.powersgd(rank=4), optax.sgd(0.1))

  References:
    Vogels et al, `PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization <https://arxiv.org/abs/1905.13727>`_, 2019.
  """
  if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
      or rank < 1:
    raise ValueError(f"rank must be an int >= 1, got {rank!r}")
  rank = int(rank)
  if isinstance(num_iters_per_step, bool) or not isinstance(
      num_iters_per_step, (int, np.integer)) or num_iters_per_step < 1:
    raise ValueError(
      f"num_iters_per_step must be an int >= 1, got {num_iters_per_step!r}")
  try:
    rate = float(min_compression_rate)
  except (TypeError, ValueError):
    rate = math.nan
  if not rate >= 0 or math.isinf(rate):
    raise ValueError(
      "min_compression_rate must be a finite number >= 0, got "
      f"{min_compression_rate!r}")
  _compressor._check_float("orthogonalization_epsilon",
                           orthogonalization_epsilon, 0.0, None)
  for name, value in (("warm_start", warm_start),
                      ("batch_same_shape", batch_same_shape)):
    if not isinstance(value, bool):
      raise ValueError(f"{name} must be a bool, got {value!r}")
  if orthogonalization not in _lowrank.ORTHOGONALIZATIONS:
    raise ValueError(
      f"orthogonalization must be one of {_lowrank.ORTHOGONALIZATIONS}, "
      f"got {orthogonalization!r}")
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an int, got {seed!r}")
  codec = _powersgd_codec(rank, rate, warm_start, orthogonalization_epsilon,
                          int(num_iters_per_step), int(seed),
                          batch_same_shape, orthogonalization)
  return _compressor.compressed(
    codec, axis_name=axis_name, error_feedback=error_feedback,
    start_step=start_step, policy=policy, seed=int(seed))
