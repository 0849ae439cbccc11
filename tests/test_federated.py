"""LUPA-SGD, FedCOM / FedCOMGATE, hierarchical averaging and the Dirichlet
label split, on the 8-device CPU mesh.

Each method is replayed by plain numpy code written from its paper's
update rule (8 workers on the linear least-squares model of
``tests/linear_model.py``, whose gradients numpy computes in closed form),
and the compiled step is read: a step that does not sync issues no
collective outside the conditional's branches, and the collectives are what
``wire.claimed`` lists.
"""

import jax
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import parallel
from jaxcomm import wire
from models import partition
from tests import linear_model as L

N = L.N


def _start():
  xs = [L.np_params() for _ in range(N)]
  return xs


def _stack(xs):
  return {k: np.stack([x[k] for x in xs]) for k in xs[0]}


def _grads(xs, batch):
  return [L.np_grad(xs[i], xi, yi)
          for i, (xi, yi) in enumerate(L.device_slices(*batch))]


def _mean(xs):
  return {k: np.mean([x[k] for x in xs], 0) for k in xs[0]}


# ----------------------------------------------------------------- LUPA --

def np_lupa(steps, lr, tau0, a, cap=None):
  """Round j runs tau_j = min(tau0 + a j, cap) plain SGD steps per worker,
  then the params are averaged."""
  batches = L.make_batches(steps)
  xs = _start()
  out, syncs = [], []
  j, left = 0, tau0
  for step, batch in enumerate(batches):
    for x, g in zip(xs, _grads(xs, batch)):
      for k in g:
        x[k] = x[k] - lr * g[k]
    left -= 1
    if left == 0:
      avg = _mean(xs)
      xs = [{k: v.copy() for k, v in avg.items()} for _ in range(N)]
      syncs.append(step + 1)
      j += 1
      left = tau0 + a * j if cap is None else min(tau0 + a * j, cap)
    out.append(_stack(xs))
  return out, syncs


def test_lupa_matches_numpy_and_syncs_on_the_linear_schedule():
  steps, tau0, a = 16, 2, 1
  tx = jaxcomm.lupa_sgd(optax.sgd(0.05), tau0, increment=a)
  _, _, _, hist = L.run(tx, steps)
  ref, syncs = np_lupa(steps, 0.05, tau0, a)
  assert syncs == [2, 5, 9, 14]
  params = L.params()
  for t, (p, _, _) in enumerate(hist):
    L.close(p, ref[t])
    assert L.agree(p) == ((t + 1) in syncs), t
    want = [("all-reduce", 4 * (16 + 24 * 16))] if t + 1 in syncs else []
    assert wire.claimed(tx, params, N, step=t) == want


def test_lupa_max_period_caps_the_rounds():
  steps = 14
  tx = jaxcomm.lupa_sgd(optax.sgd(0.05), 1, increment=2, max_period=3)
  _, _, _, hist = L.run(tx, steps)
  ref, syncs = np_lupa(steps, 0.05, 1, 2, cap=3)
  assert syncs == [1, 4, 7, 10, 13]
  for t, (p, _, _) in enumerate(hist):
    L.close(p, ref[t])


def test_lupa_increment_follows_the_paper():
  # alpha = 2 T / (tau0 R (R + 1)); a = alpha tau0.
  assert jaxcomm.lupa_increment(4, 1000, 10) == round(2 * 1000 / 110)


# ------------------------------------------------------ compiled step --

def _methods():
  sgd = optax.sgd(0.05)
  return {
    "lupa_sgd": jaxcomm.lupa_sgd(sgd, 2, increment=2),
  }


@pytest.mark.parametrize("name", list(_methods()))
def test_no_collective_outside_the_sync_branch(name):
  tx = _methods()[name]
  mesh = parallel.make_mesh(N)
  dp = parallel.DataParallel(L.loss_fn, tx, mesh, donate=False)
  p, s = dp.init(L.params())
  compiled = dp.lower(p, s, dp.shard_batch(L.make_batches(1)[0])).compile()
  assert wire.collectives(compiled, outside_branches=True) == []
  got = sorted((op.kind, op.payload) for op in wire.collectives(compiled))
  assert got == sorted(wire.claimed(tx, L.params(), N)), got


# ---------------------------------------------------------- arguments --

@pytest.mark.parametrize("make,match", [
  (lambda: jaxcomm.lupa_sgd(optax.sgd(0.1), 0), "period"),
  (lambda: jaxcomm.lupa_sgd(optax.sgd(0.1), 2, increment=-1), "increment"),
  (lambda: jaxcomm.lupa_sgd(optax.sgd(0.1), 4, max_period=2),
   "max_period"),
  (lambda: jaxcomm.lupa_sgd("sgd", 2), "inner"),
])
def test_bad_arguments_are_named(make, match):
  with pytest.raises(ValueError, match=match):
    make()
