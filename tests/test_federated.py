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


# ------------------------------------------------------ FedCOM(GATE) --

def _np_topk(v, ratio):
  """k = max(1, ceil(ratio size)) largest magnitudes kept, the rest 0."""
  flat = v.ravel()
  k = max(1, int(np.ceil(ratio * flat.size)))
  keep = np.argsort(-np.abs(flat), kind="stable")[:k]
  out = np.zeros_like(flat)
  out[keep] = flat[keep]
  return out.reshape(v.shape)


def np_fedcom(steps, eta, tau, gamma, gate, ratio=None):
  """Algorithms 1 and 2 of Haddadpour et al. 2021 on 8 workers: tau SGD
  steps on ``g`` (FedCOM) or ``g - delta_j`` (FedCOMGATE); ``Q_j`` the
  top-k of ``(x - x_j) / eta`` on ``w`` (``b`` is too small for the
  compressor's policy and is averaged exactly); ``x -= eta gamma mean Q_j``;
  ``delta_j += (Q_j - Q) / tau``."""
  batches = L.make_batches(steps)
  x = L.np_params()
  xs = [{k: v.copy() for k, v in x.items()} for _ in range(N)]
  delta = [{k: np.zeros_like(v) for k, v in x.items()} for _ in range(N)]
  out, deltas = [], []
  for step, batch in enumerate(batches):
    for i, g in enumerate(_grads(xs, batch)):
      for k in g:
        d = g[k] - delta[i][k] if gate else g[k]
        xs[i][k] = xs[i][k] - eta * d
    if (step + 1) % tau == 0:
      qj = []
      for xi in xs:
        m = {k: (x[k] - xi[k]) / eta for k in x}
        if ratio is not None:
          m["w"] = _np_topk(m["w"], ratio)
        qj.append(m)
      q = _mean(qj)
      x = {k: x[k] - eta * gamma * q[k] for k in x}
      if gate:
        for i in range(N):
          for k in x:
            delta[i][k] = delta[i][k] + (qj[i][k] - q[k]) / tau
      xs = [{k: v.copy() for k, v in x.items()} for _ in range(N)]
    out.append(_stack(xs))
    deltas.append(_stack(delta))
  return out, deltas


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("ratio", [None, 0.1])
def test_fedcom_matches_numpy(gate, ratio):
  steps, eta, tau, gamma = 9, 0.05, 3, 1.5
  make = jaxcomm.fedcomgate if gate else jaxcomm.fedcom
  comp = jaxcomm.topk(ratio) if ratio is not None else None
  tx = make(optax.sgd(eta), tau, learning_rate=eta, server_lr=gamma,
            compressor=comp)
  _, _, _, hist = L.run(tx, steps)
  ref, deltas = np_fedcom(steps, eta, tau, gamma, gate, ratio)
  for t, (p, st, _) in enumerate(hist):
    L.close(p, ref[t], rtol=1e-4, atol=2e-5)
    assert L.agree(p) == ((t + 1) % tau == 0), t
    if gate:
      got = jax.tree.map(L.rows, st.schedule.tracking)
      L.close(got, deltas[t], rtol=1e-3, atol=2e-4)
      for k in got:   # the tracking terms average to 0
        np.testing.assert_allclose(got[k].mean(0), 0, atol=1e-5)


def test_fedcom_without_compressor_is_local_sgd():
  steps, tau = 6, 3
  _, _, _, a = L.run(jaxcomm.fedcom(optax.sgd(0.05),
      learning_rate=0.05, period=tau), steps)
  _, _, _, b = L.run(jaxcomm.local_sgd(optax.sgd(0.05), tau), steps)
  for (pa, _, _), (pb, _, _) in zip(a, b):
    L.close(pa, pb, rtol=1e-5, atol=1e-6)


def test_fedcom_wire_follows_the_compressor():
  params = L.params()
  tx = jaxcomm.fedcom(optax.sgd(0.05),
      learning_rate=0.05, period=3, compressor=jaxcomm.topk(0.1))
  spec = jaxcomm.spec_of(jaxcomm.topk(0.1))
  assert wire.claimed(tx, params, N, step=2) == list(
    spec.wire([params["b"], params["w"]], N, 0))
  assert wire.claimed(tx, params, N, step=0) == []

# --------------------------------------------------------- hierarchical --

AXES = ("dcn", "ici")
GROUPS, PER = 2, 4


