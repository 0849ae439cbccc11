"""GradiVeQ (Yu et al. 2018): PCA-based linear vector quantization of
gradient slices, summed in the compressed domain.

The bucket is cut into ``S`` slices of ``d = dim`` elements (the last
zero-padded). A basis ``U`` (``d x k``, orthonormal columns, the same on
every device) compresses each slice ``v`` to ``U^T v``; the compression is
linear, so the devices' compressed slices are summed by one all-reduce of
``k / d`` of the data and decompressed once::

  c_i = U^T X_i              X_i: device i's slices, one per column
  mean = U (sum_i c_i) / n   sent_i = U c_i   (e_i' = X_i - U c_i)

Every ``refresh`` steps (and at the codec's first step, while ``U`` is
still zero) the bucket travels whole instead (one dense psum, the update
exact), and the new ``U`` is the top ``k`` principal directions of the
averaged gradient's slices (the eigenvectors of ``sum_s v_s v_s^T``),
as the paper refreshes its basis from periodic full gradients.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import _vma
from jaxcomm.collectives import _core
from jaxcomm.collectives import _lowrank


def slices(size: int, dim: int) -> int:
  """``S``, the slices of ``dim`` elements a bucket of ``size`` needs."""
  return -(-int(size) // int(dim))


def pieces(s: int, d: int) -> list[tuple[int, int]]:
  """The refresh step's dense psums: ``[lo, hi)`` ranges of the ``s``
  slices of ``d`` elements, at most 4 (one under 16384 elements), summed
  one after the other so that one piece is in flight (a whole-bucket
  psum inside the step's ``lax.cond`` held 1.6x the plain step's memory
  on TPU)."""
  count = max(1, min(4, int(s) * int(d) // 16384))
  step = -(-int(s) // count)
  return [(lo, min(lo + step, s)) for lo in range(0, s, step)]


def basis(mean_slices: jax.Array, rank: int) -> jax.Array:
  """``U^T`` (``[k, d]``): the top ``rank`` principal directions of the
  rows of ``mean_slices`` (``[S, d]``, uncentred: the eigenvectors of the
  ``d x d`` Gram matrix with the largest eigenvalues).

  The slices are first divided by a power of two near their largest
  magnitude (exact, and the eigenvectors do not change with the scale):
  the Gram matrix's squares would overflow float32 from ``|x| ~ 1e19``,
  and a finite step would then leave a NaN basis in the state."""
  scaled = mean_slices / _lowrank.pow2_scale(mean_slices)
  gram = jax.lax.dot_general(scaled, scaled, (((0,), (0,)), ((), ())))
  # Ascending eigenvalues; unchecked as ATOMO's (QDWH on TPU).
  _, vecs = _vma.unchecked(jnp.linalg.eigh, gram)
  return jnp.flip(vecs.T[-rank:], axis=0)


@dataclasses.dataclass(frozen=True)
class GradiveqCodec(_codec.CodecBase):
  """GradiVeQ's linear compressor ``U^T`` on slices of ``dim`` elements,
  the basis refreshed from the dense exchange every ``refresh`` steps
  (:func:`gradiveq`).

  Attributes:
    dim: ``d``, elements per slice.
    rank: ``k``, the principal directions kept (``k <= d``).
    refresh: steps between dense exchanges that refresh ``U``.
  """

  dim: int = 256
  rank: int = 32
  refresh: int = 100

  @property
  def name(self):
    return f"gradiveq({self.dim}, {self.rank})"

  def init(self, layout):
    del layout
    return jnp.zeros((self.rank, self.dim), jnp.float32)

  def apply(self, x, state, ctx):
    size, d, n = x.shape[0], self.dim, ctx.num_devices
    s = slices(size, d)
    ut = state                                               # [k, d]
    fresh = (ctx.step % self.refresh == 0) | jnp.all(ut == 0)

    def grid(v):
      return (v if s * d == size else jnp.pad(v, (0, s * d - size))
              ).reshape(s, d)

    xg = grid(x)                                             # [S, d]
    c = jax.lax.dot_general(ut, xg, (((1,), (1,)), ((), ())))  # [k, S]

    def backg(c):                                            # -> [S, d]
      return jax.lax.dot_general(c, ut, (((0,), (0,)), ((), ())))

    def dense(xg, c):
      del c
      total = None
      for lo, hi in pieces(s, d):
        part = xg[lo:hi] if total is None else _core.after(xg[lo:hi], total)
        part = _core.psum(part, ctx.axis_name)
        if total is None and hi == s:
          total = part
        else:
          total = (jnp.broadcast_to(_core.zeros_after(1, part)[0], (s, d))
                   if total is None else total).at[lo:hi].set(part)
      return total, xg, basis(total, self.rank)

    def project(xg, c):
      del xg
      return backg(_core.psum(c, ctx.axis_name)), backg(c), ut

    total, sent, ut = jax.lax.cond(fresh, dense, project, xg, c)
    mean = total.reshape(-1)[:size] / n
    sent = sent.reshape(-1)[:size]
    return _codec.CodecResult(mean=mean, sent=sent, state=ut)

  def _dense_wire(self, size):
    return [("all-reduce", 4 * self.dim * (hi - lo))
            for lo, hi in pieces(slices(size, self.dim), self.dim)]

  def _project_wire(self, size):
    return [("all-reduce", 4 * self.rank * slices(size, self.dim))]

  def wire(self, layout, n):
    del n
    return self._dense_wire(layout.size) + self._project_wire(layout.size)

  def wire_at(self, layout, n, step):
    # The codec's first step refreshes too (U starts at zero): exact for
    # start_step a multiple of refresh, the default.
    del n
    if step % self.refresh == 0:
      return self._dense_wire(layout.size)
    return self._project_wire(layout.size)


@_registry.method(
    gap=(
      "32 of 256 PCA directions from one dense step in 100; what they "
      "miss waits for the next dense step"),
    paper="Yu et al. 2018 (GradiVeQ)",
    summary="k of d PCA coefficients per slice, summed compressed (psum); "
    "basis from a periodic dense step",
    static=("dim", "rank", "refresh"))
@_compressor.shared_options
def gradiveq(dim: int | None = None, rank: int | None = None,
             refresh: int | None = None, *, axis_name="data",
             error_feedback: bool = True, policy=None, seed: int = 0,
             **options):
  """GradiVeQ: a shared PCA basis compresses slices, summed by a psum.

  Gradient vector quantization by a PCA basis shared by all devices, the
  compressed vectors summed by an all-reduce.

  .. math::
    c_i = U^T X_i, \\quad u = \\frac{1}{n} U \\sum_{i=1}^{n} c_i, \\quad
    e_i \\leftarrow X_i - U c_i

  ``X_i`` holds device ``i``'s gradient (with its error) as slices of
  ``d = dim`` consecutive elements of the bucket; ``U`` (``d x k``,
  orthonormal) is the same on every device, so the compressed slices
  (``k / d`` of the data) add in one all-reduce whose bytes do not grow
  with ``n``, and are decompressed once. Every ``refresh`` steps the
  step is dense (a psum of the whole bucket; the update exact, nothing
  left in the residual) and ``U`` becomes the top ``k`` principal
  directions of that averaged gradient's slices (the eigenvectors of the
  slices' ``d x d`` Gram matrix), as the paper recomputes its basis from
  periodic full gradients; the codec's first step is such a step.
  What the projection drops stays in each device's residual (error
  feedback), so ``n u = sum_i sent_i`` and no mass is lost.

  Static shapes: the slices are the bucket's consecutive elements
  (compressed leaves concatenated, the last slice zero-padded), one
  ``U`` per bucket, not per layer; ``d``, ``k`` and ``refresh`` are
  static; the refresh step and the compressed step are the two branches
  of one ``lax.cond`` (the compiled program holds both exchanges; a step
  moves one). The refresh's dense psum is split into up to 4 psums of
  consecutive slices, one after the other (``pieces``; same bytes,
  one piece in flight: a whole-bucket psum inside the ``cond`` held 1.6x
  the plain step's memory on TPU). Layouts: slices ``[S, d]`` (``d``
  minor: keep it a multiple of 128; the dense psum carries the padded
  slices, at most ``d - 1`` zeros), coefficients ``[k, S]``, ``U^T``
  ``[k, d]``.

  Departures: the basis comes from the uncentred Gram matrix of the
  averaged gradient of one refresh step (the paper's PCA on full
  gradients of the refresh iterations, which its linear compressor
  needs uncentred to sum); coefficients travel as float32 (the paper
  also quantizes them to fewer bits before its ring all-reduce). The
  products run at the backend's default matmul precision (bf16 passes
  on TPU, as PowerSGD's; exact float32 on CPU).

  Args:
    dim: ``d``, elements per slice, ``>= 1``, or None (default): 256
      (static).
    rank: ``k``, principal directions kept, in ``[1, dim]``, or None
      (default): 32 (static; ``d / k`` = 8x fewer bytes).
    refresh: steps between dense refresh steps, ``>= 1``, or None
      (default): 100 (static).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what the projection drops (default True).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's key (GradiVeQ draws nothing).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay``,
      ``shift_rate``, forwarded to :func:`jaxcomm.compressed`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (a compressor, to chain
    before an optimizer) whose state is a :class:`jaxcomm.CompressState`;
    its codec state is ``U^T`` per bucket (``[k, d]`` float32,
    replicated; zero until the first refresh).

  Raises:
    ValueError: naming the argument, when ``dim`` or ``refresh`` is not an
      int >= 1, ``rank`` not an int in ``[1, dim]``, ``error_feedback``
      not one of its values, or one of ``**options``, ``policy`` or
      ``axis_name`` is unknown or out of range
      (:func:`jaxcomm.compressed`). The update raises a ValueError
      outside a context that binds ``axis_name`` (a ``shard_map`` or
      :class:`jaxcomm.parallel.DataParallel` step).

  Examples:
    Before the optimizer, as every compressor:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> tx = optax.chain(jaxcomm.gradiveq(dim=256, rank=32), optax.sgd(0.1))

    Two steps on 8 devices with slices of ``d = 4`` elements and ``k = 1``
    direction. Step 0 is a refresh: the exact mean travels dense and
    ``U`` becomes its slices' principal direction ``v``. At step 1 each
    device's slices are a multiple of ``v`` plus the same ``w``
    orthogonal to it: one coefficient per slice travels (a quarter of the
    bytes), the update is the mean of the ``v`` parts, and each device's
    ``w`` parts (norm ``|w| sqrt(64) = 8``) wait in its residual:

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()           # 8 devices on "data"
    >>> tx = jaxcomm.gradiveq(dim=4, rank=1)
    >>> v = jnp.array([1.0, 1.0, 1.0, 1.0]) / 2
    >>> w = jnp.array([1.0, -1.0, 1.0, -1.0]) / 2
    >>> c = jnp.arange(8.0)[:, None, None] + jnp.linspace(0, 1, 64)[:, None]
    >>> g0 = (c * v).reshape(8, 256)              # device i: 64 slices
    >>> g1 = ((1 - c) * v + w).reshape(8, 256)
    >>> def two_steps(g0, g1):
    ...   state = tx.init(g0[0])
    ...   u0, state = tx.update(g0[0], state)
    ...   u1, state = tx.update(g1[0], state)
    ...   return u0, u1, state.residual[0][None]
    >>> u0, u1, residual = jax.jit(jax.shard_map(
    ...   two_steps, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P(), P("data"))))(g0, g1)
    >>> print(np.abs(u0 - g0.mean(0)).max() < 1e-5)
    True
    >>> print(np.abs(u1 - (g1.mean(0) - jnp.tile(w, 64))).max() < 1e-5)
    True
    >>> print(np.linalg.norm(residual, axis=1).round(3))
    [8. 8. 8. 8. 8. 8. 8. 8.]
    >>> for step in (0, 1):
    ...   print(jaxcomm.wire.claimed(tx, g0[0], 8, step=step)[0])
    ('all-reduce', 1024)
    ('all-reduce', 256)

  References:
    Yu et al, `GradiVeQ: Vector Quantization for Bandwidth-Efficient
    Gradient Aggregation in Distributed CNN Training <https://arxiv.org/
    abs/1811.03617>`_, NeurIPS 2018.
  """
  dim = 256 if dim is None else _checks.integer("dim", dim, 1)
  rank = 32 if rank is None else rank
  _checks.integer("rank", rank, 1)
  if rank > dim:
    raise ValueError(f"rank must be an int in [1, dim={dim}], got "
                     f"{rank!r}")
  refresh = 100 if refresh is None else _checks.integer("refresh",
                                                        refresh, 1)
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(GradiveqCodec(dim, rank, refresh),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["gradiveq"]
