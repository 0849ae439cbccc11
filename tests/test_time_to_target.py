"""The time-to-target benchmark's arithmetic, and the committed figures
agree with themselves and with the README (nothing here is timed)."""

import json
import os
import re

import pytest

from benchmarks import time_to_target as ttt

_ROOT = os.path.dirname(os.path.dirname(__file__))
_JSON = os.path.join(_ROOT, "docs", "benchmarks", "time_to_target.json")
_README = os.path.join(_ROOT, "README.md")


def _history(losses, step_s):
  return [{"step": i + 1, "loss": l, "time": i * step_s}
          for i, l in enumerate(losses)]


def test_score_by_hand():
  """Steps and seconds to a target and their multiples, worked by hand:
  loss falls 1/step (smoothed over 20 steps, the mean of a window of a
  linear sequence is its middle value)."""
  n = 100
  dense = {"method": ttt.DENSE, "seed": 0,
           "history": _history([100.0 - i for i in range(n)], 0.5)}
  fast = {"method": "x", "seed": 0,
          "history": _history([100.0 - 2 * i for i in range(n)], 0.1)}
  never = {"method": "y", "seed": 0,
           "history": _history([100.0] * n, 0.1)}
  free = {"step_s": 0.05}
  # Dense's smoothed loss at step k >= 20 is 100 - (k - 1) + 9.5; <= 60
  # first at k = 50.5 -> 51.  fast's: 100 - 2 (k - 1) + 19 <= 60 -> 30.5
  # -> k = 31.
  t_free = ttt.score([dense, fast, never], free, 60.0)
  assert dense["steps_to_target"] == 51
  assert dense["seconds_to_target"] == pytest.approx(50 * 0.5)
  assert t_free == pytest.approx(0.05 * 50)
  assert fast["steps_to_target"] == 31
  assert fast["seconds_to_target"] == pytest.approx(30 * 0.1)
  assert fast["x_dense"] == pytest.approx(3.0 / 25.0)
  assert fast["x_free"] == pytest.approx(3.0 / 2.5)
  # x_free is the steps factor times the step-time factor.
  assert fast["steps_factor"] == pytest.approx(30 / 50)
  assert fast["step_time_factor"] == pytest.approx(0.1 / 0.05)
  assert never["seconds_to_target"] is None and never["x_free"] is None
  # Its 30 steps at 0.1 s: 1.5 s of them at t_free, 1.5 s beyond, no burst.
  b = fast["breakdown"]
  assert (b["compute_s"], b["every_step_s"], b["bursts_s"]) == (
    pytest.approx(1.5), pytest.approx(1.5), pytest.approx(0.0, abs=1e-9))


def test_breakdown_puts_syncs_in_bursts():
  """Steps of 0.05 s (t_free) with a 1 s sync after every 10th: 30 steps
  to the target take 1.5 s of compute, nothing per step, 3 syncs."""
  times, t = [], 0.0
  for i in range(60):
    times.append(t)
    t += 1.05 if (i + 1) % 10 == 0 else 0.05
  r = {"history": [{"step": i + 1, "loss": 0.0, "time": x}
                   for i, x in enumerate(times)],
       "steps_to_target": 31, "seconds_to_target": times[30]}
  b = ttt.breakdown(r, {"step_s": 0.05})
  assert b["compute_s"] == pytest.approx(1.5)
  assert b["every_step_s"] == pytest.approx(0.0, abs=1e-9)
  assert b["bursts_s"] == pytest.approx(3.0)


def _records():
  assert os.path.exists(_JSON), "docs/benchmarks/time_to_target.json"
  with open(_JSON) as f:
    return json.load(f)


def test_committed_records_have_the_keys_and_agree_with_themselves():
  recs = _records()
  rates = sorted({r["rate_gbps"] for r in recs})
  assert rates == [1.0, 10.0]
  for rate in rates:
    rows = [r for r in recs if r["rate_gbps"] == rate]
    dense = next(r for r in rows
                 if r["method"] == ttt.DENSE and r["seed"] == 0)
    assert dense["x_dense"] == pytest.approx(1.0)
    # T_free is the free step times dense's steps to the target.
    assert dense["t_free"] == pytest.approx(
      dense["free_step_s"] * (dense["steps_to_target"] - 1))
    for r in rows:
      for key in ("rate_gbps", "method", "seconds_to_target", "x_dense",
                  "x_free"):
        assert key in r, (rate, r["method"], key)
      if r["seconds_to_target"] is None:
        assert r["x_dense"] is None and r["x_free"] is None
        continue
      assert r["x_dense"] == pytest.approx(
        r["seconds_to_target"] / dense["seconds_to_target"])
      assert r["x_free"] == pytest.approx(
        r["seconds_to_target"] / r["t_free"])
    # The exchange share is what the two step times say.
    assert dense["exchange_share"] == pytest.approx(
      1 - dense["free_step_s"] / dense["step_s"])
  one = [r for r in recs if r["rate_gbps"] == 1.0]
  assert next(r for r in one if r["method"] == ttt.DENSE)[
    "exchange_share"] >= 0.75


def test_the_readme_leads_with_the_committed_figures():
  """The first measured figure is the 1 Gbit/s result, with the best
  method's multiples as the json has them."""
  recs = [r for r in _records() if r["rate_gbps"] == 1.0 and r["seed"] == 0
          and r["x_dense"] is not None and r["method"] != ttt.DENSE]
  best = min(recs, key=lambda r: r["x_dense"])
  with open(_README) as f:
    text = f.read()
  figures = text.split("## Measured figures", 1)[1]
  first = figures.split("\n- ", 1)[1].split("\n- ", 1)[0]
  assert "Time to a target loss" in first, first
  assert best["method"] in first.replace("\n  ", " "), first
  nums = {float(x) for x in re.findall(r"(\d+\.\d+)x", first)}
  assert round(best["x_dense"], 2) in nums, (best["x_dense"], nums)
  assert round(best["x_free"], 2) in nums, (best["x_free"], nums)
