"""jaxcomm: communication-efficient data-parallel training for JAX.

Gradient compressors are Optax ``GradientTransformation``s that carry their
own error-feedback state; use them inside a ``jax.shard_map`` (or
``jax.pmap``) train step::

  tx = optax.chain(jaxcomm.powersgd(rank=4), optax.sgd(0.1))
"""

from jaxcomm import collectives
from jaxcomm import parallel
from jaxcomm import wire
from jaxcomm._compressor import Codec
from jaxcomm._compressor import CodecResult
from jaxcomm._compressor import CompressState
from jaxcomm._compressor import CompressStats
from jaxcomm._compressor import Context
from jaxcomm._compressor import compress_states
from jaxcomm._compressor import compressed
from jaxcomm._compressor import spec_of
from jaxcomm._compressor import stats
from jaxcomm._policy import LeafPolicy
from jaxcomm.transforms import AdaCommSchedule
from jaxcomm.transforms import LocalState
from jaxcomm.transforms import OneBitAdamState
from jaxcomm.transforms import OneBitLambState
from jaxcomm.transforms import OneBitState
from jaxcomm.transforms import PowerSGDState
from jaxcomm.transforms import SignumState
from jaxcomm.transforms import ZeroOneAdamState
from jaxcomm.transforms import adacomm
from jaxcomm.transforms import apply_updates
from jaxcomm.transforms import cast
from jaxcomm.transforms import csc
from jaxcomm.transforms import dgc
from jaxcomm.transforms import diloco
from jaxcomm.transforms import dpsgd
from jaxcomm.transforms import choco
from jaxcomm.transforms import ChocoState
from jaxcomm.transforms import sgp
from jaxcomm.transforms import PushSumState
from jaxcomm.transforms import ef_signsgd
from jaxcomm.transforms import gtopk
from jaxcomm.transforms import int8
from jaxcomm.transforms import local_sgd
from jaxcomm.transforms import local_states
from jaxcomm.transforms import mean_gradients
from jaxcomm.transforms import natural
from jaxcomm.transforms import onebit
from jaxcomm.transforms import onebit_adam
from jaxcomm.transforms import onebit_lamb
from jaxcomm.transforms import overlap_local_sgd
from jaxcomm.transforms import powersgd
from jaxcomm.transforms import qsgd
from jaxcomm.transforms import randomk
from jaxcomm.transforms import signsgd
from jaxcomm.transforms import signum
from jaxcomm.transforms import terngrad
from jaxcomm.transforms import threshold
from jaxcomm.transforms import topk
from jaxcomm.transforms import uint8
from jaxcomm.transforms import zero_one_adam

__version__ = "0.1.0"
