"""Decentralized (gossip) methods: each device mixes parameters with its
neighbours on a topology; the replicas never agree exactly.

D-PSGD, CHOCO-SGD and SGP, DCD- and ECD-PSGD and SQuARM-SGD, on the
local-update engine (:mod:`jaxcomm._local_engine`); the compressed ones
wrap a sparsifier (registry family ``"local"``, ``gossip=True``).
"""

from jaxcomm.transforms.gossip._dcd import ReplicaState
from jaxcomm.transforms.gossip._dcd import dcd_psgd
from jaxcomm.transforms.gossip._dcd import ecd_psgd
from jaxcomm.transforms.gossip._gossip import ChocoState
from jaxcomm.transforms.gossip._gossip import PushSumState
from jaxcomm.transforms.gossip._gossip import choco
from jaxcomm.transforms.gossip._gossip import dpsgd
from jaxcomm.transforms.gossip._gossip import sgp
from jaxcomm.transforms.gossip._squarm import SquarmState
from jaxcomm.transforms.gossip._squarm import squarm

__all__ = [
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
]
