"""Public factories and state types, one module per family.

Each family module lists its public names in ``__all__``; they are exported
here and from ``jaxcomm`` (a new factory in a family module needs no line
in either), and methods are described in ``jaxcomm.registry``.
"""

# pylint: disable=wildcard-import
from jaxcomm.transforms import _adacomp
from jaxcomm.transforms import _atomo
from jaxcomm.transforms import _dcd
from jaxcomm.transforms import _delayed
from jaxcomm.transforms import _demo
from jaxcomm.transforms import _dense
from jaxcomm.transforms import _dgc
from jaxcomm.transforms import _diloco
from jaxcomm.transforms import _dist_ef_sgdm
from jaxcomm.transforms import _ecq
from jaxcomm.transforms import _fedcom
from jaxcomm.transforms import _global_topk
from jaxcomm.transforms import _gmc
from jaxcomm.transforms import _gossip
from jaxcomm.transforms import _gradiveq
from jaxcomm.transforms import _hierarchical
from jaxcomm.transforms import _ibcd
from jaxcomm.transforms import _integer
from jaxcomm.transforms import _lag
from jaxcomm.transforms import _local
from jaxcomm.transforms import _local_engine
from jaxcomm.transforms import _lupa
from jaxcomm.transforms import _mgs
from jaxcomm.transforms import _mx
from jaxcomm.transforms import _natural
from jaxcomm.transforms import _optimizers
from jaxcomm.transforms import _over_the_air
from jaxcomm.transforms import _powersgd
from jaxcomm.transforms import _qcs
from jaxcomm.transforms import _quantization
from jaxcomm.transforms import _scalecom
from jaxcomm.transforms import _sidco
from jaxcomm.transforms import _signs
from jaxcomm.transforms import _sketch
from jaxcomm.transforms import _sparcml
from jaxcomm.transforms import _sparsification
from jaxcomm.transforms import _squarm
from jaxcomm.transforms import _ternary
from jaxcomm.transforms import _variance
from jaxcomm.transforms import _zero_one_adam
from jaxcomm.transforms._adacomp import *
from jaxcomm.transforms._atomo import *
from jaxcomm.transforms._dcd import *
from jaxcomm.transforms._delayed import *
from jaxcomm.transforms._demo import *
from jaxcomm.transforms._dense import *
from jaxcomm.transforms._dgc import *
from jaxcomm.transforms._diloco import *
from jaxcomm.transforms._dist_ef_sgdm import *
from jaxcomm.transforms._ecq import *
from jaxcomm.transforms._fedcom import *
from jaxcomm.transforms._global_topk import *
from jaxcomm.transforms._gmc import *
from jaxcomm.transforms._gossip import *
from jaxcomm.transforms._gradiveq import *
from jaxcomm.transforms._hierarchical import *
from jaxcomm.transforms._ibcd import *
from jaxcomm.transforms._integer import *
from jaxcomm.transforms._lag import *
from jaxcomm.transforms._local import *
from jaxcomm.transforms._local_engine import *
from jaxcomm.transforms._lupa import *
from jaxcomm.transforms._mgs import *
from jaxcomm.transforms._mx import *
from jaxcomm.transforms._natural import *
from jaxcomm.transforms._optimizers import *
from jaxcomm.transforms._over_the_air import *
from jaxcomm.transforms._powersgd import *
from jaxcomm.transforms._qcs import *
from jaxcomm.transforms._quantization import *
from jaxcomm.transforms._scalecom import *
from jaxcomm.transforms._sidco import *
from jaxcomm.transforms._signs import *
from jaxcomm.transforms._sketch import *
from jaxcomm.transforms._sparcml import *
from jaxcomm.transforms._sparsification import *
from jaxcomm.transforms._squarm import *
from jaxcomm.transforms._ternary import *
from jaxcomm.transforms._variance import *
from jaxcomm.transforms._zero_one_adam import *

__all__ = []
__all__ += _adacomp.__all__
__all__ += _atomo.__all__
__all__ += _dcd.__all__
__all__ += _delayed.__all__
__all__ += _demo.__all__
__all__ += _dense.__all__
__all__ += _ecq.__all__
__all__ += _fedcom.__all__
__all__ += _dgc.__all__
__all__ += _diloco.__all__
__all__ += _dist_ef_sgdm.__all__
__all__ += _global_topk.__all__
__all__ += _gmc.__all__
__all__ += _lag.__all__
__all__ += _gossip.__all__
__all__ += _gradiveq.__all__
__all__ += _hierarchical.__all__
__all__ += _ibcd.__all__
__all__ += _integer.__all__
__all__ += _local.__all__
__all__ += _local_engine.__all__
__all__ += _lupa.__all__
__all__ += _mgs.__all__
__all__ += _mx.__all__
__all__ += _natural.__all__
__all__ += _optimizers.__all__
__all__ += _over_the_air.__all__
__all__ += _powersgd.__all__
__all__ += _qcs.__all__
__all__ += _quantization.__all__
__all__ += _scalecom.__all__
__all__ += _sidco.__all__
__all__ += _signs.__all__
__all__ += _sparcml.__all__
__all__ += _sketch.__all__
__all__ += _sparsification.__all__
__all__ += _squarm.__all__
__all__ += _ternary.__all__
__all__ += _variance.__all__
__all__ += _zero_one_adam.__all__
