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
