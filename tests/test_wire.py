"""jaxcomm.wire: collectives read from compiled HLO, bytes in closed form."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import wire


def _lower(fn, mesh, x, in_spec=P("data"), out_spec=P()):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(in_spec,),
                               out_specs=out_spec)).lower(x)


def test_psum_bytes_closed_form(mesh):
  x = jnp.zeros((8, 1000), jnp.float32)
  rep = wire.report(_lower(lambda a: jax.lax.psum(a[0], "data"), mesh, x))
  assert rep.payload == {"all-reduce": 4000}
  assert rep.sent["all-reduce"] == pytest.approx(2 * 7 / 8 * 4000)


def test_all_gather_and_all_to_all_closed_form(mesh):
  x = jnp.zeros((8, 64), jnp.float32)

  def f(a):
    g = jax.lax.all_gather(a[0], "data", tiled=True)        # 8*64 f32 out
    t = jax.lax.all_to_all(a.reshape(8, 8), "data", 0, 0, tiled=True)
    return g, t

  rep = wire.report(_lower(f, mesh, x, out_spec=(P("data"), P("data"))))
  assert rep.payload["all-gather"] == 8 * 64 * 4
  assert rep.payload["all-to-all"] == 64 * 4
  assert rep.sent["all-gather"] == pytest.approx(7 / 8 * 8 * 64 * 4)


def test_permute_and_int8_and_bf16_bytes(mesh):
  x = jnp.zeros((8, 100), jnp.float32)

  def f(a):
    perm = [(i, (i + 1) % 8) for i in range(8)]
    p = jax.lax.ppermute(a[0], "data", perm)
    return p

  rep = wire.report(_lower(f, mesh, x, out_spec=P("data")))
  assert rep.payload == {"collective-permute": 400}
  assert rep.sent["collective-permute"] == pytest.approx(400)


def test_subgroup_replica_groups(mesh):
  sub = jax.make_mesh((2, 4), ("a", "data"),
                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = jnp.zeros((8, 10), jnp.float32)
  f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=sub,
                            in_specs=P(("a", "data")), out_specs=P("a")))
  ops = wire.collectives(f.lower(x))
  assert [(o.kind, o.payload, o.group) for o in ops] == [
    ("all-reduce", 40, 4)]


def test_hlo_text_parsing_of_tuples_and_async():
  text = """
HloModule m, num_partitions=4
  %a = (f32[10]{0}, bf16[6]{0}) all-reduce(%x, %y), replica_groups={{0,1,2,3}}
  %b = (u32[2]{0}, u32[8]{0}) all-gather-start(%z), replica_groups=[1,4]<=[4]
  %c = u32[8]{0} all-gather-done(%b)
"""
  ops = wire.collectives(text)
  assert ops == [wire.Op("all-reduce", 52, 4), wire.Op("all-gather", 32, 4)]


# One step's collectives on 8 CPU devices (mesh a=2, data=4: psums of a
# tuple and of int8 over every device, an all-gather, an all-to-all, a
# ppermute, a psum_scatter), verbatim from jaxlib 0.10.2's and jaxlib
# 0.12.0.1's compiled text, metadata cut; the newer one prints replica
# groups over the mesh's axes. Payloads by hand (elements x bytes). In the
# texts below a backslash at the end of a line continues the instruction.
_CPU_LINES = {
  "0.10.2": (
    "replica_groups={{0,1,2,3},{4,5,6,7}}",
    "replica_groups={{0,1,2,3,4,5,6,7}}"),
  "0.12.0.1": (
    "replica_groups=mesh['a'=2,'data'=4] {'data'}",
    "replica_groups=mesh['a'=2,'data'=4] {'a','data'}"),
}
_CPU_TEXT = """HloModule jit_f, num_partitions=8
  %all_gather.3 = f32[4000]{0} all-gather(%bitcast), channel_id=1, \
DATA, dimensions={0}, use_global_device_ids=true
  %ppermute.3 = f32[1000]{0} collective-permute(%bitcast), channel_id=1, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %reduce_scatter.7 = f32[1,250]{1,0} reduce-scatter(%bitcast.2), \
channel_id=1, DATA, use_global_device_ids=true, dimensions={0}, \
to_apply=%region_3.0
  %all-to-all = (f32[1,250]{1,0}, f32[1,250]{1,0}, f32[1,250]{1,0}, \
f32[1,250]{1,0}) all-to-all(%wrapped_slice, %wrapped_slice.1, \
%wrapped_slice.2, %wrapped_slice.3), channel_id=1, DATA
  %psum.30 = s8[6]{0} all-reduce(%convert_bitcast_fusion), channel_id=1, \
