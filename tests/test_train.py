"""train.py: short runs per compressor family, resume, resizing, bad input.

Runs go through ``train.main(argv)`` in this process (whose 8 CPU devices
conftest made), with a tiny char-LSTM and a few steps each.
"""

import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxcomm
import models
import train
from jaxcomm import wire

TINY = ["--model-args", "embed_dim=8,hidden_size=32,num_layers=1",
        "--seq-len", "16", "--batch-size", "16", "--eval-examples", "32",
        "--no-progress", "--no-plot", "--schedule", "constant"]

FAMILIES = [(name, args) for name, args in (
  ("dense", ""),
  ("cast", "error_feedback=True"),
  ("powersgd", "rank=2"),
  ("topk", "ratio=0.05"),
  ("onebit", ""),
) if name in train.available_compressors()]


def _run(tmp_path, *extra, name="run"):
  return train.main(TINY + ["--out-dir", str(tmp_path / name)]
                    + [str(e) for e in extra])


def _host_state(result):
  return jax.tree.map(np.asarray, jax.device_get(result["opt_state"]))


@pytest.mark.parametrize("name,args", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_loss_decreases_and_devices_agree(name, args, tmp_path):
  r = _run(tmp_path, "--compressor", name, "--compressor-args", args,
           "--steps", 8, "--lr", 0.02, "--checkpoint-every", 0)
  losses = [h["loss"] for h in r["history"]]
  assert len(losses) == 8
  assert np.mean(losses[-2:]) < losses[0] - 0.05, losses
  assert r["identical_params"]
  assert r["bytes_per_step"] > 0
  if name != "dense":
    assert r["bytes_per_step"] < r["dense_bytes_per_step"]
  lines = open(tmp_path / "run" / "metrics.jsonl").read().splitlines()
  assert [json.loads(x)["step"] for x in lines] == list(range(1, 9))


def _resume_compressor():
  if "powersgd" in train.available_compressors():
    return ["--compressor", "powersgd", "--compressor-args", "rank=2"]
  return ["--compressor", "cast", "--compressor-args", "error_feedback=True"]


def test_resume_is_bit_identical(tmp_path):
  comp = _resume_compressor()
  full = _run(tmp_path, *comp, "--steps", 6, "--checkpoint-every", 0,
              name="full")
  _run(tmp_path, *comp, "--steps", 6, "--stop-after", 3, name="split")
  ckpt = tmp_path / "split" / "checkpoints"
  assert (train.Checkpoints(str(tmp_path / "split")).latest()
          == str(ckpt / "step_00000003"))
  resumed = _run(tmp_path, *comp, "--steps", 6, "--resume", name="split")
  a = jax.tree.leaves(jax.device_get(full["params"]))
  b = jax.tree.leaves(jax.device_get(resumed["params"]))
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(_host_state(full)),
                  jax.tree.leaves(_host_state(resumed)), strict=True):
    np.testing.assert_array_equal(x, y)
  steps = [json.loads(x)["step"] for x in
           open(tmp_path / "split" / "metrics.jsonl").read().splitlines()]
  assert steps == list(range(1, 7))


def test_checkpoint_from_8_devices_restores_on_4(tmp_path):
  comp = ["--compressor", "cast", "--compressor-args", "error_feedback=True"]
  r8 = _run(tmp_path, *comp, "--steps", 6, "--stop-after", 2, name="r")
  before = jaxcomm.compress_states(_host_state(r8))[0].residual
  assert before and np.asarray(before[0]).shape[0] == 8
  # Resume on 4 devices up to the same step: nothing runs, the result holds
  # the restored (resized) state.
  r4 = _run(tmp_path, *comp, "--steps", 6, "--stop-after", 2, "--resume",
            "--num-devices", 4, name="r")
  after = jaxcomm.compress_states(_host_state(r4))[0].residual
  for x, y in zip(before, after, strict=True):
    assert np.asarray(y).shape[0] == 4
    np.testing.assert_allclose(np.mean(x, axis=0), np.mean(y, axis=0),
                               rtol=1e-6, atol=1e-7)
  assert np.abs(np.asarray(after[0])).sum() > 0
  # and training goes on from there on 4 devices.
  r = _run(tmp_path, *comp, "--steps", 6, "--stop-after", 3, "--resume",
           "--num-devices", 4, name="r")
  assert r["num_devices"] == 4 and r["identical_params"]


def test_unknown_names_list_the_choices(tmp_path):
  with pytest.raises(ValueError, match="valid choices: dense, cast"):
    _run(tmp_path, "--compressor", "nosuch")
  with pytest.raises(ValueError, match="valid names: charlm, cnn"):
    _run(tmp_path, "--model", "nosuch")
  with pytest.raises(ValueError, match="takes no argument"):
    _run(tmp_path, "--compressor", "dense", "--compressor-args", "rank=3")


def test_missing_data_dir_names_the_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="data_batch_1"):
    _run(tmp_path, "--model", "cnn", "--dataset", "cifar10", "--data-dir",
         tmp_path / "nowhere", "--model-args", "")
  with pytest.raises(ValueError, match="--data-dir"):
    _run(tmp_path, "--model", "cnn", "--dataset", "cifar10",
         "--model-args", "")


def _tree_bytes(root):
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      p = os.path.join(d, f)
      out[os.path.relpath(p, root)] = open(p, "rb").read()
  return out


def test_corrupt_or_incompatible_checkpoint(tmp_path):
  comp = ["--compressor", "cast", "--compressor-args", "error_feedback=True"]
  _run(tmp_path, *comp, "--steps", 4, "--stop-after", 2, name="c")
  root = tmp_path / "c" / "checkpoints"
  good = _tree_bytes(root)
  # Incompatible: another model size; the message names what differs.
  with pytest.raises(train.CheckpointError, match="model_args"):
    train.main(["--model-args", "embed_dim=8,hidden_size=16,num_layers=1"]
               + TINY[2:] + comp + ["--steps", "4", "--resume", "--out-dir",
                                    str(tmp_path / "c")])
  with pytest.raises(train.CheckpointError, match="steps"):
    _run(tmp_path, *comp, "--steps", 5, "--resume", name="c")
  assert _tree_bytes(root) == good
  # Corrupt: flip bytes in the largest array file of the latest step.
  _flip_bytes(train.Checkpoints(str(tmp_path / "c")).latest())
  corrupted = _tree_bytes(root)
  with pytest.raises(train.CheckpointError, match="corrupt"):
    _run(tmp_path, *comp, "--steps", 4, "--resume", name="c")
  assert _tree_bytes(root) == corrupted  # nothing overwritten
  # A fresh run into the same directory must be asked for.
  with pytest.raises(ValueError, match="--overwrite"):
    _run(tmp_path, *comp, "--steps", 4, name="c")


