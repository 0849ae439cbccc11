"""Public factories and state types, one package per family.

Gradient compressors by kind (:mod:`~jaxcomm.transforms.quantize`,
:mod:`~jaxcomm.transforms.sparsify`, :mod:`~jaxcomm.transforms.lowrank`),
whole optimizers (:mod:`~jaxcomm.transforms.optimizers`), local-update and
decentralized methods (:mod:`~jaxcomm.transforms.local`,
:mod:`~jaxcomm.transforms.gossip`) and delayed averaging
(:mod:`~jaxcomm.transforms.delay`). Each family package lists its public
names in ``__all__``; they are exported here and from ``jaxcomm``, and
methods are described in ``jaxcomm.registry`` (importing this package
registers them).
"""

from jaxcomm.transforms.delay import PipeSGDState
from jaxcomm.transforms.delay import SpyState
from jaxcomm.transforms.delay import StaleState
from jaxcomm.transforms.delay import pipe_sgd
from jaxcomm.transforms.delay import spy
from jaxcomm.transforms.delay import stale_sgd
from jaxcomm.transforms.gossip import ChocoState
from jaxcomm.transforms.gossip import PushSumState
from jaxcomm.transforms.gossip import ReplicaState
from jaxcomm.transforms.gossip import SquarmState
from jaxcomm.transforms.gossip import choco
from jaxcomm.transforms.gossip import dcd_psgd
from jaxcomm.transforms.gossip import dpsgd
from jaxcomm.transforms.gossip import ecd_psgd
from jaxcomm.transforms.gossip import sgp
from jaxcomm.transforms.gossip import squarm
from jaxcomm.transforms.local import AdaCommSchedule
from jaxcomm.transforms.local import FedcomState
from jaxcomm.transforms.local import LocalState
from jaxcomm.transforms.local import LupaSchedule
from jaxcomm.transforms.local import adacomm
from jaxcomm.transforms.local import apply_updates
from jaxcomm.transforms.local import diloco
from jaxcomm.transforms.local import fedcom
from jaxcomm.transforms.local import fedcomgate
from jaxcomm.transforms.local import hierarchical_sgd
from jaxcomm.transforms.local import local_sgd
from jaxcomm.transforms.local import local_states
from jaxcomm.transforms.local import lupa_increment
from jaxcomm.transforms.local import lupa_sgd
from jaxcomm.transforms.local import muloco
from jaxcomm.transforms.local import overlap_local_sgd
from jaxcomm.transforms.lowrank import PowerSGDState
from jaxcomm.transforms.lowrank import atomo
from jaxcomm.transforms.lowrank import gradiveq
from jaxcomm.transforms.lowrank import powersgd
from jaxcomm.transforms.optimizers import DeMoState
from jaxcomm.transforms.optimizers import OneBitAdamState
from jaxcomm.transforms.optimizers import OneBitLambState
from jaxcomm.transforms.optimizers import ZeroOneAdamState
from jaxcomm.transforms.optimizers import demo
from jaxcomm.transforms.optimizers import onebit_adam
from jaxcomm.transforms.optimizers import onebit_lamb
from jaxcomm.transforms.optimizers import zero_one_adam
from jaxcomm.transforms.quantize import DistEfSgdmState
from jaxcomm.transforms.quantize import OneBitState
from jaxcomm.transforms.quantize import OverTheAirCodec
from jaxcomm.transforms.quantize import RequantizedState
from jaxcomm.transforms.quantize import SignumState
from jaxcomm.transforms.quantize import cast
from jaxcomm.transforms.quantize import dist_ef_sgdm
from jaxcomm.transforms.quantize import ecq_sgd
from jaxcomm.transforms.quantize import ef_signsgd
from jaxcomm.transforms.quantize import int4
from jaxcomm.transforms.quantize import int8
from jaxcomm.transforms.quantize import mean_gradients
from jaxcomm.transforms.quantize import mx
from jaxcomm.transforms.quantize import natural
from jaxcomm.transforms.quantize import onebit
from jaxcomm.transforms.quantize import ota_analog
from jaxcomm.transforms.quantize import ota_onebit
from jaxcomm.transforms.quantize import qcs
from jaxcomm.transforms.quantize import qsgd
from jaxcomm.transforms.quantize import signsgd
from jaxcomm.transforms.quantize import signum
from jaxcomm.transforms.quantize import terngrad
from jaxcomm.transforms.quantize import uint8
from jaxcomm.transforms.sparsify import adacomp
from jaxcomm.transforms.sparsify import csc
from jaxcomm.transforms.sparsify import dgc
from jaxcomm.transforms.sparsify import fetchsgd
from jaxcomm.transforms.sparsify import gmc
from jaxcomm.transforms.sparsify import gtopk
from jaxcomm.transforms.sparsify import ibcd
from jaxcomm.transforms.sparsify import lag
from jaxcomm.transforms.sparsify import mgs
from jaxcomm.transforms.sparsify import randomk
from jaxcomm.transforms.sparsify import sbc
from jaxcomm.transforms.sparsify import scalecom
from jaxcomm.transforms.sparsify import sidco
from jaxcomm.transforms.sparsify import sparcml
from jaxcomm.transforms.sparsify import stc
from jaxcomm.transforms.sparsify import threshold
from jaxcomm.transforms.sparsify import topk
from jaxcomm.transforms.sparsify import variance_sparsification

__all__ = [
  # quantize
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
  # sparsify
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
  # lowrank
  "powersgd",
  "PowerSGDState",
  "atomo",
  "gradiveq",
  # optimizers
  "demo",
  "DeMoState",
  "onebit_adam",
  "onebit_lamb",
  "OneBitAdamState",
  "OneBitLambState",
  "zero_one_adam",
  "ZeroOneAdamState",
  # local
  "diloco",
  "muloco",
  "fedcom",
  "fedcomgate",
  "FedcomState",
  "hierarchical_sgd",
  "local_sgd",
  "adacomm",
  "overlap_local_sgd",
  "apply_updates",
  "local_states",
  "AdaCommSchedule",
  "LocalState",
  "lupa_sgd",
  "LupaSchedule",
  "lupa_increment",
  # gossip
  "dpsgd",
  "choco",
  "sgp",
  "ChocoState",
  "PushSumState",
  "dcd_psgd",
  "ecd_psgd",
  "ReplicaState",
  "squarm",
  "SquarmState",
  # delay
  "pipe_sgd",
  "stale_sgd",
  "PipeSGDState",
  "SpyState",
  "StaleState",
  "spy",
]
