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

:class:`Hosts` instead builds several namespaces ("hosts") joined through a
bridge, each by its own veth pair rate-limited in both directions: traffic
inside a host stays on its loopback (fast), traffic between hosts crosses
its host's link (the tbf rate), like a cluster whose machines each have one
network card.

Needs root and iproute2; :func:`unavailable` says why not, without raising.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
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


class _Managed:
  """A context manager that builds in ``_setup`` and always ``close``s:
  on exit, and when ``_setup`` fails part way."""

  def _setup(self) -> None:
    raise NotImplementedError

  def close(self) -> None:
    raise NotImplementedError

  def __enter__(self):
    try:
      self._setup()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()


class Namespace(_Managed):
  """A network namespace whose loopback is up, removed on exit.

  Example::

    with Namespace() as ns:
      ns.set_rate(1.0)                 # 1 Gbit/s on the loopback
      subprocess.run(ns.command(["python", "worker.py"]))
  """

  def __init__(self, prefix: str = "jaxcomm-bench"):
    self.name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    self.rate = None

  def _setup(self) -> None:
    _run(["ip", "netns", "add", self.name])
    _run(self.command(["ip", "link", "set", "lo", "up"]))

  def command(self, argv: list[str], host: int = 0) -> list[str]:
    """``argv`` run inside the namespace (there is one host, 0)."""
    if host != 0:
      raise ValueError(f"a Namespace has one host (0), got host={host}")
    return ["ip", "netns", "exec", self.name] + list(argv)

  def address(self, host: int = 0) -> str:
    """The address processes on ``host`` listen on."""
    del host
    return "127.0.0.1"

  def set_rate(self, gbit: float | None) -> None:
    """Rate-limits the loopback to ``gbit`` Gbit/s (None: no limit)."""
    _run(self.command(["tc", "qdisc", "del", "dev", "lo", "root"]),
         check=False)
    if gbit is not None:
      _run(self.command(["tc", "qdisc", "add", "dev", "lo", "root"]
                        + _tbf(gbit)))
    self.rate = gbit

  def qdisc(self) -> str:
    """``tc -s qdisc show dev lo`` inside the namespace."""
    return _run(self.command(["tc", "-s", "qdisc", "show", "dev", "lo"]),
                check=False).stdout

  def close(self) -> None:
    """Stops any process left in the namespace and removes it."""
    _remove(self.name)


def _remove(name: str) -> None:
  """Kills the processes in namespace ``name`` and deletes it."""
  pids = _run(["ip", "netns", "pids", name], check=False).stdout
  for pid in pids.split():
    try:
      os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
      pass
  _run(["ip", "netns", "del", name], check=False)


def _tbf(gbit: float) -> list[str]:
  return ["tbf", "rate", f"{int(round(gbit * 1000))}mbit", "burst",
          str(burst_bytes(gbit)), "latency", "50ms"]


class Hosts(_Managed):
  """``n`` network namespaces ("hosts") joined by a bridge, removed on exit.

  Host ``i`` has address ``10.X.0.(i+1)`` on a veth whose other end sits in
  a switch namespace's bridge. :meth:`set_rate` puts a token-bucket filter
  on both ends of every host's veth: each host sends and receives at most
  ``gbit`` Gbit/s to the others, whatever the number of processes on it,
  while processes on one host talk over its loopback without a limit.

  Each host namespace gets an ``/etc/netns/<name>/hosts`` (bind-mounted
  over ``/etc/hosts`` by ``ip netns exec``) that resolves this machine's
  hostname to the host's own address, so a library that binds to
  ``gethostname()`` (gloo does) listens where the other hosts can reach it.

  Example::

    with Hosts(2) as h:
      h.set_rate(1.0)
      cmd = h.command(["python", "worker.py", h.address(0)], host=1)
  """

  def __init__(self, n: int, prefix: str = "jxh"):
    if n < 2:
      raise ValueError(f"Hosts needs n >= 2 hosts, got {n}")
    tag = uuid.uuid4().hex[:5]
    self.n = n
    self.switch = f"{prefix}-{tag}-sw"
    self.names = [f"{prefix}-{tag}-{i}" for i in range(n)]
    self._veth = [(f"h{i}{tag}", f"s{i}{tag}") for i in range(n)]
    self._net = f"10.{random.randint(64, 250)}.{random.randint(0, 250)}"
    self.rate = None

  def address(self, host: int = 0) -> str:
    """The address processes on ``host`` listen on."""
    return f"{self._net}.{host + 1}"

  def command(self, argv: list[str], host: int = 0) -> list[str]:
    """``argv`` run inside host ``host``'s namespace."""
    if not 0 <= host < self.n:
      raise ValueError(f"host must be in [0, {self.n}), got {host}")
    return ["ip", "netns", "exec", self.names[host]] + list(argv)

  def _setup(self) -> None:
    _run(["ip", "netns", "add", self.switch])
    sw = ["ip", "-n", self.switch]
    _run(sw + ["link", "add", "br0", "type", "bridge"])
    _run(sw + ["link", "set", "br0", "up"])
    hostname = socket.gethostname()
    for i, (name, (inner, outer)) in enumerate(zip(self.names, self._veth)):
      _run(["ip", "netns", "add", name])
      os.makedirs(f"/etc/netns/{name}", exist_ok=True)
      with open(f"/etc/netns/{name}/hosts", "w", encoding="utf-8") as f:
        f.write(f"127.0.0.1 localhost\n{self.address(i)} {hostname}\n")
      _run(["ip", "link", "add", inner, "netns", name, "type", "veth",
            "peer", "name", outer, "netns", self.switch])
      _run(sw + ["link", "set", outer, "master", "br0"])
      _run(sw + ["link", "set", outer, "up"])
      h = ["ip", "-n", name]
      _run(h + ["addr", "add", f"{self.address(i)}/24", "dev", inner])
      _run(h + ["link", "set", inner, "up"])
      _run(h + ["link", "set", "lo", "up"])

  def set_rate(self, gbit: float | None) -> None:
    """Each host's link to the others at ``gbit`` Gbit/s each way (None:
    no limit)."""
    for name, (inner, outer) in zip(self.names, self._veth):
      for ns, dev in ((name, inner), (self.switch, outer)):
        base = ["ip", "netns", "exec", ns, "tc", "qdisc"]
        _run(base + ["del", "dev", dev, "root"], check=False)
        if gbit is not None:
          _run(base + ["add", "dev", dev, "root"] + _tbf(gbit))
    self.rate = gbit

  def sent(self) -> list[int]:
    """Bytes each host has sent to the others through its link's filter
    (since the last :meth:`set_rate`; 0 while no limit is set)."""
    out = []
    for name, (inner, _) in zip(self.names, self._veth):
      text = _run(["ip", "netns", "exec", name, "tc", "-s", "qdisc", "show",
                   "dev", inner], check=False).stdout
      words = text.split()
      out.append(int(words[words.index("Sent") + 1])
                 if "Sent" in words else 0)
    return out

  def close(self) -> None:
    """Stops the processes left in the hosts and removes every namespace."""
    for name in self.names + [self.switch]:
      _remove(name)
      shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


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
