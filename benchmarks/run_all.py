"""Runs every benchmark in turn: ``make bench``.

Each ``benchmarks/bench_*.py`` module prints its own markdown tables (and
writes plots under ``runs/bench``); nothing here passes or fails on speed.
"""

import os

# Benchmarks that compile 8-device steps need the simulated devices before
# JAX starts; a benchmark that wants fewer uses a sub-mesh.
if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import importlib  # noqa: E402
import pkgutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import benchmarks  # noqa: E402

# Arguments ``make bench`` gives a benchmark's ``main`` (others get none).
# bench_compile: both shape sets, every compressor, each row in a fresh
# process killed after 300 s, so a pathological compile cannot hang the run
# (about 20 min on 2 cores before the bucketing refactor, dgc the slowest).
ARGS = {"bench_compile": ["--timeout", "300"]}


def main(argv=None):
  names = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                 if m.name.startswith("bench_"))
  only = set(argv or sys.argv[1:])
  failed = []
  for name in names:
    if only and name not in only:
      continue
    print(f"\n## {name}\n", flush=True)
    t0 = time.perf_counter()
    try:
      module = importlib.import_module(f"benchmarks.{name}")
      if name in ARGS:
        module.main(ARGS[name])
      else:
        module.main()
    except Exception as e:  # pylint: disable=broad-except
      failed.append(name)
      print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
    print(f"\n({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
  if failed:
    print(f"\nfailed: {', '.join(failed)}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
