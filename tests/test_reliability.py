"""Bad input and faults that must not lose or corrupt what a run owes.

Each test here reproduces a case that once passed silently (a wrong leaf
compressed, a run that could not resume) and checks what a user expects.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel


def test_policy_mask_is_matched_by_path_not_position():
  """A mask whose keys are not the params' is refused, naming the paths;
  one with the same keys in another insertion order routes by name."""
  params = {"a": jnp.zeros((32, 32)), "b": jnp.zeros((32, 32))}
  wrong = jaxcomm.LeafPolicy(mask={"kernel": True, "bias": False})
  with pytest.raises(ValueError, match=r"mask.*a.*kernel|mask.*kernel"):
    wrong.plan(params, lambda shape: True)
  # Insertion order b, a: still routed by name.
  mask = {"b": False, "a": True}
  paths = jaxcomm.LeafPolicy(mask=mask, min_size=1).plan(
    params, lambda shape: True)
  assert paths == ["compress", "dense"]        # leaves in order a, b
  # A nested mask must name the nested leaves.
  nested = {"layer": {"w": jnp.zeros((16, 16)), "b": jnp.zeros((16,))}}
  with pytest.raises(ValueError, match="layer/w"):
    jaxcomm.LeafPolicy(mask={"layer": {"b": True}}).plan(
      nested, lambda shape: True)


def test_policy_mask_from_a_callable_and_in_a_step():
  """The path-matched mask decides which leaf keeps a residual."""
  params = {"a": jnp.zeros((64,)), "b": jnp.zeros((64,))}
  tx = jaxcomm.topk(0.25, axis_name=None,
                    policy=jaxcomm.LeafPolicy(
                      min_size=1, mask=lambda g: {"b": True, "a": False}))
  grads = {"a": jnp.arange(64.0), "b": jnp.arange(64.0)}
  updates, state = tx.update(grads, tx.init(params), params)
  # "a" is dense: its update is the gradient itself; "b" keeps its top 16.
  np.testing.assert_array_equal(np.asarray(updates["a"]), np.arange(64.0))
  want_b = np.where(np.arange(64) >= 48, np.arange(64.0), 0.0)
  np.testing.assert_array_equal(np.asarray(updates["b"]), want_b)


_TINY = ["--model-args", "embed_dim=8,hidden_size=16,num_layers=1",
         "--seq-len", "16", "--batch-size", "16", "--eval-examples", "16",
         "--no-progress", "--no-plot", "--schedule", "constant",
         "--compressor", "topk", "--compressor-args", "ratio=0.1",
         "--lr", "0.02"]


def test_resume_survives_a_torn_last_metrics_line(tmp_path, capsys):
  """What a kill leaves (half a JSON line) is dropped and reported; the
  resumed run ends like an uninterrupted one."""
  import train  # pylint: disable=import-outside-toplevel
  out = str(tmp_path / "run")
  train.main(_TINY + ["--out-dir", out, "--steps", "6", "--stop-after",
                      "4", "--checkpoint-every", "2"])
  metrics = tmp_path / "run" / "metrics.jsonl"
  with open(metrics, "a") as f:
    f.write('{"step": 5, "loss": 1.2')        # torn by a kill
  r = train.main(_TINY + ["--out-dir", out, "--steps", "6", "--resume",
                          "--checkpoint-every", "2"])
  assert "dropped a torn last line" in capsys.readouterr().out
  steps = [h["step"] for h in r["history"]]
  assert steps == [1, 2, 3, 4, 5, 6], steps
  whole = train.main(_TINY + ["--out-dir", str(tmp_path / "whole"),
                              "--steps", "6", "--checkpoint-every", "2"])
  np.testing.assert_allclose([h["loss"] for h in r["history"]],
                             [h["loss"] for h in whole["history"]],
                             rtol=1e-6)


def test_a_damaged_line_before_the_last_is_named(tmp_path):
  from trainer import loop  # pylint: disable=import-outside-toplevel
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl: line 2"):
    loop.read_history(str(path))
  path.write_text('{"step": 1}\n{"step": 2}\n{"st')
  assert loop.read_history(str(path)) == [{"step": 1}, {"step": 2}]


def test_os_errors_end_in_one_line_that_says_what_to_do():
  import errno  # pylint: disable=import-outside-toplevel

  from trainer import loop  # pylint: disable=import-outside-toplevel
  full = loop.os_error_text(OSError(errno.ENOSPC, "No space left on device",
                                    "runs/a/metrics.jsonl"))
  assert "runs/a/metrics.jsonl" in full and "--resume" in full
  ro = loop.os_error_text(OSError(errno.EROFS, "Read-only file system",
                                  "/ro/run"))
  assert "/ro/run" in ro and "--out-dir" in ro
  assert "--out-dir" in loop.os_error_text(
    NotADirectoryError(errno.ENOTDIR, "Not a directory", "f/run"))


def test_out_dir_that_is_a_file_is_one_line_on_the_command_line(tmp_path):
  """train.py as a script: a regular file as --out-dir exits 1 with one
  line on stderr, no traceback."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from pathlib import Path  # pylint: disable=import-outside-toplevel
  root = Path(__file__).resolve().parents[1]
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  proc = subprocess.run(
    [sys.executable, str(root / "train.py")] + _TINY
    + ["--num-devices", "2", "--steps", "1",
       "--out-dir", str(blocker / "run")],
    cwd=root, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  err = proc.stderr.strip().splitlines()
  assert err[-1].startswith("error:") and "--out-dir" in err[-1], err[-3:]


def test_sgp_refuses_graphs_that_cannot_mix():
  """A device no one sends to (its push-sum weight decays to 0) or a graph
  of two separate halves is refused by name at construction."""
  import optax  # pylint: disable=import-outside-toplevel
  no_in = [[1], [2], [0], [0]]              # nobody sends to device 3
  with pytest.raises(ValueError, match=r"not strongly connected.*\[3\]"):
    jaxcomm.sgp(optax.sgd(0.1), topology=no_in)
  halves = [[1], [0], [3], [2]]
  with pytest.raises(ValueError, match="not strongly connected"):
    jaxcomm.sgp(optax.sgd(0.1), topology=halves)
  jaxcomm.sgp(optax.sgd(0.1), topology=[[1], [2], [3], [0]])   # a ring


@pytest.mark.parametrize("argv,flag", [
  (["--slow-gbit", "nan"], "gbit_per_s"),
  (["--slow-gbit", "inf"], "gbit_per_s"),
  (["--slow-gbit", "10", "--slow-latency-us", "-1"], "latency_us"),
  (["--slow-gbit", "10", "--per-host", "-3"], "--per-host"),
  (["--slow-gbit", "10", "--hosts", "0"], "--hosts"),
  (["--slow-gbit", "10", "--overhead-ms", "no such method=2"],
   "no such method"),
])
def test_advise_cli_refuses_what_it_cannot_price(argv, flag, capsys):
  """Each bad flag is a command-line error naming it, not a table of nan
  or a silently ignored value."""
  from jaxcomm import advise  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as e:
    advise.main(["--shapes", "64x64", "--hosts", "4"] + argv)
  assert e.value.code == 2
  assert flag in capsys.readouterr().err


def test_advise_names_the_candidates_an_overhead_may_take():
  from jaxcomm import advise  # pylint: disable=import-outside-toplevel
  params = {"w": jnp.zeros((64, 64))}
  axes = [advise.Axis("dcn", 4, jaxcomm.wire.CostModel.link(10))]
  with pytest.raises(ValueError, match="names no candidate.*'dense'"):
    advise.advise(params, axes, overhead_s={"topk": 1e-3})
  name = advise.default_candidates()[0].name
  rows = advise.advise(params, axes, overhead_s={name: 0.5})
  assert [r.overhead_s for r in rows if r.name == name] == [0.5]


def test_axis_names_and_rates_are_checked_where_they_enter():
  """A repeated axis name, an infinite learning rate and an infinite
  min_compression_rate are refused by name at construction."""
  import optax  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="axis_name must name each axis once"):
    jaxcomm.topk(0.1, axis_name=("dcn", "dcn"))
  with pytest.raises(ValueError, match="axis_name must name each axis once"):
    jaxcomm.local_sgd(optax.sgd(0.1), 4, axis_name=("dcn", "dcn"))
  for make in (jaxcomm.onebit_adam, jaxcomm.onebit_lamb):
    with pytest.raises(ValueError, match="learning_rate must be a finite"):
      make(float("inf"), freeze_step=2)
  with pytest.raises(ValueError, match="learning_rate must be a finite"):
    jaxcomm.zero_one_adam(float("inf"), var_freeze_step=2)
  with pytest.raises(ValueError, match="min_compression_rate"):
    jaxcomm.powersgd(2, min_compression_rate=float("inf"))
  with pytest.raises(ValueError, match="min_compression_rate"):
    jaxcomm.powersgd(2, min_compression_rate=-1.0)
  jaxcomm.topk(0.1, axis_name=("dcn", "ici"))          # distinct: fine


