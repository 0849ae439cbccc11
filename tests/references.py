"""Numpy references shared by several test modules, written from the
papers' definitions (not from the code under test)."""

import fractions
import math

import numpy as np


def topk_count(ratio: float, size: int) -> int:
  """Top-k's ``k`` for a leaf of ``size`` elements (Aji & Heafield 2017;
  jaxcomm's docstring): ``max(1, ceil(ratio * size))``, at most ``size``,
  with ``ratio * size`` computed exactly from the decimal ratio the user
  wrote (``0.1 * 30`` is 3, not float64's 3.0000000000000004)."""
  exact = fractions.Fraction(repr(float(ratio))) * size
  return max(1, min(size, math.ceil(exact)))


def np_topk(d: np.ndarray, ratio: float) -> np.ndarray:
  """``d`` with all but its ``topk_count(ratio, d.size)`` largest
  magnitudes zeroed (lower index first on ties)."""
  flat = d.reshape(-1)
  keep = np.argsort(-np.abs(flat), kind="stable")[:topk_count(ratio,
                                                              flat.size)]
  out = np.zeros_like(flat)
  out[keep] = flat[keep]
  return out.reshape(d.shape)


def dgc_sample_size(size: int, sample_ratio: float, density: float) -> int:
  """How many of a leaf's ``size`` values DGC samples to estimate its
  threshold.

  The paper (Lin et al. 2018, Sec. 3 and its code) samples a fixed share
  of the gradient, ``ceil(sample_ratio * size)`` (0.1% to 1%). jaxcomm
  departs from it in two stated ways (``jaxcomm.dgc``'s docstring): at
  least ``ceil(2 / density)`` samples, so that two are expected above the
  threshold, and at most ``ceil(100 / density)``, since a hundred expected
  above it already fix the count within about 10%. Never more than the
  leaf.
  """
  paper = math.ceil(fractions.Fraction(repr(float(sample_ratio))) * size)
  at_least = math.ceil(2 / density)       # departure 1
  at_most = math.ceil(100 / density)      # departure 2
  return min(size, max(min(paper, at_most), at_least))


def mixing_matrix(topology: str, n: int, phase: int) -> np.ndarray:
  """The gossip mixing matrix ``W`` of ``topology`` on ``n`` devices at
  ``phase``, from the topologies' definitions: ring (self and both
  neighbours, 1/3 each), 2 x n/2 torus (self and four neighbours, 1/5
  each), hypercube and one-peer exponential (self and the phase's one
  peer, 1/2 each; the phase cycles over 3 dimensions, n = 8)."""
  w = np.zeros((n, n))
  if topology == "ring":
    for i in range(n):
      for j in (i - 1, i, i + 1):
        w[i, j % n] += 1 / 3
  elif topology == "torus":          # 2 x 4 for n = 8
    r, c = 2, n // 2
    for i in range(n):
      a, b = divmod(i, c)
      for da, db in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
        w[i, ((a + da) % r) * c + (b + db) % c] += 0.2
  elif topology == "hypercube":
    for i in range(n):
      w[i, i] += 0.5
      w[i, i ^ (1 << (phase % 3))] += 0.5
  else:                              # one-peer exponential
    for i in range(n):
      w[i, i] += 0.5
      w[i, (i + (1 << (phase % 3))) % n] += 0.5
  return w
