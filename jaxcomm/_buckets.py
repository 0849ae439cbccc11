"""Buckets: the compressed leaves of a step laid out as a few flat buffers.

A compressor never loops over leaves in traced code. :func:`plan` lays the
compressed leaves (their shapes are static) into flat float32 buffers,
*buckets*, and a codec runs once per bucket. Inside a bucket, leaves of equal
shape sit next to each other, so each run of equal shapes (a *group*) is one
contiguous slice that reshapes for free to ``[G, *shape]``: per-leaf
semantics (a per-leaf scale, a per-leaf k, a per-leaf matrix) become one
batched op per group, and the program grows with the number of distinct
shapes, not with the number of leaves (a transformer's 24 identical layers
are one group per parameter kind).

Buckets are capped in bytes (``LeafPolicy(bucket_bytes=...)``, like DDP's
``bucket_cap_mb``); a leaf larger than the cap has a bucket of its own, and
no leaf is ever split. ``bucket_bytes=None`` (the default) puts every
compressed leaf in one bucket.

Everything here is static Python (shapes, offsets) except the array helpers
of :class:`Layout`, which issue one op per group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm import _prefix
from jaxcomm import _rows

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Group:
  """A run of equal-shape leaves, contiguous in its bucket.

  Attributes:
    shape: the leaves' shape.
    count: how many leaves (``G``).
    first: index of the group's first segment in the bucket.
    offset: element offset of the group in the bucket.
    leaves: for each leaf of the group, its index among all compressed
      leaves in ``jax.tree.leaves`` order (use it to derive per-leaf keys).
  """

  shape: Shape
  count: int
  first: int
  offset: int
  leaves: tuple[int, ...]

  @property
  def leaf_size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def size(self) -> int:
    return self.count * self.leaf_size


# A bucket's buffers in a compressor's state are stored in whole tiles of
# the TPU's 1-D layout (where that pads at most 1/64: long buckets). A
# state row (``[1, N]``: per device, or per model shard, inside shard_map)
# reads as the flat ``[N]`` for free only then;
# otherwise the compiler copies it (the row's tiles of 128 and the 1-D
# tiles of 1,024 pad differently), a gradient-sized buffer per field:
# MXFP4 + EF sharded on two v5e slices held 1.51x the plain step's memory
# per chip with ``[N]`` rows, 1.11x with whole tiles.
STORED_TILE = 1024


def stored_length(size: int) -> int:
  """Length of a state buffer for ``size`` values: ``size`` rounded up to
  whole 1-D TPU tiles (:data:`STORED_TILE`) where that pads at most 1/64 of
  it (as ``collectives._core.chunk_length`` aligns chunks), else ``size``.
  A per-device row ``[1, N]`` is read as ``[N]`` through a copy on TPU
  when ``N`` is not whole tiles (the comment above)."""
  whole = -(-int(size) // STORED_TILE) * STORED_TILE
  return whole if (whole - size) * 64 <= size else int(size)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static layout of one bucket.

  Attributes:
    leaves: per segment (bucket order), the leaf's index among all
      compressed leaves in ``jax.tree.leaves`` order.
    shapes: per segment, the leaf's shape.
    groups: runs of equal shapes (see :class:`Group`).
    splits: inside a sharded step (``parallel.update_on_shards``), per
      segment how the whole leaf is split into the blocks the bucket holds:
      ``((dim, axes, size), ...)`` for each split dimension of the leaf
      (``axes`` the mesh axes, ``size`` the devices along them), ``()``
      for a whole leaf; None outside a sharded step. Codecs that work on
      blocks ignore it; one that can exchange whole leaves (PowerSGD's
      ``sharded="whole"``) reads it.
  """

  leaves: tuple[int, ...]
  shapes: tuple[Shape, ...]
  groups: tuple[Group, ...]
  splits: tuple | None = None

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

  @property
  def offsets(self) -> tuple[int, ...]:
    return tuple(int(o) for o in np.cumsum((0,) + self.sizes)[:-1])

  @property
  def size(self) -> int:
    return int(sum(self.sizes))

  @property
  def stored_size(self) -> int:
    """Length of the bucket's buffers in a compressor's state (residual,
    momentum, estimates, a chunk owner's server error):
    :func:`stored_length` of :attr:`size`; the tail is zeros."""
    return stored_length(self.size)

  @property
  def num_segments(self) -> int:
    return len(self.shapes)

  # -------------------------------------------------- array helpers ----

  def views(self, flat: jax.Array) -> list[jax.Array]:
    """Per group, the ``[G, leaf_size]`` view of ``flat`` (free reshapes).

    ``flat`` may carry leading batch axes: ``[..., size]`` gives
    ``[..., G, leaf_size]`` views.
    """
    lead = flat.shape[:-1]
    return [flat[..., g.offset:g.offset + g.size].reshape(
      lead + (g.count, g.leaf_size)) for g in self.groups]

  def matrices(self, flat: jax.Array, as_matrix: Callable[[Shape], Shape]
               ) -> list[jax.Array]:
    """Per group, ``[G, n, m]`` with ``(n, m) = as_matrix(shape)``."""
    return [v.reshape((g.count,) + tuple(as_matrix(g.shape)))
            for v, g in zip(self.views(flat), self.groups)]

  def join(self, parts: Sequence[jax.Array]) -> jax.Array:
    """Inverse of :meth:`views`: per-group arrays back into one buffer."""
    flats = [jnp.reshape(p, p.shape[:-2] + (-1,)) if p.ndim >= 2 else p
             for p in parts]
    return flats[0] if len(flats) == 1 else jnp.concatenate(flats, axis=-1)

  def join_any(self, parts: Sequence[jax.Array]) -> jax.Array:
    """Per-group arrays of any trailing shape ``[G, ...]`` -> flat."""
    flats = [jnp.ravel(p) for p in parts]
    return flats[0] if len(flats) == 1 else jnp.concatenate(flats)

  def reduce(self, fn: Callable[[jax.Array], jax.Array], flat: jax.Array,
             *, pad=None) -> jax.Array:
    """Per-segment reduction: ``fn([G, leaf_size]) -> [G]`` on each group,
    concatenated to ``[num_segments]`` in bucket order.

    ``pad``: a value that leaves ``fn``'s result unchanged when appended
    to a row (0 for a max or a sum of magnitudes); short leaves of similar
    sizes are then reduced together as rows of one batch padded with it
    (:mod:`jaxcomm._rows`), one op per batch instead of one per shape.
    """
    runs = [(g.offset, g.count, g.leaf_size) for g in self.groups]
    batches, alone = (((), range(len(runs))) if pad is None
                      else _rows.plan(runs))
    parts = [None] * len(runs)
    for b in batches:
      rows = b.gather(flat, pad, slices=True)    # fused into fn's reduction
      for (i, _, _, _), r in zip(b.members, b.split(fn(rows))):
        parts[i] = r
    views = self.views(flat)
    for i in alone:
      parts[i] = fn(views[i])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  def broadcast(self, per_segment: jax.Array) -> jax.Array:
    """``[num_segments]`` values -> ``[size]`` (each segment's value repeated
    over its elements). Short leaves of similar sizes are broadcast as rows
    of one batch (:mod:`jaxcomm._rows`)."""
    runs = [(g.offset, g.count, g.leaf_size) for g in self.groups]
    batches, alone = _rows.plan(runs)
    parts = [None] * len(runs)
    for b in batches:
      rows = jnp.concatenate([
        per_segment[self.groups[i].first:self.groups[i].first + count]
        for i, _, count, _ in b.members])
      wide = jnp.broadcast_to(rows[:, None], (b.rows, b.width))
      for (i, _, _, _), flat in zip(b.members, b.unpad(wide)):
        parts[i] = flat
    for i in alone:
      g = self.groups[i]
      v = per_segment[g.first:g.first + g.count]
      parts[i] = jnp.broadcast_to(v[:, None], (g.count, g.leaf_size)
                                  ).reshape(-1)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  def split(self, flat: jax.Array) -> list[jax.Array]:
    """The bucket's leaves, in bucket order, in their shapes.

    ``flat`` may carry leading axes: ``[..., size]`` -> ``[..., *shape]``.
    """
    lead = flat.shape[:-1]
    return [flat[..., o:o + s].reshape(lead + tuple(shape))
            for o, s, shape in zip(self.offsets, self.sizes, self.shapes)]


