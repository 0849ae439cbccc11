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


def dirichlet_split(labels, num_devices: int, alpha: float, seed: int, *,
                    min_size: int = 1, max_tries: int = 100
                    ) -> list[np.ndarray]:
  """Indices of each device's shard, label-skewed by a Dirichlet draw.

  Args:
    labels: integer class labels, shape ``(N,)``.
    num_devices: the number of shards, an int >= 1.
    alpha: the Dirichlet concentration, > 0.
    seed: seed of the draw (the same seed gives the same split).
    min_size: every shard gets at least this many examples: the draw is
      repeated (from the same generator) until it does.
    max_tries: draws before giving up.

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
  if (isinstance(num_devices, bool) or not isinstance(num_devices, int)
      or num_devices < 1):
    raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
  if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
      or not np.isfinite(alpha) or alpha <= 0):
    raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"seed must be an int, got {seed!r}")
  if (isinstance(min_size, bool) or not isinstance(min_size, int)
      or min_size < 0 or min_size * num_devices > len(labels)):
    raise ValueError(f"min_size must be an int in [0, len(labels) / "
                     f"num_devices], got {min_size!r}")
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
  """``[num_devices, num_classes]``: how many of each class a shard has."""
  labels = np.asarray(labels)
  return np.stack([np.bincount(labels[s], minlength=num_classes)
                   for s in shards])


def device_batches(arrays: Mapping[str, np.ndarray], shards, per_device: int,
                   *, seed: int) -> Iterator[dict]:
  """Endless global batches: device ``d``'s ``per_device`` examples drawn
  (with replacement, seeded) from its own shard, devices in order along
  the leading axis, as ``DataParallel`` splits a batch."""
  rng = np.random.default_rng(seed)
  while True:
    idx = np.concatenate([rng.choice(s, per_device) for s in shards])
    yield {k: v[idx] for k, v in arrays.items()}


__all__ = ["device_batches", "dirichlet_split", "label_counts"]