def test_default_falls_back_without_powersgd(tmp_path, monkeypatch, capsys):
  # A build of jaxcomm without powersgd: the registry does not list it.
  reg = jaxcomm._registry  # pylint: disable=protected-access
  monkeypatch.setattr(reg, "_REGISTERED", [
    m for m in reg.registered() if m.name != "powersgd"])
  argv = [a for a in TINY if a != "--no-plot"]
  r = train.main(argv + ["--steps", "3", "--out-dir", str(tmp_path / "f")])
  assert "no powersgd" in capsys.readouterr().out
  assert r["compressor"] == "cast"
  assert r["compressor_args"] == {"dtype": "bfloat16", "error_feedback": True}
  for f in ("curves.png", "summary.md", "metrics.jsonl", "config.json"):
    assert (tmp_path / "f" / f).exists(), f
  with pytest.raises(ValueError, match="unknown compressor: 'powersgd'"):
    train.main(TINY + ["--compressor", "powersgd", "--compressor-args",
                       "rank=2", "--out-dir", str(tmp_path / "g")])


@pytest.mark.parametrize("flag,value", [("--eval-examples", 0),
                                        ("--log-every", 0),
                                        ("--checkpoint-every", -1),
                                        ("--stop-after", -1),
                                        ("--lr", "nan")])
def test_nonsense_flags_are_refused_by_name(flag, value, tmp_path):
  with pytest.raises(ValueError, match=flag):
    _run(tmp_path, "--compressor", "dense", flag, value)


@pytest.mark.parametrize("model,args,match", [
  ("charlm", "embed_dim=8,hidden_size=-3,num_layers=1",
   r"--model-args hidden_size=-3: .*positive integer"),
  ("charlm", "embed_dim=8,hidden=32", r"--model-args: .*hidden; accepted: "
   r"vocab_size, embed_dim, hidden_size, num_layers"),
  ("charlm", "embed_dim=8,hidden_size=32,num_layers=0",
   r"--model-args num_layers=0: .*positive integer"),
  ("charlm", "embed_dim=2.5,hidden_size=32",
   r"--model-args embed_dim=2.5: .*positive integer"),
  ("charlm", "vocab_size=7,hidden_size=32",
   r"--model-args vocab_size=7: the dataset fixes vocab_size"),
  ("mlp", "hidden_sizes=(16,-1)",
   r"--model-args hidden_sizes=\(16, -1\): .*tuple of positive integers"),
  ("cnn", "hidden=0", r"--model-args hidden=0: .*positive integer"),
  ("cnn", "num_classes=5", r"--model-args num_classes=5: the dataset fixes"),
], ids=["negative", "unknown", "zero_layers", "float", "vocab", "mlp_tuple",
        "cnn_zero", "classes"])
def test_nonsense_model_args_are_refused_by_name(model, args, match,
                                                 tmp_path):
  with pytest.raises(ValueError, match=match):
    _run(tmp_path, "--compressor", "dense", "--model", model,
         "--model-args", args, "--steps", 1)
  assert not (tmp_path / "run").exists()


def _metrics_steps(out):
  return [json.loads(x)["step"]
          for x in open(out / "metrics.jsonl").read().splitlines()]


def test_resuming_a_finished_run_keeps_its_train_loss(tmp_path, capsys):
  comp = ["--compressor", "cast", "--compressor-args", "error_feedback=True"]
  first = _run(tmp_path, *comp, "--steps", 2, name="d")
  out = tmp_path / "d"
  before = json.loads((out / "result.json").read_text())
  capsys.readouterr()
  again = _run(tmp_path, *comp, "--steps", 2, "--resume", name="d")
  assert "run already complete at step 2" in capsys.readouterr().out
  after = json.loads((out / "result.json").read_text())
  for r in (again, after):
    assert np.isfinite(r["train_loss"]) and np.isfinite(r["train_accuracy"])
    assert r["train_loss"] == first["train_loss"] == before["train_loss"]
    assert r["train_accuracy"] == first["train_accuracy"]
    assert r["eval_loss"] == first["eval_loss"]
    assert r["steps"] == 2
    assert r["steps_per_s"] == before["steps_per_s"] > 0
  summary = (out / "summary.md").read_text()
  assert "nan" not in summary
  assert f"| {first['train_loss']:.4f} |" in summary
  assert _metrics_steps(out) == [1, 2]


