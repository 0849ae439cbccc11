"""The gallery in ``examples/``: every script runs in its short mode and
prints figures that show it did its work.

Each script runs in a subprocess with ``--quick``, from the repository
root, with this process's environment (tests/conftest.py's 8 simulated CPU
devices, XLA flags and compilation cache). Every line of the forms below
that it prints is checked, and it must print at least one:

* ``loss: A -> B``: training lowered the loss (``B < A``; a NaN fails);
* ``...: R.Rx fewer``: a compressed exchange sent fewer bytes (``R > 1``).

Scripts named in :data:`CHECKS` get their own checks on top.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
# Seconds a script's --quick run may take here before it is stopped (about
# 30 s each on one free core; the bound leaves room for a loaded machine).
TIMEOUT = 900

LOSS = re.compile(r"^loss: (\S+) -> (\S+)", re.M)
FEWER = re.compile(r"([0-9][0-9,.]*)x fewer", re.M)


def _number(text: str) -> float:
  return float(text.replace(",", ""))


def _one(pattern: str, out: str) -> tuple:
  m = re.search(pattern, out, re.M)
  assert m, f"no line matching {pattern!r} in:\n{out}"
  return tuple(_number(g) for g in m.groups())


def _fsdp_int8(out):
  # int8 across slices: about 4x fewer bytes than float32 (a block scale
  # per 256 values and the 2-phase sum cost a little); the compiled step
  # moves what int8 claims, plus the 4-byte loss mean's all-reduce.
  sent, claimed, dense = _one(
    r"int8 ([0-9,]+) \(claimed ([0-9,]+)\), dense f32 ([0-9,]+)", out)
  assert 3.5 < dense / sent < 4.0
  assert 0 <= sent - claimed <= 8


def _diloco(out):
  # int4 codes of the pseudo-gradient: ~8x fewer bytes a sync than dense.
  int4, dense = _one(r"per sync: int4 ([0-9,]+), dense ([0-9,]+)", out)
  assert 6.0 < dense / int4 < 8.0
  accuracy = re.findall(r"held-out accuracy ([0-9.]+)$", out, re.M)
  assert accuracy and float(accuracy[-1]) > 0.5, out  # chance: 0.1


def _powersgd(out):
  ps, dense = _one(r"powersgd ([0-9,]+), dense ([0-9,]+)", out)
  assert dense / ps > 10


def _onebit(out):
  adam, warm, after = _one(
    r"adam ([0-9,]+); 1-bit adam ([0-9,]+) in the warm-up, ([0-9,]+)", out)
  assert warm == adam  # the warm-up is the dense mean
  assert adam / after > 20  # ~2 bits per value against 32 (x2, all-reduce)
  rows = re.findall(r"^ *\d+  ([0-9.nainf]+) +([0-9.nainf]+)$", out, re.M)
  assert rows, out
  assert all(float(v) < 5 for row in rows for v in row), rows  # finite


def _aot(out):
  assert "DOES NOT FIT" not in out
  assert re.search(r"^int8: .*\(fits in HBM\)", out, re.M), out


def _custom_codec(out):
  claimed, compiled = _one(r"claimed ([0-9,]+), compiled ([0-9,]+)", out)
  assert 0 <= compiled - claimed <= 8  # the loss mean's all-reduce
  gap, kept = _one(r"by ([0-9.]+)%; with the residuals by ([0-9.e+-]+)",
                   out)
  assert gap > 1.0  # compression dropped mass from the applied updates ...
  assert kept < 1e-4  # ... and the residuals hold it


def _gossip(out):
  # Decentralized: only permutes to the ring neighbours, no all-reduce.
  table = re.findall(r"^\| ([a-z-]+) \| [0-9,]+ \|", out, re.M)
  assert table == ["collective-permute"], out
  accuracy = re.findall(r"held-out accuracy ([0-9.]+)$", out, re.M)
  assert accuracy and float(accuracy[-1]) > 0.5, out  # chance: 0.1


CHECKS = {
  "nnx_fsdp_int8.py": _fsdp_int8,
  "diloco_compressed.py": _diloco,
  "powersgd_cnn.py": _powersgd,
  "onebit_adam.py": _onebit,
  "aot_tpu_report.py": _aot,
  "custom_codec.py": _custom_codec,
  "gossip_choco.py": _gossip,
}


def test_the_gallery_has_the_named_scripts():
  assert len(SCRIPTS) >= 6
  missing = sorted(set(CHECKS) - set(SCRIPTS))
  assert not missing, f"examples/ lacks {missing}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_documents_how_to_run_it(script):
  """A module docstring (the gallery page's text) with the command lines."""
  source = (EXAMPLES / script).read_text()
  m = re.match(r'"""(.*?)"""', source, re.S)
  assert m, f"{script} has no module docstring"
  assert f"python examples/{script} --quick" in m.group(1)
  assert "def main(argv=None)" in source


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_uses_public_names_only(script):
  """What users copy must not reach into private modules (``jaxcomm._x``,
  ``jaxcomm.transforms._x``, ``jax._src``), which move between releases."""
  source = (EXAMPLES / script).read_text()
  private = re.findall(r"\b(?:jaxcomm|jax)(?:\.[A-Za-z]\w*)*\._\w+", source)
  private += re.findall(r"from (?:jaxcomm|jax)[\w.]* import \(?\s*_\w+",
                        source)
  assert not private, f"{script} uses {sorted(set(private))}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
  if script == "aot_tpu_report.py" and importlib.util.find_spec(
      "libtpu") is None:
    pytest.skip("libtpu is not installed (jax[tpu], the test extra on "
                "Linux x86_64): nothing compiles for TPU here")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                   if p])
  proc = subprocess.run(
    [sys.executable, str(EXAMPLES / script), "--quick"], cwd=ROOT, env=env,
    capture_output=True, text=True, timeout=TIMEOUT)
  out = proc.stdout
  assert proc.returncode == 0, (
    f"{script} exited {proc.returncode}\n--- stdout\n{out[-4000:]}\n"
    f"--- stderr\n{proc.stderr[-4000:]}")
  losses = LOSS.findall(out)
  ratios = FEWER.findall(out)
  assert losses or ratios, f"{script} printed no loss or bytes line:\n{out}"
  for first, last in losses:
    assert float(last) < float(first), f"{script}: loss {first} -> {last}"
  for r in ratios:
    assert _number(r) > 1, f"{script}: {r}x fewer\n{out}"
  if script in CHECKS:
    CHECKS[script](out)
