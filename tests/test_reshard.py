"""A sharded step's state moved to another FSDP size
(``parallel.reshard_state``): every element keeps what it owes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel

AUTO = jax.sharding.AxisType.Auto
SPECS = {"w": P("fsdp", None), "v": P(None, "fsdp"), "b": P()}


def _mesh(fsdp):
  return jax.make_mesh((2, fsdp), ("dcn", "fsdp"), axis_types=(AUTO,) * 2,
                       devices=jax.devices()[:2 * fsdp])


def _loss(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w"] + p["b"])
  return jnp.mean((h @ p["v"] - y) ** 2)


def _data(steps, seed=0, hidden=64):
  rng = np.random.RandomState(seed)
  w0 = {"w": rng.randn(32, hidden).astype(np.float32) * 0.2,
        "v": rng.randn(hidden, 64).astype(np.float32) * 0.2,
        "b": np.zeros(hidden, np.float32)}
  batches = [(rng.randn(16, 32).astype(np.float32),
              rng.randn(16, 64).astype(np.float32)) for _ in range(steps)]
  return w0, batches


def _setup(tx, fsdp, host_params):
  mesh = _mesh(fsdp)
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
            for k, v in host_params.items()}
  dp = parallel.DataParallel(_loss, tx, mesh, axis_name="dcn",
                             auto_axes=("fsdp",))
  p, s = dp.init(params)
  return mesh, dp, p, s


def _train(dp, p, s, batches):
  for b in batches:
    p, s, _ = dp.step(p, s, tuple(map(jnp.asarray, b)))
    jax.block_until_ready(p)
  return p, s


def _place(host_state, layout, mesh):
  specs = parallel.state_specs(layout, "dcn")
  return jax.tree.map(lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)),
                      host_state, specs, is_leaf=lambda x: isinstance(x, P))


def _reshard(tx, comps, host_state, layout_old, fsdp_old, fsdp_new, p_host):
  mesh, dp, p_new, fresh = _setup(tx, fsdp_new, p_host)
  state, restarted = parallel.reshard_state(
    host_state, layout_old, jax.device_get(fresh), dp.layout,
    params=p_host, specs=SPECS, axis_name="dcn", data_size=2,
    old_axes={"fsdp": fsdp_old}, new_axes={"fsdp": fsdp_new},
    compressors=comps)
  return mesh, dp, p_new, state, restarted


def test_an_elementwise_compressor_continues_as_if_never_resharded():
  """bf16 with error feedback rounds element by element and Adam's
  moments are element-wise too, so on (dcn=2, fsdp=4) three steps, a move
  to fsdp=2, then three more give the params of six steps on fsdp=4: the
  residuals, moments and counts arrived where their elements went."""
  comp = jaxcomm.cast(jnp.bfloat16, axis_name="dcn", error_feedback=True)
  tx = optax.chain(comp, optax.adam(1e-2))
  w0, batches = _data(6)
  _, dp4, p, s = _setup(tx, 4, w0)
  p_ref, _ = _train(dp4, p, s, batches)
  p, s = _train(dp4, *_setup(tx, 4, w0)[2:], batches[:3])
  p_host = jax.device_get(p)
  mesh2, dp2, _, state, restarted = _reshard(
    tx, [comp], jax.device_get(s), dp4.layout, 4, 2, p_host)
  assert restarted == []
  p2 = {k: jax.device_put(v, NamedSharding(mesh2, SPECS[k]))
        for k, v in p_host.items()}
  p2, _ = _train(dp2, p2, _place(state, dp2.layout, mesh2), batches[3:])
  for k in p_ref:
    np.testing.assert_allclose(np.asarray(p2[k]), np.asarray(p_ref[k]),
                               rtol=2e-5, atol=2e-6, err_msg=k)


def _slice_residuals(state_rows, fsdp, hidden=64):
  """Per slice, each compressed leaf's residual put back together by hand:
  the bucket of a (dcn, fsdp) device holds its "v" block (hidden x
  64/fsdp; leaves in tree order: "b" (dense), "v", "w") then its "w" block
  (32/fsdp x hidden), then the zeros of a bucket stored in whole tiles."""
  out = []
  rows = np.asarray(state_rows).reshape(2, fsdp, -1)
  nv, nw = hidden * (64 // fsdp), (32 // fsdp) * hidden
  for d in range(2):
    w = np.concatenate([rows[d, f, nv:nv + nw].reshape(32 // fsdp, hidden)
                        for f in range(fsdp)], axis=0)
    v = np.concatenate([rows[d, f, :nv].reshape(hidden, 64 // fsdp)
                        for f in range(fsdp)], axis=1)
    np.testing.assert_array_equal(rows[d, :, nv + nw:], 0.0)
    out.append((w, v))
  return out


@pytest.mark.parametrize("fsdp_new,hidden", [(2, 64), (1, 64), (2, 2600)])
def test_topk_residuals_land_on_the_elements_they_belong_to(fsdp_new,
                                                           hidden):
  """Top-k's residuals after three steps on fsdp=4, moved to fsdp=2 (and
  1): each slice's residual of each leaf, assembled by hand from the
  device rows, is the same array before and after; the run goes on. With
  ``hidden=2600`` a device's bucket (62,400 values on fsdp=4, 124,800 on
  fsdp=2) is stored in whole tiles of 1,024 on both sides, zeros after."""
  comp = jaxcomm.topk(0.05, axis_name="dcn",
                      policy=jaxcomm.LeafPolicy(min_size=hidden + 1))
  tx = optax.chain(comp, optax.sgd(0.1))
  w0, batches = _data(5, hidden=hidden)
  _, dp4, p, s = _setup(tx, 4, w0)
  p, s = _train(dp4, p, s, batches[:3])
  host = jax.device_get(s)
  if hidden == 2600:
    assert np.shape(host[0].residual[0])[-1] == 62_464
  before = _slice_residuals(host[0].residual[0], 4, hidden)
  assert all(np.abs(w).sum() > 0 for w, _ in before)
  mesh, dp2, _, state, _ = _reshard(tx, [comp], host, dp4.layout, 4,
                                    fsdp_new, jax.device_get(p))
  if hidden == 2600:
    assert np.shape(state[0].residual[0])[-1] == 124_928
  after = _slice_residuals(state[0].residual[0], fsdp_new, hidden)
  for (w0_, v0_), (w1, v1) in zip(before, after):
    np.testing.assert_array_equal(w1, w0_)
    np.testing.assert_array_equal(v1, v0_)
  p2 = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
        for k, v in jax.device_get(p).items()}
  p2, _ = _train(dp2, p2, _place(state, dp2.layout, mesh), batches[3:])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p2))


def test_onebit_server_error_total_is_kept_and_powersgd_q_restarts():
  """onebit's server error is owned by chunks of the data axis: its total
  over a slice, per element, is kept and re-cut into the new devices'
  chunks. PowerSGD's warm start owes nothing and restarts as at init."""
  comp = jaxcomm.onebit(axis_name="dcn")
  tx = optax.chain(comp, optax.sgd(0.1))
  w0, batches = _data(3)
  _, dp4, p, s = _setup(tx, 4, w0)
  p, s = _train(dp4, p, s, batches)
  host = jax.device_get(s)
  server = host[0].codec[0].server_error
  assert np.abs(server).sum() > 0
  _, _, _, state, _ = _reshard(tx, [comp], host, dp4.layout, 4, 2,
                               jax.device_get(p))
  new_server = state[0].codec[0].server_error
  # The total over both slices' devices (rows of dcn x fsdp), per element
  # of each leaf, assembled by hand as for the residuals.
  def totals(rows, fsdp):
    per = _slice_residuals(rows, fsdp)
    return [per[0][i] + per[1][i] for i in range(2)]
  for a, b in zip(totals(server, 4), totals(new_server, 2)):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
  # Each element's total sits with one device of the slice pair.
  rows = np.asarray(new_server).reshape(2, 2, -1)
  assert not np.any((rows[0] != 0) & (rows[1] != 0))

  comp = jaxcomm.powersgd(2, axis_name="dcn")
  tx = optax.chain(comp, optax.sgd(0.1))
  _, dp4, p, s = _setup(tx, 4, w0)
  p, s = _train(dp4, p, s, batches)
  _, _, _, state, restarted = _reshard(tx, [comp], jax.device_get(s),
                                       dp4.layout, 4, 2, jax.device_get(p))
  assert restarted and all(".codec" in r and ".q" in r for r in restarted)
  _, _, _, fresh = _setup(tx, 2, w0)
  for q, q0 in zip(state[0].codec[0].q, jax.device_get(fresh)[0].codec[0].q):
    np.testing.assert_array_equal(q, q0)


