"""XLA settings the CPU benchmarks apply before JAX starts (stdlib only, so
it can run before anything imports jax)."""

import os

CPU_TIMEOUT_FLAGS = ("--xla_cpu_collective_timeout_seconds=900",
                     "--xla_cpu_collective_call_terminate_timeout_seconds=900")


def raise_cpu_collective_timeouts() -> None:
  """Adds XLA's two CPU collective timeouts (900 s) to ``XLA_FLAGS`` unless
  set: collectives over many simulated devices on few busy cores can wait
  longer than the defaults (README, "Simulated CPU devices")."""
  old = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join(
    [old] + [f for f in CPU_TIMEOUT_FLAGS if f.split("=")[0] not in old]
  ).strip()