def _pod_run(tx, steps):
  mesh = parallel.make_pod_mesh(GROUPS)
  dp = parallel.DataParallel(L.loss_fn, tx, mesh, axis_name=AXES,
                             donate=False)
  p, s = dp.init(L.params())
  hist = []
  for batch in L.make_batches(steps):
    p, s, _ = dp.step(p, s, batch)
    jax.block_until_ready(p)
    hist.append((jax.tree.map(L.rows, p), s))
  return dp, p, s, hist


def np_hierarchical(steps, lr, period, global_period, ratio=None):
  """Workers 4g..4g+3 form group g. SGD per worker; every ``period`` steps
  a group's workers take its average; every ``global_period`` steps the
  group averages' deltas ``theta - x_g`` (top-k of ``w`` with error
  accumulation per group when ``ratio``) are averaged over groups,
  ``theta -= mean``, and every worker restarts from theta."""
  batches = L.make_batches(steps)
  theta = L.np_params()
  xs = [{k: v.copy() for k, v in theta.items()} for _ in range(N)]
  err = [np.zeros_like(theta["w"]) for _ in range(GROUPS)]
  out = []
  for step, batch in enumerate(batches):
    for x, g in zip(xs, _grads(xs, batch)):
      for k in g:
        x[k] = x[k] - lr * g[k]
    c = step + 1
    if c % period == 0 or c % global_period == 0:
      for g in range(GROUPS):
        avg = _mean(xs[g * PER:(g + 1) * PER])
        for i in range(g * PER, (g + 1) * PER):
          xs[i] = {k: v.copy() for k, v in avg.items()}
    if c % global_period == 0:
      deltas = []
      for g in range(GROUPS):
        d = {k: theta[k] - xs[g * PER][k] for k in theta}
        if ratio is not None:
          v = d["w"] + err[g]
          d["w"] = _np_topk(v, ratio)
          err[g] = v - d["w"]
        deltas.append(d)
      m = _mean(deltas)
      theta = {k: theta[k] - m[k] for k in theta}
      xs = [{k: v.copy() for k, v in theta.items()} for _ in range(N)]
    out.append(_stack(xs))
  return out


@pytest.mark.parametrize("ratio", [None, 0.1])
def test_hierarchical_matches_numpy(ratio):
  steps, period, gp = 8, 2, 4
  comp = (jaxcomm.topk(ratio, axis_name="dcn") if ratio is not None
          else None)
  tx = jaxcomm.hierarchical_sgd(optax.sgd(0.05), period, gp,
                                compressor=comp, axis_name=AXES)
  _, _, _, hist = _pod_run(tx, steps)
  ref = np_hierarchical(steps, 0.05, period, gp, ratio)
  for t, (p, _) in enumerate(hist):
    L.close(p, ref[t], rtol=1e-4, atol=1e-5)
    assert L.agree(p) == ((t + 1) % gp == 0), t


def test_hierarchical_compiled_step_and_wire():
  """Collectives only inside the branches; the group branch's all-reduce
  and the global branch's (group all-reduce, then the compressor's
  exchange across the 2 groups) are what the spec claims."""
  params = L.params()
  for comp in (None, jaxcomm.topk(0.1, axis_name="dcn")):
    tx = jaxcomm.hierarchical_sgd(optax.sgd(0.05), 2, 4, compressor=comp,
                                  axis_name=AXES)
    mesh = parallel.make_pod_mesh(GROUPS)
    dp = parallel.DataParallel(L.loss_fn, tx, mesh, axis_name=AXES,
                               donate=False)
    p, s = dp.init(params)
    compiled = dp.lower(p, s, dp.shard_batch(L.make_batches(1)[0])
                        ).compile()
    assert wire.collectives(compiled, outside_branches=True) == []
    got = sorted((op.kind, op.payload) for op in wire.collectives(compiled))
    assert got == sorted(wire.claimed(tx, params, GROUPS)), got
    assert wire.claimed(tx, params, GROUPS, step=0) == []
    assert wire.claimed(tx, params, GROUPS, step=1) == [
      ("all-reduce", 4 * 400)]

# ------------------------------------------------------ compiled step --

