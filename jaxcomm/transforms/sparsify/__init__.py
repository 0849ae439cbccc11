"""Sparsifiers: gradient compressors that send a subset of the values.

Top-k, random-k and threshold selection and their shared exchange
(``_sparsification`` over the ``_sparse_helpers`` engine), AdaComp, DGC,
global top-k and CSC, GMC, IBCD, LAG, MGS, ScaleCom, SIDCo, FetchSGD's
count sketch, SparCML, STC and SBC, and variance-based sparsification. Each
is a codec run by :func:`jaxcomm.compressed` (registry family
``"compressor"``, kind ``"sparsify"``).
"""

from jaxcomm.transforms.sparsify._adacomp import adacomp
from jaxcomm.transforms.sparsify._dgc import dgc
from jaxcomm.transforms.sparsify._global_topk import csc
from jaxcomm.transforms.sparsify._global_topk import gtopk
from jaxcomm.transforms.sparsify._gmc import gmc
from jaxcomm.transforms.sparsify._ibcd import ibcd
from jaxcomm.transforms.sparsify._lag import lag
from jaxcomm.transforms.sparsify._mgs import mgs
from jaxcomm.transforms.sparsify._scalecom import scalecom
from jaxcomm.transforms.sparsify._sidco import sidco
from jaxcomm.transforms.sparsify._sketch import fetchsgd
from jaxcomm.transforms.sparsify._sparcml import sparcml
from jaxcomm.transforms.sparsify._sparsification import randomk
from jaxcomm.transforms.sparsify._sparsification import threshold
from jaxcomm.transforms.sparsify._sparsification import topk
from jaxcomm.transforms.sparsify._ternary import sbc
from jaxcomm.transforms.sparsify._ternary import stc
from jaxcomm.transforms.sparsify._variance import variance_sparsification

__all__ = [
  "topk",
  "randomk",
  "threshold",
  "adacomp",
  "dgc",
  "gtopk",
  "csc",
  "gmc",
  "ibcd",
  "lag",
  "mgs",
  "scalecom",
  "sidco",
  "fetchsgd",
  "sparcml",
  "stc",
  "sbc",
  "variance_sparsification",
]
