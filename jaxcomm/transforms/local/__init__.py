"""Local-update methods: an inner optimizer run for several steps between
syncs of the parameters.

Local SGD, AdaComm, overlap local SGD, hierarchical SGD, DiLoCo and
MuLoCo, FedCOM and FedCOMGATE and LUPA-SGD, all on one engine
(:mod:`jaxcomm._local_engine`, whose state types and helpers are exported
here); a method may wrap a quantizer for its sync (registry family
``"local"``).
"""

from jaxcomm._local_engine import AdaCommSchedule
from jaxcomm._local_engine import LocalState
from jaxcomm._local_engine import apply_updates
from jaxcomm._local_engine import local_states
from jaxcomm.transforms.local._diloco import diloco
from jaxcomm.transforms.local._diloco import muloco
from jaxcomm.transforms.local._fedcom import FedcomState
from jaxcomm.transforms.local._fedcom import fedcom
from jaxcomm.transforms.local._fedcom import fedcomgate
from jaxcomm.transforms.local._hierarchical import hierarchical_sgd
from jaxcomm.transforms.local._local import adacomm
from jaxcomm.transforms.local._local import local_sgd
from jaxcomm.transforms.local._local import overlap_local_sgd
from jaxcomm.transforms.local._lupa import LupaSchedule
from jaxcomm.transforms.local._lupa import lupa_increment
from jaxcomm.transforms.local._lupa import lupa_sgd

__all__ = [
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
]
