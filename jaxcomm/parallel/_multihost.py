"""Many processes through ``jax.distributed``."""

from __future__ import annotations

import socket
import time

import jax

# ------------------------------------------------------------ multi-host --

def _wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Fails with a clear message if ``address`` accepts no TCP connection
  within ``timeout_s`` (JAX itself would abort the process)."""
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(
      f"coordinator_address must be 'host:port', got {address!r}")
  deadline = time.monotonic() + timeout_s
  last = None
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host.strip("[]"), int(port)),
                                    timeout=min(2.0, timeout_s)):
        return
    except OSError as e:
      last = e
      time.sleep(0.2)
  raise ConnectionError(
    f"could not reach the coordinator at {address} within {timeout_s}s "
    f"({last}); is process 0 running and is the address reachable from "
    "this host?")


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_count: int | None = None,
               timeout_s: int = 60) -> None:
  """Joins this process to a multi-process JAX job.

  On TPU pods and SLURM clusters JAX detects everything: call with no
  arguments. Elsewhere pass the coordinator's ``host:port``, the number of
  processes and this process's id. On CPU (``JAX_PLATFORMS=cpu``) the
  collectives run over gloo and ``local_device_count`` sets how many CPU
  devices this process simulates. Must run before any JAX computation.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator.
    num_processes: number of processes in the job.
    process_id: this process's id, in ``[0, num_processes)``.
    local_device_count: CPU devices to simulate in this process.
    timeout_s: how long to wait for the other processes before failing.

  Raises:
    ValueError: when only some of ``coordinator_address``,
      ``num_processes`` and ``process_id`` are given, or one is out of
      range (the address not ``host:port``).
    ConnectionError: when a process other than 0 cannot reach the
      coordinator within ``timeout_s``.
  """
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ValueError(
      "pass all of coordinator_address, num_processes and process_id, or "
      "none of them (auto-detection on TPU pods and SLURM)")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(
      f"process_id must be in [0, {num_processes}), got {process_id}")
  if coordinator_address is not None and process_id != 0:
    _wait_for_coordinator(coordinator_address, timeout_s)
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  platforms = jax.config.jax_platforms or ""
  if "cpu" in platforms or platforms == "":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes,
    process_id=process_id, initialization_timeout=int(timeout_s))
