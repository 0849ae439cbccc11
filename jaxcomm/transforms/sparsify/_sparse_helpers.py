"""What the sparsifiers share (:mod:`._sparsification`'s top-k, random-k
and threshold; DGC, gTop-k, CSC, ScaleCom, SIDCo): the k-of-n factories'
checks, ``k`` per segment, a bucket's segments and leaf rows, per-row PRNG
keys, each segment's local top-k and the sparse psum of selected pairs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _checks
from jaxcomm.collectives import _core
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import topk as _topk

_GRANULARITIES = ("leaf", "model")


def _checked_codec(make_codec, ratio, granularity, *args):
  """``make_codec(ratio, granularity, *args)`` after the checks every
  k-of-n factory shares (``ratio`` in ``(0, 1]``, a known granularity)."""
  ratio = _checks.ratio("ratio", ratio)
  _checks.choice("granularity", granularity, _GRANULARITIES)
  return make_codec(ratio, granularity, *args)


# ------------------------------------------------------------- helpers ----

def num_selected(ratio: float, size: int) -> int:
  """``k = max(1, ceil(ratio * size))``, at most ``size``.

  A relative slack of 1e-9 keeps ``0.1 * 30`` at 3 (not 4).
  """
  return max(1, min(size, math.ceil(ratio * size * (1 - 1e-9))))


class _Segs(NamedTuple):
  """Equal-length segments side by side in a bucket, one per row of a
  ``[count, size]`` view: one batched selection for all of them.

  Attributes:
    offset: element offset of the first segment in the bucket.
    count: how many segments (rows).
    size: elements per segment.
    ids: per row, the id its PRNG key is folded with (the leaf's index
      among the compressed leaves, in ``jax.tree.leaves`` order).
  """

  offset: int
  count: int
  size: int
  ids: tuple[int, ...]


def _segments(layout, granularity: str = "leaf") -> list[_Segs]:
  """The bucket's segments: one group of rows per shape (``"leaf"``), or
  the whole bucket as one segment (``"model"``)."""
  if granularity == "model":
    return [_Segs(0, 1, layout.size, (min(layout.leaves),))]
  return [_Segs(g.offset, g.count, g.leaf_size, tuple(g.leaves))
          for g in layout.groups]


def _check_selects_one(name):
  """``check_layouts`` of top-k and random-k: refuses a ratio keeping
  fewer than one element of every segment (leaf, or bucket with
  ``granularity="model"``), which the floor ``k = 1`` would hide."""
  def check(self, layouts):
    if self.granularity == "model":
      sizes, unit = [lay.size for lay in layouts], "bucket"
    else:
      sizes, unit = [s for lay in layouts for s in lay.sizes], "leaf"
    _checks.selects_one("ratio", self.ratio, sizes, name, unit)
  return check


def _num_pairs(segs, ratio) -> int:
  return sum(s.count * num_selected(ratio, s.size) for s in segs)


def _row_keys(key, ids) -> jax.Array:
  """Per row, ``fold_in(key, id)``."""
  return jax.vmap(lambda j: jax.random.fold_in(key, j))(
    jnp.asarray(ids, jnp.int32))


def _sparse_exchange(gv, gi, ctx):
  """sparse psum of values ``gv`` at bucket positions ``gi``
  (``layout.size``: unused slot); returns flat (mean, sent)."""
  total = ctx.layout.size
  summed = _sparse.sparse_psum(gv, gi, total, ctx.axis_name)
  sent = _core.zeros_after(total, gi).at[gi].set(gv, mode="drop")
  return summed / ctx.num_devices, sent



def _local_topk(x, segs, ratio):
  """Each segment's k largest ``|x|``, all segments through
  :func:`jaxcomm.kernels.topk.topk_abs_groups`: flat (values, bucket
  positions), segment by segment."""
  sel = _topk.topk_abs_groups(
    x, [(s.offset, s.count, s.size, num_selected(ratio, s.size))
        for s in segs], order="any")
  return (jnp.concatenate([v.reshape(-1) for v, _ in sel]),
          jnp.concatenate([i.reshape(-1) for _, i in sel]))



def _leaf_rows(layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Static ``(bounds, sizes)`` of the bucket's leaves, in bucket order."""
  sizes = tuple(int(s) for s in layout.sizes)
  bounds = tuple(int(b) for b in np.cumsum((0,) + sizes))
  return bounds, sizes