def runs(sizes: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
  """Runs of consecutive equal sizes in a flat concatenation.

  Returns ``(offset, count, size)`` per run: elements ``[offset, offset +
  count * size)`` reshape for free to ``[count, size]``, so a per-segment
  operation is one batched op per run (a bucket's equal shapes sit side by
  side, so a bucket has at most one run per group).
  """
  out, offset = [], 0
  for s in (int(s) for s in sizes):
    if out and out[-1][2] == s:
      o, c, _ = out[-1]
      out[-1] = (o, c + 1, s)
    else:
      out.append((offset, 1, s))
    offset += s
  return tuple(out)


def unflatten(flat: jax.Array, shapes: Sequence[Shape]) -> list[jax.Array]:
  """Inverse of :func:`flatten`: consecutive pieces of ``flat`` in
  ``shapes`` (a :class:`Layout`'s ``split`` without the layout)."""
  out, offset = [], 0
  for shape in shapes:
    size = int(np.prod(shape, dtype=np.int64))
    out.append(flat[offset:offset + size].reshape(tuple(shape)))
    offset += size
  return out


def flatten(leaves: Sequence[jax.Array], dtype=jnp.float32) -> jax.Array:
  """Leaves (in bucket order) into one flat buffer of ``dtype``."""
  flats = [jnp.ravel(x).astype(dtype) for x in leaves]
  if not flats:
    return jnp.zeros((0,), dtype)
  return flats[0] if len(flats) == 1 else jnp.concatenate(flats)


def _is_complex(x) -> bool:
  return bool(jnp.issubdtype(x.dtype, jnp.complexfloating))


def real_shape(x) -> Shape:
  """``x``'s shape as real values: complex leaves gain a trailing 2."""
  return tuple(x.shape) + ((2,) if _is_complex(x) else ())


def flatten_real(leaves: Sequence[jax.Array], dtype=jnp.float32
                 ) -> jax.Array:
  """:func:`flatten`, with complex leaves as interleaved (real, imaginary)
  pairs, so that averaging or mixing the buffer keeps imaginary parts."""
  return flatten([jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
                  if _is_complex(x) else x for x in leaves], dtype)


def unflatten_like(flat: jax.Array, leaves: Sequence[jax.Array]) -> list:
  """Inverse of :func:`flatten_real`: each piece in its leaf's shape and
  dtype (complex leaves rebuilt from their pairs)."""
  out = []
  for piece, x in zip(unflatten(flat, [real_shape(x) for x in leaves]),
                      leaves):
    if _is_complex(x):
      piece = jax.lax.complex(piece[..., 0], piece[..., 1])
    out.append(piece.astype(x.dtype))
  return out


def plan(shapes: Sequence[Shape], bucket_bytes: int | None = None,
         itemsize: int = 4) -> tuple[Layout, ...]:
  """Lays compressed leaves of these shapes (tree order) into buckets.

  Equal shapes are grouped, groups ordered by their first leaf; buckets are
  filled in that order up to ``bucket_bytes`` (``None``: one bucket),
  splitting between leaves only.

  Returns:
    One :class:`Layout` per bucket (empty tuple for no leaves).
  """
  shapes = [tuple(int(d) for d in s) for s in shapes]
  if not shapes:
    return ()
  order: list[Shape] = []
  members: dict[Shape, list[int]] = {}
  for j, s in enumerate(shapes):
    if s not in members:
      members[s] = []
      order.append(s)
    members[s].append(j)
  seq = [(s, j) for s in order for j in members[s]]
  cap = None if bucket_bytes is None else int(bucket_bytes)
  buckets: list[list[tuple[Shape, int]]] = [[]]
  used = 0
  for s, j in seq:
    nbytes = int(np.prod(s, dtype=np.int64)) * itemsize
    if cap is not None and buckets[-1] and used + nbytes > cap:
      buckets.append([])
      used = 0
    buckets[-1].append((s, j))
    used += nbytes
  return tuple(_layout(b) for b in buckets)


def _layout(items: list[tuple[Shape, int]]) -> Layout:
  groups, offset = [], 0
  i = 0
  while i < len(items):
    s = items[i][0]
    k = i
    while k < len(items) and items[k][0] == s:
      k += 1
    g = Group(shape=s, count=k - i, first=i, offset=offset,
              leaves=tuple(j for _, j in items[i:k]))
    groups.append(g)
    offset += g.size
    i = k
  return Layout(leaves=tuple(j for _, j in items),
                shapes=tuple(s for s, _ in items), groups=tuple(groups))


def check_bucket_bytes(value) -> int | None:
  return _checks.integer("bucket_bytes", value, 1, allow_none=True)


# Widest block :func:`leaf_blocks` uses, and the narrowest worth it (below
# it, per-run ops are cheaper than a reduction over that many blocks).
LEAF_BLOCK_MAX = 4096
LEAF_BLOCK_MIN = 32


def leaf_blocks(sizes: Sequence[int]) -> int | None:
  """The block width ``B`` that tiles every leaf of a flat concatenation:
  the largest divisor of ``gcd(sizes)`` up to :data:`LEAF_BLOCK_MAX`, or
  None when it is under :data:`LEAF_BLOCK_MIN`.

  With it, per-leaf reductions and broadcasts run on the ``[L / B, B]``
  view of the whole bucket (a free reshape): one reduction per block, the
  blocks' partials combined per leaf (a sorted segment reduction of
  ``L / B`` values) and the per-leaf result read back per block. The
  program then has the same ops for any number of leaves and sizes.
  """
  g = 0
  for s in sizes:
    g = math.gcd(g, int(s))
  if g == 0:
    return None
  best = max(d for d in range(1, min(g, LEAF_BLOCK_MAX) + 1) if g % d == 0)
  return best if best >= LEAF_BLOCK_MIN else None


def block_leaf_ids(sizes: Sequence[int], block: int) -> jax.Array:
  """``int32[L / block]``: the leaf of each block (see :func:`leaf_blocks`),
  a cumulative sum of leaf starts built at run time (as
  ``kernels.topk.segment_ids``, so that XLA does not fold an ``L / block``
  constant)."""
  counts = [int(s) // block for s in sizes]
  total = sum(counts)
  starts = np.cumsum([0] + counts)[1:-1]
  zeros = jax.lax.optimization_barrier(jnp.zeros((total,), jnp.int32))
  marks = zeros.at[jnp.asarray(starts, jnp.int32)].add(1, mode="drop")
  return _prefix.prefix_sum(marks, jnp.int32)
