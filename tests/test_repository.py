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
