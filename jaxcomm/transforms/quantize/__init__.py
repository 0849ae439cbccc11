"""Quantizers: gradient compressors that send every value in fewer bits.

The dense mean every compressor is measured against and its casts, QSGD and
TernGrad's stochastic levels, int8/int4/uint8 blocks, MX formats, natural
compression, the sign family (onebit, signSGD, Signum, EF-signSGD),
dist-EF-SGDM, ECQ-SGD, the over-the-air simulations and QCS. Each is a
codec run by :func:`jaxcomm.compressed` (registry family ``"compressor"``,
kind ``"quantize"``).
"""

from jaxcomm.transforms.quantize._dense import cast
from jaxcomm.transforms.quantize._dense import mean_gradients
from jaxcomm.transforms.quantize._dist_ef_sgdm import DistEfSgdmState
from jaxcomm.transforms.quantize._dist_ef_sgdm import dist_ef_sgdm
from jaxcomm.transforms.quantize._ecq import ecq_sgd
from jaxcomm.transforms.quantize._integer import RequantizedState
from jaxcomm.transforms.quantize._integer import int4
from jaxcomm.transforms.quantize._integer import int8
from jaxcomm.transforms.quantize._integer import uint8
from jaxcomm.transforms.quantize._mx import mx
from jaxcomm.transforms.quantize._natural import natural
from jaxcomm.transforms.quantize._over_the_air import OverTheAirCodec
from jaxcomm.transforms.quantize._over_the_air import ota_analog
from jaxcomm.transforms.quantize._over_the_air import ota_onebit
from jaxcomm.transforms.quantize._qcs import qcs
from jaxcomm.transforms.quantize._quantization import qsgd
from jaxcomm.transforms.quantize._quantization import terngrad
from jaxcomm.transforms.quantize._signs import OneBitState
from jaxcomm.transforms.quantize._signs import SignumState
from jaxcomm.transforms.quantize._signs import ef_signsgd
from jaxcomm.transforms.quantize._signs import onebit
from jaxcomm.transforms.quantize._signs import signsgd
from jaxcomm.transforms.quantize._signs import signum

__all__ = [
  "mean_gradients",
  "cast",
  "qsgd",
  "terngrad",
  "int8",
  "int4",
  "uint8",
  "RequantizedState",
  "dist_ef_sgdm",
  "DistEfSgdmState",
  "ecq_sgd",
  "mx",
  "natural",
  "onebit",
  "signsgd",
  "signum",
  "ef_signsgd",
  "OneBitState",
  "SignumState",
  "ota_analog",
  "ota_onebit",
  "OverTheAirCodec",
  "qcs",
]