def _flip_bytes(step_dir):
  files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs
           if f != "meta.json"]
  big = max(files, key=os.path.getsize)
  blob = bytearray(open(big, "rb").read())
  for i in range(len(blob) // 2, min(len(blob), len(blob) // 2 + 16)):
    blob[i] ^= 0xFF
  open(big, "wb").write(bytes(blob))


def test_corrupt_latest_names_the_older_checkpoint_and_resume_from_it(
    tmp_path):
  comp = ["--compressor", "cast", "--compressor-args", "error_feedback=True"]
  full = _run(tmp_path, *comp, "--steps", 4, "--checkpoint-every", 2,
              name="o")
  root = tmp_path / "o" / "checkpoints"
  older, latest = root / "step_00000002", root / "step_00000004"
  ckpts = train.Checkpoints(str(tmp_path / "o"))
  assert ckpts.latest() == str(latest) and older.is_dir()
  _flip_bytes(latest)
  corrupted = _tree_bytes(latest)
  with pytest.raises(train.CheckpointError) as err:
    _run(tmp_path, *comp, "--steps", 4, "--resume", name="o")
  msg = str(err.value)
  assert "corrupt" in msg and str(latest) in msg
  assert (f"pass --resume-from {older} to resume from the older checkpoint "
          "at step 2") in msg
  # The fallback is checked against this run like any resume,
  with pytest.raises(train.CheckpointError, match="steps: checkpoint has 4"):
    _run(tmp_path, *comp, "--steps", 5, "--resume-from", older, name="o")
  # refuses what is not a checkpoint, naming the flag,
  with pytest.raises(train.CheckpointError, match="--resume-from nowhere"):
    _run(tmp_path, *comp, "--steps", 4, "--resume-from", "nowhere", name="o")
  # and continues bit-identically to the end (a name under checkpoints/ is
  # enough), truncating the metrics to its step; the corrupt step is moved
  # aside, not overwritten, and the new step 4 is the latest.
  r = _run(tmp_path, *comp, "--steps", 4, "--resume-from", older.name,
           name="o")
  assert r["steps"] == 4 and np.isfinite(r["train_loss"])
  assert r["train_loss"] == full["train_loss"]
  for x, y in zip(jax.tree.leaves(jax.device_get(full["params"])),
                  jax.tree.leaves(jax.device_get(r["params"])), strict=True):
    np.testing.assert_array_equal(x, y)
  assert _metrics_steps(tmp_path / "o") == [1, 2, 3, 4]
  assert ckpts.latest() == str(latest) and ckpts.read()[3] == 4
  assert _tree_bytes(root / "abandoned" / latest.name) == corrupted
  assert ckpts.steps() == [4, 2]
  # and a plain --resume now finds the new checkpoint.
  again = _run(tmp_path, *comp, "--steps", 4, "--resume", name="o")
  assert again["train_loss"] == full["train_loss"]


def test_format_1_checkpoint_is_refused_by_name(tmp_path):
  """The layout before the CheckpointManager (meta.json beside the arrays)
  is named, not misread."""
  step = tmp_path / "checkpoints" / "step_00000002"
  step.mkdir(parents=True)
  (step / "meta.json").write_text(json.dumps({"format": 1}))
  ckpts = train.Checkpoints(str(tmp_path))
  assert ckpts.resolve(step.name) == str(step)
  with pytest.raises(train.CheckpointError, match="format 1"):
    ckpts.read(str(step))


def test_refused_restore_exits_cleanly(tmp_path):
  """A subprocess: the error, and no asyncio tracebacks at exit."""
  comp = ["--compressor", "cast", "--compressor-args", "error_feedback=True"]
  _run(tmp_path, *comp, "--steps", 4, "--checkpoint-every", 2, name="x")
  # Remove the array data of both checkpoints: orbax's reads fail while
  # others are in flight (the case that left tensorstore calling back into a
  # closed event loop).
  victims = [os.path.join(d, f)
             for d, _, fs in os.walk(tmp_path / "x" / "checkpoints")
             for f in fs if os.path.basename(os.path.dirname(d))
             .startswith("ocdbt.process_") and os.path.basename(d) == "d"]
  assert victims, "orbax's array files not found: layout changed?"
  for f in victims:
    os.remove(f)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count"))
  proc = subprocess.run(
    [sys.executable, os.path.join(repo, "train.py"), *TINY, *comp,
     "--steps", "4", "--num-devices", "2", "--resume", "--out-dir",
     str(tmp_path / "x")],
    cwd=repo, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert "error: checkpoint" in proc.stderr, proc.stderr
  assert "is corrupt or unreadable" in proc.stderr, proc.stderr
  assert "no other checkpoint" in proc.stderr, proc.stderr
  assert "Event loop is closed" not in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr


def _unretrieved_failure(loop):
  """Runs a task that fails on ``loop``, never reads its error, closes the
  loop and drops the task: what a restore's other failed reads leave."""
  import asyncio
  import gc

  async def fails():
    raise ValueError("a read failed")

  task = loop.create_task(fails())
  loop.run_until_complete(asyncio.sleep(0))
  assert task.done()
  loop.close()
  del task
  gc.collect()


@pytest.mark.parametrize("drained", [False, True])
def test_restore_loops_log_the_other_failed_reads_quietly(drained, caplog):
  import asyncio

  from trainer import checkpoints
  caplog.set_level(logging.DEBUG)
  if drained:
    with checkpoints._drained_event_loops():
      loop = asyncio.new_event_loop()
    assert isinstance(loop, checkpoints._DrainingEventLoop)
  else:
    loop = asyncio.new_event_loop()
  _unretrieved_failure(loop)
  errors = [r for r in caplog.records if r.levelno >= logging.ERROR
            and "never retrieved" in r.getMessage()]
  quiet = [r for r in caplog.records if r.levelno == logging.DEBUG
           and "a read failed" in r.getMessage()]
  # The default loop logs the traceback (the CI failure); the restore's loop
  # keeps the error, at debug level.
  assert (len(errors), len(quiet)) == ((0, 1) if drained else (1, 0))


def test_one_device_summary_says_nothing_crosses_the_wire():
  r = {"model": "mlp", "compressor": "topk", "compressor_args": {},
       "num_devices": 1, "steps": 3, "train_loss": 1.0, "eval_loss": 1.0,
       "eval_accuracy": 0.5, "bytes_per_step": 0, "dense_bytes_per_step": 0,
       "compression_ratio": float("inf"), "steps_per_s": 2.0}
  table = train.summary_table([r])
  assert "one device: no traffic" in table and "inf" not in table
  r.update(dataset="digits", train_time_s=1.0, wall_time_s=2.0,
           out_dir="runs/x")
  line = train.summary_line(r)
  assert "one device: nothing crosses the wire" in line, line
  assert "inf" not in line and "0 B" not in line, line
  r.update(num_devices=8, bytes_per_step=100, dense_bytes_per_step=1000,
           compression_ratio=10.0)
  assert "| 10.0x |" in train.summary_table([r])
  line = train.summary_line(r)
  assert "(10.0x less)" in line
  assert "nothing crosses" not in line


def test_every_flag_has_help_and_default():
  """train.py --help: every flag says what it does, and each flag with a
  default shows it (ArgumentDefaultsHelpFormatter adds it only to flags
  that have a help text)."""
  parser = train.build_parser()
  flags = [a for a in parser._actions if a.option_strings
           and a.dest != "help"]
  assert len(flags) > 30
  missing = [a.option_strings[0] for a in flags
             if not (a.help and a.help.strip())]
  assert not missing, f"flags without help: {missing}"
  text = " ".join(parser.format_help().split())
  by_flag = {a.option_strings[0]: a for a in flags}
  formatter = parser._get_formatter()
  for flag, default in (("--lr", "0.003"), ("--steps", "1500"),
                        ("--seq-len", "64"), ("--dataset", "auto"),
                        ("--momentum", "0.9"), ("--weight-decay", "0.0"),
                        ("--schedule", "cosine"), ("--warmup-steps", "50")):
    action = by_flag[flag]
    shown = formatter._get_help_string(action) % {"default": action.default}
    assert shown.endswith(f"(default: {default})"), (flag, shown)
    assert " ".join(shown.split()) in text
  for a in flags:
    if a.default is not None:
      assert "(default: " in formatter._get_help_string(a), a.option_strings


LOCAL_RUNS = [
  ("local_sgd", ["--local", "local_sgd", "--local-args", "period=4",
                 "--optimizer", "momentum", "--lr", 0.5]),
  ("diloco_topk", ["--local", "diloco", "--local-args", "period=4",
                   "--optimizer", "adamw", "--lr", 0.01, "--compressor",
                   "topk", "--compressor-args", "ratio=0.05"]),
  ("adacomm", ["--local", "adacomm", "--local-args", "period=2,interval=2",
               "--optimizer", "momentum", "--lr", 0.5]),
  ("fedcom_topk", ["--local", "fedcom", "--local-args",
                   "period=4,learning_rate=0.5", "--optimizer", "sgd",
                   "--lr", 0.5, "--compressor", "topk", "--compressor-args",
                   "ratio=0.1"]),
]


@pytest.mark.parametrize("name,args", LOCAL_RUNS,
                         ids=[r[0] for r in LOCAL_RUNS])
def test_local_update_runs_resume_bit_identical_across_a_sync(name, args,
                                                              tmp_path):
  """A local-update run split at step 3 (between syncs: per-device params
  differ in the checkpoint) and resumed equals the straight run, through
  the sync at step 4, bit for bit; bytes move on sync steps only."""
  full = _run(tmp_path, *args, "--steps", 6, "--checkpoint-every", 0,
              name="full")
  _run(tmp_path, *args, "--steps", 6, "--stop-after", 3, name="split")
  resumed = _run(tmp_path, *args, "--steps", 6, "--resume", name="split")
  for x, y in zip(jax.tree.leaves(jax.device_get(full["params"])),
                  jax.tree.leaves(jax.device_get(resumed["params"])),
                  strict=True):
    assert x.shape[0] == 8          # per device
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(_host_state(full)),
                  jax.tree.leaves(_host_state(resumed)), strict=True):
    np.testing.assert_array_equal(x, y)
  moved = [h["bytes_per_step"] for h in full["history"]]
  if name != "adacomm":
    assert [m > 0 for m in moved] == [False, False, False, True, False,
                                      False], moved
    assert full["identical_params"] is False  # step 6: between syncs
  else:
    assert moved[1] > 0 and 0 < sum(m > 0 for m in moved) < 6, moved
  assert full["bytes_per_step"] == pytest.approx(sum(moved) / 6)
  assert full["bytes_per_step"] < full["dense_bytes_per_step"]


GOSSIP_RUNS = [
  ("choco", ["--local", "choco", "--local-args", "topology=ring,gamma=0.5",
             "--compressor", "topk", "--compressor-args", "ratio=0.1"]),
  ("sgp", ["--local", "sgp", "--local-args", "topology=exponential"]),
  ("dcd_topk", ["--local", "dcd_psgd", "--local-args", "topology=ring",
                "--compressor", "topk", "--compressor-args", "ratio=0.1"]),
]


@pytest.mark.parametrize("name,args", GOSSIP_RUNS,
                         ids=[r[0] for r in GOSSIP_RUNS])
def test_gossip_runs_log_consensus_and_resume_bit_identical(name, args,
                                                            tmp_path):
  """Decentralized runs: every step moves bytes, the metrics carry the
  consensus distance, and a resumed run (per-device params and gossip
  memory in the checkpoint) equals the straight one bit for bit."""
  del name
  args = args + ["--optimizer", "momentum", "--lr", 0.5, "--steps", 4]
  full = _run(tmp_path, *args, "--checkpoint-every", 0, "--log-every", 1,
              name="full")
  _run(tmp_path, *args, "--stop-after", 2, name="split")
  resumed = _run(tmp_path, *args, "--resume", name="split")
  for x, y in zip(jax.tree.leaves(jax.device_get(full["params"])),
                  jax.tree.leaves(jax.device_get(resumed["params"])),
                  strict=True):
    assert x.shape[0] == 8
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(_host_state(full)),
                  jax.tree.leaves(_host_state(resumed)), strict=True):
    np.testing.assert_array_equal(x, y)
  hist = full["history"]
  assert all(h["bytes_per_step"] > 0 for h in hist)
  dist = [h["consensus_distance"] for h in hist]
  assert dist[0] > 0 and all(np.isfinite(dist)), dist
  assert full["identical_params"] is False


