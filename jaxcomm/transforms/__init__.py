"""Public compressor factories, one module per family."""

from jaxcomm.transforms._dense import cast
from jaxcomm.transforms._dense import mean_gradients
from jaxcomm.transforms._optimizers import OneBitAdamState
from jaxcomm.transforms._optimizers import OneBitLambState
from jaxcomm.transforms._optimizers import onebit_adam
from jaxcomm.transforms._optimizers import onebit_lamb
from jaxcomm.transforms._powersgd import PowerSGDState
from jaxcomm.transforms._powersgd import powersgd
from jaxcomm.transforms._quantization import OneBitState
from jaxcomm.transforms._quantization import SignumState
from jaxcomm.transforms._quantization import ef_signsgd
from jaxcomm.transforms._quantization import int8
from jaxcomm.transforms._quantization import natural
from jaxcomm.transforms._quantization import onebit
from jaxcomm.transforms._quantization import qsgd
from jaxcomm.transforms._quantization import signsgd
from jaxcomm.transforms._quantization import signum
from jaxcomm.transforms._quantization import terngrad
from jaxcomm.transforms._quantization import uint8
from jaxcomm.transforms._sparsification import csc
from jaxcomm.transforms._sparsification import dgc
from jaxcomm.transforms._sparsification import gtopk
from jaxcomm.transforms._sparsification import randomk
from jaxcomm.transforms._sparsification import threshold
from jaxcomm.transforms._sparsification import topk