def test_resize_params_needs_a_device_axis():
  """Replicated params (no leading device axis) are refused, naming the
  leaves' leading sizes, instead of having their rows averaged."""
  from jaxcomm import parallel  # pylint: disable=import-outside-toplevel
  plain = {"w": np.ones((4, 3), np.float32), "b": np.ones((3,), np.float32)}
  with pytest.raises(ValueError, match=r"resize_params needs per-device"):
    parallel.resize_params(plain, 8)
  per_device = {"w": np.arange(24.0).reshape(8, 3),
                "b": np.arange(8.0).reshape(8, 1)}
  four = parallel.resize_params(per_device, 4)
  np.testing.assert_allclose(four["w"].mean(axis=0),
                             per_device["w"].mean(axis=0))
  np.testing.assert_allclose(four["w"][1], per_device["w"][2:4].mean(axis=0))


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.signsgd(error_feedback="ef21"),
  lambda: jaxcomm.signum(error_feedback="ef21"),
  lambda: jaxcomm.onebit(error_feedback="ef21"),
  lambda: jaxcomm.natural(error_feedback="ef21"),
  lambda: jaxcomm.cast(jnp.bfloat16, error_feedback="ef21"),
], ids=["signsgd", "signum", "onebit", "natural", "cast"])
def test_ef21_is_refused_where_the_exchange_is_not_a_mean(make):
  """EF21 keeps h = mean_i h_i only if the exchange returns the mean of
  what devices sent; a vote, a server stage or a second rounding breaks it
  (signSGD's update grew without bound), so the combination is refused by
  name at construction."""
  with pytest.raises(ValueError, match=r"error_feedback='ef21' needs an "
                     r"exchange whose result is the mean"):
    make()


