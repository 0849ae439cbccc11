"""Registry entries for the OCP microscaling formats (``jaxcomm.mx``).

The reference follows the OCP MX v1.0 definition in float64 numpy: blocks of
32 consecutive elements, the shared scale ``2^(floor(log2 max|v|) - emax)``,
each element divided by it and converted by ``ml_dtypes`` (round to nearest
even) after saturation at the element type's largest value. The exchange's
blocks start at each device's chunk of the bucket (``ceil(L / n)`` rounded
up to 128 elements, zero padded), as the two-phase exchange documents.
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
  """``v`` (a multiple of 32 long) through MX ``fmt`` and back."""
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
    out[b:b + 32] = q * scale
  return out


def _mx_ref(fmt):
  def ref_step(xs, state, step, key, n):
    shapes = [x.shape for x in xs[0]]
    flat = [np.concatenate([x.ravel() for x in dev]) for dev in xs]
    size = flat[0].size
    chunk = -(-math.ceil(size / n) // 128) * 128
    sent, rows = [], []
    for f in flat:
      padded = np.zeros(chunk * n)
      padded[:size] = f
      q = np.concatenate([mx_round(padded[c * chunk:(c + 1) * chunk], fmt)
                          for c in range(n)])
      rows.append(q)
      sent.append(q[:size])
    summed = np.sum(rows, axis=0).astype(np.float32)
    total = np.concatenate([mx_round(summed[c * chunk:(c + 1) * chunk], fmt)
                            for c in range(n)])[:size] / n

    def split(v):
      out, off = [], 0
      for s in shapes:
        k = int(np.prod(s))
        out.append(v[off:off + k].reshape(s))
        off += k
      return out
    return split(total), [split(s) for s in sent], state
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