@pytest.mark.parametrize("fsdp", [4, 2, 1])
def test_powersgd_compresses_the_same_leaves_at_every_fsdp_size(fsdp):
  """PowerSGD decides compress-or-dense on the whole matrix, as it takes
  its low rank: at rank 4 both w (32x64) and v (64x64) pass PyTorch's rule
  (n + m) r 2 < n m, whatever blocks fsdp cuts (w's 8x64 blocks at fsdp=4
  alone would not; they were sent dense there, compressed at fsdp=2 and
  1). So each device's residual holds 1/fsdp of both."""
  w0, _ = _data(1)
  rank = 4
  want = sum(x.size for x in w0.values() if x.ndim == 2
             and (x.shape[0] + x.shape[1]) * rank * 2 < x.size)
  assert want == 32 * 64 + 64 * 64
  tx = optax.chain(jaxcomm.powersgd(rank, axis_name="dcn"), optax.sgd(0.1))
  _, _, _, s = _setup(tx, fsdp, w0)
  res = jax.device_get(s)[0].residual
  assert sum(np.shape(r)[-1] for r in res) * fsdp == want


def test_powersgd_state_moves_from_fsdp_4_to_2():
  """The same state tree on both sizes: a checkpoint of fsdp=4 is re-cut
  for fsdp=2 (the residual's total per slice kept), and the run goes
  on."""
  comp = jaxcomm.powersgd(4, axis_name="dcn")
  tx = optax.chain(comp, optax.sgd(0.1))
  w0, batches = _data(4)
  _, dp4, p, s = _setup(tx, 4, w0)
  p, s = _train(dp4, p, s, batches[:2])
  host = jax.device_get(s)
  mesh, dp2, _, state, _ = _reshard(tx, [comp], host, dp4.layout, 4, 2,
                                    jax.device_get(p))
  _, _, _, fresh = _setup(tx, 2, w0)
  assert jax.tree.structure(state) == jax.tree.structure(
    jax.device_get(fresh))
  for old, new in zip(_slice_residuals(host[0].residual[0], 4),
                      _slice_residuals(state[0].residual[0], 2)):
    for a, b in zip(old, new):
      np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
  p2 = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
        for k, v in jax.device_get(p).items()}
  p2, _ = _train(dp2, p2, _place(state, dp2.layout, mesh), batches[2:])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p2))


