"""Registry entries for the OCP microscaling formats (``jaxcomm.mx``).

The reference follows the OCP MX v1.0 definition in float64 numpy: each
leaf cut into blocks of 32 consecutive elements (flattened in row-major
order; a block never takes elements of another leaf), the shared scale
``2^(floor(log2 max|v|) - emax)``, each element divided by it and converted
by ``ml_dtypes`` (round to nearest even) after saturation at the element
type's largest value. A leaf whose size is not a multiple of 32 ends in a
short block, scaled by its own elements. Both phases of the exchange round
every leaf this way: each device's leaf, then the float32 sum of what the
devices sent (the chunks of the exchange, whole blocks, do not show).
"""

import math

import ml_dtypes
import numpy as np

import jaxcomm
from tests import registry

# format -> (element type, emax of its largest normal).
_FORMATS = {
  "mxfp8": (ml_dtypes.float8_e4m3fn, 8),
  "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 15),
  "mxfp6": (ml_dtypes.float6_e2m3fn, 2),
  "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 4),
  "mxfp4": (ml_dtypes.float4_e2m1fn, 2),
}


def mx_round(v, fmt):
  """A flat ``v`` through MX ``fmt`` and back: blocks of 32 from its first
  element, the last one short where ``v.size`` is not a multiple of 32."""
  dtype, emax = _FORMATS[fmt]
  top = float(ml_dtypes.finfo(dtype).max)
  out = np.zeros(v.shape, np.float64)
  for b in range(0, v.size, 32):
    blk = np.asarray(v[b:b + 32], np.float32).astype(np.float64)
    amax = np.abs(blk).max()
    if amax == 0:
      continue
    scale = 2.0 ** (math.floor(math.log2(amax)) - emax)
    q = np.clip(blk / scale, -top, top).astype(dtype).astype(np.float64)
    out[b:b + blk.size] = q * scale
  return out


def mx_tensor(x, fmt):
  """A tensor through MX ``fmt`` and back, blocked within it."""
  x = np.asarray(x)
  return mx_round(x.reshape(-1), fmt).reshape(x.shape)


def _mx_ref(fmt):
  def ref_step(xs, state, step, key, n):
    sent = [[mx_tensor(x, fmt) for x in dev] for dev in xs]
    mean = []
    for j in range(len(xs[0])):
      summed = np.sum([s[j] for s in sent], axis=0).astype(np.float32)
      mean.append(mx_tensor(summed, fmt) / n)
    return mean, sent, state
  return ref_step


for _fmt, _ef in (("mxfp8", True), ("mxfp6", False), ("mxfp4", True)):
  registry.register(registry.Entry(
    name=f"mx_{_fmt}{'_ef' if _ef else ''}",
    ref_init=lambda shapes: None,
    ref_step=_mx_ref(_fmt),
    error_feedback=_ef,
    factory=jaxcomm.mx,
    kwargs={"fmt": _fmt, "error_feedback": _ef},
    bad_args=[({"fmt": "mxfp5"}, "fmt"), ({"fmt": "e4m3"}, "fmt")],
    # The reducer rounds each chunk's sum once more after the residual is
    # taken: that second rounding is not fed back.
    conserves=False,
  ))
