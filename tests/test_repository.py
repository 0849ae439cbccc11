"""What the repository tracks: sources, not build artifacts."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _git(*args):
  if shutil.which("git") is None or not (ROOT / ".git").exists():
    pytest.skip("not a git checkout")
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                        text=True, check=False)


def test_no_wheels_tracked_and_wheels_ignored():
  tracked = _git("ls-files", "*.whl").stdout.split()
  assert not tracked, f"wheels committed: {tracked}"
  # A wheel dropped anywhere in the tree stays out of `git add`.
  for name in ("x-1.0-py3-none-any.whl", "dist/y-2.0-py3-none-any.whl"):
    assert _git("check-ignore", "-q", "--no-index", name).returncode == 0, (
        f"{name} is not ignored by .gitignore")


# Every non-test module stays a size one can read whole: a module growing
# past this is split by responsibility (as trainer/loop.py and
# benchmarks/network.py were).
MAX_MODULE_LINES = 600


def test_modules_are_at_most_600_lines():
  files = sorted(p for d in ("jaxcomm", "trainer", "benchmarks", "models")
                 for p in (ROOT / d).rglob("*.py"))
  files.append(ROOT / "train.py")
  assert len(files) > 50, f"found only {len(files)} modules under {ROOT}"
  long = {}
  for path in files:
    with open(path, encoding="utf-8") as f:
      n = sum(1 for _ in f)
    if n > MAX_MODULE_LINES:
      long[str(path.relative_to(ROOT))] = n
  assert not long, (
    f"modules over {MAX_MODULE_LINES} lines (split them by "
    "responsibility): "
    + ", ".join(f"{name} has {n} lines" for name, n in sorted(long.items())))
