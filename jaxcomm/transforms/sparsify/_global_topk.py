"""Selections the devices agree on: gTop-k (Shi et al. 2019) by recursive
doubling, and CSC (Sun et al. 2019) by chunk norms summed over devices."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.collectives import _sparse
from jaxcomm.transforms.sparsify._sparsification import _checked_codec
from jaxcomm.transforms.sparsify._sparsification import _local_topk
from jaxcomm.transforms.sparsify._sparsification import _segments
from jaxcomm.transforms.sparsify._sparsification import num_selected

# -------------------------------------------------------------- gTop-k ----

@dataclasses.dataclass(frozen=True)
class GtopkCodec(_codec.CodecBase):
  """Global top-k: each device's local top-k merged pairwise by recursive
  doubling and re-sparsified to k after every merge.

  Attributes:
    ratio: fraction of each segment's coordinates kept, in ``(0, 1]``.
    granularity: ``"leaf"`` (one tree per leaf) or ``"model"`` (one over
      the whole bucket).
  """

  ratio: float
  granularity: str = "leaf"

  @property
  def name(self):
    return f"gtopk({self.ratio})"

  def apply(self, x, state, ctx):
    ratio = self.ratio
    segs = _segments(ctx.layout, self.granularity)
    gv, gi = _local_topk(x, segs, ratio)
    total = ctx.layout.size
    bounds = [0] + [s.offset + (r + 1) * s.size
                    for s in segs for r in range(s.count)]
    ks = [num_selected(ratio, s.size) for s in segs for _ in range(s.count)]
    g_val, g_idx, delivered = _sparse.gtopk_psum(gv, gi, bounds, ks,
                                                 ctx.axis_name)
    summed = _core.zeros_after(total, g_idx).at[g_idx].set(g_val,
                                                           mode="drop")
    sent = _core.zeros_after(total, gi).at[gi].set(
      jnp.where(delivered, gv, 0.0), mode="drop")
    return _codec.CodecResult(mean=summed / ctx.num_devices, sent=sent,
                              state=state)

  def wire(self, layout, n):
    segs = _segments(layout, self.granularity)
    return _sparse.gtopk_psum_wire(
      [s.count * num_selected(self.ratio, s.size) for s in segs],
      [s.count * s.size for s in segs], n)


@_registry.method(
    gap=(
      "one global top-k of all devices' k each: a step sends 1/n of what "
      "top-k sends, a longer delay"),
    paper="Shi et al. 2019",
    summary="global top-k by recursive doubling, O(k log n)",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def gtopk(ratio: float, *, granularity: str = "leaf", axis_name="data",
          error_feedback: bool = True, policy=None, seed: int = 0,
          **options):
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
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), a ``granularity`` other than ``"leaf"`` or
      ``"model"``, or an ``axis_name``, ``error_feedback``, ``policy`` or
      option that :func:`jaxcomm.compressed` refuses. The update raises
      one on a number of devices that is not a power of two.

  Examples:
    ``k = 2`` of 8 values: device ``d`` (0 to 7) has ``d + 1`` at
    coordinate ``d`` and ``0.5`` at ``d + 1`` (mod 8), so the local
    selections cover every coordinate, where :func:`jaxcomm.topk`'s
    update would have 8 nonzeros. The merges keep 2 in all; what a device
    selected that did not reach the sum stays in its residual, so the
    gradient mass is conserved:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.gtopk(0.25, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> d = np.arange(8)
    >>> grads = np.zeros((8, 8))
    >>> grads[d, d], grads[d, (d + 1) % 8] = d + 1.0, 0.5
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> update, residual = np.asarray(update), np.asarray(residual)
    >>> print(update.round(3))
    [0.    0.    0.    0.    0.    0.    0.875 1.062]
    >>> print(np.allclose(8 * update + residual.sum(0), grads.sum(0)))
    True

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.gtopk(0.001), optax.sgd(0.1))

  References:
    Shi et al, `A Distributed Synchronous SGD Algorithm with Global Top-k
    Sparsification for Low Bandwidth Networks
    <https://arxiv.org/abs/1901.04359>`_, 2019.
  """
  return _compressor.compressed(
    _checked_codec(GtopkCodec, ratio, granularity), axis_name=axis_name,
    error_feedback=error_feedback, policy=policy, seed=seed, **options)


# ----------------------------------------------------------------- CSC ----

def csc_num_chunks(ratio: float, size: int, chunk_size: int) -> int:
  """Chunks exchanged: ``max(1, ceil(ratio * ceil(size / chunk_size)))``."""
  return num_selected(ratio, -(-size // chunk_size))


@dataclasses.dataclass(frozen=True)
class CscCodec(_codec.CodecBase):
  """CSC: the bucket cut into chunks, chunk L1 norms summed over devices,
  the chunks of largest summed norm summed (no index, no all-gather).

  Attributes:
    chunk_size: elements per chunk (>= 1; the last one zero-padded).
    ratio: fraction of chunks exchanged, in ``(0, 1]``.
  """

  chunk_size: int
  ratio: float

  @property
  def name(self):
    return f"csc({self.chunk_size}, {self.ratio})"

  def apply(self, x, state, ctx):
    m = csc_num_chunks(self.ratio, x.shape[0], self.chunk_size)
    total, chosen = _sparse.chunk_psum(x, self.chunk_size, m, ctx.axis_name)
    sent = jnp.where(chosen, x, 0.0)
    return _codec.CodecResult(mean=total / ctx.num_devices, sent=sent,
                              state=state)

  def wire(self, layout, n):
    del n
    return _sparse.chunk_psum_wire(
      layout.size, self.chunk_size,
      csc_num_chunks(self.ratio, layout.size, self.chunk_size))


@_registry.method(
    gap=(
      "1% of 64-element chunks by summed |g|: coarser than top-k at the "
      "same ratio, more of the gradient waits"),
    paper="Sun et al. 2019 (GradientFlow)",
    summary="top chunks by allreduced L1 norm, traffic independent of n",
    defaults={"chunk_size": 64, "ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def csc(chunk_size: int, ratio: float, *, axis_name="data",
        error_feedback: bool = True, policy=None, seed: int = 0,
        **options):
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
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the chunk selection is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``chunk_size`` that is not an
      int ``>= 1``, a ``ratio`` outside ``(0, 1]`` (or traced), or an
      ``axis_name``, ``error_feedback``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses.

  Examples:
    Chunks of 2 values, one of the 4 exchanged: device ``i`` (1 to 8) has
    ``i`` in the first chunk and ``3, 3`` in the last. The summed L1 norms
    (36 against 48) pick the last chunk on every device, though device 8's
    own first chunk is the larger there; its values arrive as their exact
    mean:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.csc(2, 0.25, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> grads = np.zeros((8, 8))
    >>> grads[:, 0], grads[:, 6:] = np.arange(1.0, 9.0), 3.0
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(update).round(3))
    [0. 0. 0. 0. 0. 0. 3. 3.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.csc(chunk_size=1024, ratio=0.01),
    ...                   optax.sgd(0.1))

  References:
    Sun et al, `Optimizing Network Performance for Distributed DNN Training
    on GPU Clusters: ImageNet/AlexNet Training in 1.5 Minutes
    <https://arxiv.org/abs/1902.06855>`_, 2019.
  """
  chunk_size = _checks.integer("chunk_size", chunk_size, 1)
  ratio = _checks.ratio("ratio", ratio)
  return _compressor.compressed(CscCodec(chunk_size, ratio),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = [
  "csc",
  "gtopk",
]
