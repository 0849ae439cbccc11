"""Helpers for tests that start other Python processes."""

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env() -> dict:
  """This environment for a child process that sets its own device count
  and imports the repository's packages."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split()
    if "xla_force_host_platform_device_count" not in f)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env