def test_ef21_keeps_its_invariant_where_the_exchange_is_a_mean(mesh):
  """Where the exchange is linear (top-k, int8) EF21 still builds, and on 8
  devices the aggregate stays the mean of the device estimates."""
  from tests import harness  # pylint: disable=import-outside-toplevel
  for tx in (jaxcomm.topk(0.1, error_feedback="ef21"),
             jaxcomm.int8(error_feedback="ef21")):
    _, state, _ = harness.device_run(tx, mesh, harness.make_grads(5, 4))
    est = np.asarray(state.estimate[0])
    np.testing.assert_allclose(est.mean(axis=0),
                               np.asarray(state.estimate_mean[0]),
                               rtol=1e-5, atol=1e-5)


def _per_device_complex(n, seed=0):
  r = np.random.default_rng(seed)
  return (r.normal(size=(n, 6)) + 1j * r.normal(size=(n, 6))).astype(
    np.complex64)


def test_complex_leaves_keep_their_imaginary_part_in_syncs_and_gossip(mesh):
  """The local methods' sync (the device mean) and D-PSGD's mixing carry
  complex leaves as real and imaginary pairs (1+2j stayed 1+0j)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-importing-member

  from jaxcomm import _local_engine  # pylint: disable=import-outside-toplevel
  from jaxcomm.collectives import _gossip  # pylint: disable=import-outside-toplevel
  z = _per_device_complex(8)
  w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)

  def body(z, w):
    mean = _local_engine.mean_leaves([z[0], w[0]], "data")
    mixed = _gossip.gossip_mix([z[0], w[0]], "data", "ring", 0)
    return mean[0][None], mean[1][None], mixed[0][None], mixed[1][None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 2,
                            out_specs=(P("data"),) * 4))
  mz, mw, gz, gw = (np.asarray(a) for a in f(z, w))
  assert mz.dtype == np.complex64
  np.testing.assert_allclose(mz, np.tile(z.mean(0), (8, 1)), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(mw, np.tile(w.mean(0), (8, 1)), rtol=1e-6)
  # Ring mixing with weights 1/3: x_i <- (x_{i-1} + x_i + x_{i+1}) / 3.
  ring = (np.roll(z, 1, 0) + z + np.roll(z, -1, 0)) / 3
  np.testing.assert_allclose(gz, ring, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    gw, (np.roll(w, 1, 0) + w + np.roll(w, -1, 0)) / 3, rtol=1e-5)


def test_sharded_exchange_carries_complex_leaves():
  """The exchange once per host: a complex gradient's mean over the pod
  keeps its imaginary part; empty float leaves pass."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-importing-member

  from jaxcomm import parallel  # pylint: disable=import-outside-toplevel
  mesh = parallel.make_pod_mesh(num_slices=2)
  tx = parallel.sharded_exchange(jaxcomm.mean_gradients(axis_name="dcn"),
                                 "ici", fast_size=mesh.shape["ici"])
  z = _per_device_complex(8, seed=1)
  params = {"z": jnp.zeros(6, jnp.complex64), "e": jnp.zeros((0,))}
  state = tx.init(params)

  def body(z):
    g = {"z": jaxcomm.collectives.pvary(z[0], ("dcn", "ici")),
         "e": jaxcomm.collectives.pvary(jnp.zeros((0,)), ("dcn", "ici"))}
    u, _ = tx.update(g, state, params)
    return u["z"][None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("dcn", "ici")),
                            out_specs=P(("dcn", "ici"))))
  got = np.asarray(f(z))
  np.testing.assert_allclose(got, np.tile(z.mean(0), (8, 1)), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("opt,arg", [("onebit_adam", "freeze_step"),
                                     ("zero_one_adam", "var_freeze_step")])
def test_train_refuses_a_frozen_variance_no_warm_up_estimated(opt, arg,
                                                              tmp_path):
  """``--optimizer-args freeze_step=0`` on a new run froze a zero variance
  (NaN eval loss, exit 0): refused by name, pointing at --resume."""
  import train  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=rf"{arg}=0 freezes a variance"):
    train.main(_TINY[:-6] + ["--optimizer", opt, "--optimizer-args",
                             f"{arg}=0", "--steps", "2",
                             "--out-dir", str(tmp_path / "r")])


