"""Pallas kernels for the hot loops of jaxcomm, each beside a jnp reference.

``bitpack``: sign packing, unpacking and the packed majority vote.
``topk``: top-k by magnitude, threshold selection and sampled thresholds.
The names below dispatch: Pallas kernels on GPU/TPU, jnp on CPU.
"""

from jaxcomm.kernels import bitpack
from jaxcomm.kernels import topk
from jaxcomm.kernels.bitpack import count_votes
from jaxcomm.kernels.bitpack import pack_signs
from jaxcomm.kernels.bitpack import unpack_signs
from jaxcomm.kernels.bitpack import vote
from jaxcomm.kernels.topk import sampled_threshold
from jaxcomm.kernels.topk import threshold_select
from jaxcomm.kernels.topk import topk_abs

__all__ = [
  "bitpack",
  "count_votes",
  "pack_signs",
  "sampled_threshold",
  "threshold_select",
  "topk",
  "topk_abs",
  "unpack_signs",
  "vote",
]
