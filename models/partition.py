"""Label-skewed splits of a data set over devices (heterogeneous data).

:func:`dirichlet_split` gives each device a shard whose class mix is drawn
from a Dirichlet distribution: for every class ``c``, proportions ``p_c ~
Dir(alpha 1_n)`` over the ``n`` devices, and the class's examples (shuffled)
cut in those proportions. Small ``alpha`` (0.1) puts most of a class on one
or two devices; large ``alpha`` (100) approaches an even, i.i.d. split.
:func:`device_batches` draws each device's batches from its own shard.
"""

from __future__ import annotations

from typing import Iterator
from typing import Mapping

import numpy as np


def _is_int(x) -> bool:
  """A Python or numpy integer (not a bool)."""
  return (isinstance(x, (int, np.integer))
          and not isinstance(x, (bool, np.bool_)))


def _int(name: str, x, lo: int | None) -> int:
  """``x`` as a Python int; ValueError naming ``name`` unless it is an
  integer (Python or numpy) ``>= lo``."""
  if not _is_int(x) or (lo is not None and x < lo):
    want = "an int" + ("" if lo is None else f" >= {lo}")
    raise ValueError(f"{name} must be {want}, got {x!r}")
  return int(x)


def dirichlet_split(labels, num_devices: int, alpha: float, seed: int, *,
                    min_size: int = 1, max_tries: int = 100
                    ) -> list[np.ndarray]:
  """Indices of each device's shard, label-skewed by a Dirichlet draw.

  Args:
    labels: integer class labels, shape ``(N,)``.
    num_devices: the number of shards, an int >= 1 (Python or numpy).
    alpha: the Dirichlet concentration, > 0.
    seed: seed of the draw, an int (the same seed gives the same split).
    min_size: every shard gets at least this many examples: the draw is
      repeated (from the same generator) until it does.
    max_tries: draws before giving up, an int >= 1.

  Returns:
    ``num_devices`` sorted int64 index arrays that partition
    ``range(len(labels))``.

  Raises:
    ValueError: for a bad argument (named), or when ``max_tries`` draws
      leave some shard with fewer than ``min_size`` examples.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f"labels must be a 1-d integer array, got dtype "
                     f"{labels.dtype} and shape {labels.shape}")
  num_devices = _int("num_devices", num_devices, 1)
  if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
      or not np.isfinite(alpha) or alpha <= 0):
    raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
  seed = _int("seed", seed, None)
  max_tries = _int("max_tries", max_tries, 1)
  if (not _is_int(min_size) or min_size < 0
      or int(min_size) * num_devices > len(labels)):
    raise ValueError(f"min_size must be an int in [0, len(labels) / "
                     f"num_devices], got {min_size!r}")
  min_size = int(min_size)
  rng = np.random.default_rng(seed)
  classes = np.unique(labels)
  for _ in range(max_tries):
    shards = [[] for _ in range(num_devices)]
    for c in classes:
      idx = np.flatnonzero(labels == c)
      rng.shuffle(idx)
      p = rng.dirichlet(np.full(num_devices, float(alpha)))
      cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
      for d, part in enumerate(np.split(idx, cuts)):
        shards[d].append(part)
    out = [np.sort(np.concatenate(s)).astype(np.int64) for s in shards]
    if min(len(s) for s in out) >= min_size:
      return out
  raise ValueError(
    f"no Dirichlet draw in {max_tries} tries gave every one of "
    f"{num_devices} shards {min_size} examples at alpha={alpha}: lower "
    "min_size or raise alpha")


def label_counts(labels, shards, num_classes: int) -> np.ndarray:
  """``[num_devices, num_classes]``: how many of each class a shard has.

  Raises:
    ValueError: when ``labels`` is not 1-d integer, ``num_classes`` is not
      an int >= 1, a label is outside ``[0, num_classes)``, or ``shards``
      is empty.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f"labels must be a 1-d integer array, got dtype "
                     f"{labels.dtype} and shape {labels.shape}")
  num_classes = _int("num_classes", num_classes, 1)
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(
      f"labels must lie in [0, num_classes={num_classes}), got labels from "
      f"{labels.min()} to {labels.max()}")
  if len(shards) == 0:
    raise ValueError("shards must hold at least one shard, got none")
  return np.stack([np.bincount(labels[np.asarray(s, np.int64)],
                               minlength=num_classes) for s in shards])


def device_batches(arrays: Mapping[str, np.ndarray], shards, per_device: int,
                   *, seed: int) -> Iterator[dict]:
  """Endless global batches: device ``d``'s ``per_device`` examples drawn
  (with replacement, seeded) from its own shard, devices in order along
  the leading axis, as ``DataParallel`` splits a batch.

  Raises:
    ValueError: when ``shards`` is empty or one of them is (naming the
      device), or ``per_device`` is not an int >= 1.
  """
  per_device = _int("per_device", per_device, 1)
  shards = [np.asarray(s) for s in shards]
  if not shards:
    raise ValueError("shards must hold at least one shard, got none")
  empty = [d for d, s in enumerate(shards) if s.size == 0]
  if empty:
    raise ValueError(
      f"shards[{empty[0]}] is empty: device {empty[0]} has no examples to "
      "draw its batch from (give every device one, e.g. dirichlet_split's "
      "min_size >= 1)")
  return _draw(arrays, shards, per_device, np.random.default_rng(seed))


def _draw(arrays, shards, per_device, rng) -> Iterator[dict]:
  while True:
    idx = np.concatenate([rng.choice(s, per_device) for s in shards])
    yield {k: v[idx] for k, v in arrays.items()}


__all__ = ["device_batches", "dirichlet_split", "label_counts"]
