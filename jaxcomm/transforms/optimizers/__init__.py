"""Communication-efficient optimizers: whole optimizers that exchange their
own compressed momentum.

DeMo, 1-bit Adam and 1-bit LAMB (their two-phase exchange in
``_onebit_common``) and 0/1 Adam, which runs on the local-update engine
(:mod:`jaxcomm._local_engine`) and wraps the sign quantizers (registry
family ``"optimizer"``).
"""

from jaxcomm.transforms.optimizers._demo import DeMoState
from jaxcomm.transforms.optimizers._demo import demo
from jaxcomm.transforms.optimizers._optimizers import OneBitAdamState
from jaxcomm.transforms.optimizers._optimizers import OneBitLambState
from jaxcomm.transforms.optimizers._optimizers import onebit_adam
from jaxcomm.transforms.optimizers._optimizers import onebit_lamb
from jaxcomm.transforms.optimizers._zero_one_adam import ZeroOneAdamState
from jaxcomm.transforms.optimizers._zero_one_adam import zero_one_adam

__all__ = [
  "demo",
  "DeMoState",
  "onebit_adam",
  "onebit_lamb",
  "OneBitAdamState",
  "OneBitLambState",
  "zero_one_adam",
  "ZeroOneAdamState",
]
