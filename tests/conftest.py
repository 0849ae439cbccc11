"""Test set-up: 8 simulated CPU devices, made before JAX starts."""

import importlib.metadata
import os

_FLAGS = (
  "--xla_force_host_platform_device_count=8",
  # On 2 cores, XLA's CPU collectives rendezvous all 8 fake devices; a
  # collective queued behind other work can wait longer than the default.
  "--xla_cpu_collective_timeout_seconds=900",
  "--xla_cpu_collective_call_terminate_timeout_seconds=900",
)
# The suite's programs are small and run once or a few times: most of its
# CPU time was XLA compiling them, mostly code generation. These flags
# compile with LLVM at -O0, the classic fusion emitters and one codegen
# split; the HLO passes (whose collectives the wire checks read) are the
# same. Eight battery steps compiled in 5.4 s by default, 1.1 s with them.
# XLA aborts on a flag it does not know, so each jaxlib gets the flags it
# was checked with (jaxlib 0.12 no longer knows the fusion-emitter flag);
# a jaxlib not listed runs the suite without them.
_O0 = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
  "--xla_cpu_parallel_codegen_split_count=1",
)
_FAST_COMPILE = {
  "0.10.": _O0 + ("--xla_cpu_use_fusion_emitters=false",),
  "0.12.": _O0,
}


def _jaxlib_version() -> str:
  try:
    return importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return ""


for _prefix, _fast in _FAST_COMPILE.items():
  if _jaxlib_version().startswith(_prefix):
    _FLAGS += _fast
os.environ["XLA_FLAGS"] = " ".join(
  [os.environ.get("XLA_FLAGS", "")] + [f for f in _FLAGS
                                      if f.split("=")[0] not in
                                      os.environ.get("XLA_FLAGS", "")]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU tier (tests/test_tpu.py): libtpu compiles for TPU topologies on
# this CPU host; each pytest worker loads it (otherwise a lock file).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# A persistent compilation cache shared by the pytest workers (and the
# processes tests start): many tests compile the same step program (one
# compressor's step for its reference, non-finite, orbax and wrapper
# checks); the second compile is a cache read. Measured on 3 battery
# entries: 103 s -> 79 s from an empty cache. Results are the same
# executables, keyed by the program and its compile options.
# One cache per jaxlib (the two CI legs run different ones in one clone).
_CACHE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
  f"jax-{_jaxlib_version() or 'none'}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(scope="session")
def mesh():
  """An 8-device mesh over one axis named ``data`` (Auto axis type)."""
  if len(jax.devices()) < NUM_DEVICES:
    pytest.skip(f"needs {NUM_DEVICES} devices, have {len(jax.devices())}")
  return jax.make_mesh((NUM_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
