"""MGS's merge (Shi et al. 2020) on the alpha-beta model: the plan's
predicted times against layer-wise and whole-model top-k."""

import pytest

import jaxcomm
from jaxcomm.transforms.sparsify import _mgs

BATTERY = [1152, 3072]   # the battery's compressed leaves


def test_battery_plans_merge_short_and_split_long_backward_passes():
  link = jaxcomm.wire.CostModel.link(10.0, 50.0)
  assert _mgs.merge_plan(BATTERY, 8, 0.05, link, 0.001) == ((0, 2),)
  assert _mgs.merge_plan(BATTERY, 8, 0.05, link, 0.1) == ((0, 1), (1, 2))


def _resnetish():
  # Conv layers growing toward the output, small norms between them.
  sizes = []
  for c in (64, 128, 256, 512):
    for _ in range(4):
      sizes += [9 * c * c, c, c]
  return sizes + [512 * 1000]


@pytest.mark.parametrize("gbit", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("backward", [0.01, 0.1])
def test_plan_is_never_slower_than_layerwise_or_whole_model(gbit, backward):
  sizes = _resnetish()
  link = jaxcomm.wire.CostModel.link(gbit, 50.0)
  kw = dict(n=16, ratio=0.001, link=link, backward_seconds=backward,
            topk_seconds_per_element=1e-9)
  plan = _mgs.merge_plan(sizes, **kw)
  covered = [l for lo, hi in plan for l in range(lo, hi)]
  assert covered == list(range(len(sizes)))
  layerwise = [(l, l + 1) for l in range(len(sizes))]
  whole = [(0, len(sizes))]
  t = {name: _mgs.timeline(sizes, g, **kw).comm
       for name, g in (("mgs", plan), ("layer", layerwise),
                       ("model", whole))}
  assert t["mgs"] <= t["layer"] + 1e-12, t
  assert t["mgs"] <= t["model"] + 1e-12, t
