"""A network namespace with a rate-limited loopback, and process groups in it.

The network benchmark runs every simulated host as one process inside a
fresh network namespace (``ip netns add``). The namespace has only a
loopback interface, so all traffic between the processes (the
``jax.distributed`` coordinator, gloo's collectives, PyTorch's gloo
process group) stays on that loopback, and a token-bucket filter on it
(``tc qdisc ... tbf``) sets the bandwidth.

The loopback is one shared medium: every byte any process sends passes the
one filter, so ``n`` processes each sending ``b`` bytes at the same time take
``n b / B`` seconds, not ``b / B`` as on ``n`` separate host links.

Needs root and iproute2; :func:`unavailable` says why not, without raising.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid


def _run(argv, check=True):
  return subprocess.run(argv, capture_output=True, text=True, check=check,
                        timeout=30)


def unavailable() -> str | None:
  """Why namespaces cannot be used here (None when they can).

  Checks for root, for ``ip`` and ``tc``, and that a probe namespace can be
  created, brought up and rate-limited, then removes it.
  """
  if not hasattr(os, "geteuid") or os.geteuid() != 0:
    return "network namespaces need root (run as root or with sudo)"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"`{tool}` not found (apt-get install -y iproute2)"
  name = f"jxprobe-{uuid.uuid4().hex[:8]}"
  try:
    _run(["ip", "netns", "add", name])
  except (subprocess.CalledProcessError, OSError) as e:
    return f"`ip netns add` is not permitted here: {_err(e)}"
  try:
    _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
    _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo",
          "root", "tbf", "rate", "1gbit", "burst", "256kb", "latency",
          "50ms"])
  except (subprocess.CalledProcessError, OSError) as e:
    return f"cannot configure a namespace's loopback: {_err(e)}"
  finally:
    _run(["ip", "netns", "del", name], check=False)
  return None


def _err(e) -> str:
  text = getattr(e, "stderr", None) or str(e)
  return text.strip().splitlines()[-1] if text.strip() else str(e)


def burst_bytes(gbit: float) -> int:
  """Token-bucket depth for ``gbit``: 1 ms of traffic, at least 256 KiB
  (the loopback's MTU is 64 KiB; a bucket below it drops packets)."""
  return max(256 * 1024, int(gbit * 1e9 / 8 * 1e-3))


class Namespace:
  """A network namespace whose loopback is up, removed on exit.

  Example::

    with Namespace() as ns:
      ns.set_rate(1.0)                 # 1 Gbit/s on the loopback
      subprocess.run(ns.command(["python", "worker.py"]))
  """

  def __init__(self, prefix: str = "jaxcomm-bench"):
    self.name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    self.rate = None

  def __enter__(self) -> "Namespace":
    _run(["ip", "netns", "add", self.name])
    try:
      _run(self.command(["ip", "link", "set", "lo", "up"]))
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def command(self, argv: list[str]) -> list[str]:
    """``argv`` run inside the namespace."""
    return ["ip", "netns", "exec", self.name] + list(argv)

  def set_rate(self, gbit: float | None) -> None:
    """Rate-limits the loopback to ``gbit`` Gbit/s (None: no limit)."""
    _run(self.command(["tc", "qdisc", "del", "dev", "lo", "root"]),
         check=False)
    if gbit is not None:
      _run(self.command([
        "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
        f"{int(round(gbit * 1000))}mbit", "burst", str(burst_bytes(gbit)),
        "latency", "50ms"]))
    self.rate = gbit

  def qdisc(self) -> str:
    """``tc -s qdisc show dev lo`` inside the namespace."""
    return _run(self.command(["tc", "-s", "qdisc", "show", "dev", "lo"]),
                check=False).stdout

  def close(self) -> None:
    """Stops any process left in the namespace and removes it."""
    pids = _run(["ip", "netns", "pids", self.name], check=False).stdout
    for pid in pids.split():
      try:
        os.kill(int(pid), signal.SIGKILL)
      except (OSError, ValueError):
        pass
    _run(["ip", "netns", "del", self.name], check=False)


def run_group(commands: list[list[str]], timeout_s: float, env=None,
              cwd=None) -> tuple[list[int | None], list[str], bool]:
  """Starts one process per command and waits for all of them.

  Each process gets its own session, so on timeout the whole group (and
  anything the processes started) is killed by process-group id.

  Returns:
    ``(return codes, outputs, timed_out)``; a return code is None for a
    process killed at the timeout.
  """
  procs = [subprocess.Popen(c, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True) for c in commands]
  deadline = time.monotonic() + timeout_s
  outs, codes, timed_out = [], [], False
  for p in procs:
    try:
      out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
      outs.append(out.decode(errors="replace"))
      codes.append(p.returncode)
    except subprocess.TimeoutExpired:
      timed_out = True
      outs.append(None)
      codes.append(None)
  if timed_out:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except OSError:
          pass
    for i, p in enumerate(procs):
      out, _ = p.communicate()
      if outs[i] is None:
        outs[i] = out.decode(errors="replace")
  return codes, outs, timed_out


class Group:
  """Processes started together, each in its own session, output to files.

  ``running()`` is False once all have exited, or as soon as one fails
  (the others are then killed: they would wait for it forever).
  """

  def __init__(self, commands: list[list[str]], env=None, cwd=None):
    self.logs = [tempfile.TemporaryFile() for _ in commands]
    self.procs = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT,
                                   env=env, cwd=cwd, start_new_session=True)
                  for c, log in zip(commands, self.logs)]

  def running(self) -> bool:
    codes = [p.poll() for p in self.procs]
    if any(c not in (None, 0) for c in codes):
      self.kill()
      return False
    return any(c is None for c in codes)

  def kill(self) -> None:
    """SIGKILL to each process group this object started."""
    for p in self.procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except OSError:
          pass

  def finish(self) -> tuple[list[int], list[str]]:
    """Waits for every process; ``(return codes, outputs)``."""
    codes = [p.wait() for p in self.procs]
    outs = []
    for log in self.logs:
      log.seek(0)
      outs.append(log.read().decode(errors="replace"))
      log.close()
    return codes, outs


def read_json_lines(path) -> list[dict]:
  """The JSON records a worker appended to ``path`` (missing file: [])."""
  try:
    with open(path) as f:
      lines = f.read().split("\n")
  except FileNotFoundError:
    return []
  out = []
  for line in lines[:-1]:   # the last piece may be a line being written
    if line.strip():
      out.append(json.loads(line))
  return out
