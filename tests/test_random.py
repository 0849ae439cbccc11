"""Stochastic rounding's noise (``jaxcomm._random``): the same numbers as
``jax.random``, drawn element-wise so that no buffer of noise exists."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm import _random


@pytest.mark.parametrize("shape,offset", [((), 0), ((7,), 0), ((3, 5), 0),
                                          ((1000, 33), 0), ((4, 8), 100),
                                          ((257,), 12_345)])
@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5])
def test_draws_equal_jax_random(shape, offset, seed):
  """Bit for bit the slice ``[offset:]`` of ``jax.random``'s flat draw,
  under jit and eagerly, for raw and typed keys."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), 3)
  size = int(np.prod(shape))
  want_bits = np.asarray(jax.random.bits(key, (offset + size,), jnp.uint32))
  want_uni = np.asarray(jax.random.uniform(key, (offset + size,)))
  draw = jax.jit(lambda k: (_random.bits(k, shape, offset),
                            _random.uniform(k, shape, offset)))
  for k in (key, jax.random.wrap_key_data(key)):
    got_bits, got_uni = draw(k)
    np.testing.assert_array_equal(np.asarray(got_bits).ravel(),
                                  want_bits[offset:])
    np.testing.assert_array_equal(np.asarray(got_uni).ravel(),
                                  want_uni[offset:])
    assert got_uni.dtype == jnp.float32 and got_uni.shape == shape
  np.testing.assert_array_equal(
    np.asarray(_random.uniform(key, shape, offset)).ravel(),
    want_uni[offset:])


def test_uniform_moments():
  """A closed form: U[0, 1) has mean 1/2 and variance 1/12."""
  u = np.asarray(_random.uniform(jax.random.PRNGKey(9), (1_000_000,)))
  assert u.min() >= 0.0 and u.max() < 1.0
  assert abs(u.mean() - 0.5) < 2e-3
  assert abs(u.var() - 1 / 12) < 1e-3


def test_other_generators_go_to_jax_random():
  """Non-partitionable Threefry and other implementations draw through
  ``jax.random`` itself: the numbers are always ``jax.random``'s."""
  key = jax.random.PRNGKey(4)
  with jax.threefry_partitionable(False):
    want = np.asarray(jax.random.uniform(key, (64,)))
    got = np.asarray(_random.uniform(key, (64,)))
  np.testing.assert_array_equal(got, want)
  rbg = jax.random.key(4, impl="rbg")
  np.testing.assert_array_equal(
    np.asarray(_random.bits(rbg, (5, 3))),
    np.asarray(jax.random.bits(rbg, (15,), jnp.uint32)).reshape(5, 3))


def test_the_draw_is_fused_into_its_consumer():
  """Stochastic rounding of 1M floats compiles with no noise buffer: its
  temporaries stay under a tenth of the input's bytes (a materialized
  draw alone would be the input's size)."""
  x = jax.ShapeDtypeStruct((1 << 20,), jnp.float32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)

  def rounded(x, key):
    return jnp.floor(x + _random.uniform(key, x.shape)).astype(jnp.int8)

  mem = jax.jit(rounded).lower(x, key).compile().memory_analysis()
  assert mem.temp_size_in_bytes < (x.size * 4) // 10, mem
