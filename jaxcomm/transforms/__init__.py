"""Public compressor factories, one module per family."""

from jaxcomm.transforms._dense import cast
from jaxcomm.transforms._dense import mean_gradients
