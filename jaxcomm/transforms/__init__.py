"""Public factories and state types, one module per family.

Each family module lists its public names in ``__all__``; they are exported
here and from ``jaxcomm`` (a new factory in a family module needs no line
in either), and methods are described in ``jaxcomm.registry``.
"""

# pylint: disable=wildcard-import
from jaxcomm.transforms import _dense
from jaxcomm.transforms import _local
from jaxcomm.transforms import _optimizers
from jaxcomm.transforms import _powersgd
from jaxcomm.transforms import _quantization
from jaxcomm.transforms import _sparsification
from jaxcomm.transforms._dense import *
from jaxcomm.transforms._local import *
from jaxcomm.transforms._optimizers import *
from jaxcomm.transforms._powersgd import *
from jaxcomm.transforms._quantization import *
from jaxcomm.transforms._sparsification import *

__all__ = []
__all__ += _dense.__all__
__all__ += _local.__all__
__all__ += _optimizers.__all__
__all__ += _powersgd.__all__
__all__ += _quantization.__all__
__all__ += _sparsification.__all__