EVERY, use_global_device_ids=true, to_apply=%region_4.0
  %all-reduce = (f32[1000]{0}, f32[6]{0}) all-reduce(%bitcast, \
%convert_bitcast_fusion.1), channel_id=1, DATA, \
use_global_device_ids=true, to_apply=%region_0.0
"""
_CPU_OPS = [wire.Op("all-gather", 4000 * 4, 4),
            wire.Op("collective-permute", 1000 * 4, 8, 8 / 8),
            wire.Op("reduce-scatter", 250 * 4 * 4, 4),
            wire.Op("all-to-all", 4 * 250 * 4, 4),
            wire.Op("all-reduce", 6 * 1, 8),
            wire.Op("all-reduce", (1000 + 6) * 4, 4)]


@pytest.mark.parametrize("jaxlib", sorted(_CPU_LINES))
def test_cpu_collectives_of_two_jaxlibs(jaxlib):
  data, every = _CPU_LINES[jaxlib]
  text = _CPU_TEXT.replace("DATA", data).replace("EVERY", every)
  assert wire.collectives(text) == _CPU_OPS


# In-slice collectives of the int8 sharded step compiled for v5e by libtpu
# 0.0.42.1 and 0.0.50.1 (the same text from both), metadata cut: tiles,
# tile groups and memory spaces in the layouts; then synthetic lines as a
# later compiler may print them (async halves whose operands sit in
# another memory space, variadic gathers, comments, packed 4-bit values,
# a bounded dynamic dimension, new attributes), a computation named after
# a collective and a fusion that calls it (no collective of their own).
_TPU_TEXT = """HloModule jit_step, is_scheduled=true, num_partitions=8
%all-reduce-scatter.2 (input_0: f32[256,1024]) -> f32[64,1024] {
  %fusion.98 = (f32[64,1024]{1,0:T(8,128)S(1)}, f32[1024,64]{0,1:T(8,128)\
S(1)}) fusion(%fusion.38, %fusion.23), kind=kCustom, \
calls=%all-reduce-scatter.2
}
ENTRY %main.1 (p: f32[8]) -> f32[8] {
  %all-gather.24 = bf16[1024,256]{0,1:T(8,128)(2,1)S(1)} all-gather(\
%param_0.578), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={1}, \
use_global_device_ids=true, frontend_attributes={chain_id="0"}
  %all-reduce.35 = (f32[]{:T(128)}, f32[256]{0:T(256)S(1)}) all-reduce(\
%get-tuple-element.74, %get-tuple-element.73), channel_id=20, \
replica_groups={{0,1,2,3}}, use_global_device_ids=true, \
to_apply=%region_17.19.clone
  %ags = ((f32[8]{0:S(1)}, bf16[4]{0}), (f32[32]{0:T(256)S(1)}, \
bf16[16]{0})) all-gather-start(%a, %b), replica_groups=[1,4]<=[4], \
dimensions={0}
  %agd = (f32[32]{0}, bf16[16]{0}) all-gather-done(%ags)
  %cps = (f32[100]{0:S(1)}, f32[100]{0}, u32[]{:S(2)}, u32[]{:S(2)}) \
collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %ars = (f32[10]{0:T(256)S(1)}, /*index=1*/s4[64]{0:E(4)}) \
all-reduce-start(%y, %z), replica_groups={{0,1}}, new_attr={k=(1,2)}
  %ard = (f32[10]{0}, s4[64]{0:E(4)}) all-reduce-done(%ars)
  ROOT %dyn = f32[<=32,4]{1,0:T(8,128)} all-gather(%w), \
replica_groups={{0,1,2,3}}, dimensions={0}
}
"""


def test_tpu_and_synthetic_collectives():
  assert wire.collectives(_TPU_TEXT) == [
    wire.Op("all-gather", 1024 * 256 * 2, 4),
    wire.Op("all-reduce", 4 + 256 * 4, 4),
    wire.Op("all-gather", 32 * 4 + 16 * 2, 4),
    wire.Op("collective-permute", 100 * 4, 8, 2 / 8),
    wire.Op("all-reduce", 10 * 4 + 64 // 2, 2),
    wire.Op("all-gather", 32 * 4 * 4, 4)]


@pytest.mark.parametrize("line,why", [
  ("%bad.1 = f32[8]{0:T(8,128)S(1) all-reduce(%x)", "unclosed '{'"),
  ("%bad.1 = q77[8]{0} all-reduce(%x)", "unknown element type 'q77'"),
  ("%bad.1 = (f32[8]{0} f32[8]{0}) all-gather-start(%x)", "expected ','"),
  ("%bad.1 = f32[8]{0} all-gather-start(%x)", "not a tuple"),
])
def test_an_unreadable_collective_is_named_with_the_versions(line, why):
  """A collective whose line cannot be read is an error naming it and the
  versions that printed it, never a collective of 0 bytes."""
  import importlib.metadata  # noqa: PLC0415
  with pytest.raises(ValueError, match="wire.collectives") as e:
    wire.collectives("HloModule m, num_partitions=8\n  " + line)
  msg = str(e.value)
  assert "%bad.1" in msg and why in msg, msg
  assert f"jaxlib {importlib.metadata.version('jaxlib')}" in msg, msg


@pytest.mark.parametrize("dtype,bits", [
  ("pred", 8), ("s4", 4), ("u8", 8), ("bf16", 16), ("f16", 16),
  ("f32", 32), ("f64", 64), ("c64", 64), ("c128", 128), ("token", 0),
  ("f8e4m3fn", 8), ("f8e5m2", 8), ("f8e8m0fnu", 8), ("f4e2m1fn", 4),
  ("f99", None), ("tuple", None)])
def test_element_widths(dtype, bits):
  from jaxcomm import _hlo  # noqa: PLC0415
  assert _hlo.dtype_bits(dtype) == bits


def test_shape_reader_keeps_memory_spaces_and_packing():
  """A nested tuple read field by field: dims, the layout's memory space
  and element size, bytes by hand; where the shape ends."""
  from jaxcomm import _hlo  # noqa: PLC0415
  text = ("((f32[2,3]{1,0:T(2,128)S(1)}, s4[5]{0:E(4)}), u8[]{:S(2)}, "
          "/*index=2*/token[]) send(%a)")
  shape, end = _hlo.parse_shape(text)
  (pair, u8, token) = shape.elements
  (f32, s4) = pair.elements
  assert (f32.dims, f32.memory_space, f32.nbytes) == ((2, 3), 1, 24)
  assert (s4.element_bits, s4.nbytes) == (4, 3)        # 5 x 4 bits
  assert (u8.dims, u8.memory_space, u8.nbytes) == ((), 2, 1)
  assert token.nbytes == 0 and shape.nbytes == 24 + 3 + 1
  assert text[end:].startswith(" send(")
  assert str(f32) == "f32[2,3]"


@pytest.mark.parametrize("groups,size", (
  # Explicit lists.
  ("{{0,1,2,3},{4,5,6,7}}", 4),
  ("{{0,4},{1,5},{2,6},{3,7}}", 2),
  ("{{0,1,2,3,4,5,6,7}}", 8),
  # Iota form: [G,S]<=[dims] and [G,S]<=[dims]T(perm), G groups of S.
  ("[2,4]<=[8]", 4),
  ("[1,8]<=[8]", 8),
  ("[2,4]<=[4,2]T(1,0)", 4),
  ("[4,2]<=[2,4]T(1,0)", 2),
  ("[2,2]<=[2,2]T(1,0)", 2),
  # Mesh-axes form (JAX 0.11): the product of the named axes' sizes.
  ("mesh['a'=2,'data'=4] {'data'}", 4),
  ("mesh['a'=2,'data'=4] {'a'}", 2),
  ("mesh['a'=2,'data'=4] {'a','data'}", 8),
  ("mesh[a=2,data=4] {data}", 4),
  ("mesh['data'=8] {'data':(2)4}", 4),
  ("mesh['x'=2,'y'=4], device_ids=([[0,2,4,6],[1,3,5,7]]) {'y'}", 4),
  # No groups: every device.
  ("{}", 8),
))
def test_replica_group_forms(groups, size):
  text = ("HloModule m, num_partitions=8\n"
          "  %a = f32[10]{0} all-reduce(%x), channel_id=1, "
          f"replica_groups={groups}, use_global_device_ids=true, "
          "to_apply=%sum\n")
  assert wire.collectives(text) == [wire.Op("all-reduce", 40, size)]


def test_replica_groups_jax_011_line():
  # Verbatim (metadata cut) from JAX 0.11.2's CPU compile of the subgroup
  # psum of test_subgroup_replica_groups.
  text = (
    "HloModule jit_f, num_partitions=8\n"
    "  ROOT %psum_invariant.7 = f32[1,10]{1,0} all-reduce(%param.1), "
    "channel_id=1, replica_groups=mesh['a'=2,'data'=4] {'data'}, "
    "use_global_device_ids=true, to_apply=%region_0.0\n")
  assert wire.collectives(text) == [wire.Op("all-reduce", 40, 4)]


def test_dense_payload_counts_float_leaves_only():
  params = {"w": jnp.zeros((3, 4)), "i": jnp.zeros((5,), jnp.int32),
            "h": jnp.zeros((2,), jnp.bfloat16)}
  assert wire.dense_payload(params) == (12 + 2) * 4


def test_cost_model_closed_forms():
  m = wire.CostModel(alpha=1e-5, beta=1e-9)
  s, n = 1e6, 8
  assert m.time("all-reduce", s, n) == pytest.approx(
    2 * 7 * 1e-5 + 2 * 7 / 8 * s * 1e-9)
  tree = wire.CostModel(alpha=1e-5, beta=1e-9, algorithm="tree")
  assert tree.time("all-reduce", s, n) == pytest.approx(
    2 * 3 * (1e-5 + s * 1e-9))
  rd = wire.CostModel(alpha=1e-5, beta=1e-9, algorithm="recursive_doubling")
  assert rd.time("all-reduce", s, n) == pytest.approx(3 * (1e-5 + s * 1e-9))
  assert m.time("all-reduce", s, 1) == 0.0
  # Ring beats tree for large messages, latency dominates small ones.
  assert m.time("all-reduce", 1e9, 64) < tree.time("all-reduce", 1e9, 64)
  assert rd.time("all-reduce", 8, 64) < m.time("all-reduce", 8, 64)
  link = wire.CostModel.link(25.0, latency_us=0)
  assert link.time("all-reduce", 100e6, 2) == pytest.approx(
    100e6 * 8 / 25e9)


def test_cost_model_and_summary_bad_input():
  with pytest.raises(ValueError, match="alpha"):
    wire.CostModel(alpha=-1, beta=0)
  with pytest.raises(ValueError, match="algorithm"):
    wire.CostModel(alpha=0, beta=0, algorithm="butterfly")
  with pytest.raises(ValueError, match="gbit_per_s"):
    wire.CostModel.link(0)
  with pytest.raises(ValueError, match="kind"):
    wire.sent_bytes("broadcast", 1, 2)
  with pytest.raises(ValueError, match="step"):
    wire.collectives(object())


def test_summary_ratio_against_dense():
  params = {"w": np.zeros((1000,), np.float32)}
  rep = wire.summarize([("all-reduce", 400)], n=8, params=params)
  assert rep.ratio == pytest.approx(10.0)
  assert math.isinf(wire.summarize([], n=8, params=params).ratio)
  assert "ratio" in rep.table()


def test_report_prints_as_a_table(mesh):
  x = jnp.zeros((8, 1000), jnp.float32)
  params = {"w": np.zeros((1000,), np.float32)}
  rep = wire.report(_lower(lambda a: jax.lax.psum(a[0], "data"), mesh, x),
                    params=params)
  # A psum of the whole parameter vector: 2 * 7/8 * 4000 = 7000 bytes sent,
  # as many as the dense baseline, ratio 1.
  want = "\n".join([
    "| op | payload bytes | sent bytes/device |", "|---|---:|---:|",
    "| all-reduce | 4,000 | 7,000 |", "| total | | 7,000 |",
    "| dense f32 psum | | 7,000 |", "| ratio | | 1.0x |"])
  assert str(rep) == want
  assert f"{rep}" == want


def test_report_compiles_an_nnx_lowering(mesh):
  """flax's nnx.jit(...).lower(...) is not a jax.stages.Lowered: its text
  is StableHLO without HLO collectives until it is compiled."""
  nnx = pytest.importorskip("flax.nnx")
  x = jnp.zeros((8, 1000), jnp.float32)
  fn = jax.shard_map(lambda a: jax.lax.psum(a[0], "data"), mesh=mesh,
                     in_specs=(P("data"),), out_specs=P())
  rep = wire.report(nnx.jit(fn).lower(x))
  assert rep.payload == {"all-reduce": 4000}
  assert rep.total_sent == pytest.approx(2 * 7 / 8 * 4000)


def test_report_without_collectives_is_an_error():
  """A step with no collective (one device, or a step whose exchange was
  compiled away) must not report total_sent=0 and ratio=inf."""
  lowered = jax.jit(lambda a: a * 2).lower(jnp.zeros((10,), jnp.float32))
  with pytest.raises(ValueError, match="no collective"):
    wire.report(lowered, params={"w": np.zeros((10,), np.float32)})
