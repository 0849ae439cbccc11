"""Two CPU processes with 4 devices each train like one process with 8."""

import json
import os
import subprocess
import sys

import pytest

from tests import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "pod", "fsdp"])
def test_two_processes_match_one_process(tmp_path, mode):
  """flat: dense data parallelism over 8 devices. pod: a ("dcn", "ici")
  mesh with one slice per process and the hierarchical chain (dense mean
  inside a slice, PowerSGD between slices), against the same mesh cut from
  one process's 8 devices. fsdp: params sharded over an fsdp axis whose
  groups span both processes (no process holds a whole weight), top-k
  across "dcn" on each device's shards."""
  extra = [mode] if mode != "flat" else []
  one = tmp_path / "one.json"
  subprocess.run([sys.executable, "-m", "tests.mp_worker", "0", "1", "0", "8",
                  str(one)] + extra, cwd=ROOT, env=procs.child_env(),
                 check=True, timeout=300)
  port = procs.free_port()
  two = tmp_path / "two.json"
  workers = [subprocess.Popen(
    [sys.executable, "-m", "tests.mp_worker", str(pid), "2", str(port), "4",
     str(two)] + extra, cwd=ROOT, env=procs.child_env(),
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for pid in range(2)]
  outs = []
  for p in workers:
    try:
      out, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      for q in workers:
        q.kill()
      raise
    outs.append(out.decode(errors="replace"))
  for p, out in zip(workers, outs):
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
    "local_device_count=1, timeout_s=5)\n" % procs.free_port())
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                     env=procs.child_env(), capture_output=True, timeout=120)
  assert p.returncode != 0
  assert b"could not reach the coordinator" in p.stderr, p.stderr[-2000:]
