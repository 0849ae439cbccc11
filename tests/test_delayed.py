"""Pipe-SGD, bounded staleness and Grishchenko et al.'s sparsified prox
(jaxcomm/transforms/delay/_delayed.py) on 8 devices: numpy replays written from
the papers' updates, the compiled schedule (Pipe-SGD's new params depend on
no collective), wire bytes from the HLO, bit-identical resumption through
orbax, and bad arguments refused by name."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomm
from jaxcomm import aot
from jaxcomm import parallel
from tests import harness
from tests import linear_model as lm
from tests import registry as battery

battery.load(["tests.entries_quantization"])
INT8 = battery.ENTRIES["int8"]
N = harness.N
STEPS = 4


def _float_leaves(tree):
  return {k: np.asarray(v, np.float64) for k, v in tree.items()
          if np.issubdtype(np.asarray(v).dtype, np.floating)}


# ------------------------------------------------------------- replays ----


def test_pipe_sgd_applies_the_previous_steps_mean(mesh):
  """Width 2: u_0 = 0, u_t = mean_i g_{i,t-1}; width 3: two steps late."""
  grads = harness.make_grads(seed=3, steps=STEPS)
  for width in (2, 3):
    ups, _, _ = harness.device_run(jaxcomm.pipe_sgd(width=width), mesh, grads)
    for t, u in enumerate(ups):
      src = t - (width - 1)
      for k, got in _float_leaves(u).items():
        want = (np.zeros_like(got) if src < 0 else
                np.asarray(grads[src][k], np.float64).mean(axis=0))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6,
                                   err_msg=f"width {width} step {t} {k}")


def test_pipe_sgd_with_int8_is_the_int8_replay_one_step_late(mesh):
  """Pipe-SGD around a compressor: step t applies what the battery's numpy
  int8 reference (error feedback included) averaged at step t - 1."""
  grads = harness.make_grads(seed=4, steps=STEPS)
  tx = jaxcomm.pipe_sgd(INT8.make(axis_name="data"))
  ups, state, _ = harness.device_run(tx, mesh, grads)
  ref, res, _ = harness.numpy_run(INT8, grads)
  for t, u in enumerate(ups):
    for k, got in _float_leaves(u).items():
      want = np.zeros_like(got) if t == 0 else ref[t - 1][k]
      np.testing.assert_allclose(got, want, rtol=INT8.rtol, atol=INT8.atol,
                                 err_msg=f"step {t} {k}")
  # The pending average is the replay's last one; residuals match too.
  floats = [k for k in sorted(harness.battery_params()) if k != "step"]
  pending = {k: q[0] for k, q in zip(floats, state.pending)}
  for k, want in ref[-1].items():
    np.testing.assert_allclose(np.asarray(pending[k], np.float64),
                               want, rtol=INT8.rtol, atol=INT8.atol)
  for j, got in enumerate(harness.residuals_of(state.inner)):
    for i in range(N):
      np.testing.assert_allclose(got[i], res[i][j], rtol=INT8.rtol,
                                 atol=INT8.atol * 10)


def test_delayed_sgd_on_a_linear_model_is_the_numpy_replay():
  """chain(pipe_sgd(), sgd(lr)) on 8 devices is w_{t+1} = w_t - lr
  mean_i grad_i(w_{t-1}) (grad_i(w_{-1}) = 0), gradients from numpy."""
  lr, steps = 0.05, 5
  data = lm.make_batches(steps)
  _, _, _, hist = lm.run(optax.chain(jaxcomm.pipe_sgd(), optax.sgd(lr)),
                         steps, batches=data)
  w = lm.np_params()
  prev = jax.tree.map(np.zeros_like, w)
  for t in range(steps):
    gs = [lm.np_grad(w, x, y) for x, y in lm.device_slices(*data[t])]
    g = {k: np.mean([d[k] for d in gs], axis=0) for k in w}
    w = {k: w[k] - lr * prev[k] for k in w}
    prev = g
    lm.close(hist[t][0], w)


def _stale_replay(grads, taus):
  """mean_i g_{i, t - tau_i(t)} with g_{i,s} = 0 for s < 0."""
  out = []
  for t in range(len(grads)):
    upd = {}
    for k in grads[0]:
      if not np.issubdtype(np.asarray(grads[0][k]).dtype, np.floating):
        continue
      rows = [np.asarray(grads[t - taus[t][i]][k][i], np.float64)
              if t - taus[t][i] >= 0 else
              np.zeros(np.shape(grads[0][k])[1:]) for i in range(N)]
      upd[k] = np.mean(rows, axis=0)
    out.append(upd)
  return out


def test_stale_sgd_fixed_and_random_staleness_are_the_replay(mesh):
  """A fixed tau per device (0..7, bound 8) and a random one per device and
  step in [0, 3] (the documented draw: randint(fold_in(PRNGKey(seed), t),
  (n,), 0, tau_max + 1), shared by all devices)."""
  steps = 6
  grads = harness.make_grads(seed=5, steps=steps)
  fixed = tuple(range(N))
  cases = [(jaxcomm.stale_sgd(tau=fixed, tau_max=8), [fixed] * steps)]
  draws = [np.asarray(jax.random.randint(
    jax.random.fold_in(jax.random.PRNGKey(7), t), (N,), 0, 4))
           for t in range(steps)]
  cases.append((jaxcomm.stale_sgd(tau=None, tau_max=3, seed=7), draws))
  assert len({tuple(d) for d in draws}) > 1
  for tx, taus in cases:
    ups, state, _ = harness.device_run(tx, mesh, grads)
    want = _stale_replay(grads, taus)
    for t, u in enumerate(ups):
      for k, got in _float_leaves(u).items():
        np.testing.assert_allclose(got, want[t][k], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{taus[0]} step {t} {k}")
    assert int(state.count) == steps


def test_stale_sgd_tau_0_is_the_exchange_and_tau_1_with_int8_is_pipe_sgd(
    mesh):
  """tau=0 gives the exchange's own update; tau=1 around int8 hands int8
  the previous gradient, which is what pipe_sgd(int8) applies."""
  grads = harness.make_grads(seed=8, steps=STEPS)
  plain, _, _ = harness.device_run(jaxcomm.mean_gradients(), mesh, grads)
  zero, _, _ = harness.device_run(jaxcomm.stale_sgd(tau=0), mesh, grads)
  chex.assert_trees_all_equal(_float_leaves(plain[-1]),
                              _float_leaves(zero[-1]))
  pipe, _, _ = harness.device_run(
    jaxcomm.pipe_sgd(INT8.make(axis_name="data")), mesh, grads)
  late, _, _ = harness.device_run(
    jaxcomm.stale_sgd(INT8.make(axis_name="data"), tau=1), mesh, grads)
  for a, b in zip(pipe, late):
    chex.assert_trees_all_close(_float_leaves(a), _float_leaves(b),
                                rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- SPY ----

D, M = 40, 16            # lasso: 40 coordinates, 16 rows per device


def _lasso(seed=0):
  r = np.random.RandomState(seed)
  x_true = np.zeros(D)
  x_true[:5] = r.randn(5) * 2
  a = r.randn(N * M, D).astype(np.float32)
  b = (a @ x_true + 0.01 * r.randn(N * M)).astype(np.float32)
  return a, b


def _lasso_loss(p, batch):
  a, b = batch
  return 0.5 * jnp.mean((a @ p["x"] - b) ** 2)


def _spy_replay(a, b, steps, gamma, lam, prob, identify, seed):
  """The paper's update in numpy: x = prox(xbar); each worker sets its
  x_i to x - gamma grad f_i(x) on its mask; xbar += mean_i Delta_i."""
  x_i = np.zeros((N, D))
  xbar = np.zeros(D)
  x = np.zeros(D)
  sent = []
  for t in range(steps):
    total = np.zeros(D)
    count = 0
    for i in range(N):
      ai, bi = a[i * M:(i + 1) * M], b[i * M:(i + 1) * M]
      grad = ai.T.astype(np.float64) @ (ai @ x - bi) / M
      key = jax.random.fold_in(jax.random.fold_in(
        jax.random.PRNGKey(seed), t), i)
      mask = np.asarray(jax.random.uniform(key, (D,))) < prob
      if identify:
        mask |= x != 0
      delta = np.where(mask, x - gamma * grad - x_i[i], 0.0)
      x_i[i] += delta
      total += delta
      count += int(mask.sum())
    xbar = xbar + total / N
    x = np.sign(xbar) * np.maximum(np.abs(xbar) - gamma * lam, 0.0)
    sent.append(count)
  return x, x_i, sent


def _spy_run(tx, a, b, steps, mesh):
  dp = parallel.DataParallel(_lasso_loss, tx, mesh, donate=False)
  p, s = dp.init({"x": jnp.zeros(D, jnp.float32)})
  sent = []
  for _ in range(steps):
    p, s, _ = dp.step(p, s, (a, b))
    jax.block_until_ready(p)
    sent.append(int(s.sent))
  return p, s, sent


@pytest.mark.parametrize("identify", [True, False])
def test_spy_is_the_papers_update(mesh, identify):
  a, b = _lasso()
  steps, gamma, lam, prob = 12, 0.05, 0.1, 0.3
  tx = jaxcomm.spy(gamma, lam, prob, identify=identify, seed=2)
  p, s, sent = _spy_run(tx, a, b, steps, mesh)
  x, x_i, want_sent = _spy_replay(a, b, steps, gamma, lam, prob, identify, 2)
  np.testing.assert_allclose(np.asarray(p["x"]), x, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(s.point), x_i, rtol=1e-4, atol=1e-5)
  assert sent == want_sent
  assert int(s.sent_total) == sum(want_sent)
  if identify:   # the support's coordinates are always among those sent
    assert sent[-1] >= N * int(np.sum(x != 0))


# ------------------------------------------------------- compiled HLO ----

def _step_outputs(tx):
  """The compiled DataParallel step of ``tx`` on the linear model, its
  per-output collective dependence and the number of param leaves."""
  mesh = parallel.make_mesh(N)
  dp = parallel.DataParallel(lm.loss_fn, tx, mesh, donate=False)
  p, s = dp.init(lm.params())
  text = dp.lower(p, s, lm.make_batches(1)[0]).compile().as_text()
  return aot.collective_dependence(text), len(jax.tree.leaves(p)), s


def test_pipe_sgd_new_params_depend_on_no_collective():
  """Compiled step of chain(pipe_sgd(int8()), sgd): the new params (the
  step's update) read only the state's pending average; the step's
  collectives flow into the new pending average alone, so the exchange of
  step t can run while step t + 1 computes. Without pipe_sgd the same
  check finds the params waiting for the exchange."""
  dense = optax.chain(jaxcomm.int8(), optax.sgd(0.1))
  deps, n_params, _ = _step_outputs(dense)
  assert all(deps[:n_params]), deps
  tx = optax.chain(jaxcomm.pipe_sgd(jaxcomm.int8()), optax.sgd(0.1))
  deps, n_params, state = _step_outputs(tx)
  assert not any(deps[:n_params]), deps
  # The state's pending average (after count) is where the exchange goes.
  pend = state[0].pending
  first = n_params + 1
  assert all(deps[first:first + len(pend)]), deps


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.pipe_sgd(jaxcomm.int8()),
  lambda: jaxcomm.stale_sgd(jaxcomm.topk(0.1), tau=(0, 1, 2, 3, 0, 1, 2, 3)),
  lambda: jaxcomm.spy(0.1, 0.01, 0.2),
], ids=["pipe_int8", "stale_topk", "spy"])
def test_wire_bytes_match_the_compiled_hlo(make, mesh):
  tx = make()
  params = {k: v for k, v in harness.battery_params().items()
            if k != "step"}
  hlo = jaxcomm.wire.report(harness.lower_update(tx, mesh, params=params),
                            params=params)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, N), n=N,
                                 params=params)
  assert hlo.payload == claim.payload, (hlo.payload, claim.payload)


# --------------------------------------------------------- checkpoints ----


def _train(tx, loss_fn, p0, data, state=None, params=None, start=0,
           stop=None):
  mesh = parallel.make_mesh(N)
  dp = parallel.DataParallel(loss_fn, tx, mesh, donate=False)
  p, s = dp.init(p0)
  if state is not None:
    p, s = params, state
  for t in range(start, len(data) if stop is None else stop):
    p, s, _ = dp.step(p, s, data[t])
    jax.block_until_ready((p, s))
  return p, s


@pytest.mark.parametrize("case", ["pipe_int8_momentum", "stale_random",
                                  "spy"])
def test_resume_from_orbax_is_bit_identical(case, tmp_path):
  """k steps, save (params, state) with orbax, restore onto the abstract
  target, continue: bit for bit the uninterrupted run. The state holds
  everything in flight (pending average, ring buffer, workers' points)."""
  if case == "pipe_int8_momentum":
    tx = optax.chain(jaxcomm.pipe_sgd(jaxcomm.int8()),
                     optax.sgd(0.05, momentum=0.9))
    loss, p0, data = lm.loss_fn, lm.params(), lm.make_batches(6)
  elif case == "stale_random":
    tx = optax.chain(jaxcomm.stale_sgd(tau=None, tau_max=3, seed=1),
                     optax.sgd(0.05))
    loss, p0, data = lm.loss_fn, lm.params(), lm.make_batches(6)
  else:
    tx = jaxcomm.spy(0.05, 0.1, 0.3)
    loss, p0, data = _lasso_loss, {"x": jnp.zeros(D, jnp.float32)}, [
      _lasso()] * 6
  whole_p, whole_s = _train(tx, loss, p0, data)
  p, s = _train(tx, loss, p0, data, stop=3)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", {"params": p, "state": s})
  ckpt.wait_until_finished()
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    {"params": p, "state": s})
  back = ckpt.restore(tmp_path / "ckpt", target=target)
  chex.assert_trees_all_equal(jax.device_get(back),
                              jax.device_get({"params": p, "state": s}))
  p2, s2 = _train(tx, loss, p0, data, state=back["state"],
                  params=back["params"], start=3)
  chex.assert_trees_all_equal(jax.device_get(p2), jax.device_get(whole_p))
  chex.assert_trees_all_equal(jax.device_get(s2), jax.device_get(whole_s))


# ------------------------------------------------------- bad arguments ----


@pytest.mark.parametrize("call,match", [
  (lambda: jaxcomm.pipe_sgd(width=1), "width"),
  (lambda: jaxcomm.pipe_sgd(width=2.0), "width"),
  (lambda: jaxcomm.pipe_sgd(optax.sgd(0.1)), "exchange"),
  (lambda: jaxcomm.pipe_sgd(optax.chain(jaxcomm.int8(), optax.sgd(0.1))),
   "exchange"),
  (lambda: jaxcomm.stale_sgd(tau=-1), "tau"),
  (lambda: jaxcomm.stale_sgd(tau=(0, -2)), r"tau\[1\]"),
  (lambda: jaxcomm.stale_sgd(tau=()), "tau"),
  (lambda: jaxcomm.stale_sgd(tau=4, tau_max=2), r"tau_max must be >= max"),
  (lambda: jaxcomm.stale_sgd(tau=None), "tau_max must be given"),
  (lambda: jaxcomm.stale_sgd(tau=None, tau_max=-1), "tau_max"),
  (lambda: jaxcomm.stale_sgd(tau=1, seed=-3), "seed"),
  (lambda: jaxcomm.spy(0.0, 0.1, 0.5), "step_size"),
  (lambda: jaxcomm.spy(0.1, -1.0, 0.5), "l1"),
  (lambda: jaxcomm.spy(0.1, 0.1, 0.0), "probability"),
  (lambda: jaxcomm.spy(0.1, 0.1, 1.5), "probability"),
  (lambda: jaxcomm.spy(0.1, 0.1, 0.5, identify=1), "identify"),
])
def test_bad_arguments_are_refused_by_name(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_one_tau_per_device_is_checked_against_the_axis(mesh):
  tx = jaxcomm.stale_sgd(tau=(0, 1, 2))
  with pytest.raises(ValueError, match="tau has 3 entries for 8 devices"):
    harness.device_run(tx, mesh, harness.make_grads(seed=0, steps=1))


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.stale_sgd(tau=1),
  lambda: jaxcomm.spy(0.1, l1=0.0, probability=0.5),
], ids=["stale_sgd", "spy"])
def test_an_unbound_axis_is_named_not_a_jax_name_error(make):
  """Outside shard_map the update says which axis it needs (as every other
  method does through check_axis), not JAX's bare NameError."""
  tx = make()
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    tx.update({"w": jnp.ones(4)}, state, params)