@pytest.mark.parametrize("make", [lambda: jaxcomm.int8(),
                                  lambda: jaxcomm.dgc(0.01),
                                  lambda: jaxcomm.topk(0.05)],
                         ids=["int8", "dgc", "topk"])
def test_a_device_sum_that_overflows_is_a_skipped_step(make, mesh):
  """3e38 on every device: the sum over 8 devices overflows float32. The
  step is skipped and counted, the state stays as it was (int8's residual
  kept 3e38 for good and updated by 0; DGC gave NaN every later step), and
  the next, normal steps train."""
  from tests import harness  # pylint: disable=import-outside-toplevel
  params = {"w": jnp.zeros((64, 48))}
  big = [{"w": np.full((8, 64, 48), 3e38, np.float32)}]
  rng = np.random.default_rng(0)
  normal = [{"w": rng.normal(size=(8, 64, 48)).astype(np.float32)}
            for _ in range(3)]
  upd, state, _ = harness.device_run(make(), mesh, big + normal,
                                     params=params)
  st = jaxcomm.compress_states(state)[0]
  assert np.all(np.isnan(np.asarray(upd[0]["w"])))
  assert int(np.asarray(st.stats.nonfinite_steps).max()) == 1
  for u in upd[1:]:
    w = np.asarray(u["w"])
    assert np.all(np.isfinite(w)) and np.abs(w).max() > 0
  assert np.abs(np.asarray(st.residual[0])).max() < 100.0
  if "dgc" in repr(make()):
    return    # DGC's sampled threshold draws from the step's key: it moved
  # The same three normal steps from a fresh state give the same updates:
  # the skipped step left nothing behind.
  again, _, _ = harness.device_run(make(), mesh, normal, params=params)
  for a, b in zip(upd[1:], again):
    np.testing.assert_allclose(np.asarray(a["w"]), np.asarray(b["w"]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make,name", [
  (lambda: jaxcomm.topk(0.1, start_step=2**31), "start_step"),
  (lambda: jaxcomm.onebit_adam(1e-3, freeze_step=10**12), "freeze_step"),
  (lambda: jaxcomm.zero_one_adam(1e-3, var_freeze_step=2**40),
   "var_freeze_step"),
  (lambda: jaxcomm.local_sgd(optax.sgd(0.1), period=2**31), "period"),
  (lambda: jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), 2**32), "period"),
])
def test_step_settings_beyond_int32_counters_are_named(make, name):
  """Step counters are int32: a step setting no counter can reach is an
  error naming it, not an overflow inside the traced comparison."""
  with pytest.raises(ValueError, match=f"{name} must be <= 2147483647"):
    make()


def test_pod_mesh_refuses_one_name_for_both_axes():
  with pytest.raises(ValueError, match="slow_axis and fast_axis must differ"):
    jaxcomm.parallel.make_pod_mesh(2, slow_axis="x", fast_axis="x")


# ------------------------------------- one non-finite decision per model --

