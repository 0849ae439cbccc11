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
