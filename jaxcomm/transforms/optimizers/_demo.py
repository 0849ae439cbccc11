"""DeMo, Decoupled Momentum Optimization (Peng, Quesnelle & Kingma 2024).

Each device keeps its own momentum and never synchronizes it. Every step it
adds its gradient to the decayed momentum, takes the momentum's fast
components (the largest DCT-II coefficients of each tile), removes them
from the momentum and sends only them; the update is the sign of the
devices' averaged fast components::

  m_i = beta m_i + g_i
  c_i = topk_per_tile(DCT(m_i))          (index, value) pairs per tile
  m_i = m_i - IDCT(c_i)
  Q   = IDCT(mean_i c_i)                 one all-gather of every c_i
  x   = x - lr (sign(Q) + lambda x)

This is error feedback with a decayed residual (``x = beta e + g``, ``e' =
x - sent``) around a DCT top-k codec, so the optimizer is one
:func:`jaxcomm.compressed` transform (the momentum is its per-device
residual: leaf policy, buckets, non-finite agreement, wire claims, orbax
and ``parallel.resize_state`` as for every compressor) followed by the sign
step.

The tiles: a leaf is the matrix ``(prod(shape[:-1]), shape[-1])`` (a
vector is one row) cut into ``h x w`` tiles, ``h`` (``w``) the largest
divisor of the row (column) count not above ``compression_chunk``, as the
reference implementation chooses them per dimension; each tile's 2-D
orthonormal DCT-II is two matmuls with DCT matrices computed in numpy at
trace time, one batched einsum per group of equal shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _policy
from jaxcomm import _registry
from jaxcomm import _stages
from jaxcomm.collectives import _core
from jaxcomm.collectives import _sparse

_HIGHEST = jax.lax.Precision.HIGHEST


@functools.lru_cache(maxsize=None)
def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II matrix ``D`` (``c = D x``, ``x = D^T c``):
  ``D[k, j] = s_k cos(pi (2 j + 1) k / (2 n))``, ``s_0 = sqrt(1 / n)``,
  ``s_k = sqrt(2 / n)``. Float64, read-only."""
  k = np.arange(n, dtype=np.float64)[:, None]
  j = np.arange(n, dtype=np.float64)[None, :]
  d = np.cos(np.pi * (2.0 * j + 1.0) * k / (2.0 * n)) * math.sqrt(2.0 / n)
  d[0] *= math.sqrt(0.5)
  d.setflags(write=False)
  return d


def _tile_side(size: int, chunk: int) -> int:
  """The largest divisor of ``size`` not above ``chunk``."""
  return max(d for d in range(1, min(size, chunk) + 1) if size % d == 0)


def _matrix(shape) -> tuple[int, int]:
  if len(shape) <= 1:
    return 1, int(np.prod(shape, dtype=np.int64))
  return int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])


def tiles(shape, chunk: int) -> tuple[int, int, int, int]:
  """``(rows, cols, h, w)``: a leaf of ``shape`` as a matrix and its tile."""
  r, c = _matrix(tuple(shape))
  return r, c, _tile_side(r, chunk), _tile_side(c, chunk)


class _Plan(NamedTuple):
  """Static per-bucket layout of the coefficients and the message."""

  groups: tuple        # per group: (offset, count, rows, cols, h, w)
  capacity: int        # pairs per message
  bound: int           # largest tile (indices are in [0, bound))
  base: np.ndarray     # per slot: the flat coefficient index of its tile


