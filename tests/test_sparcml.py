"""SparCML's own tests: the all-gather streams pairs while the union of
the devices' supports is small and goes dense once it passes the
break-even (both branches of the measured switch taken, each equal to the
exact sum of the devices' top-k), and no message is ever larger than the
dense all-reduce's matching one (Renggli et al. 2019)."""

import jax
import numpy as np
import pytest

import jaxcomm
from jaxcomm import _buckets
from jaxcomm.collectives import _sparse
from jaxcomm.transforms.sparsify import _sparcml
from tests import harness
from tests import references

SIZE = 4096       # one leaf; 8 owners of 512 positions
RATIO = 1 / 16    # k = 256 per device


def _grads(positions, seed):
  """Per device: small noise, and 100 at its ``positions[i]``."""
  rng = np.random.RandomState(seed)
  g = 0.01 * rng.randn(harness.N, SIZE)
  for i, pos in enumerate(positions):
    g[i, pos] = 100.0 * (1 + i)
  return [{"w": g.astype(np.float32)}]


def _spread():
  """Device i: 64 positions in each of ranges 0..3, disjoint across
  devices: each of those owners' unions is 512 > the break-even."""
  return [np.concatenate([c * 512 + i * 64 + np.arange(64)
                          for c in range(4)]) for i in range(harness.N)]


def _shared():
  """Every device: the same 32 positions of each range (unions of 32)."""
  pos = np.concatenate([c * 512 + np.arange(32) for c in range(8)])
  return [pos] * harness.N


@pytest.mark.parametrize("case,dense", [("spread", True), ("shared", False)])
def test_switch_takes_the_branch_of_the_measured_union(case, dense, mesh):
  params = {"w": jax.numpy.zeros((SIZE,), jax.numpy.float32)}
  lay = _buckets.plan([(SIZE,)])[0]
  plan = _sparcml.plan(lay, harness.N, RATIO)
  assert plan.gather == _sparcml.SWITCH and plan.scatter == _sparcml.SPARSE
  tx = jaxcomm.sparcml(RATIO)
  grads = _grads(_spread() if case == "spread" else _shared(), seed=4)
  updates, state, _ = harness.device_run(tx, mesh, grads, params=params)
  g = np.asarray(grads[0]["w"], np.float64)
  want = np.mean([references.np_topk(g[i], RATIO)
                  for i in range(harness.N)], axis=0)
  np.testing.assert_allclose(updates[0]["w"], want, rtol=1e-6, atol=1e-6)
  codec = jaxcomm.compress_states(state)[0].codec[0]
  union = int(np.asarray(codec.union).reshape(-1)[0])
  assert union == (512 if dense else 32), union
  assert int(np.asarray(codec.dense_steps).reshape(-1)[0]) == int(dense)
  assert (union > plan.c2) == dense


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_no_message_exceeds_the_dense_all_reduce(n):
  """Per phase, the sparse message is smaller than the dense one (the
  range's ``m`` float32 per device), or is that dense message."""
  shapes = [(3, 3, 64, 64), (512, 1000), (1000,), (300, 7)]
  lay = _buckets.plan(shapes)[0]
  seen = set()
  for ratio in (0.001, 0.01, 0.05, 0.2, 0.5, 1.0):
    codec = _sparcml.SparcmlCodec(ratio)
    p = _sparcml.plan(lay, n, ratio)
    seen.add((p.scatter, p.gather))
    dense = 4 * n * p.m
    for kind, size in codec.wire(lay, n):
      assert size <= dense or (kind, size) == ("all-reduce", 4), (
        ratio, kind, size, dense)
    if p.scatter == _sparcml.SPARSE:
      assert _sparse.message_words(p.c1, p.m) < p.m
    if p.gather != _sparcml.DENSE:
      assert _sparse.message_words(p.c2, p.m) < p.m
  assert any(d == _sparcml.DENSE for d, _ in seen)
