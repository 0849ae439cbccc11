"""Inclusive prefix sums of long 1-D arrays, blocked for the TPU compiler.

``jnp.cumsum`` is a reduce-window that XLA rewrites into a scan; the TPU
compiler's code generation of that scan grows faster than its length
(libtpu 0.0.42.1, v5e, compile-only: 0.5 s for 65,536 int32, 2.6 s for
262,144, 13.4 s for 1,048,576), and even a 1,024-wide scan along rows
took 0.46 s of a top-k step's compile. Here the sum is taken along the
rows of a ``[m, 128]`` view by 7 shift-and-add steps (Hillis and Steele:
elementwise ops, which compile quickly), then over the ``m`` row totals
(recursively), and gives the same integers (an integer sum is exact in
any order): 1,048,576 entries compile in a fraction of a second
(``benchmarks/bench_topk_compile.py``). CPU and GPU compile either form
quickly; one form serves every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Entries per row of the blocked view (a TPU vector register's lanes).
BLOCK = 128


def _scan_rows(v: jax.Array) -> jax.Array:
  """Inclusive prefix sum along the last axis of ``v`` (``BLOCK`` wide):
  ``log2(BLOCK)`` steps of adding the array shifted by 1, 2, 4, ..."""
  width = v.shape[-1]
  shift = 1
  while shift < width:
    moved = jnp.pad(v[..., :width - shift], [(0, 0)] * (v.ndim - 1) +
                    [(shift, 0)])
    v = v + moved
    shift *= 2
  return v


def prefix_sum(x: jax.Array, dtype=None) -> jax.Array:
  """``jnp.cumsum(x, dtype=dtype)`` of a 1-D array, blocked.

  Args:
    x: a 1-D array (integer or bool; a float sum would round in another
      order than ``jnp.cumsum``'s).
    dtype: the accumulation and result type (default: ``x``'s, bool as
      int32).

  Returns:
    The inclusive prefix sum, shape ``x.shape``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxcomm._prefix import prefix_sum
    >>> prefix_sum(jnp.arange(5), dtype=jnp.int32)
    Array([ 0,  1,  3,  6, 10], dtype=int32)
  """
  if x.ndim != 1:
    raise ValueError(f"x must be 1-D, got shape {x.shape}")
  if dtype is None:
    dtype = jnp.int32 if x.dtype == jnp.bool_ else x.dtype
  if jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
    raise ValueError(f"dtype must be an integer type (an exact sum), got "
                     f"{jnp.dtype(dtype).name}")
  x = x.astype(dtype)
  n = x.shape[0]
  if n <= BLOCK:
    return _scan_rows(x)
  rows = -(-n // BLOCK)
  v = jnp.pad(x, (0, rows * BLOCK - n)).reshape(rows, BLOCK)
  inner = _scan_rows(v)
  before = prefix_sum(inner[:, -1], dtype) - inner[:, -1]
  return (inner + before[:, None]).reshape(-1)[:n]
