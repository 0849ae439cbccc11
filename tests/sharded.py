"""Harness for compressors inside a step manual over the data axis only
(``DataParallel(auto_axes=...)``, ``parallel.update_on_shards``): each
device runs the compressor on its own blocks of the battery's params.

The sharded semantics are block-wise: the devices that hold the same block
of a leaf (one per slice along ``dcn``) form a battery of ``n = dcn``
devices on that block. :func:`block_indices` names the blocks, and the
tests replay each with the battery's numpy reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel
from tests import harness

DATA = "dcn"
AUTO = jax.sharding.AxisType.Auto

# Mesh shapes and how the battery's params are split over the model axes
# (every block of a compressed leaf keeps >= 256 elements, so the default
# leaf policy still compresses it, and PowerSGD's blocks stay worth
# factorizing at rank 4 on the first mesh; the bias stays dense and
# replicated, so it is updated as one copy per fsdp device).
MESHES = {
  "dcn2_fsdp4": (
    {"dcn": 2, "fsdp": 4},
    {"b": P(), "conv": P(None, None, "fsdp", None), "step": P(),
     "w": P("fsdp", None)}),
  "dcn2_fsdp2_tensor2": (
    {"dcn": 2, "fsdp": 2, "tensor": 2},
    {"b": P(), "conv": P(None, None, "tensor", "fsdp"), "step": P(),
     "w": P("fsdp", "tensor")}),
}


@functools.lru_cache(maxsize=None)
def mesh_of(name):
  shape, _ = MESHES[name]
  size = int(np.prod(list(shape.values())))
  return jax.make_mesh(tuple(shape.values()), tuple(shape),
                       axis_types=(AUTO,) * len(shape),
                       devices=jax.devices()[:size])


def auto_axes(mesh) -> tuple:
  return tuple(a for a in mesh.axis_names if a != DATA)


def placed_params(mesh_name, params=None):
  """The battery's params placed as the mesh's specs say."""
  mesh = mesh_of(mesh_name)
  _, specs = MESHES[mesh_name]
  params = harness.battery_params() if params is None else params
  return jax.tree.map(
    lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), params, specs)


def block_indices(mesh_name) -> list:
  """Per distinct block: ``{leaf: index}`` (a tuple of slices into the
  whole leaf), in the order of the state's rows inside one slice (model
  axes sorted by name, the first major)."""
  mesh = mesh_of(mesh_name)
  _, specs = MESHES[mesh_name]
  params = harness.battery_params()
  model = sorted(auto_axes(mesh))
  sizes = [mesh.shape[a] for a in model]
  out = []
  for flat in range(int(np.prod(sizes))):
    coords = dict(zip(model, np.unravel_index(flat, sizes)))
    idx = {}
    for k, x in params.items():
      sl = []
      for d, e in enumerate(tuple(specs[k]) + (None,) * (
          x.ndim - len(specs[k]))):
        if e is None:
          sl.append(slice(None))
          continue
        axes = e if isinstance(e, tuple) else (e,)
        k_blocks, pos = 1, 0
        for a in axes:
          pos = pos * mesh.shape[a] + int(coords[a])
          k_blocks *= mesh.shape[a]
        size = x.shape[d] // k_blocks
        sl.append(slice(pos * size, (pos + 1) * size))
      idx[k] = tuple(sl)
    out.append(idx)
  return out


def block_params(mesh_name):
  """The battery's params cut to one block's shapes."""
  idx = block_indices(mesh_name)[0]
  return {k: x[idx[k]] for k, x in harness.battery_params().items()}


def block_grads(grads_seq, idx) -> list:
  """``make_grads`` output (leading axis n) cut to one block."""
  return [{k: np.asarray(g[k])[(slice(None),) + idx[k]] for k in g}
          for g in grads_seq]


_STEPS = {}


def _stepper(tx, mesh_name):
  key = (id(tx), mesh_name)
  if key in _STEPS:
    return _STEPS[key]
  mesh = mesh_of(mesh_name)
  _, specs = MESHES[mesh_name]
  auto = auto_axes(mesh)
  params = placed_params(mesh_name)
  layout = parallel.state_layout(tx, params, mesh, DATA, specs=specs,
                                 auto_axes=auto)
  update = parallel.update_on_shards(tx, layout, specs, DATA, auto, mesh)
  s_specs = parallel.state_specs(layout, DATA, auto_axes=auto)

  def step(params, state, grads):
    grads = jax.tree.map(
      lambda g, p: g[0] if jnp.issubdtype(g.dtype, jnp.floating) else p,
      grads, params)
    # Zero params: the new params are the step's updates.
    return update(grads, state, params)

  fn = jax.jit(jax.shard_map(step, mesh=mesh,
                             in_specs=(P(), s_specs, P(DATA)),
                             out_specs=(P(), s_specs),
                             axis_names={DATA}))
  _STEPS[key] = (fn, layout, params)
  return _STEPS[key]


def place_grads(mesh_name, grads):
  mesh = mesh_of(mesh_name)
  _, specs = MESHES[mesh_name]
  return jax.tree.map(
    lambda g, sp: jax.device_put(g, NamedSharding(mesh, P(DATA, *sp))),
    grads, specs)


def device_run(tx, mesh_name, grads_seq, state=None):
  """``tx`` for ``len(grads_seq)`` steps on the mesh, on each device's
  blocks; returns (updates per step as whole host arrays, host state,
  layout)."""
  fn, layout, params = _stepper(tx, mesh_name)
  mesh = mesh_of(mesh_name)
  _, specs = MESHES[mesh_name]
  if state is None:
    state = parallel.init_state(tx, params, mesh, DATA, layout, specs=specs,
                                auto_axes=auto_axes(mesh))
  updates = []
  for grads in grads_seq:
    upd, state = fn(params, state, place_grads(mesh_name, grads))
    jax.block_until_ready((upd, state))
    updates.append(jax.device_get(upd))
  return updates, jax.device_get(state), layout


def lower(tx, mesh_name):
  fn, layout, params = _stepper(tx, mesh_name)
  mesh = mesh_of(mesh_name)
  _, specs = MESHES[mesh_name]
  state = parallel.init_state(tx, params, mesh, DATA, layout, specs=specs,
                              auto_axes=auto_axes(mesh))
  grads = harness.make_grads(0, 1, n=mesh.shape[DATA])[0]
  grads = place_grads(mesh_name, grads)
  return fn.lower(params, state, grads)


def residual_rows(state, mesh_name) -> dict:
  """Per compressed leaf (by name): the error-feedback memory of every
  state row (slice-major, then block), cut out of the flat buckets. A
  compressor may send a block whole where compressing it would not pay
  (PowerSGD on a narrow block): its leaves are the subset of the battery's
  compressed leaves whose block sizes fill the buffer."""
  found = jaxcomm.compress_states(state)
  assert found, "no CompressState in state"
  memory = found[0].residual or found[0].estimate
  width = sum(int(np.shape(b)[-1]) for b in memory)
  block = block_params(mesh_name)
  names = list(harness.COMPRESSED)
  for keep in (names, names[1:], names[:1]):
    if sum(int(np.prod(block[k].shape)) for k in keep) == width:
      parts = harness.split_buckets(memory, [block[k].shape for k in keep])
      return dict(zip(keep, parts))
  raise AssertionError(f"residual width {width} fits no compressed leaves")