def test_resize_state_checks_rows_against_the_model_sizes():
  """A (dcn=2, fsdp=4) state has 8 rows per residual: read with
  model_axes={"fsdp": 2} it passed as 4 slices of 2 blocks, and rows of
  different fsdp blocks were averaged as if they were slices. Refused,
  naming the rows and the sizes; with the true sizes each block's two
  slice rows are averaged (numpy)."""
  comp = jaxcomm.topk(0.05, axis_name="dcn")
  tx = optax.chain(comp, optax.sgd(0.1))
  w0, batches = _data(2)
  _, dp4, p, s = _setup(tx, 4, w0)
  _, s = _train(dp4, p, s, batches)
  host = jax.device_get(s)
  with pytest.raises(ValueError, match=r"has 8 rows, but data_size=2 x "
                     r"model_axes=\{'fsdp': 2\} gives 4"):
    parallel.resize_state(host, dp4.layout, 1, axis_name="dcn",
                          model_axes={"fsdp": 2}, data_size=2)
  with pytest.raises(ValueError, match="(pass data_size=|has 8 rows)"):
    parallel.resize_state(host, dp4.layout, 1, axis_name="dcn",
                          model_axes={"fsdp": 2})
  one = parallel.resize_state(host, dp4.layout, 1, axis_name="dcn",
                              model_axes={"fsdp": 4}, data_size=2)
  rows = np.asarray(host[0].residual[0], np.float64)
  np.testing.assert_allclose(
    one[0].residual[0], rows.reshape((2, 4, -1)).mean(axis=0), rtol=1e-6)