def test_local_sgd_checkpoint_resumes_on_4_devices(tmp_path):
  args = ["--local", "local_sgd", "--local-args", "period=4", "--optimizer",
          "momentum", "--lr", 0.5]
  r8 = _run(tmp_path, *args, "--steps", 8, "--stop-after", 2, name="r")
  mean8 = [np.asarray(x).mean(0) for x in
           jax.tree.leaves(jax.device_get(r8["params"]))]
  r4 = _run(tmp_path, *args, "--steps", 8, "--stop-after", 2, "--resume",
            "--num-devices", 4, name="r")
  for x, m in zip(jax.tree.leaves(jax.device_get(r4["params"])), mean8,
                  strict=True):
    assert x.shape[0] == 4
    np.testing.assert_allclose(x.mean(0), m, rtol=1e-5, atol=1e-6)
  r = _run(tmp_path, *args, "--steps", 8, "--stop-after", 4, "--resume",
           "--num-devices", 4, name="r")
  assert r["num_devices"] == 4 and r["identical_params"]  # synced at 4


def test_local_flags_are_checked(tmp_path):
  with pytest.raises(ValueError, match="period=H"):
    _run(tmp_path, "--local", "local_sgd", "--steps", 2)
  with pytest.raises(ValueError,
                     match="dense all-reduce; --compressor applies to"):
    _run(tmp_path, "--local", "local_sgd", "--local-args", "period=2",
         "--compressor", "topk", "--compressor-args", "ratio=0.1",
         "--steps", 2)
  with pytest.raises(ValueError, match="valid: .*outer_lr"):
    _run(tmp_path, "--local", "diloco", "--local-args", "period=2,nosuch=1",
         "--steps", 2)
  with pytest.raises(ValueError, match="exchanges its own"):
    _run(tmp_path, "--local", "diloco", "--local-args", "period=2",
         "--optimizer", "onebit_adam", "--steps", 2)
  with pytest.raises(ValueError, match="--local choco gossips compressed"):
    _run(tmp_path, "--local", "choco", "--steps", 2)