def _plan(layout, topk: int, chunk: int) -> _Plan:
  groups, base = [], []
  for g in layout.groups:
    r, c, h, w = tiles(g.shape, chunk)
    groups.append((g.offset, g.count, r, c, h, w))
    num = g.count * (r // h) * (c // w)
    # Coefficients lie tile by tile ([count, r/h, c/w, h, w]) at the
    # group's offset; slot j of tile t belongs to tile t.
    base.append(np.repeat(g.offset + np.arange(num) * (h * w), topk))
  bound = max((h * w for *_, h, w in groups), default=1)
  base = (np.concatenate(base) if base else np.zeros(0)).astype(np.int32)
  return _Plan(tuple(groups), int(base.size), bound, base)


def _forward(x, groups):
  """Per group, the ``[tiles, h * w]`` DCT coefficients of the bucket."""
  out = []
  for off, count, r, c, h, w in groups:
    v = x[off:off + count * r * c].reshape(count, r // h, h, c // w, w)
    coef = jnp.einsum("gyhxw,ah,bw->gyxab", v,
                      jnp.asarray(dct_matrix(h), jnp.float32),
                      jnp.asarray(dct_matrix(w), jnp.float32),
                      precision=_HIGHEST)
    out.append(coef.reshape(-1, h * w))
  return out


def _inverse(coef, groups):
  """The flat coefficient buffer (tile by tile) back to the bucket."""
  out = []
  for off, count, r, c, h, w in groups:
    v = coef[off:off + count * r * c].reshape(count, r // h, c // w, h, w)
    x = jnp.einsum("gyxab,ah,bw->gyhxw", v,
                   jnp.asarray(dct_matrix(h), jnp.float32),
                   jnp.asarray(dct_matrix(w), jnp.float32),
                   precision=_HIGHEST)
    out.append(x.reshape(-1))
  return out[0] if len(out) == 1 else jnp.concatenate(out)


@dataclasses.dataclass(frozen=True)
class DemoCodec(_codec.CodecBase):
  """The top-``topk`` DCT coefficients of every tile, all-gathered.

  Attributes:
    topk: coefficients sent per tile.
    chunk: the largest tile side (:func:`tiles`).
  """

  topk: int
  chunk: int
  name = "demo"

  def accepts(self, shape):
    _, _, h, w = tiles(shape, self.chunk)
    # A tile of at most topk coefficients would travel whole (DeMo then
    # extracts everything: the update is the exact mean), and its indices
    # would cost more than the dense psum: such a leaf goes dense.
    return int(np.prod(shape, dtype=np.int64)) > 0 and h * w > self.topk

  def apply(self, x, state, ctx):
    topk = self.topk
    plan = _plan(ctx.layout, topk, self.chunk)
    # x is the decayed momentum plus the gradient: computed once into its
    # own buffer, not fused into each consumer as transposed copies of both.
    x = _compressor._materialized(x, ctx.step)
    vals, idx = [], []
    for coef in _forward(x, plan.groups):
      _, i = jax.lax.top_k(jnp.abs(coef), topk)   # ties: lower index first
      vals.append(jnp.take_along_axis(coef, i, axis=-1).reshape(-1))
      idx.append(i.reshape(-1))
    vals = vals[0] if len(vals) == 1 else jnp.concatenate(vals)
    idx = idx[0] if len(idx) == 1 else jnp.concatenate(idx)
    base = jnp.asarray(plan.base)
    size = ctx.layout.size
    words = _core.all_gather(_sparse.pack_pairs(vals, idx, plan.bound),
                             ctx.axis_name)
    all_vals, all_idx = _sparse.unpack_pairs(words, plan.capacity,
                                             plan.bound)
    all_idx = (base + all_idx).reshape(-1)
    total = _core.zeros_after(size, all_idx).at[all_idx].add(
      all_vals.reshape(-1))
    own = _core.zeros_after(size, idx).at[base + idx].add(vals)
    mean = _inverse(total / ctx.num_devices, plan.groups)
    sent = _inverse(own, plan.groups)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    plan = _plan(layout, self.topk, self.chunk)
    return _sparse.sparse_psum_wire(plan.capacity, plan.bound, n)


class DeMoState(NamedTuple):
  """State of :func:`demo`.

  Attributes:
    exchange: the :class:`jaxcomm.CompressState` of the exchange; its
      ``residual`` is each device's own momentum ``m_i`` (flat per bucket,
      per device, never synchronized), its ``count`` the step.
  """

  exchange: _compressor.CompressState


@_registry.method(
    paper="Peng et al. 2024 (DeMo)",
    summary=(
      "each device's momentum stays local; the top-k DCT-II coefficients "
      "of each tile of it are removed from it and all-gathered as (index, "
      "value) pairs; the step is the sign of their mean's inverse DCT"),
    defaults={"learning_rate": 1e-3})
def demo(
  learning_rate: float | Callable[[jax.Array], jax.Array],
  *,
  compression_decay: float = 0.999,
  compression_topk: int | None = None,
  compression_chunk: int | None = None,
  sign: bool = True,
  weight_decay: float = 0.0,
  axis_name="data",
  policy=None,
) -> optax.GradientTransformationExtraArgs:
  """DeMo (Peng et al. 2024): local momenta, fast DCT parts, a sign step.

  Each device ``i`` keeps its own momentum ``m_i``; only its fast
  components (its largest DCT coefficients) are exchanged, and the step
  is a sign step. Per step, per leaf cut into tiles:

  .. math::
    m_i \\leftarrow \\beta m_i + g_i, \\quad
    c_i = \\operatorname{topk}(\\operatorname{DCT}(m_i)), \\quad
    m_i \\leftarrow m_i - \\operatorname{DCT}^{-1}(c_i),

  .. math::
    Q = \\operatorname{DCT}^{-1}\\Big(\\frac{1}{n}\\sum_i c_i\\Big), \\quad
    x \\leftarrow x - \\eta_t (\\operatorname{sign}(Q) + \\lambda x)

  (``topk``: the ``compression_topk`` coefficients of largest magnitude
  in each tile, ties to the lower index). A leaf ``(d_1, ..., d_k, c)`` is
  the matrix ``(d_1 ... d_k, c)`` (a vector one row) cut into ``h x w``
  tiles, ``h`` and ``w`` the largest divisors of its dimensions not above
  ``compression_chunk``; the DCT is the tile's orthonormal 2-D DCT-II.
  What travels is one all-gather of every device's ``(index, value)``
  pairs: ``compression_topk`` per tile, values in float32, indices within
  the tile in the smallest unsigned type (uint16 for 64 x 64 tiles),
  packed into uint32 words; ``n`` times the message per device. A
  dimension without a divisor near ``compression_chunk`` gets thin tiles:
  the char-LSTM's ``(96, 103)`` head (a prime vocabulary) is cut into 48 x
  1 tiles of which 32 coefficients travel, more bytes than its dense psum;
  keep such a leaf dense with a :class:`jaxcomm.LeafPolicy` mask.

  Departures from the paper's reference implementation, stated:

  * the coefficients are averaged over all ``n`` devices (``sum / n``);
    the reference's ``scatter_reduce(mean, include_self=False)`` averages
    each coefficient over the devices that sent it;
  * the momentum is kept in gradient units (the reference accumulates
    ``lr g``): with a constant rate the steps are the same, and with a
    schedule the momentum is rescaled by ``lr_{t-1} / lr_t`` each step,
    which makes them the same too; with ``sign=False`` the step is
    ``-lr Q`` in gradient units;
  * leaves of more than two dimensions are tiled as the matrix above (the
    reference takes the first two dimensions); leaves the policy keeps
    dense (below ``policy.min_size``, 256 elements by default) and leaves
    whose tiles hold at most ``compression_topk`` coefficients travel in
    the fused dense psum: that is DeMo extracting every coefficient (the
    momentum is emptied each step and the update is the exact mean
    gradient's sign), at fewer bytes.

  Args:
    learning_rate: a number or an optax schedule of the step.
    compression_decay: the momentum's decay ``beta``, in ``[0, 1)``.
    compression_topk: coefficients sent per tile (static; default 32);
      fewer than the largest tile, ``compression_chunk ** 2``.
    compression_chunk: the largest tile side (static; default 64), at
      least 2.
    sign: step by the sign of the exchanged components (the paper's
      signSGD step); False: by the components themselves.
    weight_decay: decoupled weight decay ``lambda`` (needs ``params``).
    axis_name: the data axis (a name, a tuple of names, or None).
    policy: a :class:`jaxcomm.LeafPolicy`: small leaves travel in the
      fused dense psum, exactly.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DeMoState`.

  Raises:
    ValueError: naming the argument, when ``learning_rate`` (a number) or
      ``weight_decay`` is negative or not finite, ``compression_decay`` is
      not in ``[0, 1)``, ``compression_chunk`` is not an int >= 2,
      ``compression_topk`` not an int >= 1 below ``compression_chunk **
      2``, ``sign`` not a bool, or ``policy`` / ``axis_name`` is invalid.
      The update raises a ValueError for a complex gradient leaf, for
      ``weight_decay`` without ``params``, for a state that is not a
      :class:`DeMoState`, and outside a context that binds ``axis_name``.

  Examples:
    The whole optimizer (it replaces ``optax.adamw``; no mean first):

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> tx = jaxcomm.demo(1e-3)

    One step on 8 devices, a 16 x 16 leaf cut into 4 x 4 tiles, one
    coefficient per tile sent. Device ``i`` (1 to 8) has the gradient
    ``i * slow + fast``: ``slow`` is constant on each tile (its DCT is the
    tile's first coefficient, the one sent) and ``fast`` alternates along
    the rows (it has no such coefficient). The step is ``-lr`` times the
    sign of the mean slow part, tile by tile, and ``fast`` (norm
    ``0.1 * 16``) stays in every device's momentum:

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()           # 8 devices on "data"
    >>> tx = jaxcomm.demo(0.01, compression_chunk=4, compression_topk=1)
    >>> signs = jnp.array([[1.0, -1, 1, 1], [-1, 1, 1, -1],
    ...                    [1, 1, -1, 1], [-1, -1, 1, 1]])
    >>> slow = jnp.kron(signs, jnp.ones((4, 4)))      # one sign per tile
    >>> fast = 0.1 * jnp.tile(jnp.array([[1.0], [-1.0]]), (8, 16))
    >>> grads = jnp.arange(1.0, 9.0)[:, None, None] * slow + fast
    >>> def step(g):
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.exchange.residual[0][None]
    >>> update, momentum = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(update[::4, ::4]).round(3))  # one value per tile
    [[-0.01  0.01 -0.01 -0.01]
     [ 0.01 -0.01 -0.01  0.01]
     [-0.01 -0.01  0.01 -0.01]
     [ 0.01  0.01 -0.01 -0.01]]
    >>> print(np.abs(update - (-0.01 * slow)).max() < 1e-7)
    True
    >>> print(np.linalg.norm(momentum, axis=1).round(3))
    [1.6 1.6 1.6 1.6 1.6 1.6 1.6 1.6]

  References:
    Peng, Quesnelle & Kingma, `DeMo: Decoupled Momentum Optimization
    <https://arxiv.org/abs/2411.19870>`_, 2024.
  """
  name = "demo"
  if not callable(learning_rate):
    _checks.number("learning_rate", learning_rate, 0.0, None, finite=True)
  _checks.decay("compression_decay", compression_decay, name)
  # Static arguments default to None: optax.inject_hyperparams then keeps
  # them out of the traced hyperparameters unless the caller passes them.
  chunk = _checks.integer("compression_chunk", 64 if compression_chunk is None
                          else compression_chunk, 2)
  topk = _checks.integer("compression_topk", 32 if compression_topk is None
                         else compression_topk, 1)
  if topk >= chunk * chunk:
    raise ValueError(
      f"{name}: compression_topk ({topk}) must be below the largest tile's "
      f"{chunk * chunk} coefficients (compression_chunk={chunk}): every "
      "tile would travel whole")
  _checks.boolean("sign", sign)
  _checks.number("weight_decay", weight_decay, 0.0, None, finite=True)
  ex = _compressor.compressed(
    DemoCodec(topk, chunk), axis_name=axis_name, error_feedback=True,
    residual_decay=compression_decay, policy=policy,
    lr_schedule=learning_rate if callable(learning_rate) else None)
  no_decay = isinstance(weight_decay, (int, float)) and weight_decay == 0

  def init_fn(params):
    return DeMoState(exchange=ex.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    _checks.state_type(name, state, DeMoState, "optimizer")
    for path, x in jax.tree_util.tree_leaves_with_path(updates):
      if _policy.is_complex(x):
        raise ValueError(
          f"{name}: gradient leaf {jax.tree_util.keystr(path)} is complex; "
          "complex parameters are not supported")
    if params is None and not no_decay:
      raise ValueError(f"{name}: weight_decay needs params: call "
                       "tx.update(grads, state, params)")
    q, ex_state = ex.update(updates, state.exchange, params)
    count = state.exchange.count
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    lr = jnp.asarray(lr, jnp.float32)

    def step(u, p):
      if not _policy.is_float(u):
        return u
      d = jnp.sign(u) if sign else u
      d = d.astype(jnp.float32)
      if not no_decay:
        d = d + weight_decay * p.astype(jnp.float32)
      return (-lr * d).astype(u.dtype)

    out = jax.tree.map(step, q, q if params is None else params)
    # The step is cast to the gradients' dtypes above: one that overflows a
    # float16 or bfloat16 leaf (a large learning rate, or weight decay on a
    # large param) is skipped and counted like a non-finite gradient.
    narrow = [(d, s) for d, s in zip(jax.tree.leaves(q),
                                     jax.tree.leaves(out))
              if _policy.is_float(d) and jnp.finfo(d.dtype).bits < 32]
    if narrow:
      peaks = jnp.stack([_stages.peak(jnp.ravel(s).astype(jnp.float32))
                         for _, s in narrow])
      over = _compressor.narrow_overflow(axis_name, peaks,
                                         [d.dtype for d, _ in narrow])
      ex_state = _compressor.skip_step(ex_state, state.exchange, over)
      out = jax.tree.map(
        lambda x: jnp.where(over, jnp.nan, x).astype(x.dtype)
        if _policy.is_float(x) else x, out)
    return out, DeMoState(exchange=ex_state)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, _compressor.spec_of(ex)), update_fn)


__all__ = ["demo", "DeMoState"]