@pytest.fixture(scope="module")
def topk_states():
  """A top-k state on (dcn=2, fsdp=4) and a fresh one on fsdp=2."""
  comp = jaxcomm.topk(0.05, axis_name="dcn")
  tx = optax.chain(comp, optax.sgd(0.1))
  w0, _ = _data(1)
  _, dp4, p, s = _setup(tx, 4, w0)
  _, dp2, _, fresh = _setup(tx, 2, w0)
  return (comp, jax.device_get(s), dp4.layout, jax.device_get(fresh),
          dp2.layout, jax.device_get(p))


_ROWS = r"has {} rows, but data_size={} x model_axes=\{{'fsdp': {}\}}"


@pytest.mark.parametrize("case,match", [
  ("wrong_fsdp", _ROWS.format(8, 2, 2)),
  ("wrong_data", _ROWS.format(8, 4, 4)),
  ("fewer_slices", _ROWS.format(8, 1, 4)),
  ("rows_short", _ROWS.format(5, 2, 4)),
  ("other_policy", r"holds buckets of \[1536\] elements, but "
   r"compressors\[0\].* plans \[\]"),
  ("other_buckets", r"plans \[1024, 512\]"),
  ("template_of_fsdp_4", r"\(template\).*has 8 rows.*'fsdp': 2"),
])
def test_malformed_reshard_inputs_are_named(topk_states, case, match):
  """What does not fit is named: a state of another fsdp or data size
  than old_axes/data_size say, rows cut short, a compressor with another
  leaf policy or bucket size, a template of other sizes (once a raw
  "cannot reshape", an IndexError, a broadcast error, or accepted)."""
  comp, host, layout, fresh, layout2, ph = topk_states
  kw = dict(params=ph, specs=SPECS, axis_name="dcn", data_size=2,
            old_axes={"fsdp": 4}, new_axes={"fsdp": 2}, compressors=[comp])
  state, template, t_layout = host, fresh, layout2
  if case == "wrong_fsdp":
    kw["old_axes"] = {"fsdp": 2}
  elif case == "wrong_data":
    kw["data_size"] = 4
  elif case == "fewer_slices":
    kw["data_size"] = 1
  elif case == "rows_short":
    res = np.asarray(host[0].residual[0])[:5]
    state = (host[0]._replace(residual=(res,)), host[1])
  elif case == "other_policy":
    kw["compressors"] = [jaxcomm.topk(
      0.05, axis_name="dcn", policy=jaxcomm.LeafPolicy(min_size=3000))]
  elif case == "other_buckets":
    kw["compressors"] = [jaxcomm.topk(
      0.05, axis_name="dcn", policy=jaxcomm.LeafPolicy(bucket_bytes=4096))]
  elif case == "template_of_fsdp_4":
    template, t_layout = host, layout
  with pytest.raises(ValueError, match=match):
    parallel.reshard_state(state, layout, template, t_layout, **kw)


def test_what_cannot_be_recut_is_named():
  comp = jaxcomm.topk(0.05, axis_name="dcn")
  tx = optax.chain(comp, optax.sgd(0.1))
  w0, _ = _data(1)
  _, dp4, p, s = _setup(tx, 4, w0)
  host, ph = jax.device_get(s), jax.device_get(p)
  with pytest.raises(ValueError, match="no compressor is left"):
    _reshard(tx, [], host, dp4.layout, 4, 2, ph)
  with pytest.raises(ValueError, match="same model axes"):
    parallel.reshard_state(host, dp4.layout, host, dp4.layout, params=ph,
                           specs=SPECS, axis_name="dcn", data_size=2,
                           old_axes={"fsdp": 4}, new_axes={"tensor": 2},
                           compressors=[comp])
  # "w" compressed in blocks of 16 x 64 = 1024 elements on fsdp=2 travels
  # dense in blocks of 512 on fsdp=4 under a policy that compresses from
  # 600 elements: its residual would have nowhere to go.
  policy = jaxcomm.LeafPolicy(min_size=600)
  comp = jaxcomm.topk(0.05, axis_name="dcn", policy=policy)
  tx = optax.chain(comp, optax.sgd(0.1))
  _, dp2, p, s = _setup(tx, 2, w0)
  with pytest.raises(ValueError,
                     match=r"leaves \['w'\] are compressed .* travel dense"):
    _reshard(tx, [comp], jax.device_get(s), dp2.layout, 2, 4,
             jax.device_get(p))


# (dcn, fsdp) layouts of the 8 devices an int8 state moves between.
_INT8_MOVES = [((2, 4), (4, 2)), ((4, 2), (2, 4)), ((2, 4), (8, 1)),
               ((8, 1), (4, 2)), ((1, 4), (1, 8))]