def test_zero_one_adam_runs_from_the_command_line(tmp_path):
  r = _run(tmp_path, "--optimizer", "zero_one_adam", "--optimizer-args",
           "var_freeze_step=2,local_step_scaler=2,local_step_clipper=2",
           "--lr", 0.003, "--steps", 6, "--checkpoint-every", 0)
  assert r["compressor"] == "zero_one_adam"
  assert jax.tree.leaves(jax.device_get(r["params"]))[0].shape[0] == 8
  moved = [h["bytes_per_step"] for h in r["history"]]
  # Steps 1-2: variance steps (the dense mean); then 1-bit syncs at steps
  # 3, 4 and 6 (the interval doubles to 2 after two steps), none at 5.
  dense = r["dense_bytes_per_step"]
  assert moved[0] == moved[1] == dense, moved
  assert moved[2] == moved[3] == moved[5] and 0 < moved[2] < dense / 10
  assert moved[4] == 0, moved
  assert np.isfinite(r["eval_loss"])


# ------------------------------------------------ --slices: the pod recipe

def test_slices_with_a_dense_mean_follow_the_flat_run(tmp_path):
  """--slices 2 with --compressor dense (a mean inside each slice of 4,
  then between the 2) is the same mean as the flat 8-device run: the same
  losses and params; the bytes counted are those between slices."""
  common = ["--compressor", "dense", "--steps", 4, "--checkpoint-every", 0]
  flat = _run(tmp_path, *common, name="flat")
  pod = _run(tmp_path, *common, "--slices", 2, name="pod")
  np.testing.assert_allclose([h["loss"] for h in pod["history"]],
                             [h["loss"] for h in flat["history"]],
                             rtol=1e-5)
  for a, b in zip(jax.tree.leaves(jax.device_get(pod["params"])),
                  jax.tree.leaves(jax.device_get(flat["params"]))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)
  size = sum(np.size(x) for x in jax.tree.leaves(pod["params"]))
  # A ring all-reduce of the float32 params (and the finiteness flag)
  # between 2 slices sends each byte once.
  assert pod["dense_bytes_per_step"] == pytest.approx(4 * size + 4)
  assert pod["bytes_per_step"] == pytest.approx(4 * size + 4)