def _methods():
  sgd = optax.sgd(0.05)
  return {
    "lupa_sgd": jaxcomm.lupa_sgd(sgd, 2, increment=2),
    "fedcom": jaxcomm.fedcom(optax.sgd(0.05), learning_rate=0.05, period=3),
    "fedcom_topk": jaxcomm.fedcom(optax.sgd(0.05),
        learning_rate=0.05, period=3, compressor=jaxcomm.topk(0.1)),
    "fedcomgate_qsgd": jaxcomm.fedcomgate(optax.sgd(0.05),
        learning_rate=0.05, period=3,
        compressor=jaxcomm.qsgd(4, error_feedback=True)),
  }


@pytest.mark.parametrize("name", list(_methods()))
def test_no_collective_outside_the_sync_branch(name):
  L.assert_collectives_only_in_sync(_methods()[name])


# ---------------------------------------------------------- arguments --

@pytest.mark.parametrize("make,match", [
  (lambda: jaxcomm.lupa_sgd(optax.sgd(0.1), 0), "period"),
  (lambda: jaxcomm.lupa_sgd(optax.sgd(0.1), 2, increment=-1), "increment"),
  (lambda: jaxcomm.lupa_sgd(optax.sgd(0.1), 4, max_period=2),
   "max_period"),
  (lambda: jaxcomm.lupa_sgd("sgd", 2), "inner"),
  (lambda: jaxcomm.hierarchical_sgd(optax.sgd(0.1), 2, 3),
   "global_period"),
  (lambda: jaxcomm.hierarchical_sgd(optax.sgd(0.1), 2, 4,
                                    axis_name="data"), "axis_name"),
  (lambda: jaxcomm.hierarchical_sgd(optax.sgd(0.1), 2, 4,
                                    compressor=jaxcomm.topk(0.1)),
   "axis_name"),
  (lambda: jaxcomm.fedcom(optax.sgd(0.1),
      learning_rate=0.0, period=2), "learning_rate"),
  (lambda: jaxcomm.fedcom(optax.sgd(0.1),
      learning_rate=0.1, period=0), "period"),
  (lambda: jaxcomm.fedcom(optax.sgd(0.1),
      learning_rate=0.1, period=2, server_lr=-1.0), "server_lr"),
  (lambda: jaxcomm.fedcom(optax.sgd(0.1),
      learning_rate=0.1, period=2, compressor=optax.sgd(1.0)),
   "compressor"),
  (lambda: jaxcomm.fedcom(optax.sgd(0.1),
      learning_rate=0.1, period=2, compressor=jaxcomm.topk(
    0.1, axis_name="x")), "axis_name"),
  (lambda: jaxcomm.fedcomgate(optax.sgd(0.1),
      learning_rate=0.1, period=2, compressor=jaxcomm.topk(
    0.1, error_feedback=False)), "error_feedback"),
])
def test_bad_arguments_are_named(make, match):
  with pytest.raises(ValueError, match=match):
    make()


# ------------------------------------------------------- the data split --

def test_dirichlet_split_partitions_and_is_seeded():
  labels = np.repeat(np.arange(10), 50)
  a = partition.dirichlet_split(labels, 8, 0.1, seed=3)
  b = partition.dirichlet_split(labels, 8, 0.1, seed=3)
  c = partition.dirichlet_split(labels, 8, 0.1, seed=4)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))
  allidx = np.sort(np.concatenate(a))
  np.testing.assert_array_equal(allidx, np.arange(len(labels)))
  assert min(len(s) for s in a) >= 1


def test_dirichlet_alpha_sets_the_skew():
  """Small alpha: each shard dominated by few classes; large alpha: close
  to the global mix (mean total-variation distance to uniform)."""
  labels = np.repeat(np.arange(10), 200)
  def skew(alpha):
    shards = partition.dirichlet_split(labels, 8, alpha, seed=0)
    counts = partition.label_counts(labels, shards, 10)
    mix = counts / counts.sum(1, keepdims=True)
    return float(np.mean(0.5 * np.abs(mix - 0.1).sum(1)))
  assert skew(0.1) > 0.5 > 0.1 > skew(100.0)


@pytest.mark.parametrize("kwargs,match", [
  ({"num_devices": 0}, "num_devices"),
  ({"alpha": 0.0}, "alpha"),
  ({"alpha": float("nan")}, "alpha"),
  ({"seed": 1.5}, "seed"),
  ({"min_size": 1000}, "min_size"),
])
def test_dirichlet_bad_arguments_are_named(kwargs, match):
  args = {"labels": np.arange(20) % 4, "num_devices": 4, "alpha": 1.0,
          "seed": 0}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    partition.dirichlet_split(**args)
