"""jaxcomm: communication-efficient data-parallel training for JAX.

Gradient compressors are Optax ``GradientTransformation``s that carry their
own error-feedback state; use them inside a ``jax.shard_map`` (or
``jax.pmap``) train step::

  tx = optax.chain(jaxcomm.powersgd(rank=4), optax.sgd(0.1))
"""

import importlib

from jaxcomm import collectives
from jaxcomm import parallel
from jaxcomm import registry
from jaxcomm import wire
from jaxcomm._codec import Codec
from jaxcomm._codec import CodecBase
from jaxcomm._codec import GossipCodec
from jaxcomm._codec import SteppedCodec
from jaxcomm._compressor import CodecResult
from jaxcomm._compressor import CompressState
from jaxcomm._compressor import CompressStats
from jaxcomm._compressor import Context
from jaxcomm._compressor import compress_states
from jaxcomm._compressor import compressed
from jaxcomm._compressor import spec_of
from jaxcomm._compressor import stats
from jaxcomm._policy import LeafPolicy
from jaxcomm.transforms import *  # pylint: disable=wildcard-import

__version__ = "0.1.0"


def __getattr__(name):
  # jaxcomm.advise loads on first use, so that ``python -m jaxcomm.advise``
  # runs it as a script without a second copy of the module.
  if name == "advise":
    return importlib.import_module("jaxcomm.advise")
  raise AttributeError(f"module 'jaxcomm' has no attribute {name!r}")
