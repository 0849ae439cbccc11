"""The TPU tier: every battery entry's step compiled by the real TPU
compiler for two slices, compile-only (libtpu, ``jaxcomm.aot``).

No TPU is needed: ``jax.experimental.topologies`` gives compile-only
devices of a TPU topology, and the step of :class:`jaxcomm.parallel.
DataParallel` lowers on abstract params. Each entry is compiled on two
slices of two generations (v5e 2x2 and v6e 2x2: 8 chips, a (dcn=2,
fsdp=4) mesh), sharded (``auto_axes=("fsdp",)``, a loss on whole arrays)
and in block mode (every axis manual, a tensor-parallel loss on blocks),
next to the plain jit step of the same model compiled the same way. From
the compiled programs:

* per-chip temporaries at most 1.25x the plain step's (+ 256 KiB: the
  plain step of this model holds 0.5 to 2 MiB, and a 128-lane tile of a
  small vector is 4 KiB);
* what crosses the slices (the megascale runtime's sends) is exactly what
  ``wire.claimed`` says the compressor sends for one chip's blocks, up to
  4 KiB of scalars (non-finite flags, the step counter), and no more than
  the plain step's all-reduce;
* with ``JAXCOMM_KERNELS=always`` the kernels lower by Mosaic inside the
  step (``tpu_custom_call``), for each generation.

Compile time is reported by ``benchmarks/bench_tpu.py``
(``docs/benchmarks/tpu.md``), not asserted: the machines are shared.
The model is small (an MLP of 0.5M params, 2 dense leaves of 256 x 1024
and a bias) so that the 2 x 51 x 2 compiles take about 5 minutes of the
suite on 2 cores; the layouts' blow-ups this tier exists for (a minor
dimension of 2 tiled to 128 lanes) show at any size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import aot
from jaxcomm import parallel
from tests import registry

ENTRIES = registry.load()
NAMES = sorted(ENTRIES)
GENERATIONS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
SLICES = 2
DIM = 256
TEMP_RATIO = 1.25
TEMP_SLACK = 256 << 10
SCALARS = 4096
# Entries whose arguments set a size that the tier's small model needs
# changed (as in tests/test_shards.py's memory test).
KWARGS = {"fetchsgd": {"cols": 4096}}


@functools.lru_cache(maxsize=None)
def _mesh(gen):
  try:
    return aot.slice_mesh(GENERATIONS[gen], SLICES)
  except ValueError as e:
    pytest.fail(f"the TPU tier needs libtpu (a test dependency): {e}")


def _block_loss(p, batch):
  """Block mode's loss: each chip holds ``w1[:, cols]``, ``w2[rows, :]``
  and ``b[cols]`` (Megatron's split of an MLP over fsdp) and its slice's
  batch; a reduce-scatter over fsdp gives each chip its columns of the
  output, a psum the loss."""
  h = jax.nn.gelu(batch["x"] @ p["w1"])
  out = jax.lax.psum_scatter(h @ p["w2"], "fsdp", scatter_dimension=1,
                             tiled=True) + p["b"]
  k = out.shape[1]
  y = jax.lax.dynamic_slice_in_dim(
    batch["y"], jax.lax.axis_index("fsdp") * k, k, axis=1)
  return jax.lax.psum(jnp.sum((out - y) ** 2), "fsdp") / y.size / 4


def _model(gen, mode):
  """``(loss_fn, params, batch, specs)``, abstract, on ``gen``'s mesh."""
  mesh = _mesh(gen)
  loss_fn, params, batch = aot.mlp(mesh, DIM)
  if mode == "block":
    sh = lambda *s: NamedSharding(mesh, P(*s))
    params = {
      "w1": jax.ShapeDtypeStruct((DIM, 4 * DIM), jnp.float32,
                                 sharding=sh(None, "fsdp")),
      "w2": jax.ShapeDtypeStruct((4 * DIM, DIM), jnp.float32,
                                 sharding=sh("fsdp", None)),
      "b": jax.ShapeDtypeStruct((DIM,), jnp.float32, sharding=sh("fsdp"))}
    data = jax.ShapeDtypeStruct((64, DIM), jnp.float32, sharding=sh("dcn"))
    batch = {"x": data, "y": data}
    loss_fn = _block_loss
  specs = jax.tree.map(lambda x: x.sharding.spec, params)
  return loss_fn, params, batch, specs


@functools.lru_cache(maxsize=None)
def _plain(gen):
  """The plain jit step's figures (XLA's own reductions; whole arrays)."""
  loss_fn, params, batch = aot.mlp(_mesh(gen), DIM)
  compiled, secs = aot.compile_lowered(
    aot.plain_step(loss_fn).lower(params, batch))
  return aot.analyze(compiled, secs, slices=SLICES)


def _compile(tx, gen, mode):
  loss_fn, params, batch, specs = _model(gen, mode)
  mesh = _mesh(gen)
  dp = parallel.DataParallel(
    loss_fn, tx, mesh, axis_name="dcn",
    auto_axes=("fsdp",) if mode == "sharded" else (), donate=False)
  p, state = dp.init(params)
  compiled, secs = aot.compile_lowered(dp.lower(p, state, batch))
  fig = aot.analyze(compiled, secs, slices=SLICES)
  return fig, state, params, specs


def _claim(tx, params, specs, gen):
  """What the compressor says one chip sends across the slices."""
  mesh = _mesh(gen)
  block = parallel.shard_shapes(params, specs, mesh)
  splits = parallel.shard_splits(specs, mesh)
  comp = jaxcomm.spec_of(tx)
  if comp is None:
    return None
  claim = jaxcomm.wire.claimed(tx, block, SLICES, splits=splits)
  return jaxcomm.wire.summarize(claim, n=SLICES, params=block).total_sent


def _check(name, gen, mode):
  entry = ENTRIES[name]
  tx = entry.make(axis_name="dcn", **KWARGS.get(name, {}))
  fig, state, params, specs = _compile(optax.chain(tx, optax.sgd(0.1)), gen,
                                       mode)
  base = _plain(gen)
  assert fig.temp <= TEMP_RATIO * base.temp + TEMP_SLACK, (
    f"{name} {gen} {mode}: temporaries {fig.temp} B per chip, the plain "
    f"step's {base.temp} B ({fig.temp / base.temp:.2f}x)")
  assert fig.transfers, (name, gen, mode)
  assert fig.crossing <= base.crossing + SCALARS, (
    name, gen, mode, fig.crossing, base.crossing)
  claim = _claim(tx, params, specs, gen)
  if claim is not None:
    assert abs(fig.crossing - claim) <= SCALARS, (
      f"{name} {gen} {mode}: {fig.crossing:.0f} B cross the slices, the "
      f"claim is {claim:.0f} B; sends: {fig.transfers}")
  return fig


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
@pytest.mark.parametrize("name", NAMES)
def test_sharded_step_compiles_for_tpu_within_plain_memory_and_claim(
    name, gen):
  _check(name, gen, "sharded")


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
@pytest.mark.parametrize("name", NAMES)
def test_block_step_compiles_for_tpu_within_plain_memory_and_claim(
    name, gen):
  _check(name, gen, "block")


def test_plain_step_sends_one_all_reduce_of_the_gradient():
  """The baseline itself, against arithmetic: the plain step hands the
  cross-slice runtime the chip's f32 gradient shards (w1, w2: 1/4 each;
  the bias whole) in all-reduces."""
  fig = _plain("v5e")
  assert {t.kind for t in fig.transfers} == {"all-reduce"}
  shards = 2 * DIM * 4 * DIM // 4 + DIM
  assert shards * 4 <= fig.handed <= shards * 4 + SCALARS, fig.transfers


def test_parse_a_megascale_send():
  """The send parser against a line of a compiled v5e step."""
  line = ('%send.2 = (f32[1024,8,128]{2,1,0:T(8,128)}, u32[], token[]) '
          'send(%bitcast.5, %after-all.2), channel_id=6, '
          'is_host_transfer=true, frontend_attributes={_xla_megascale_'
          'transfer_type="ALL_TO_ALL"}')
  (t,) = aot.transfers(line)
  assert t.kind == "all-to-all" and t.handed == 1024 * 8 * 128 * 4
  assert t.crossing(2) == t.handed / 2
  assert aot.Transfer("all-gather", 100.0, "").crossing(4) == 300.0
  assert aot.Transfer("all-reduce", 100.0, "").crossing(4) == 150.0


def test_bad_topology_is_named():
  with pytest.raises(ValueError, match="topology"):
    aot.slice_mesh("v5e", 2)
  with pytest.raises(ValueError, match="slices"):
    aot.slice_mesh("v5e:2x2", 0)