def _fsdp_mesh():
  return jax.make_mesh((2, 4), ("dcn", "fsdp"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("guard", [True, False], ids=["apply_if_finite",
                                                      "bare"])
def test_nan_in_one_fsdp_block_skips_the_whole_sharded_model(guard):
  """(dcn=2, fsdp=4) with auto_axes=("fsdp",), top-k between slices, a
  NaN in one fsdp block of one slice's gradient: every block of the model
  skips the step (params unchanged, with apply_if_finite after the
  compressor) or every block's update is NaN (without), and the skip is
  counted once on every device's row. Once each block decided alone: the
  other blocks took the step, and the count read [1, 0, 0, 0] per
  slice."""
  mesh = _fsdp_mesh()

  def loss_fn(p, batch):
    # Whole arrays: slice s's gradient of w is batch["g"][s], of b its
    # last (finite) row.
    return (jnp.sum(p["w"] * batch["g"][0])
            + jnp.sum(p["b"] * batch["g"][0, -1]))

  rng = np.random.RandomState(0)
  g = rng.randn(2, 64, 16).astype(np.float32)
  g[0, :16] = np.nan                  # fsdp block 0 of w, slice 0
  w0 = rng.randn(64, 16).astype(np.float32)
  params = {"w": jax.device_put(w0, NamedSharding(mesh, P("fsdp", None))),
            "b": jax.device_put(np.ones(16, np.float32),
                                NamedSharding(mesh, P()))}
  inner = optax.sgd(1.0)
  tx = optax.chain(jaxcomm.topk(0.25, axis_name="dcn"),
                   optax.apply_if_finite(inner, 5) if guard else inner)
  dp = parallel.DataParallel(loss_fn, tx, mesh, axis_name="dcn",
                             auto_axes=("fsdp",), batch_axes=("dcn",),
                             donate=False)
  p, s = dp.init(params)
  p, s, _ = dp.step(p, s, {"g": g})
  w, b = np.asarray(p["w"]), np.asarray(p["b"])
  if guard:
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(b, np.ones(16))
    skipped = np.asarray(jax.device_get(s[1].notfinite_count))
    assert np.all(skipped == 1), skipped
  else:
    for block in range(4):
      assert np.all(np.isnan(w[16 * block:16 * (block + 1)])), block
    assert np.all(np.isnan(b))
  count = np.asarray(jax.device_get(
    jaxcomm.compress_states(s)[0].stats.nonfinite_steps))
  assert np.all(count == 1), count


def test_nan_in_one_model_block_skips_every_block_in_block_mode():
  """Block mode (every mesh axis manual, loss on the device's blocks) on
  (dcn=2, fsdp=4): a NaN in the gradient of fsdp block 0 on slice 0 makes
  every block skip the step alike, counted once on every row; the next,
  finite step moves every block by the plain mean gradient."""
  mesh = _fsdp_mesh()

  def loss_fn(p, batch):
    # Gradient of w: batch[0, 1] everywhere, NaN on block 0 where the
    # slice's batch[0, 0] says so.
    bad = (batch[0, 0] > 0) & (jax.lax.axis_index("fsdp") == 0)
    part = (jnp.where(bad, jnp.nan, 1.0) * jnp.sum(p["w"])
            + jnp.sum(p["b"])) * batch[0, 1]
    return jax.lax.psum(part, "fsdp")

  w0 = np.zeros((64, 16), np.float32)
  params = {"w": jax.device_put(w0, NamedSharding(mesh, P("fsdp", None))),
            "b": jax.device_put(np.zeros(16, np.float32),
                                NamedSharding(mesh, P("fsdp")))}
  tx = optax.chain(jaxcomm.mean_gradients(axis_name="dcn"),
                   optax.apply_if_finite(optax.sgd(1.0), 5))
  dp = parallel.DataParallel(loss_fn, tx, mesh, axis_name="dcn",
                             donate=False)
  p, s = dp.init(params)
  nan_step = np.array([[1.0, 2.0], [0.0, 4.0]], np.float32)
  p, s, _ = dp.step(p, s, nan_step)
  np.testing.assert_array_equal(np.asarray(p["w"]), w0)
  np.testing.assert_array_equal(np.asarray(p["b"]), np.zeros(16))
  count = np.asarray(jaxcomm.compress_states(s)[0].stats.nonfinite_steps)
  assert np.all(count == 1), count
  p, s, _ = dp.step(p, s, np.array([[0.0, 2.0], [0.0, 4.0]], np.float32))
  np.testing.assert_allclose(np.asarray(p["w"]), np.full((64, 16), -3.0))
  np.testing.assert_allclose(np.asarray(p["b"]), np.full(16, -3.0))
