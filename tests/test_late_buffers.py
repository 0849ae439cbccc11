"""Buffers made late (``collectives._core.zeros_after`` / ``after``): the
values are exactly what they stand for. Their effect on memory is checked
where it matters, on every battery entry's compiled sharded step
(``tests/test_shards.py``, memory test)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.collectives import _core


@pytest.mark.parametrize("after", [
  np.array([-2**31, 5], np.int32), np.array([7], np.int8),
  np.array([-3.5, np.inf], np.float32), np.array([np.nan], np.float32),
  np.zeros((0,), np.int32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_zeros_after_is_positive_zeros(after, dtype):
  """+0 everywhere (no -0.0, no NaN), whatever the value it hangs on:
  the most negative int32, an infinity, a NaN, or nothing."""
  z = np.asarray(jax.jit(lambda a: _core.zeros_after(10, a, dtype))(after))
  assert z.shape == (10,) and z.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(z, np.zeros(10))
  if jnp.issubdtype(dtype, jnp.floating):
    assert not np.signbit(z.astype(np.float32)).any()


def test_after_is_the_value_and_nan_with_a_nan_dep():
  x = np.array([-0.0, 1.5, -np.inf, 3.0], np.float32)
  f = jax.jit(_core.after)
  got = np.asarray(f(x, np.array([2.0, np.nan], np.float32)))
  assert (got.view(np.uint32) == x.view(np.uint32)).all()   # bit for bit
  assert np.isnan(np.asarray(f(x, np.array([np.nan], np.float32)))).all()
  np.testing.assert_array_equal(
    np.asarray(f(x, np.zeros((0,), np.float32))), x)
