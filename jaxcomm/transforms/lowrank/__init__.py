"""Low-rank compressors: gradient compressors that send a factorization.

PowerSGD's power iteration, ATOMO's sampled singular vectors and
GradiVeQ's principal components. Each is a codec run by
:func:`jaxcomm.compressed` (registry family ``"compressor"``, kind
``"lowrank"``).
"""

from jaxcomm.transforms.lowrank._atomo import atomo
from jaxcomm.transforms.lowrank._gradiveq import gradiveq
from jaxcomm.transforms.lowrank._powersgd import PowerSGDState
from jaxcomm.transforms.lowrank._powersgd import powersgd

__all__ = [
  "powersgd",
  "PowerSGDState",
  "atomo",
  "gradiveq",
]
