"""Registry entries for the dense baselines (mean_gradients, cast)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxcomm
from tests import registry


def _mean_ref_step(xs, state, step, key, n):
  mean = [np.mean([x[j] for x in xs], axis=0) for j in range(len(xs[0]))]
  return mean, xs, state


registry.register(registry.Entry(
  name="mean_gradients",
  ref_init=lambda shapes: None,
  ref_step=_mean_ref_step,
  error_feedback=False,
  factory=jaxcomm.mean_gradients,
))


def _cast_ref(np_dtype):
  def ref_step(xs, state, step, key, n):
    # Each device divides by n and rounds to the wire dtype; the chunk owner
    # adds the n contributions in float32 and rounds the sum once more.
    low = [[np.asarray((x / n).astype(np.float32).astype(np_dtype),
                       np.float64) for x in dev] for dev in xs]
    mean = []
    for j in range(len(xs[0])):
      s = np.sum([low[i][j] for i in range(n)], axis=0).astype(np.float32)
      mean.append(s.astype(np_dtype).astype(np.float64))
    sent = [[l * n for l in dev] for dev in low]
    return mean, sent, state
  return ref_step


for _dtype, _np in ((jnp.bfloat16, ml_dtypes.bfloat16),
                    (jnp.float16, np.float16)):
  for _ef in (False, True):
    registry.register(registry.Entry(
      name=f"cast_{np.dtype(_dtype).name}{'_ef' if _ef else ''}",
      ref_init=lambda shapes: None,
      ref_step=_cast_ref(_np),
      error_feedback=_ef,
      factory=jaxcomm.cast,
      kwargs={"dtype": _dtype, "error_feedback": _ef},
      bad_args=[({"dtype": jnp.int8}, "dtype"),
                ({"policy": 3}, "policy")],
      rtol=1e-2, atol=1e-2,
      # The summed chunk is rounded to the wire dtype once more after the
      # residual is taken: that second rounding is not fed back.
      conserves=False,
    ))


def _fp8_cast_ref(np_dtype):
  """As :func:`_cast_ref`, after scaling the bucket by a shared power of
  two ``2^k`` (``max |x|`` over devices and leaves ``< 2^(k + t)``, ``2^t
  <= top / 2``), so that neither cast saturates; the mean and what each
  device sent are unscaled."""
  top = float(ml_dtypes.finfo(np_dtype).max)
  t = np.frexp(top / 2)[1] - 1

  def low_of(v):
    v = np.asarray(v, np.float32)
    assert np.abs(v).max() < top        # the scale keeps it in range
    return np.asarray(v.astype(np_dtype), np.float64)

  def ref_step(xs, state, step, key, n):
    m = max(np.abs(np.asarray(x, np.float32)).max() for dev in xs
            for x in dev)
    k = int(np.frexp(np.float32(m))[1]) - t
    low = [[low_of(np.ldexp(x, -k) / n) for x in dev] for dev in xs]
    mean = [np.ldexp(low_of(np.sum([low[i][j] for i in range(n)], axis=0)),
                     k) for j in range(len(xs[0]))]
    return mean, [[np.ldexp(l * n, k) for l in dev] for dev in low], state
  return ref_step


for _name, _np in (("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
                   ("float8_e5m2", ml_dtypes.float8_e5m2)):
  registry.register(registry.Entry(
    name=f"cast_{_name}_ef",
    ref_init=lambda shapes: None,
    ref_step=_fp8_cast_ref(_np),
    error_feedback=True,
    factory=jaxcomm.cast,
    kwargs={"dtype": _name, "error_feedback": True},
    rtol=1e-2, atol=1e-2,
    conserves=False,
  ))
