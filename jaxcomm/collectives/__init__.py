"""Collectives used inside shard_map / pmap by jaxcomm's compressors.

Each accepts ``axis_name=None`` to run on one device without communicating.
"""

from jaxcomm.collectives._core import all_gather
from jaxcomm.collectives._core import all_gather_varying
from jaxcomm.collectives._core import all_to_all
from jaxcomm.collectives._core import axis_index
from jaxcomm.collectives._core import axis_size
from jaxcomm.collectives._core import check_axis
from jaxcomm.collectives._core import check_local
from jaxcomm.collectives._core import from_words
from jaxcomm.collectives._core import fused_psum
from jaxcomm.collectives._core import pack_fields
from jaxcomm.collectives._core import padded_length
from jaxcomm.collectives._core import pmax
from jaxcomm.collectives._core import ppermute
from jaxcomm.collectives._core import psum
from jaxcomm.collectives._core import pvary
from jaxcomm.collectives._core import scatter_gather_sum
from jaxcomm.collectives._core import to_words
from jaxcomm.collectives._core import unpack_fields
from jaxcomm.collectives._core import varying_axes
from jaxcomm.collectives._gossip import gossip_average
from jaxcomm.collectives._gossip import gossip_messages
from jaxcomm.collectives._gossip import gossip_mix
from jaxcomm.collectives._gossip import mixing_matrix
from jaxcomm.collectives._gossip import push_sum_mix
from jaxcomm.collectives._lowrank import lowrank_allreduce
from jaxcomm.collectives._quantized import integer_allreduce
from jaxcomm.collectives._quantized import natural_allreduce
from jaxcomm.collectives._quantized import requantized_allreduce
from jaxcomm.collectives._signs import compressed_allreduce
from jaxcomm.collectives._signs import gather_signs
from jaxcomm.collectives._signs import majority_vote
from jaxcomm.collectives._sparse import chunk_psum
from jaxcomm.collectives._sparse import gtopk_psum
from jaxcomm.collectives._sparse import index_dtype
from jaxcomm.collectives._sparse import sparse_psum

__all__ = [
  "all_gather",
  "all_gather_varying",
  "all_to_all",
  "axis_index",
  "axis_size",
  "chunk_psum",
  "compressed_allreduce",
  "from_words",
  "fused_psum",
  "gather_signs",
  "gossip_average",
  "gossip_messages",
  "gossip_mix",
  "gtopk_psum",
  "index_dtype",
  "integer_allreduce",
  "lowrank_allreduce",
  "majority_vote",
  "mixing_matrix",
  "natural_allreduce",
  "pack_fields",
  "pmax",
  "ppermute",
  "psum",
  "push_sum_mix",
  "pvary",
  "requantized_allreduce",
  "scatter_gather_sum",
  "sparse_psum",
  "to_words",
  "unpack_fields",
  "varying_axes",
]
