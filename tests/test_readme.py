"""The README's complete example runs as it stands (read from README.md,
so the two cannot drift) and lands where least squares says."""

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example() -> str:
  text = (ROOT / "README.md").read_text()
  found = re.search(r"^### A complete example\n.*?```python\n(.*?)```",
                    text, re.S | re.M)
  assert found, "README.md lost its complete example"
  return found.group(1)


def test_the_complete_example_runs_and_solves_its_least_squares(capsys):
  code = _example()
  assert len(code.splitlines()) < 30
  names = {"__name__": "__main__"}
  exec(compile(code, "README.md (A complete example)", "exec"), names)  # noqa: S102
  printed = capsys.readouterr().out
  assert re.fullmatch(r"loss \S+\n", printed), printed
  # Every name the tour's snippets use is defined by the example.
  for name in ("loss_fn", "params", "batches", "tx", "mesh", "dp"):
    assert name in names
  # The closed form: numpy's least-squares fit of all the batches' rows
  # (with a bias column) is the model the training reaches.
  x = np.concatenate([np.asarray(b[0], np.float64) for b in names["batches"]])
  y = np.concatenate([np.asarray(b[1], np.float64) for b in names["batches"]])
  sol, *_ = np.linalg.lstsq(np.hstack([x, np.ones((len(x), 1))]), y,
                            rcond=None)
  params = names["params"]
  np.testing.assert_allclose(np.asarray(params["w"]), sol[:-1], atol=1e-3)
  np.testing.assert_allclose(np.asarray(params["b"]), sol[-1], atol=1e-3)
  assert float(printed.split()[1]) < 1e-6
