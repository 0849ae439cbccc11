"""Delayed averaging: when the averaged gradient is applied.

Pipe-SGD and stale-synchronous SGD wrap any compressor (the exchange) and
apply its mean one or more steps late; SPY, a solver for L1-regularized
problems, is here too (registry family ``"delay"``).
"""

from jaxcomm.transforms.delay._delayed import PipeSGDState
from jaxcomm.transforms.delay._delayed import SpyState
from jaxcomm.transforms.delay._delayed import StaleState
from jaxcomm.transforms.delay._delayed import pipe_sgd
from jaxcomm.transforms.delay._delayed import spy
from jaxcomm.transforms.delay._delayed import stale_sgd

__all__ = [
  "pipe_sgd",
  "stale_sgd",
  "PipeSGDState",
  "SpyState",
  "StaleState",
  "spy",
]
