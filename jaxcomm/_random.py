"""Stochastic rounding's noise, drawn where it is used.

``jax.random.uniform(key, shape)`` lowers on CPU to a rolled loop that
carries two ``uint32`` buffers of ``shape`` (XLA cannot fuse a loop into
its consumer), so a quantizer that rounds each element stochastically
held three buffers the size of the device's gradient besides the
gradient itself: on the sharded MLP of ``tests/test_shards.py``, QSGD's
step used 1.40x and TernGrad's 1.59x the plain step's memory.

:func:`uniform` and :func:`bits` compute the same numbers as JAX's default
generator (Threefry-2x32 over a flat counter, ``jax_threefry_partitionable``
on, the JAX default since 0.5) as plain element-wise arithmetic on an
``iota``: the compiler fuses the draw into the rounding that consumes it,
and no buffer of noise is ever materialized, on any backend. Under any
other setting (another default PRNG implementation, partitionable
Threefry off, typed keys of another implementation) they call
``jax.random`` itself, so a draw is always exactly ``jax.random``'s.

Threefry-2x32 with 20 rounds is the counter-based generator of Salmon et
al, "Parallel Random Numbers: As Easy as 1, 2, 3" (SC 2011).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Threefry-2x32's rotation constants, rounds 0-3 and 4-7 of each 8.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
# The key schedule's parity constant.
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x, r: int):
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32, 20 rounds, of counters ``(x0, x1)`` under key
  ``(k0, k1)``: ``uint32`` arrays in, the two ``uint32`` output words
  out. Element-wise: it fuses with its producer and its consumer."""
  ks = (k0, k1, k0 ^ k1 ^ _PARITY)
  x0 = x0 + ks[0]
  x1 = x1 + ks[1]
  for g in range(5):
    for r in _ROTATIONS[g % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, r) ^ x0
    x0 = x0 + ks[(g + 1) % 3]
    x1 = x1 + ks[(g + 2) % 3] + np.uint32(g + 1)
  return x0, x1


def _raw(key):
  """``key``'s two ``uint32`` words, or None where the draw must go to
  ``jax.random`` (another generator, or the non-partitionable one)."""
  if not jax.config.jax_threefry_partitionable:
    return None
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if str(jax.random.key_impl(key)) != "threefry2x32":
      return None
    key = jax.random.key_data(key)
  elif str(jax.config.jax_default_prng_impl) != "threefry2x32":
    return None
  if key.shape != (2,) or key.dtype != jnp.uint32:
    return None
  return key


def bits(key, shape, offset: int = 0):
  """``jax.random.bits(key, (offset + size,), uint32)[offset:]`` reshaped
  to ``shape``, computed element-wise (fused with its consumer).

  Args:
    key: a PRNG key (raw ``uint32[2]`` or typed).
    shape: the draw's shape.
    offset: where in a flat draw of ``key`` this one starts (a static
      int): a bucket's noise is that bucket's slice of the whole draw.

  Returns:
    ``uint32`` array of ``shape``.
  """
  shape = tuple(int(d) for d in shape)
  size = math.prod(shape)
  raw = _raw(key)
  if raw is None or offset + size >= 2**32:
    flat = jax.random.bits(key, (offset + size,), jnp.uint32)
    return flat[offset:].reshape(shape)
  lo = jax.lax.iota(jnp.uint32, size).reshape(shape) + np.uint32(offset)
  b1, b2 = threefry2x32(raw[0], raw[1], jnp.zeros_like(lo), lo)
  return b1 ^ b2


def uniform(key, shape, offset: int = 0):
  """``jax.random.uniform(key, (offset + size,), float32)[offset:]``
  reshaped to ``shape``, bit for bit, computed element-wise (see
  :func:`bits`): 23 random mantissa bits of ``[1, 2)``, minus one."""
  b = bits(key, shape, offset)
  one = np.uint32(np.float32(1.0).view(np.uint32))
  f = jax.lax.bitcast_convert_type((b >> np.uint32(9)) | one,
                                   jnp.float32) - 1.0
  return jnp.maximum(0.0, f)
