"""jaxcomm: communication-efficient data-parallel training for JAX.

Gradient compressors are Optax gradient transformations that carry their own
error-feedback state; use them inside a ``jax.shard_map`` (or
``jax.pmap``) train step::

  tx = optax.chain(jaxcomm.powersgd(rank=4), optax.sgd(0.1))

The names below are the public API: the factories and state types of
:mod:`jaxcomm.transforms`, the compressor machinery (:func:`compressed`,
:class:`Codec`, :class:`LeafPolicy`, ...) and the subpackages
:mod:`jaxcomm.parallel`, :mod:`jaxcomm.collectives`,
:mod:`jaxcomm.registry`, :mod:`jaxcomm.wire` and :mod:`jaxcomm.advise`
(loaded on first use).
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
from jaxcomm.transforms import AdaCommSchedule
from jaxcomm.transforms import ChocoState
from jaxcomm.transforms import DeMoState
from jaxcomm.transforms import DistEfSgdmState
from jaxcomm.transforms import FedcomState
from jaxcomm.transforms import LocalState
from jaxcomm.transforms import LupaSchedule
from jaxcomm.transforms import OneBitAdamState
from jaxcomm.transforms import OneBitLambState
from jaxcomm.transforms import OneBitState
from jaxcomm.transforms import OverTheAirCodec
from jaxcomm.transforms import PipeSGDState
from jaxcomm.transforms import PowerSGDState
from jaxcomm.transforms import PushSumState
from jaxcomm.transforms import ReplicaState
from jaxcomm.transforms import RequantizedState
from jaxcomm.transforms import SignumState
from jaxcomm.transforms import SpyState
from jaxcomm.transforms import SquarmState
from jaxcomm.transforms import StaleState
from jaxcomm.transforms import ZeroOneAdamState
from jaxcomm.transforms import adacomm
from jaxcomm.transforms import adacomp
from jaxcomm.transforms import apply_updates
from jaxcomm.transforms import atomo
from jaxcomm.transforms import cast
from jaxcomm.transforms import choco
from jaxcomm.transforms import csc
from jaxcomm.transforms import dcd_psgd
from jaxcomm.transforms import demo
from jaxcomm.transforms import dgc
from jaxcomm.transforms import diloco
from jaxcomm.transforms import dist_ef_sgdm
from jaxcomm.transforms import dpsgd
from jaxcomm.transforms import ecd_psgd
from jaxcomm.transforms import ecq_sgd
from jaxcomm.transforms import ef_signsgd
from jaxcomm.transforms import fedcom
from jaxcomm.transforms import fedcomgate
from jaxcomm.transforms import fetchsgd
from jaxcomm.transforms import gmc
from jaxcomm.transforms import gradiveq
from jaxcomm.transforms import gtopk
from jaxcomm.transforms import hierarchical_sgd
from jaxcomm.transforms import ibcd
from jaxcomm.transforms import int4
from jaxcomm.transforms import int8
from jaxcomm.transforms import lag
from jaxcomm.transforms import local_sgd
from jaxcomm.transforms import local_states
from jaxcomm.transforms import lupa_increment
from jaxcomm.transforms import lupa_sgd
from jaxcomm.transforms import mean_gradients
from jaxcomm.transforms import mgs
from jaxcomm.transforms import muloco
from jaxcomm.transforms import mx
from jaxcomm.transforms import natural
from jaxcomm.transforms import onebit
from jaxcomm.transforms import onebit_adam
from jaxcomm.transforms import onebit_lamb
from jaxcomm.transforms import ota_analog
from jaxcomm.transforms import ota_onebit
from jaxcomm.transforms import overlap_local_sgd
from jaxcomm.transforms import pipe_sgd
from jaxcomm.transforms import powersgd
from jaxcomm.transforms import qcs
from jaxcomm.transforms import qsgd
from jaxcomm.transforms import randomk
from jaxcomm.transforms import sbc
from jaxcomm.transforms import scalecom
from jaxcomm.transforms import sgp
from jaxcomm.transforms import sidco
from jaxcomm.transforms import signsgd
from jaxcomm.transforms import signum
from jaxcomm.transforms import sparcml
from jaxcomm.transforms import spy
from jaxcomm.transforms import squarm
from jaxcomm.transforms import stale_sgd
from jaxcomm.transforms import stc
from jaxcomm.transforms import terngrad
from jaxcomm.transforms import threshold
from jaxcomm.transforms import topk
from jaxcomm.transforms import uint8
from jaxcomm.transforms import variance_sparsification
from jaxcomm.transforms import zero_one_adam

__version__ = "0.1.0"

__all__ = [
  "adacomm",
  "AdaCommSchedule",
  "adacomp",
  "advise",
  "apply_updates",
  "atomo",
  "cast",
  "choco",
  "ChocoState",
  "Codec",
  "CodecBase",
  "CodecResult",
  "collectives",
  "compress_states",
  "compressed",
  "CompressState",
  "CompressStats",
  "Context",
  "csc",
  "dcd_psgd",
  "demo",
  "DeMoState",
  "dgc",
  "diloco",
  "dist_ef_sgdm",
  "DistEfSgdmState",
  "dpsgd",
  "ecd_psgd",
  "ecq_sgd",
  "ef_signsgd",
  "fedcom",
  "fedcomgate",
  "FedcomState",
  "fetchsgd",
  "gmc",
  "GossipCodec",
  "gradiveq",
  "gtopk",
  "hierarchical_sgd",
  "ibcd",
  "int4",
  "int8",
  "lag",
  "LeafPolicy",
  "local_sgd",
  "local_states",
  "LocalState",
  "lupa_increment",
  "lupa_sgd",
  "LupaSchedule",
  "mean_gradients",
  "mgs",
  "muloco",
  "mx",
  "natural",
  "onebit",
  "onebit_adam",
  "onebit_lamb",
  "OneBitAdamState",
  "OneBitLambState",
  "OneBitState",
  "ota_analog",
  "ota_onebit",
  "overlap_local_sgd",
  "OverTheAirCodec",
  "parallel",
  "pipe_sgd",
  "PipeSGDState",
  "powersgd",
  "PowerSGDState",
  "PushSumState",
  "qcs",
  "qsgd",
  "randomk",
  "registry",
  "ReplicaState",
  "RequantizedState",
  "sbc",
  "scalecom",
  "sgp",
  "sidco",
  "signsgd",
  "signum",
  "SignumState",
  "sparcml",
  "spec_of",
  "spy",
  "SpyState",
  "squarm",
  "SquarmState",
  "stale_sgd",
  "StaleState",
  "stats",
  "stc",
  "SteppedCodec",
  "terngrad",
  "threshold",
  "topk",
  "uint8",
  "variance_sparsification",
  "wire",
  "zero_one_adam",
  "ZeroOneAdamState",
]


def __getattr__(name):
  # jaxcomm.advise loads on first use, so that ``python -m jaxcomm.advise``
  # runs it as a script without a second copy of the module.
  if name == "advise":
    return importlib.import_module("jaxcomm.advise")
  raise AttributeError(f"module 'jaxcomm' has no attribute {name!r}")
