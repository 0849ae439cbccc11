"""Two CPU processes with 4 devices each train like one process with 8."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ)
  # The worker sets its own device count; drop the test session's flag.
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split()
    if "xla_force_host_platform_device_count" not in f)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  one = tmp_path / "one.json"
  subprocess.run([sys.executable, "-m", "tests.mp_worker", "0", "1", "0", "8",
                  str(one)], cwd=ROOT, env=_env(), check=True, timeout=300)
  port = _free_port()
  two = tmp_path / "two.json"
  procs = [subprocess.Popen(
    [sys.executable, "-m", "tests.mp_worker", str(pid), "2", str(port), "4",
     str(two)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT) for pid in range(2)]
  outs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    outs.append(out.decode(errors="replace"))
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  a, b = json.loads(one.read_text()), json.loads(two.read_text())
  assert a["processes"] == 1 and b["processes"] == 2
  assert a["devices"] == b["devices"] == 8
  assert len(a["losses"]) == 6
  assert a["losses"][-1] < a["losses"][0]
  for x, y in zip(a["losses"], b["losses"]):
    assert abs(x - y) <= 1e-6 * max(1.0, abs(x)), (a["losses"], b["losses"])


@pytest.mark.slow
def test_unreachable_coordinator_fails_in_bounded_time(tmp_path):
  code = (
    "import jaxcomm\n"
    "jaxcomm.parallel.initialize('127.0.0.1:%d', 2, 1, "
    "local_device_count=1, timeout_s=5)\n" % _free_port())
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                     capture_output=True, timeout=120)
  assert p.returncode != 0
  assert b"could not reach the coordinator" in p.stderr, p.stderr[-2000:]
