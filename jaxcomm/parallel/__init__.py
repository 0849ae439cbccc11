"""Data-parallel plumbing: meshes, per-device state, train steps, multi-host.

jaxcomm's optimizer state is partly per device (error-feedback residuals,
local momenta: every device keeps its own) and partly replicated (step
counters, PRNG keys, PowerSGD's Q, a downstream optimizer's moments). This
module owns that layout so users never hand-write it:

* :func:`state_layout` finds which state leaves are per device by tracing
  ``tx.update`` once inside ``shard_map`` and reading which outputs JAX types
  as varying over the data axis;
* per-device leaves are stored with a leading axis of size ``n`` sharded over
  the data axis (so orbax saves every device's residual), replicated leaves
  as they are;
* :class:`DataParallel` turns ``loss_fn`` and ``tx`` into a jitted
  ``shard_map`` train step with params replicated, the batch sharded, the
  state laid out as above and ``check_vma`` on;
* :func:`pmap_train_step` is the same step through ``jax.pmap``;
* :func:`initialize` starts many processes through ``jax.distributed``;
* :func:`resize_state` moves a state to a different device count without
  losing residual mass; :func:`reshard_state` moves a sharded step's state
  to other model-axis (FSDP) sizes.
"""

from jaxcomm.parallel._exchange import ShardedExchangeState
from jaxcomm.parallel._exchange import exchange_share
from jaxcomm.parallel._exchange import sharded_exchange
from jaxcomm.parallel._layout import init_state
from jaxcomm.parallel._layout import local_params
from jaxcomm.parallel._layout import param_specs
from jaxcomm.parallel._layout import shard_shapes
from jaxcomm.parallel._layout import shard_splits
from jaxcomm.parallel._layout import state_layout
from jaxcomm.parallel._layout import state_specs
from jaxcomm.parallel._layout import to_global
from jaxcomm.parallel._layout import to_local
from jaxcomm.parallel._mesh import make_mesh
from jaxcomm.parallel._mesh import make_pod_mesh
from jaxcomm.parallel._multihost import initialize
from jaxcomm.parallel._placement import _global  # noqa: F401 (trainer, tests)
from jaxcomm.parallel._placement import replicate
from jaxcomm.parallel._placement import shard_batch
from jaxcomm.parallel._pmap import pmap_replicate
from jaxcomm.parallel._pmap import pmap_train_step
from jaxcomm.parallel._reshard import reshard_state
from jaxcomm.parallel._resize import resize_params
from jaxcomm.parallel._resize import resize_state
from jaxcomm.parallel._shards import update_on_shards
from jaxcomm.parallel._step import DataParallel
from jaxcomm.parallel._step import consensus_distance
from jaxcomm.parallel._step import synchronized

__all__ = [
  "consensus_distance",
  "DataParallel",
  "exchange_share",
  "init_state",
  "initialize",
  "local_params",
  "make_mesh",
  "make_pod_mesh",
  "param_specs",
  "pmap_replicate",
  "pmap_train_step",
  "replicate",
  "reshard_state",
  "resize_params",
  "resize_state",
  "shard_batch",
  "shard_shapes",
  "shard_splits",
  "sharded_exchange",
  "ShardedExchangeState",
  "state_layout",
  "state_specs",
  "synchronized",
  "to_global",
  "to_local",
  "update_on_shards",
]
