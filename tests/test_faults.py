"""Faults: a killed training process, and a device with NaN gradients.

* SIGKILL of one ``train.py`` process of a two-process job mid-run; all
  processes are then restarted with ``--resume`` and must end with the same
  parameters and optimizer state as an uninterrupted run.
* One device's gradient is NaN for one step of :class:`DataParallel`
  training with an error-feedback compressor followed by
  ``optax.apply_if_finite``: the step is skipped on every device, counted in
  ``jaxcomm.stats``, residuals stay finite and unchanged, and training goes
  on.

(The unreachable-coordinator case is in ``tests/test_multiprocess.py``.)
"""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from tests import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------ NaN on one device --

@pytest.mark.slow
def test_nan_gradient_on_one_device_is_skipped_and_counted(mesh):
  n = mesh.shape["data"]
  per, bad_device, bad_step = 4, 3, 2
  rng = np.random.RandomState(0)
  w_true = rng.randn(16, 32).astype(np.float32)
  params = {"w": np.zeros((16, 32), np.float32),
            "b": np.zeros((32,), np.float32)}

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  tx = optax.chain(
    jaxcomm.cast(jnp.bfloat16, error_feedback=True),
    optax.apply_if_finite(optax.sgd(4.0), max_consecutive_errors=3))
  dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
  params, state = dp.init(params)
  losses = []
  x0 = rng.randn(n * per, 16).astype(np.float32)
  for step in range(8):
    x = x0.copy()
    y = x @ w_true
    if step == bad_step:
      x[bad_device * per:(bad_device + 1) * per] = np.nan
    before_p = jax.device_get(params)
    before_res = jax.device_get(state[0].residual)
    params, state, metrics = dp.step(params, state, (x, y))
    after_p = jax.device_get(params)
    losses.append(float(jax.device_get(metrics["loss"])))
    stats = jaxcomm.stats(state)[0]
    count = np.asarray(jax.device_get(stats.nonfinite_steps))
    residual = jax.device_get(state[0].residual)
    assert residual, "cast(error_feedback=True) keeps a residual"
    for res in residual:
      assert np.all(np.isfinite(res)), f"non-finite residual at step {step}"
    for leaf in jax.tree.leaves(after_p):
      assert np.all(np.isfinite(leaf)), f"non-finite params at step {step}"
    if step == bad_step:
      assert not np.isfinite(losses[-1])
      # Skipped on every device: params and residuals unchanged.
      for a, b in zip(jax.tree.leaves(before_p), jax.tree.leaves(after_p)):
        np.testing.assert_array_equal(a, b)
      for a, b in zip(before_res, residual):
        np.testing.assert_array_equal(a, b)
      assert int(jax.device_get(state[1].total_notfinite)) == 1
    else:
      assert np.isfinite(losses[-1])
      assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(before_p), jax.tree.leaves(after_p)))
    np.testing.assert_array_equal(count, int(step >= bad_step))
  # Training went on after the bad step.
  assert losses[-1] < losses[bad_step + 1] < losses[0], losses
  assert int(jax.device_get(state[1].notfinite_count)) == 0


# ------------------------------------------------- SIGKILL, then --resume --

_TINY = ["--model", "charlm",
         "--model-args", "embed_dim=8,hidden_size=32,num_layers=1",
         "--seq-len", "16", "--batch-size", "16", "--eval-examples", "32",
         "--no-progress", "--no-plot", "--schedule", "constant",
         "--compressor", "cast", "--compressor-args", "error_feedback=True",
         "--num-devices", "4", "--lr", "0.02", "--log-every", "1"]
_STEPS, _EVERY = 12, 2


def _launch(out_dir, every, *extra):
  port = procs.free_port()
  return [subprocess.Popen(
    [sys.executable, os.path.join(ROOT, "train.py"), *_TINY,
     "--steps", str(_STEPS), "--checkpoint-every", str(every),
     "--out-dir", str(out_dir), "--coordinator", f"127.0.0.1:{port}",
     "--num-processes", "2", "--process-id", str(pid), *extra],
    cwd=ROOT, env=procs.child_env(), stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    start_new_session=True) for pid in range(2)]


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
  for p in procs:
    p.communicate()


def _wait(procs, timeout):
  outs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=timeout)
      outs.append(out.decode(errors="replace"))
  except subprocess.TimeoutExpired:
    _kill(procs)
    raise
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  return outs


def _latest_step(out_dir):
  """The latest complete step under ``out_dir/checkpoints`` (0: none)."""
  import train  # pylint: disable=import-outside-toplevel
  return train.Checkpoints(str(out_dir)).latest_step() or 0


def _train_cli_missing():
  path = os.path.join(ROOT, "train.py")
  if not os.path.exists(path):
    return "train.py does not exist yet"
  import train  # pylint: disable=import-outside-toplevel
  text = train.build_parser().format_help()  # the flags live in trainer/
  for flag in ("--resume", "--coordinator", "--num-processes",
               "--process-id", "--checkpoint-every", "--out-dir"):
    if flag not in text:
      return f"train.py has no {flag} flag"
  return None


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
  why = _train_cli_missing()
  if why:
    pytest.skip(why)
  import train  # pylint: disable=import-outside-toplevel

  full, split = tmp_path / "full", tmp_path / "split"
  _wait(_launch(full, 0), timeout=120)
  assert _latest_step(full) == _STEPS

  procs = _launch(split, _EVERY)
  deadline = time.monotonic() + 120
  while _latest_step(split) < _EVERY and time.monotonic() < deadline:
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.02)
  killed_after = _latest_step(split)
  print(f"killed after the checkpoint of step {killed_after}")
  # SIGKILL one process mid-run; its peer cannot finish a collective
  # without it, so the job is restarted as a whole.
  os.kill(procs[1].pid, signal.SIGKILL)
  procs[1].wait()
  _kill(procs)
  assert 0 < killed_after < _STEPS, (
    f"the run was not killed mid-run (last checkpoint {killed_after})")

  outs = _wait(_launch(split, 0, "--resume"), timeout=120)
  assert "resumed from" in outs[0], outs[0][-2000:]
  assert _latest_step(split) == _STEPS
  # The manager's rotation kept the newest two (--keep-checkpoints 2).
  steps = train.Checkpoints(str(split)).steps()
  assert steps[0] == _STEPS and len(steps) == 2, steps

  a = train.Checkpoints(str(full)).read()
  b = train.Checkpoints(str(split)).read()
  assert a[3] == b[3] == _STEPS
  for x, y in zip(a[1], b[1], strict=True):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(a[2], b[2], strict=True):
    np.testing.assert_array_equal(x, y)
