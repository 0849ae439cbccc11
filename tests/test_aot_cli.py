"""``python -m jaxcomm.aot``'s flags: each bad one is refused in one
``error:`` line naming the flag, exit status 2, before anything compiles;
a step that does not fit the chip is reported in one line, status 1."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from jaxcomm import _aot_cli
from jaxcomm import aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not _LIBTPU, reason="needs libtpu")
OOM = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
       "required for HLO temporaries (107.48G) exceeds available HBM "
       "(15.75G).")


@pytest.fixture
def no_compile(monkeypatch):
  """Fails the test if the command reaches a compile."""
  def compile_lowered(lowered):
    raise AssertionError("a bad flag reached the compile")
  monkeypatch.setattr(aot, "compile_lowered", compile_lowered)


def _refused(capsys, argv):
  """The ``error:`` line ``main(argv)`` exits with (status 2)."""
  with pytest.raises(SystemExit) as e:
    _aot_cli.main(argv)
  assert e.value.code == 2, e.value.code
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if "error:" in l]
  assert len(lines) == 1, err
  return lines[0]


@pytest.mark.parametrize("argv,flag,says", [
  (["--model", "mlp", "--size", "-8"], "--size", "int dim > 0, got -8"),
  (["--model", "mlp", "--size", "0"], "--size", "int dim > 0, got 0"),
  (["--model", "mlp", "--size", "wide"], "--size", "'wide'"),
  (["--model", "transformer", "--size", "2b"], "--size", "124m"),
  (["--dcn-gbps", "0"], "--dcn-gbps", "> 0"),
  (["--dcn-gbps", "-3"], "--dcn-gbps", "> 0"),
  (["--dcn-gbps", "inf"], "--dcn-gbps", "finite"),
  (["--dcn-gbps", "nan"], "--dcn-gbps", "finite"),
  (["--slices", "0"], "--slices", "positive int"),
  (["--compressor", "nope"], "--compressor", "unknown method 'nope'"),
  (["--compressor", "topk:ratio=abc"], "--compressor", "ratio"),
  (["--compressor", "topk:foo=1"], "--compressor", "no option 'foo'"),
  (["--compressor", "topk:0.5"], "--compressor", "key=value"),
  (["--compressor", "topk:axis_name=data"], "--compressor", "axis_name"),
  (["--compressor", "dcd_psgd"], "--compressor",
   "local method.*compressor, delay, optimizer"),
  (["--compressor", "ecd_psgd:topology=ring"], "--compressor",
   "not a gradient compressor"),
  # A good method first: the bad one is still refused before any compile.
  (["--compressor", "topk", "--compressor", "int8:bits=3"],
   "--compressor", "'int8:bits=3'"),
])
def test_bad_flags_are_refused_before_compiling(capsys, no_compile, argv,
                                                flag, says):
  line = _refused(capsys, argv)
  assert f"error: {flag}" in line, line
  assert re.search(says, line), line


def test_unknown_topology_is_refused_by_name(capsys, no_compile):
  line = _refused(capsys, ["--topology", "v9z:2x2", "--model", "mlp",
                           "--size", "256"])
  assert "error: --topology 'v9z:2x2'" in line, line


@needs_libtpu
def test_size_not_divisible_by_the_slice_is_refused(capsys, no_compile):
  """The MLP's weights are split over the slice's chips: 6 rows over the
  4 chips of a v5e:2x2 slice do not split (JAX's IndivisibleError)."""
  line = _refused(capsys, ["--topology", "v5e:2x2", "--model", "mlp",
                           "--size", "6"])
  assert "error: --size 6" in line and "4 chips" in line, line
  # 64 batch rows over 32 slices of 4 chips do not split either.
  line = _refused(capsys, ["--topology", "v5e:2x2", "--slices", "32",
                           "--model", "mlp", "--size", "256"])
  assert "error: --slices 32" in line and "128 chips" in line, line


@pytest.mark.parametrize("argv,flag", [
  (["--model", "mlp", "--size", "-8"], "--size"),
  (["--compressor", "dcd_psgd"], "--compressor"),
])
def test_command_line_errors_have_no_traceback(argv, flag):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "jaxcomm.aot", *argv],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  errors = [l for l in out.stderr.splitlines() if "error:" in l]
  assert len(errors) == 1 and f"error: {flag}" in errors[0], out.stderr


@pytest.mark.parametrize("text,need,cap,what", [
  (OOM, "107.48G", "15.75G", " for HLO temporaries"),
  ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
   "memory in memory space hbm. Used 17.35G of 15.48G hbm. Exceeded hbm "
   "capacity by 1.87G.", "17.35G", "15.48G", ""),
])
def test_does_not_fit_reads_the_compilers_message(text, need, cap, what):
  line = _aot_cli.does_not_fit("plain jit step", RuntimeError(text))
  assert line == (f"plain jit step: does not fit: needs {need} per "
                  f"chip{what}, the chip has {cap} of HBM (the compiler's "
                  "RESOURCE_EXHAUSTED)"), line
  # A message it cannot read is quoted (one line), not lost.
  odd = _aot_cli.does_not_fit("s", RuntimeError("RESOURCE_EXHAUSTED: out of\n"
                                           "memory somewhere"))
  assert odd == "s: does not fit: RESOURCE_EXHAUSTED: out of memory "\
                "somewhere", odd
  assert _aot_cli.does_not_fit("s", RuntimeError("INTERNAL: other")) is None


@needs_libtpu
def test_a_step_that_does_not_fit_is_one_line_and_status_1(capsys,
                                                           monkeypatch):
  """Each step's compile runs out of HBM (the compiler's message, here
  raised in its place): one line per step, status 1, no exception."""
  calls = []

  def compile_lowered(lowered):
    calls.append(lowered)
    raise RuntimeError(OOM)
  monkeypatch.setattr(aot, "compile_lowered", compile_lowered)
  assert _aot_cli.main(["--topology", "v5e:2x2", "--model", "mlp", "--size",
                   "64", "--compressor", "cast:dtype=bfloat16"]) == 1
  out = capsys.readouterr().out
  fits = [l for l in out.splitlines() if "does not fit" in l]
  assert len(calls) == 2 and len(fits) == 2, out
  assert fits[0].startswith("plain jit step: does not fit: needs 107.48G")
  assert fits[1].startswith("cast: does not fit: needs 107.48G"), fits


def test_slice_mesh_refuses_malformed_axes():
  """Checked before the topology is read (no libtpu needed)."""
  for axes, says in ((("dcn", "dcn"), "'dcn' more than once"),
                     (("dcn",), "at least two"),
                     ("dcn", "not the one string"),
                     (("dcn", ""), "non-empty strings"),
                     (("dcn", 3), "non-empty strings"),
                     (("dcn", "fsdp", "fsdp"), "'fsdp' more than once")):
    with pytest.raises(ValueError, match=f"axes.*{says}"):
      aot.slice_mesh("v5e:2x2", 2, axes=axes)
