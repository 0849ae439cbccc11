"""OCP microscaling formats and FP8 casts: the codes against ``ml_dtypes``,
the bytes against bf16 from the compiled HLO, bad input."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxcomm
from jaxcomm.transforms import _mx
from tests import entries_mx
from tests import harness


@pytest.mark.parametrize("fmt", sorted(_mx.FORMATS))
def test_blocks_round_as_the_spec_says(fmt):
  """Random blocks over 11 decades, a zero block, a block with one huge
  value (its neighbours flush to zero), exact powers of two and values at
  the saturation edge: the decoded blocks equal the OCP definition
  computed with ml_dtypes' conversions (``entries_mx.mx_round``)."""
  rng = np.random.default_rng(len(fmt))
  x = rng.standard_normal(32 * 12) * np.exp(rng.uniform(-12, 12, 32 * 12))
  x[32:64] = 0.0
  x[64:96] = 1e-3
  x[64] = 1e6
  x[96:128] = 2.0 ** rng.integers(-20, 20, 32)
  x[128:160] = np.linspace(-1.999, 1.999, 32) * 2.0 ** 5
  x = np.concatenate([x, np.zeros(128 - x.size % 128)]).astype(np.float32)
  words = _mx.encode(jnp.asarray(x), fmt)
  assert words.shape == (_mx.words_per(x.size, fmt),)
  got = np.asarray(_mx.decode(words, x.size, fmt), np.float64)
  np.testing.assert_array_equal(got, entries_mx.mx_round(x, fmt))


def test_bits_per_element_match_the_format():
  assert _mx.bits_per_element("mxfp8") == 8.25
  assert _mx.bits_per_element("mxfp6") == 6.25
  assert _mx.bits_per_element("mxfp4") == 4.25
  table = _mx.magnitudes("mxfp4")
  np.testing.assert_array_equal(table, [0, .5, 1, 1.5, 2, 3, 4, 6])
  assert _mx.magnitudes("mxfp8")[-1] == 448.0


def test_mx_moves_fewer_bytes_than_bf16_in_the_compiled_step(mesh):
  """One 1M-element leaf on 8 devices, bytes read from the compiled HLO:
  MXFP8 moves 8.25 / 16 of bf16's, MXFP4 4.25 / 16, FP8 8 / 16."""
  params = {"w": jnp.zeros((1024, 1024))}

  def moved(tx):
    payload = jaxcomm.wire.report(harness.lower_update(tx, mesh, params),
                                  params=params).payload
    # Both phases of the exchange, without the fused dense psum's 4-byte
    # non-finite flag (the same for all three).
    return sum(b for kind, b in payload.items() if kind != "all-reduce")

  bf16 = moved(jaxcomm.cast(jnp.bfloat16))
  for tx, ratio in ((jaxcomm.mx("mxfp8"), 8.25 / 16),
                    (jaxcomm.mx("mxfp4"), 4.25 / 16),
                    (jaxcomm.cast("float8_e4m3fn"), 8 / 16)):
    assert math.isclose(moved(tx), bf16 * ratio, rel_tol=1e-3), (
      repr(tx), moved(tx), bf16)


def test_fp8_cast_saturates_instead_of_nan(mesh):
  """E4M3FN has no infinity: a mean above 448 saturates at 448, a NaN
  would have skipped the step."""
  tx = jaxcomm.cast("float8_e4m3fn", axis_name=None)
  params = {"w": jnp.zeros((16, 16))}
  upd, state = tx.update({"w": jnp.full((16, 16), 1000.0)}, tx.init(params))
  np.testing.assert_array_equal(np.asarray(upd["w"]), 448.0)
  assert int(state.stats.nonfinite_steps) == 0


def test_bad_format_is_named():
  with pytest.raises(ValueError, match="fmt"):
    jaxcomm.mx("mxfp5")
  with pytest.raises(ValueError, match="dtype"):
    jaxcomm.cast("float8_e4m3")
  assert ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max == 6.0


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_e5m2"])
def test_fp8_rounding_by_convert_equals_the_table(fmt):
  """FP8 elements round by XLA's convert: the same codes as rounding to
  the nearest entry of ml_dtypes' table (ties to even, saturating) at
  every midpoint between neighbours, one ulp either side, every table
  value, and beyond the largest."""
  t = _mx.magnitudes(fmt)
  mids = ((t[1:].astype(np.float64) + t[:-1]) / 2).astype(np.float32)
  a = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                      t, np.float32([t[-1] * 1.5, 1e30, 0.0])])
  a = jnp.asarray(a, jnp.float32)
  native = _mx._round_native(a, t, _mx._NATIVE[fmt])
  table = _mx._round_to_table(a, t)
  np.testing.assert_array_equal(np.asarray(native), np.asarray(table))
