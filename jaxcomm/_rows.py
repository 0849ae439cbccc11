"""Short runs of a flat buffer batched into a few padded ``[rows, width]``
arrays (internal).

A bucket's per-leaf work is one batched op per run of equal shapes
(:mod:`jaxcomm._buckets`). A model of many small leaves of different
shapes has as many runs as leaves, and on a TPU each run's op leaves
small buffers behind: the compiler keeps each in its own slot of 16 KiB
(libtpu 0.0.42.1: 512 bytes of data each), and a hundred leaves of 50 to
500 values held 2,900 of them at once in AdaComp's step (47 MiB beside the
plain step's 11 MiB of temporaries) and 500 in top-k's, and each run's
sort is compiled on its own.

:func:`plan` puts the short runs (at most :data:`SHORT` entries a
segment) of similar length into one batch each, by powers of two, so a
per-segment op is one op per batch: each segment a row, padded at its end
(at most twice its length) with a value the caller chooses. A long
segment keeps its own run.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Segments of at most this many entries are batched with others of
# similar length.
SHORT = 4096


@dataclasses.dataclass(frozen=True)
class Batch:
  """Short runs padded to one width, stacked as rows.

  Attributes:
    width: the row length (each member's ``size`` or more).
    members: per run, ``(run, offset, count, size)``: its index among
      the runs given to :func:`plan`, and its ``count`` segments of
      ``size`` entries from ``offset`` in the flat buffer.
  """

  width: int
  members: tuple[tuple[int, int, int, int], ...]

  @property
  def rows(self) -> int:
    return sum(c for _, _, c, _ in self.members)

  def first_rows(self) -> tuple[int, ...]:
    """Per member, the row of its first segment."""
    out, r = [], 0
    for _, _, c, _ in self.members:
      out.append(r)
      r += c
    return tuple(out)

  def gather(self, flat: jax.Array, fill=0, *,
             slices: bool = False) -> jax.Array:
    """``[rows, width]``: each member's segments as rows of ``flat``,
    padded at their end with ``fill``.

    By default one gather, its index a column iota plus each row's start:
    a slice and a reshape per member is a copy each on a TPU, whose tiles
    pad the rows (libtpu 0.0.50: AdaComp's step on the mixed model 1.34x
    the plain step's memory that way, 1.21x by the gather). ``slices``:
    per-member slices, pads and one concatenation instead, for a caller
    that only reduces the rows: the compiler fuses them into the
    reduction and never stores ``flat`` whole, which a gather's operand
    must be (ECQ-SGD's per-leaf maxima: 0.95x / 1.21x on libtpu 0.0.42,
    1.07x / 1.42x on 0.0.50, slices / gather).
    """
    if slices:
      parts = []
      for _, off, count, size in self.members:
        seg = flat[off:off + count * size].reshape(count, size)
        parts.append(jnp.pad(seg, ((0, 0), (0, self.width - size)),
                             constant_values=fill))
      return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    starts, sizes = [], []
    for _, off, count, size in self.members:
      starts += [off + r * size for r in range(count)]
      sizes += [size] * count
    col = lax.broadcasted_iota(jnp.int32, (self.rows, self.width), 1)
    valid = col < jnp.asarray(np.asarray(sizes, np.int32))[:, None]
    at = jnp.asarray(np.asarray(starts, np.int32))[:, None] + col
    return jnp.where(valid, flat[jnp.where(valid, at, 0)],
                     jnp.asarray(fill, flat.dtype))

  def unpad(self, rows: jax.Array) -> list[jax.Array]:
    """Per member, its segments' entries of ``rows`` (``[self.rows,
    self.width]``) without the padding, flat: one gather for the batch
    (a slice of each row then a reshape would be a copy per member on a
    TPU, whose tiles pad the rows), its index computed from one iota and
    a table of the segments' starts."""
    sizes = [size for _, _, count, size in self.members
             for _ in range(count)]
    starts = np.cumsum([0] + sizes)
    total = int(starts[-1])
    pos = lax.iota(jnp.int32, total)
    seg = jnp.searchsorted(jnp.asarray(starts[1:-1], jnp.int32), pos,
                           side="right").astype(jnp.int32)
    col = pos - jnp.asarray(starts[:-1], jnp.int32)[seg]
    flat = rows.reshape(-1)[seg * self.width + col]
    out, at = [], 0
    for _, _, count, size in self.members:
      out.append(flat[at:at + count * size])
      at += count * size
    return out

  def split(self, rows: jax.Array) -> list[jax.Array]:
    """Per member, its ``[count, ...]`` rows of ``rows`` (a batched result,
    ``[self.rows, ...]``)."""
    return [rows[r:r + c] for r, (_, _, c, _) in zip(self.first_rows(),
                                                      self.members)]


def _width_class(size: int) -> int:
  return max(128, 1 << (int(size) - 1).bit_length())


def plan(runs: Sequence[tuple[int, int, int]], *, short: int = SHORT,
         multiple: int = 1) -> tuple[tuple[Batch, ...], tuple[int, ...]]:
  """Batches of the short runs among ``runs``.

  Args:
    runs: static ``(offset, count, size)``: ``count`` segments of
      ``size`` entries from ``offset``.
    short: runs whose segments have at most this many entries are
      batched, by the power of two their length rounds up to (a class
      holding a single run is left alone).
    multiple: each batch's width is a multiple of this (a bin length).

  Returns:
    ``(batches, alone)``: the batches, and the indices of the runs left
    on their own, in order.

  Example:
    >>> from jaxcomm import _rows
    >>> batches, alone = _rows.plan([(0, 1, 300), (300, 2, 290),
    ...                              (880, 1, 9000), (9880, 1, 70)])
    >>> [(b.width, b.rows) for b in batches], alone
    ([(300, 3)], (2, 3))
  """
  if short < 1 or multiple < 1:
    raise ValueError(f"short and multiple must be >= 1, got {short} and "
                     f"{multiple}")
  classes: dict[int, list] = {}
  alone = []
  for i, (off, count, size) in enumerate(runs):
    if size <= short:
      classes.setdefault(_width_class(size), []).append(
        (i, int(off), int(count), int(size)))
    else:
      alone.append(i)
  batches = []
  for members in classes.values():
    if len(members) == 1:
      alone.append(members[0][0])
      continue
    width = max(s for _, _, _, s in members)
    width = -(-width // multiple) * multiple
    batches.append(Batch(width, tuple(members)))
  return tuple(batches), tuple(sorted(alone))