def _int8_setup(dcn, fsdp):
  mesh = jax.make_mesh((dcn, fsdp), ("dcn", "fsdp"), axis_types=(AUTO,) * 2,
                       devices=jax.devices()[:dcn * fsdp])
  w0, batches = _data(2)
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
            for k, v in w0.items()}
  comp = jaxcomm.int8(axis_name="dcn")
  dp = parallel.DataParallel(_loss, optax.chain(comp, optax.sgd(0.1)), mesh,
                             axis_name="dcn", auto_axes=("fsdp",))
  p, s = dp.init(params)
  return comp, dp, p, s, batches


def _int8_move(src, dst, host, layout, p_host, comp):
  """train.py's recipe: re-cut for the new fsdp size at the old number of
  slices (into the target's layout), then resize the slices; both checked
  against the target's fresh state."""
  (d0, f0), (d1, f1) = src, dst
  _, dp, _, fresh, _ = _int8_setup(d1, f1)
  fresh = jax.device_get(fresh)
  if f0 != f1:
    template = fresh
    if d0 != d1:
      template = parallel.resize_state(fresh, dp.layout, d0,
                                       axis_name="dcn",
                                       model_axes={"fsdp": f1},
                                       data_size=d1)
    host, _ = parallel.reshard_state(
      host, layout, template, dp.layout, params=p_host, specs=SPECS,
      axis_name="dcn", data_size=d0, old_axes={"fsdp": f0},
      new_axes={"fsdp": f1}, compressors=[comp])
    layout = dp.layout
  if d0 != d1:
    host = parallel.resize_state(host, layout, d1, axis_name="dcn",
                                 model_axes={"fsdp": f1}, data_size=d0,
                                 template=fresh)
  return host, fresh, dp


@pytest.mark.parametrize("src,dst", _INT8_MOVES,
                         ids=[f"{a}to{b}" for a, b in _INT8_MOVES])
def test_int8_state_moves_to_the_shapes_the_target_step_builds(src, dst):
  """int8's residual and (requantized exchange) server error moved between
  (dcn, fsdp) layouts: every leaf has the shape the target step's init
  gives it; the residual's slice-average total and the server error's
  total (owned by chunks: held in full) are kept (numpy sums); the target
  step then runs on it."""
  comp, dp0, p, s, batches = _int8_setup(*src)
  p, s = _train(dp0, p, s, batches)
  host, p_host = jax.device_get(s), jax.device_get(p)
  moved, fresh, dp = _int8_move(src, dst, host, dp0.layout, p_host, comp)
  for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(fresh),
                  strict=True):
    assert np.shape(a) == np.shape(b)
  res0 = np.asarray(host[0].residual[0], np.float64)
  res1 = np.asarray(moved[0].residual[0], np.float64)
  assert np.abs(res0).sum() > 0
  np.testing.assert_allclose(res1.sum() / dst[0], res0.sum() / src[0],
                             rtol=1e-5)
  if src[0] > 1 and dst[0] > 1:
    err0 = np.asarray(host[0].codec[0].server_error, np.float64)
    err1 = np.asarray(moved[0].codec[0].server_error, np.float64)
    np.testing.assert_allclose(err1.sum(), err0.sum(), rtol=1e-5,
                               atol=1e-6)
  mesh = dp.mesh
  p2 = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
        for k, v in p_host.items()}
  p2, _ = _train(dp, p2, _place(moved, dp.layout, mesh), batches)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p2))


@pytest.mark.parametrize("src,dst", [((2, 4), (1, 4)), ((8, 1), (1, 8))])
def test_int8_state_that_cannot_move_is_refused_by_name(src, dst):
  """On one slice int8 takes the exact exchange and keeps no server error
  per device: a state of 2 or more slices does not fit its step, and the
  move says which leaf before anything is placed."""
  comp, dp0, p, s, batches = _int8_setup(*src)
  p, s = _train(dp0, p, s, batches[:1])
  with pytest.raises(ValueError, match=r"server_error( comes out with "
                     r"shape|: laid out over \['dcn', 'fsdp'\] on the old)"):
    _int8_move(src, dst, jax.device_get(s), dp0.layout, jax.device_get(p),
               comp)