@pytest.mark.parametrize("sharded", [False, True])
def test_slices_compress_between_slices_and_resume(sharded, tmp_path):
  """Top-k between 2 slices (per device of the pod recipe, or per share
  with --sharded-exchange): the loss falls, the bytes are top-k's claim
  between 2 devices on the whole gradient or on a quarter of it, and a
  run stopped and resumed ends bit-identical."""
  flags = ["--compressor", "topk", "--compressor-args", "ratio=0.05",
           "--slices", 2, "--steps", 6, "--lr", 0.02]
  if sharded:
    flags.append("--sharded-exchange")
  full = _run(tmp_path, *flags, "--checkpoint-every", 0, name="full")
  losses = [h["loss"] for h in full["history"]]
  assert np.mean(losses[-2:]) < losses[0], losses
  assert full["identical_params"]
  params = jax.tree.leaves(full["params"])
  size = sum(np.size(x) for x in params)
  if sharded:
    shapes = {"share": jax.ShapeDtypeStruct((-(-size // 4),), np.float32)}
  else:
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          full["params"])
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(
    jaxcomm.topk(0.05, axis_name="dcn"), shapes, 2), 2).total_sent
  assert full["bytes_per_step"] == pytest.approx(claim)
  assert full["bytes_per_step"] < full["dense_bytes_per_step"]
  _run(tmp_path, *flags, "--stop-after", 3, name="split")
  resumed = _run(tmp_path, *flags, "--resume", name="split")
  for a, b in zip(jax.tree.leaves(jax.device_get(full["params"])),
                  jax.tree.leaves(jax.device_get(resumed["params"]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("flags,match", [
  (["--slices", 3], "--slices 3 must be >= 1 and divide"),
  (["--slices", 2, "--local", "local_sgd"], "does not combine"),
  (["--sharded-exchange"], "needs --slices > 1"),
  (["--slices", 2, "--sharded-exchange", "--compressor", "powersgd"],
   "PowerSGD takes matrices"),
])
def test_slices_refuse_what_they_cannot_run(flags, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    _run(tmp_path, "--steps", 2, *flags)


def test_slices_checkpoint_refuses_another_device_count(tmp_path):
  """A residual kept per slice cannot be spread over another device count:
  the resume is refused by name, not resized wrongly."""
  flags = ["--compressor", "topk", "--compressor-args", "ratio=0.05",
           "--slices", 2, "--steps", 4]
  _run(tmp_path, *flags, "--stop-after", 2, name="x")
  with pytest.raises(ValueError, match="cannot resize a state leaf"):
    _run(tmp_path, *flags, "--resume", "--num-devices", 4, name="x")


_LM = ["--model", "transformer", "--model-args",
       "d_model=32,num_heads=2,num_layers=1,d_ff=64,max_len=16"]


@pytest.mark.parametrize("mesh,local", [("dcn=2,fsdp=4", None),
                                        ("dcn=2,fsdp=2,tensor=2", None),
                                        ("dcn=2,fsdp=4", "diloco")])
def test_mesh_trains_a_sharded_lm_and_resumes_bit_identical(mesh, local,
                                                            tmp_path):
  """--mesh: the transformer LM split by its logical axes, top-k across
  dcn: the loss falls, the params keep their shardings, the bytes are
  top-k's claim for one device's shards on 2 devices, and a run stopped and
  resumed ends bit-identical (params and per-shard state); DiLoCo with
  top-k on the pseudo-gradient too."""
  flags = _LM + ["--mesh", mesh, "--compressor", "topk",
                 "--compressor-args", "ratio=0.05", "--steps", 6,
                 "--lr", 0.01]
  if local:
    flags += ["--local", local, "--local-args", "period=2"]
  full = _run(tmp_path, *flags, "--checkpoint-every", 0, name="full")
  losses = [h["loss"] for h in full["history"]]
  assert np.mean(losses[-2:]) < losses[0], losses
  assert full["identical_params"]
  specs = models.PARTITION_SPECS["transformer"](
    full["params"], tuple(a.split("=")[0] for a in mesh.split(",")))
  if local is None:
    for x, sp in zip(jax.tree.leaves(full["params"]),
                     jax.tree.leaves(specs, is_leaf=lambda s: isinstance(
                       s, jax.sharding.PartitionSpec))):
      assert x.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(x.sharding.mesh, sp), x.ndim), sp
    shards = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.addressable_shards[0].data.shape,
                                     x.dtype), full["params"])
    claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(
      jaxcomm.topk(0.05, axis_name="dcn"), shards, 2), 2).total_sent
    assert full["bytes_per_step"] == pytest.approx(claim)
  if "tensor" in mesh:
    return   # resuming is the same code on either mesh
  _run(tmp_path, *flags, "--stop-after", 3, name="split")
  resumed = _run(tmp_path, *flags, "--resume", name="split")
  for a, b in zip(jax.tree.leaves(jax.device_get(full["params"])),
                  jax.tree.leaves(jax.device_get(resumed["params"]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for x, y in zip(jax.tree.leaves(_host_state(full)),
                  jax.tree.leaves(_host_state(resumed)), strict=True):
    np.testing.assert_array_equal(x, y)


def test_mesh_powersgd_counts_the_whole_matrix_exchange(tmp_path):
  """--mesh with PowerSGD: each device sends the whole matrices' factors
  once per slice (sharded="whole", the default), fewer bytes than a
  factorization per shard; the run trains."""
  r = _run(tmp_path, *_LM, "--mesh", "dcn=2,fsdp=4", "--compressor",
           "powersgd", "--compressor-args", "rank=2", "--steps", 4,
           "--lr", 0.01, "--checkpoint-every", 0)
  mesh = jax.tree.leaves(r["params"])[0].sharding.mesh
  specs = models.PARTITION_SPECS["transformer"](r["params"],
                                                mesh.axis_names)
  shards = jaxcomm.parallel.shard_shapes(r["params"], specs, mesh)
  splits = jaxcomm.parallel.shard_splits(specs, mesh)
  whole = jaxcomm.wire.summarize(jaxcomm.wire.claimed(
    jaxcomm.powersgd(2, axis_name="dcn"), shards, 2, splits=splits),
    2).total_sent
  per_shard = jaxcomm.wire.summarize(jaxcomm.wire.claimed(
    jaxcomm.powersgd(2, axis_name="dcn", sharded="shard"), shards, 2,
    splits=splits), 2).total_sent
  assert r["bytes_per_step"] == pytest.approx(whole)
  assert whole < per_shard
  assert np.isfinite(r["eval_loss"])


def test_mesh_with_a_size_one_model_axis_is_the_plain_step(tmp_path):
  """--mesh dcn=2,fsdp=1 (a pod's config on one host): the same params as
  the plain 2-device run without --mesh, the replicated leaves included."""
  flags = _LM + ["--compressor", "topk", "--compressor-args", "ratio=0.05",
                 "--steps", 3, "--lr", 0.01, "--checkpoint-every", 0,
                 "--num-devices", 2]
  mesh = _run(tmp_path, *flags, "--mesh", "dcn=2,fsdp=1", name="mesh")
  plain = _run(tmp_path, *flags, name="plain")
  for (path, a), b in zip(
      jax.tree_util.tree_leaves_with_path(jax.device_get(mesh["params"])),
      jax.tree.leaves(jax.device_get(plain["params"])), strict=True):
    assert a.shape == b.shape, (jax.tree_util.keystr(path), a.shape)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("flags,match", [
  (["--mesh", "dcn=2,fsdp=2"], "holds 4 devices, --num-devices 8"),
  (["--mesh", "dcn=2"], "name the data axis and at least one model axis"),
  (["--mesh", "dcn=2,dcn=4"], "named twice"),
  (["--mesh", "dcn=2,fsdp=x"], "size of 'fsdp' must be an integer"),
  (["--mesh", "dcn=2,fsdp=4", "--slices", 2], "does not combine"),
  (["--mesh", "dcn=2,foo=4"], r"\{'foo': 4\} split no params leaf"),
])
def test_mesh_refuses_what_it_cannot_run(flags, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    _run(tmp_path, *_LM, "--steps", 2, *flags)


def test_mesh_needs_a_model_with_logical_axes(tmp_path):
  with pytest.raises(ValueError, match="--model charlm has none"):
    _run(tmp_path, "--steps", 2, "--mesh", "dcn=2,fsdp=4")


def test_mesh_checkpoint_refuses_another_mesh(tmp_path):
  flags = _LM + ["--compressor", "topk", "--compressor-args", "ratio=0.05",
                 "--steps", 4]
  _run(tmp_path, *flags, "--mesh", "dcn=2,fsdp=4", "--stop-after", 2)
  with pytest.raises(train.CheckpointError, match="keep their names"):
    _run(tmp_path, *flags, "--mesh", "dcn=2,tensor=4", "--resume")


@pytest.mark.parametrize("mesh,devices", [("dcn=2,fsdp=2", 4),
                                          ("dcn=4,fsdp=2", 8),
                                          ("dcn=2,fsdp=1", 2)])
def test_mesh_checkpoint_resumes_on_another_fsdp_size(mesh, devices,
                                                      tmp_path):
  """A (dcn=2, fsdp=4) checkpoint resumed with fsdp=2 (and also 4 slices):
  the residuals are re-cut for the new blocks, so the mass each slice's
  devices hold, summed, is what the checkpoint held (averaged over the
  slices when their number changes, as resize_state keeps it); then the
  run continues. (That every element lands where it belongs, moments
  included, is tests/test_reshard.py's.)"""
  flags = _LM + ["--compressor", "topk", "--compressor-args", "ratio=0.05",
                 "--optimizer", "adam", "--lr", 0.01]
  saved = _run(tmp_path, *flags, "--mesh", "dcn=2,fsdp=4", "--steps", 4,
               "--stop-after", 2)

  def per_slice(state, slices):
    res = jaxcomm.compress_states(state)[0].residual[0]
    return res.reshape(slices, -1).astype(np.float64).sum(axis=1)

  before = per_slice(_host_state(saved), 2)
  assert np.abs(before).min() > 0
  restored = _run(tmp_path, *flags, "--mesh", mesh, "--num-devices",
                  devices, "--steps", 4, "--stop-after", 2, "--resume")
  slices = int(mesh.split(",")[0].split("=")[1])
  after = per_slice(_host_state(restored), slices)
  np.testing.assert_allclose(after.mean(), before.mean(), rtol=1e-5)
  if slices == 2:
    np.testing.assert_allclose(after, before, rtol=1e-5)
  more = _run(tmp_path, *flags, "--mesh", mesh, "--num-devices", devices,
              "--steps", 4, "--resume")
  assert np.isfinite(more["eval_loss"])


def test_mesh_checkpoint_resumes_on_another_number_of_slices(tmp_path):
  """A (dcn=2, fsdp=4) checkpoint resumed on (dcn=1, fsdp=4): each fsdp
  block's residual is the average of its two slices' rows (what the state
  owes the averaged update), computed here from the saved state; then the
  run continues on 4 devices."""
  flags = _LM + ["--compressor", "topk", "--compressor-args", "ratio=0.05",
                 "--lr", 0.01]
  saved = _run(tmp_path, *flags, "--mesh", "dcn=2,fsdp=4", "--steps", 4,
               "--stop-after", 2)
  before = jaxcomm.compress_states(_host_state(saved))[0].residual[0]
  assert before.shape[0] == 8 and np.abs(before).max() > 0
  restored = _run(tmp_path, *flags, "--mesh", "dcn=1,fsdp=4",
                  "--num-devices", 4, "--steps", 4, "--stop-after", 2,
                  "--resume")
  after = jaxcomm.compress_states(_host_state(restored))[0].residual[0]
  want = before.reshape((2, 4) + before.shape[1:]).astype(np.float64)
  np.testing.assert_allclose(after, want.mean(axis=0), rtol=1e-6, atol=1e-7)
  more = _run(tmp_path, *flags, "--mesh", "dcn=1,fsdp=4", "--num-devices",
              4, "--steps", 4, "--resume")
  assert np.isfinite(more["eval_loss"])


@pytest.mark.parametrize("flags,match", [
  (["--keep-checkpoints", 0], "--keep-checkpoints must be >= 1"),
  (["--weight-decay", -1], "--weight-decay must be a finite number >= 0"),
  (["--eval-every", -1], "--eval-every must be >= 0"),
  (["--compressor", "topk", "--compressor-args", "ratio=0.1,ratio=0.2"],
   "'ratio' is given twice"),
  (["--local", "diloco", "--local-args", "period=2,outer_lr=abc"],
   "outer_lr='abc': expected a finite number"),
  (["--optimizer", "adam", "--optimizer-args", "freeze_step=5"],
   "--optimizer adam takes none"),
  (["--local-args", "period=4"], "without --local"),
  (["--delay-args", "width=3"], "--delay-args 'width=3' without --delay"),
  (["--local", "hierarchical_sgd", "--local-args", "period=1"],
   "--local hierarchical_sgd averages within groups .* give --slices"),
  (["--local", "hierarchical_sgd", "--slices", 2, "--local-args",
    "period=2,global_period=3"],
   "^--local hierarchical_sgd: global_period must be a multiple"),
  (["--delay", "pipe_sgd", "--delay-args", "width=abc"],
   "^--delay pipe_sgd: width must be an int >= 2"),
])
def test_run_flags_out_of_range_are_named(flags, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    _run(tmp_path, "--steps", 2, *flags)


@pytest.mark.parametrize("zeta", [0.0, 1e12])
def test_lag_run_counts_only_the_steps_that_send(zeta, tmp_path):
  """LAG in train.py: a step's bytes are the 4-byte sender count plus each
  bucket's all-reduce only where some device sent it; the summary gives
  the fraction of steps a device sent on. zeta=0: every device sends every
  step (the static claim); zeta=1e12: only the first step sends."""
  steps = 5
  r = _run(tmp_path, "--compressor", "lag", "--compressor-args",
           f"zeta={zeta}", "--steps", steps, "--checkpoint-every", 0,
           "--log-every", 1)
  tx = jaxcomm.lag(zeta)
  cfg = train.Config(model="charlm",
                     model_args="embed_dim=8,hidden_size=32,num_layers=1",
                     seq_len=16)
  params = train.build_model(cfg, train.load_data(cfg)[2]).params
  full = wire.summarize(wire.claimed(tx, params, 8), 8).total_sent
  buckets = wire.summarize(
    [("all-reduce", 4 * lay.size)
     for lay in jaxcomm.spec_of(tx).layouts(params)], 8).total_sent
  per_step = [h["bytes_per_step"] for h in r["history"] if "loss" in h]
  if zeta == 0.0:
    assert per_step == [full] * steps
    assert r["sent_fraction"] == 1.0
  else:
    assert per_step == [full] + [full - buckets] * (steps - 1)
    assert r["sent_fraction"] == pytest.approx(1 / steps)
  assert r["bytes_per_step"] == pytest.approx(sum(per_step) / steps)
  assert "of steps" in train.summary_line(r)


def test_progress_off_a_terminal_is_a_plain_line_every_few_steps(
    tmp_path, capsys):
  """Into a log (stderr not a terminal, as under ``make train > log
  2>&1``) the tqdm bar wrote a carriage-return redraw per step (about
  1,500 in a run). There the progress is one plain line every ceil(40 /
  20) = 2 steps: 20 lines for 40 steps, the last at step 40, no '\\r'."""
  argv = [a for a in TINY if a != "--no-progress"] + [
    "--progress", "--out-dir", str(tmp_path / "run"), "--steps", "40",
    "--log-every", "10"]
  train.main(argv)
  err = capsys.readouterr().err
  assert "\r" not in err
  lines = [line for line in err.splitlines() if ": step " in line]
  assert [int(line.split(": step ")[1].split("/")[0]) for line in lines] \
    == list(range(2, 41, 2))
  assert lines[-1].split(": step ")[1].startswith("40/40 loss=")
  from trainer import progress  # pylint: disable=import-outside-toplevel

  class Tty(__import__("io").StringIO):
    def isatty(self):
      return True
  # On a terminal it is still the bar (tqdm redraws with '\r').
  tty = Tty()
  bar = progress.Progress(10, 0, "x", tty)
  for _ in range(10):
    bar.update(1)
  bar.close()
  assert "\r" in tty.getvalue()


def test_delay_flags_apply_the_average_late_and_resume_bit_identical(
    tmp_path):
  """``--delay pipe_sgd`` around top-k: the run differs from the plain
  one, equals ``--delay stale_sgd`` with tau=1 (both apply each average
  one step late), and a run stopped at step 2 and resumed (the pending
  average in the checkpoint) equals the straight one bit for bit; a
  delay with --local is refused by name."""
  comp = ["--compressor", "topk", "--compressor-args", "ratio=0.1",
          "--optimizer", "momentum", "--lr", 0.5, "--steps", 4]
  pipe = comp + ["--delay", "pipe_sgd"]
  full = _run(tmp_path, *pipe, "--checkpoint-every", 0, name="full")
  plain = _run(tmp_path, *comp, "--checkpoint-every", 0, name="plain")
  stale = _run(tmp_path, *comp, "--delay", "stale_sgd", "--delay-args",
               "tau=1", "--checkpoint-every", 0, name="stale")
  _run(tmp_path, *pipe, "--stop-after", 2, name="split")
  resumed = _run(tmp_path, *pipe, "--resume", name="split")
  leaves = lambda r: jax.tree.leaves(jax.device_get(r["params"]))
  for x, y, z in zip(leaves(full), leaves(resumed), leaves(stale),
                     strict=True):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(x, z)
  assert any(np.abs(x - p).max() > 0
             for x, p in zip(leaves(full), leaves(plain)))
  with pytest.raises(ValueError, match="--delay pipe_sgd delays"):
    _run(tmp_path, "--local", "local_sgd", "--local-args", "period=2",
         "--delay", "pipe_sgd", "--steps", 2, name="bad")


def _minimal_flags(family, name):
  """The fewest flags ``--<family> name`` needs: what the method cannot
  run without (a sync period, a compressor, slices), nothing it has a
  default for."""
  flags = ["--" + family, name]
  if family == "delay":
    return flags + ["--compressor", "topk", "--compressor-args", "ratio=0.1"]
  if name not in train.GOSSIP_METHODS:
    flags += ["--local-args", "period=1"]
  if name == "choco":
    flags += ["--compressor", "topk", "--compressor-args", "ratio=0.1"]
  if name in train.HIERARCHICAL_LOCAL:
    flags += ["--slices", 2]
  return flags


_METHODS = [(f, n) for f in ("local", "delay")
            for n in jaxcomm.registry.names(f)]


@pytest.mark.parametrize("family,name", _METHODS,
                         ids=[n for _, n in _METHODS])
def test_every_local_and_delay_method_runs_with_its_defaults(family, name,
                                                             tmp_path):
  """Every --local and --delay choice runs two steps with no --*-args
  beyond what it needs: the defaults --help lists are the ones applied."""
  r = _run(tmp_path, *_minimal_flags(family, name), "--steps", 2,
           "--checkpoint-every", 0, "--eval-examples", 16)
  assert len(r["history"]) == 2
  assert all(np.isfinite(h["loss"]) for h in r["history"])


def test_help_lists_the_defaults_the_run_applies(tmp_path):
  """--help's method list shows each method's defaults (the registry's,
  and the trainer's own for DiLoCo and the gossip step); a fedcom run
  without learning_rate equals one that passes the listed 0.1."""
  epilog = " ".join(train.methods_epilog().split())
  for family in ("local", "delay"):
    for m in jaxcomm.registry.methods(family):
      for k, v in m.defaults.items():
        assert f"{k}={v}" in epilog, (m.name, k)
  assert "fedcom Haddadpour et al. 2021 (FedCOM) (default " \
         "learning_rate=0.1)" in epilog
  assert "(default global_period=4)" in epilog
  assert "(default gamma=0.5)" in epilog
  flags = ["--local", "fedcom", "--optimizer", "sgd", "--lr", 0.5,
           "--steps", 2, "--checkpoint-every", 0]
  a = _run(tmp_path, *flags, "--local-args", "period=2", name="a")
  b = _run(tmp_path, *flags, "--local-args", "period=2,learning_rate=0.1",
           name="b")
  c = _run(tmp_path, *flags, "--local-args", "period=2,learning_rate=0.5",
           name="c")
  for x, y in zip(jax.tree.leaves(jax.device_get(a["params"])),
                  jax.tree.leaves(jax.device_get(b["params"])), strict=True):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, y) for x, y in zip(
    jax.tree.leaves(jax.device_get(a["params"])),
    jax.tree.leaves(jax.device_get(c["params"]))))


def test_hierarchical_sgd_runs_on_slices(tmp_path):
  """--local hierarchical_sgd --slices 2: the groups are the slices. With
  period=1 and global_period=4, after 2 steps the 4 devices of each slice
  hold one model and the two slices differ; after 4 (a global average)
  every device holds the same model. Bytes move on every step (a group
  sync), more on the global one."""
  flags = ["--local", "hierarchical_sgd", "--slices", 2, "--local-args",
           "period=1,global_period=4", "--optimizer", "sgd", "--lr", 0.5,
           "--checkpoint-every", 0]
  r2 = _run(tmp_path, *flags, "--steps", 2, name="two")
  for x in jax.tree.leaves(jax.device_get(r2["params"])):
    x = np.asarray(x)
    assert x.shape[0] == 8
    for g in (x[:4], x[4:]):
      for row in g[1:]:
        np.testing.assert_array_equal(row, g[0])
  assert any(not np.array_equal(np.asarray(x)[0], np.asarray(x)[4])
             for x in jax.tree.leaves(jax.device_get(r2["params"])))
  assert r2["identical_params"] is False
  r4 = _run(tmp_path, *flags, "--steps", 4, name="four")
  assert r4["identical_params"]
  moved = [h["bytes_per_step"] for h in r4["history"]]
  assert all(m > 0 for m in moved) and moved[3] > moved[0], moved


def test_a_method_error_is_one_line_naming_the_flag(tmp_path):
  """The script: a method that refuses its arguments exits with one
  "error: --local NAME: ..." line, no traceback."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count"))
  proc = subprocess.run(
    [sys.executable, os.path.join(repo, "train.py"), *TINY, "--steps", "2",
     "--num-devices", "2", "--local", "fedcom", "--local-args",
     "period=2,learning_rate=x", "--out-dir", str(tmp_path / "x")],
    cwd=repo, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
  assert lines == ["error: --local fedcom: learning_rate must be a number, "
                   "got 'x'"], proc.stderr


def test_int8_mesh_resume_on_one_slice_says_what_may_change(tmp_path):
  """int8 keeps a per-device server error only from 2 slices on: a
  (dcn=2, fsdp=4) checkpoint resumed on (dcn=1, fsdp=4) is refused, naming
  the layout, what must match and what may change, without also telling
  the user to resume with the checkpoint's settings."""
  flags = _LM + ["--compressor", "int8", "--lr", 0.01, "--steps", 4]
  _run(tmp_path, *flags, "--mesh", "dcn=2,fsdp=4", "--stop-after", 2)
  with pytest.raises(train.CheckpointError) as info:
    _run(tmp_path, *flags, "--mesh", "dcn=1,fsdp=4", "--num-devices", 4,
         "--resume")
  text = str(info.value)
  assert "server_error" in text
  assert "laid out per device otherwise" in text
  assert "must match the checkpoint: --model" in text
  assert "may change: --num-devices (and --mesh's sizes)" in text
  assert "resume with the checkpoint's settings" not in text
