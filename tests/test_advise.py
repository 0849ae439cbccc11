"""jaxcomm.advise against the alpha-beta formulas written out by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxcomm
from jaxcomm import advise
from jaxcomm import wire

_P = {"w": jax.ShapeDtypeStruct((512, 256), jnp.float32)}
_BYTES = 512 * 256 * 4
_ALPHA, _GBIT = 50e-6, 10.0
_BETA = 8.0 / (_GBIT * 1e9)


def _ring_allreduce(n, s, alpha=_ALPHA, beta=_BETA):
  return 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta


def _axes(hosts=8, per_host=4):
  return [advise.Axis("dcn", hosts, wire.CostModel.link(_GBIT, 50.0)),
          advise.Axis("ici", per_host, wire.CostModel.link(800.0, 5.0))]


# Every compressor's step also agrees on finiteness: one float32 flag that
# rides in the fused dense all-reduce (mean_gradients) or in an all-reduce
# of its own (ARCHITECTURE.md, "Non-finite gradients").
_FLAG = 4


def test_dense_and_local_follow_the_ring_formula():
  cands = [advise.Candidate("dense", lambda a: jaxcomm.mean_gradients(
             axis_name=a), None, 0.0),
           advise.Candidate("local H=10", None, 10, 0.01)]
  rows = {r.name: r for r in advise.advise(_P, _axes(), cands)}
  fast = _ring_allreduce(4, _BYTES, 5e-6, 8.0 / 800e9)
  slow = _ring_allreduce(8, _BYTES)
  d = rows["dense"]
  assert d.fast_s == pytest.approx(fast)
  assert d.slow_s == pytest.approx(_ring_allreduce(8, _BYTES + _FLAG))
  assert d.slow_bytes == pytest.approx(2 * 7 / 8 * (_BYTES + _FLAG))
  loc = rows["local H=10"]
  assert loc.slow_s == pytest.approx(slow / 10)
  assert loc.fast_s == pytest.approx(fast / 10)
  assert loc.total_s < d.total_s


def test_a_link_shared_by_a_hosts_devices_divides_its_bandwidth():
  """Four devices per host each run the slow exchange over the host's one
  link: each moves its bytes at a quarter of the bandwidth. Latency is
  per message and does not change; the fast axis is left alone."""
  dense = [advise.Candidate("dense", lambda a: jaxcomm.mean_gradients(
             axis_name=a), None, 0.0)]
  axes = _axes()
  shared = [dataclasses.replace(axes[0], shared=4), axes[1]]
  (own,) = advise.advise(_P, axes, dense)
  (row,) = advise.advise(_P, shared, dense)
  assert row.slow_s == pytest.approx(
    _ring_allreduce(8, _BYTES + _FLAG, beta=4 * _BETA))
  assert row.fast_s == pytest.approx(own.fast_s)
  assert row.slow_bytes == pytest.approx(own.slow_bytes)
  with pytest.raises(ValueError, match="shared"):
    advise.Axis("dcn", 8, wire.CostModel.link(1.0), shared=0)


def test_flat_dense_is_one_ring_over_every_device():
  """A flat mean over 8 hosts x 4 is one ring of 32 whose pace is set by
  the edges between hosts (one per host): no fast stage, and a link shared
  by a host's 4 devices carries one stream. So, bandwidth-bound (64 MB of
  params), the hierarchical mean wins with a link per device and the flat
  one when the 4 share one; its 62 latencies make it lose on small
  params."""
  axes = _axes()
  shared = [dataclasses.replace(axes[0], shared=4), axes[1]]
  for ax in (axes, shared):
    rows = {r.name: r for r in advise.advise(_P, ax)}
    flat = rows["dense, flat"]
    assert flat.fast_s == 0.0
    assert flat.slow_s == pytest.approx(_ring_allreduce(32, _BYTES + _FLAG))
    assert flat.slow_bytes == pytest.approx(2 * 31 / 32 * (_BYTES + _FLAG))
    assert flat.loss_gap == 0.0
  big = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
  own = {r.name: r.total_s for r in advise.advise(big, axes)}
  assert own["dense"] < own["dense, flat"]
  one_card = {r.name: r.total_s for r in advise.advise(big, shared)}
  assert one_card["dense, flat"] < one_card["dense"]
  small = {r.name: r.total_s for r in advise.advise(_P, shared)}
  assert small["dense"] < small["dense, flat"]


def test_sharded_exchange_sends_one_share_per_device():
  """``sharded``: each of a host's 4 devices exchanges a quarter of the
  values between hosts; inside the host a reduce-scatter and an
  all-gather cost what the dense mean costs there. With the 4 sharing one
  link, the host's link carries one copy: the time of the per-device
  dense exchange with a link each."""
  cands = [advise.Candidate("s", lambda a: jaxcomm.mean_gradients(
    axis_name=a), None, 0.0, sharded=True)]
  axes = _axes()
  share = 4 * (512 * 256 // 4)
  (row,) = advise.advise(_P, axes, cands)
  assert row.fast_s == pytest.approx(
    _ring_allreduce(4, _BYTES, 5e-6, 8.0 / 800e9))
  assert row.slow_s == pytest.approx(_ring_allreduce(8, share + _FLAG))
  assert row.slow_bytes == pytest.approx(2 * 7 / 8 * (share + _FLAG))
  shared = [dataclasses.replace(axes[0], shared=4), axes[1]]
  (one_card,) = advise.advise(_P, shared, cands)
  assert one_card.slow_s == pytest.approx(
    _ring_allreduce(8, share + _FLAG, beta=4 * _BETA))
  (alone,) = advise.advise(_P, axes[:1], cands)   # no fast axis: whole
  assert alone.slow_s == pytest.approx(_ring_allreduce(8, _BYTES + _FLAG))


def test_powersgd_prices_its_two_factor_allreduces():
  """Rank 1 on a 512x256 matrix: P (512x1) and Q (256x1) in float32, two
  all-reduces over the slow axis (Vogels et al. 2019, Algorithm 1)."""
  cands = [advise.Candidate("r1", lambda a: jaxcomm.powersgd(1, axis_name=a))]
  (row,) = advise.advise(_P, _axes(), cands)
  want = (_ring_allreduce(8, 512 * 4) + _ring_allreduce(8, 256 * 4)
          + _ring_allreduce(8, _FLAG))
  assert row.slow_s == pytest.approx(want, rel=1e-6)
  assert row.slow_bytes == pytest.approx(2 * 7 / 8 * ((512 + 256) * 4
                                                      + _FLAG))


def test_recommend_respects_the_budget_and_overhead():
  """The fastest method within the budget is named; compute overhead can
  change the order; unmeasured gaps are never recommended."""
  rows = advise.advise(_P, _axes(), budget=0.05)
  assert [r.total_s for r in rows] == sorted(r.total_s for r in rows)
  best = advise.recommend(rows, 0.05)
  assert best.loss_gap <= 0.05
  faster = [r for r in rows if r.total_s < best.total_s]
  assert all(r.loss_gap is None or r.loss_gap > 0.05 for r in faster)
  slow = advise.advise(_P, _axes(), overhead_s={best.name: 10.0},
                       budget=0.05)
  assert advise.recommend(slow, 0.05).name != best.name
  assert advise.recommend(rows, -1.0) is None
  text = advise.table(rows, 0.05)
  assert f"**{best.name}**" in text


def test_one_axis_has_no_fast_stage():
  rows = advise.advise(_P, _axes()[:1])
  assert all(r.fast_s == 0.0 for r in rows)


@pytest.mark.parametrize("kwargs,match", [
  ({"axes": []}, "at least one data axis"),
  ({"axes": ["dcn"]}, "Axis values"),
  ({"budget": -0.1}, "budget"),
])
def test_bad_arguments_are_named(kwargs, match):
  args = {"axes": _axes(), **kwargs}
  with pytest.raises(ValueError, match=match):
    advise.advise(_P, **args)


def test_axis_checks_its_fields():
  with pytest.raises(ValueError, match="size"):
    advise.Axis("dcn", 0, wire.CostModel.link(1))
  with pytest.raises(ValueError, match="link must be"):
    advise.Axis("dcn", 2, 1.0)


def test_command_line_prices_the_given_shapes(capsys):
  """``python -m jaxcomm.advise`` on one 512x256 matrix, 8 hosts of 4 at
  10 Gbit/s: the dense row's slow-axis milliseconds are the ring formula,
  the named method fits the budget, and a shared link halves bandwidth."""
  def dense_slow_ms(argv):
    advise.main(argv)
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| dense |")]
    return float(row[0].split("|")[3]), out
  base = ["--shapes", "512x256", "--hosts", "8", "--per-host", "4",
          "--slow-gbit", "10"]
  ms, out = dense_slow_ms(base)
  assert ms == pytest.approx(_ring_allreduce(8, _BYTES + _FLAG) * 1e3,
                             abs=0.006)
  assert "Within a loss gap of 0.05: " in out
  best = out.rsplit("Within a loss gap of 0.05: ", 1)[1].split(" (")[0]
  gaps = {c.name: c.loss_gap for c in advise.default_candidates()}
  assert gaps[best] is not None and gaps[best] <= 0.05
  shared_ms, _ = dense_slow_ms(base + ["--shared", "2"])
  assert shared_ms == pytest.approx(
    _ring_allreduce(8, _BYTES + _FLAG, beta=2 * _BETA) * 1e3, abs=0.006)


@pytest.mark.parametrize("argv,match", [
  (["--hosts", "8", "--slow-gbit", "10"], "one of --model"),
  (["--shapes", "512xq", "--hosts", "8", "--slow-gbit", "10"], "512xq"),
  (["--model", "charlm", "--hosts", "8", "--slow-gbit", "10"],
   "benchmarks.advise"),
  (["--shapes", "8", "--hosts", "8", "--slow-gbit", "10",
    "--overhead-ms", "dense"], "NAME=MS"),
])
def test_command_line_names_bad_arguments(argv, match, capsys):
  with pytest.raises(SystemExit):
    advise.main(argv)
  assert match in capsys.readouterr().err


def test_command_line_reads_a_registered_model(capsys):
  """``python -m benchmarks.advise --model`` builds abstract params: the
  table's dense bytes are the model's parameter bytes (ring over 2 hosts
  sends each byte once); an unknown name is named."""
  from flax import nnx

  import models
  from benchmarks import advise as advise_cli
  abstract = nnx.eval_shape(lambda: models.create("charlm"))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  with pytest.raises(SystemExit):
    advise_cli.main(["--model", "nope", "--hosts", "8", "--slow-gbit", "10"])
  assert "nope" in capsys.readouterr().err
  advise_cli.main(["--model", "charlm", "--hosts", "2", "--slow-gbit", "1"])
  out = capsys.readouterr().out
  row = [line for line in out.splitlines() if line.startswith("| dense |")]
  assert float(row[0].split("|")[6]) == pytest.approx((4 * n + _FLAG) / 1e6,
                                                     abs=0.006)


# ------------------------------------------------ a sharded model (FSDP) --

def _ring(n, s, alpha, beta):
  """One all-gather or reduce-scatter of ``s`` bytes on a ring of n."""
  return (n - 1) * alpha + (n - 1) / n * s * beta


def test_fsdp_prices_the_plain_steps_gathers_and_a_shard_over_the_slow_axis():
  """Params split 4 ways over "fsdp" (800 Gbit/s, 5 us): every method pays
  one all-gather of the weights and one reduce-scatter of the gradient on
  that link, and each device sends over dcn what the method claims for its
  (128, 256) shard: the dense all-reduce a quarter of the bytes, top-k 1%
  its k = 328 pairs of the shard; a local method syncs its shard."""
  fsdp = advise.Axis("fsdp", 4, wire.CostModel.link(800.0, 5.0))
  cands = [advise.Candidate("dense", lambda a: jaxcomm.mean_gradients(
             axis_name=a), None, 0.0),
           advise.Candidate("topk", lambda a: jaxcomm.topk(0.01, axis_name=a)),
           advise.Candidate("local H=10", None, 10, 0.01)]
  rows = {r.name: r for r in advise.advise(_P, _axes()[:1], cands,
                                           fsdp=fsdp)}
  gathers = 2 * _ring(4, _BYTES, 5e-6, 8.0 / 800e9)
  shard = _BYTES // 4
  d = rows["dense"]
  assert d.fast_s == pytest.approx(gathers)
  assert d.slow_s == pytest.approx(_ring_allreduce(8, shard + _FLAG))
  assert d.slow_bytes == pytest.approx(2 * 7 / 8 * (shard + _FLAG))
  # Top-k 1% of a 128 x 256 shard: k = ceil(0.01 * 32768) = 328 float32
  # values and their positions, 16-bit since the shard has fewer than
  # 65,536 elements, all-gathered over the 8 slices; plus the flag. (On the
  # whole 512 x 256 leaf, positions would need 32 bits.)
  k = 328
  t = rows["topk"]
  assert t.fast_s == pytest.approx(gathers)
  assert t.slow_bytes == pytest.approx(7 / 8 * 8 * k * 6 + 2 * 7 / 8 * _FLAG)
  loc = rows["local H=10"]
  assert loc.fast_s == pytest.approx(gathers)
  assert loc.slow_s == pytest.approx(_ring_allreduce(8, shard) / 10)


def test_fsdp_shards_follow_the_specs_or_the_largest_dividing_dimension():
  from jax.sharding import PartitionSpec as P
  params = {"w": jax.ShapeDtypeStruct((96, 512), jnp.float32),
            "b": jax.ShapeDtypeStruct((30,), jnp.float32)}
  got = advise.fsdp_shards(params, 4)
  assert got["w"].shape == (96, 128) and got["b"].shape == (30,)
  got = advise.fsdp_shards(params, 4, {"w": P("fsdp", None), "b": P()})
  assert got["w"].shape == (24, 512) and got["b"].shape == (30,)
  with pytest.raises(ValueError, match="does not divide"):
    advise.fsdp_shards(params, 4, {"w": P(None, None), "b": P("fsdp")})


def test_fsdp_bad_arguments_are_named():
  fsdp = advise.Axis("fsdp", 4, wire.CostModel.link(800.0, 5.0))
  flat = [advise.Candidate("dense, flat", lambda a: jaxcomm.mean_gradients(
    axis_name=a), None, 0.0, flat=True)]
  with pytest.raises(ValueError, match="flat or host-sharded"):
    advise.advise(_P, _axes(), flat, fsdp=fsdp)
  with pytest.raises(ValueError, match="also a data axis"):
    advise.advise(_P, _axes(), fsdp=dataclasses.replace(fsdp, name="ici"))
  with pytest.raises(ValueError, match="specs is given without fsdp"):
    advise.advise(_P, _axes(), specs={"w": None})
  rows = advise.advise(_P, _axes(), fsdp=fsdp)
  assert not {"dense, flat", "dense, sharded"} & {r.name for r in rows}


@pytest.mark.parametrize("size", [3, 4096])
def test_an_fsdp_size_that_splits_no_leaf_is_refused(size, capsys):
  """Neither 3 nor 4096 divides 512 or 256: every leaf would stay whole
  (priced as if unsplit, without a word). Refused by name, in the library
  and on the command line; 4 (which divides both) is priced, and a leaf it
  does not divide (a bias of 7) is replicated beside the split weight."""
  link = wire.CostModel.link(800.0, 5.0)
  with pytest.raises(ValueError, match=rf"fsdp: size {size} .*divides no"):
    advise.advise(_P, _axes(), fsdp=advise.Axis("fsdp", size, link))
  with pytest.raises(SystemExit):
    advise.main(["--shapes", "512x256,256", "--hosts", "2", "--slow-gbit",
                 "1", "--fsdp", str(size)])
  assert "--fsdp" in capsys.readouterr().err
  params = dict(_P, b=jax.ShapeDtypeStruct((7,), jnp.float32))
  assert advise.advise(params, _axes(), fsdp=advise.Axis("fsdp", 4, link))
  assert advise.fsdp_shards(params, 4)["b"].shape == (7,)
