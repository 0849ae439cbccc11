"""Local-update training (local SGD, post-local SGD, ADACOMM, Overlap Local
SGD, DiLoCo / Streaming DiLoCo) on the 8-device CPU mesh.

A linear least-squares model whose gradients numpy computes in closed form
lets every method be replayed by plain numpy code: 8 workers, each with its
own batches, running the papers' update rules. The step's compiled HLO is
read to check that nothing crosses the wire between syncs.
"""

import math

import jax
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import parallel
from jaxcomm import wire
from tests import harness
from tests import linear_model as L

N = L.N
B = L.B
D_IN, D_OUT = L.D_IN, L.D_OUT


# ------------------------------------------------------- numpy references --

def np_local_sgd(steps, lr, momentum, period, start_step=0):
  """Each worker: ``t = g + m t``, ``x -= lr t``; average the params at
  steps ``<= start_step`` and every ``period``-th step."""
  batches = L.make_batches(steps)
  xs = [L.np_params() for _ in range(N)]
  ts = [{k: np.zeros_like(v) for k, v in xs[0].items()} for _ in range(N)]
  out = []
  for step, (x, y) in enumerate(batches):
    for i, (xi, yi) in enumerate(L.device_slices(x, y)):
      g = L.np_grad(xs[i], xi, yi)
      for k in g:
        ts[i][k] = g[k] + momentum * ts[i][k]
        xs[i][k] = xs[i][k] - lr * ts[i][k]
    c = step + 1
    if c <= start_step or c % period == 0:
      avg = {k: np.mean([xi[k] for xi in xs], 0) for k in xs[0]}
      xs = [{k: v.copy() for k, v in avg.items()} for _ in range(N)]
    out.append({k: np.stack([xi[k] for xi in xs]) for k in xs[0]})
  return out


def _np_inner_sgd(xs, batch, lr):
  """Every worker's plain SGD step on its own slice of ``batch``."""
  for i, (xi, yi) in enumerate(L.device_slices(*batch)):
    g = L.np_grad(xs[i], xi, yi)
    for k in g:
      xs[i][k] = xs[i][k] - lr * g[k]


def np_diloco(steps, lr, period, outer_lr, outer_m):
  """Inner SGD per worker; every ``period`` steps the mean pseudo-gradient
  ``theta - x_i`` drives Nesterov SGD (optax's form: ``t = d + m t``,
  ``theta -= lr (d + m t)``) and every worker restarts from theta."""
  batches = L.make_batches(steps)
  theta = L.np_params()
  tr = {k: np.zeros_like(v) for k, v in theta.items()}
  xs = [{k: v.copy() for k, v in theta.items()} for _ in range(N)]
  out = []
  for step, batch in enumerate(batches):
    _np_inner_sgd(xs, batch, lr)
    if (step + 1) % period == 0:
      for k in theta:
        d = np.mean([theta[k] - xi[k] for xi in xs], 0)
        tr[k] = d + outer_m * tr[k]
        theta[k] = theta[k] - outer_lr * (d + outer_m * tr[k])
      xs = [{k: v.copy() for k, v in theta.items()} for _ in range(N)]
    out.append({k: np.stack([xi[k] for xi in xs]) for k in xs[0]})
  return out


def np_overlap_local_sgd(steps, lr, period, alpha):
  """Inner SGD; every ``period`` steps ``x_i <- (1-a) x_i + a z`` and
  ``z <- mean_i x_i`` (of the pulled models)."""
  batches = L.make_batches(steps)
  z = L.np_params()
  xs = [{k: v.copy() for k, v in z.items()} for _ in range(N)]
  out = []
  for step, batch in enumerate(batches):
    _np_inner_sgd(xs, batch, lr)
    if (step + 1) % period == 0:
      xs = [{k: (1 - alpha) * xi[k] + alpha * z[k] for k in xi} for xi in xs]
      z = {k: np.mean([xi[k] for xi in xs], 0) for k in z}
    out.append({k: np.stack([xi[k] for xi in xs]) for k in xs[0]})
  return out


# ------------------------------------------------------------------ tests --

def test_local_sgd_matches_numpy_and_agrees_exactly_after_syncs():
  steps, period = 7, 3
  tx = jaxcomm.local_sgd(optax.sgd(0.05, momentum=0.9), period)
  _, _, _, hist = L.run(tx, steps)
  ref = np_local_sgd(steps, 0.05, 0.9, period)
  for t, (p, _, _) in enumerate(hist):
    L.close(p, ref[t])
    synced = (t + 1) % period == 0
    assert L.agree(p) == synced, (t, synced)


def test_period_one_follows_synchronous_training():
  """period=1 with momentum SGD is synchronous momentum SGD on the mean
  gradient (local momenta stay equal: their inputs average linearly)."""
  steps = 6
  batches = L.make_batches(steps)
  _, _, _, local = L.run(jaxcomm.local_sgd(optax.sgd(0.05, momentum=0.9), 1),
                        steps, batches)
  mesh = parallel.make_mesh(N)
  dp = parallel.DataParallel(
    L.loss_fn, optax.chain(jaxcomm.mean_gradients(), optax.sgd(
      0.05, momentum=0.9)), mesh, donate=False)
  p, s = dp.init(L.params())
  for t in range(steps):
    p, s, _ = dp.step(p, s, batches[t])
    for k in ("b", "w"):
      np.testing.assert_allclose(local[t][0][k], np.broadcast_to(
        np.asarray(p[k]), local[t][0][k].shape), rtol=1e-6, atol=1e-7)


def test_post_local_sgd_is_synchronous_until_start_step():
  steps, start, period = 7, 3, 4
  tx = jaxcomm.local_sgd(optax.sgd(0.05, momentum=0.9), period,
                         start_step=start)
  _, _, _, hist = L.run(tx, steps)
  ref = np_local_sgd(steps, 0.05, 0.9, period, start_step=start)
  for t, (p, _, _) in enumerate(hist):
    L.close(p, ref[t])
    c = t + 1
    assert L.agree(p) == (c <= start or c % period == 0), c


def test_diloco_matches_numpy_outer_nesterov():
  steps, period = 7, 3
  tx = jaxcomm.diloco(optax.sgd(0.05), optax.sgd(0.7, momentum=0.9,
                                                 nesterov=True), period)
  _, _, s, hist = L.run(tx, steps)
  ref = np_diloco(steps, 0.05, period, 0.7, 0.9)
  for t, (p, st, _) in enumerate(hist):
    L.close(p, ref[t])
    assert L.agree(p) == ((t + 1) % period == 0)
    if (t + 1) % period == 0:  # every device holds the global model
      for k in p:
        np.testing.assert_array_equal(p[k][0], L.rows(st.anchor[k]))


def test_diloco_compressor_keeps_error_mass_across_syncs():
  """Top-k with error feedback on the pseudo-gradients: at every sync,
  ``sum_i (delta_i + e_i) = n * mean + sum_i e_i'`` element for element
  (with an outer SGD(1), ``mean = theta_old - theta_new``)."""
  period, steps = 2, 6
  tx = jaxcomm.diloco(optax.sgd(0.05), optax.sgd(1.0), period,
                      compressor=jaxcomm.topk(0.05))
  _, _, _, hist = L.run(tx, steps)
  shapes = [(D_IN, D_OUT)]
  e_old = np.zeros((N, D_IN, D_OUT))
  theta = L.rows(L.params()["w"])
  for t, (_, st, _) in enumerate(hist):
    if (t + 1) % period:
      continue
    e_new = harness.split_buckets(st.compress[0].residual, shapes)[0]
    theta_new = L.rows(st.anchor["w"])
    mean = theta - theta_new
    deltas = theta[None] - _replay_inner_w(t, hist)
    np.testing.assert_allclose(mean * N + e_new.sum(0),
                               deltas.sum(0) + e_old.sum(0),
                               rtol=1e-4, atol=1e-5)
    assert np.count_nonzero(e_new) > 0   # something was held back
    e_old, theta = e_new, theta_new


def _replay_inner_w(t, hist):
  """Local ``w`` of every device after step ``t``'s inner SGD update (lr
  0.05), before the sync, in float64 from the previous params."""
  batches = L.make_batches(len(hist))
  prev = (hist[t - 1][0] if t > 0 else
          {k: np.broadcast_to(L.rows(v), (N,) + v.shape)
           for k, v in L.params().items()})
  x, y = batches[t]
  out = []
  for i, (xi, yi) in enumerate(L.device_slices(x, y)):
    p = {k: np.asarray(prev[k][i], np.float64) for k in prev}
    out.append(p["w"] - 0.05 * L.np_grad(p, xi, yi)["w"])
  return np.stack(out)


def test_overlap_local_sgd_matches_numpy():
  steps, period, alpha = 7, 2, 0.6
  tx = jaxcomm.overlap_local_sgd(optax.sgd(0.05), period, alpha=alpha)
  dp, p, _, hist = L.run(tx, steps)
  ref = np_overlap_local_sgd(steps, 0.05, period, alpha)
  for t, (pt, _, _) in enumerate(hist):
    L.close(pt, ref[t])
  assert not L.agree(hist[-1][0])
  sync = dp.synchronized(p)
  for k in ("b", "w"):
    np.testing.assert_allclose(np.asarray(sync[k]), ref[-1][k].mean(0),
                               rtol=1e-5, atol=1e-6)


def test_streaming_diloco_syncs_fragments_in_turn():
  """fragments=2: ``b`` and ``w`` (two blocks) sync at steps 2, 6, ... and
  4, 8, ...; each step's HLO branch moves one block, as wire claims."""
  period = 4
  tx = jaxcomm.diloco(optax.sgd(0.05), optax.sgd(0.7, momentum=0.9,
                                                 nesterov=True), period,
                      fragments=2)
  dp, p, s, hist = L.run(tx, 8)
  for t, (pt, _, _) in enumerate(hist):
    c = t + 1
    assert L.agree({"b": pt["b"]}) == (c % period == 2), c
    assert L.agree({"w": pt["w"]}) == (c % period == 0), c
  params = L.params()
  assert wire.claimed(tx, params, N, step=1) == [("all-reduce", 4 * D_OUT)]
  assert wire.claimed(tx, params, N, step=3) == [
    ("all-reduce", 4 * D_IN * D_OUT)]
  assert wire.claimed(tx, params, N, step=0) == []


def test_diloco_overlap_merges_tau_steps_later():
  """overlap_steps=1, alpha=0: a sync's result replaces the local params
  one step after the sync; the devices agree exactly from then."""
  period = 3
  tx = jaxcomm.diloco(optax.sgd(0.05), optax.sgd(0.7), period,
                      overlap_steps=1, alpha=0.0)
  _, _, _, hist = L.run(tx, 8)
  for t, (pt, st, _) in enumerate(hist):
    c = t + 1
    assert L.agree(pt) == (c > period and (c - 1) % period == 0), c
    if L.agree(pt):
      for k in pt:
        np.testing.assert_array_equal(pt[k][0], L.rows(st.anchor[k]))


def _methods():
  sgd = optax.sgd(0.05)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  return {
    "local_sgd": jaxcomm.local_sgd(sgd, 4),
    "post_local_sgd": jaxcomm.local_sgd(sgd, 4, start_step=2),
    "adacomm": jaxcomm.adacomm(sgd, 4),
    "overlap_local_sgd": jaxcomm.overlap_local_sgd(sgd, 4),
    "diloco": jaxcomm.diloco(optax.adamw(1e-3), outer, 4),
    "diloco_topk": jaxcomm.diloco(sgd, optax.sgd(1.0), 4,
                                  compressor=jaxcomm.topk(0.05)),
    "streaming": jaxcomm.diloco(sgd, outer, 4, fragments=2,
                                overlap_steps=1),
    "zero_one_adam": jaxcomm.zero_one_adam(1e-3, var_freeze_step=2),
  }


@pytest.mark.parametrize("name", list(_methods()))
def test_no_collective_outside_the_sync_branch(name):
  """The compiled step holds collectives only inside the conditional's
  sync branches (a step that does not sync moves nothing), and they are
  what ``wire.claimed`` lists for one sync of every fragment."""
  L.assert_collectives_only_in_sync(_methods()[name])


def test_nan_on_one_device_between_syncs_is_skipped_there():
  """Device 3's gradient is NaN at step 2: it keeps its params and inner
  state for that step and counts it; the others train on; the sync at step
  4 averages finite params and every device agrees."""
  steps, period = 4, 4
  batches = L.make_batches(steps)
  x, y = batches[1]
  x = x.copy()
  x[3 * B] = np.nan
  batches[1] = (x, y)
  tx = jaxcomm.local_sgd(optax.sgd(0.05, momentum=0.9), period)
  _, _, s, hist = L.run(tx, steps, batches)
  skipped = L.rows(s.skipped)
  assert skipped.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
  p1, p2 = hist[0][0], hist[1][0]
  for k in p1:
    np.testing.assert_array_equal(p2[k][3], p1[k][3])
    assert not np.array_equal(p2[k][2], p1[k][2])
  last = hist[-1][0]
  assert L.agree(last) and all(np.isfinite(v).all() for v in last.values())


def test_resize_keeps_the_average_model():
  """Between syncs, 8 devices -> 4: per-device params and inner momenta are
  averaged in pairs (the device average is kept), and training goes on."""
  tx = jaxcomm.local_sgd(optax.sgd(0.05, momentum=0.9), 8)
  dp, p, s, _ = L.run(tx, 3)
  host_p, _, new_p, new_s = L.resize_run(dp, p, s, 4)
  for k in host_p:
    assert new_p[k].shape[0] == 4
    np.testing.assert_allclose(new_p[k].mean(0), host_p[k].mean(0),
                               rtol=1e-6, atol=1e-7)
  dp4, p4, s4 = L.place(tx, new_p, new_s, 4)
  for t in range(5):  # count 4 -> 8: a sync at 8
    p4, s4, _ = dp4.step(p4, s4, L.make_batches(5, seed=7, n=4)[t])
  assert L.agree(jax.tree.map(L.rows, p4))


def test_adacomm_period_follows_the_loss():
  """tau = ceil(sqrt(F_l / F_0) tau_0) at the first sync after each
  interval, F the device-averaged loss since the last sync (recomputed
  here from the per-device losses the step reports)."""
  tau0, interval, steps = 4, 4, 24
  tx = jaxcomm.adacomm(optax.sgd(0.5), tau0, interval=interval)
  _, _, _, hist = L.run(tx, steps)
  losses = [float(np.mean(L.rows(m["loss"]))) for _, _, m in hist]
  period, next_sync, next_update, f0, since = tau0, tau0, interval, None, []
  syncs = 0
  for t, (_, st, _) in enumerate(hist):
    c = t + 1
    since.append(losses[t])
    if c == next_sync:
      f = float(np.mean(since))
      f0 = f if f0 is None else f0
      if c >= next_update:
        period = min(max(math.ceil(math.sqrt(f / f0) * tau0), 1), tau0)
        next_update += interval
      next_sync = c + period
      since = []
      syncs += 1
    assert int(st.schedule.period) == period, (c, int(st.schedule.period))
    assert int(st.schedule.next_sync) == next_sync, c
  assert period < tau0 and syncs >= 5   # the loss fell: syncs got closer


def test_synchronized_is_exact_when_devices_agree():
  mesh = parallel.make_mesh(N)
  x = np.tile(np.float32([1 / 3, 0.1, 7e-8])[None], (N, 1))
  dev = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  got = parallel.synchronized({"a": parallel._global(x, dev)}, mesh)
  np.testing.assert_array_equal(np.asarray(got["a"]), x[0])
  y = x.copy()
  y[0, 0] += 1.0
  got = parallel.synchronized({"a": parallel._global(y, dev)}, mesh)
  np.testing.assert_allclose(np.asarray(got["a"]), y.mean(0), rtol=1e-6)


@pytest.mark.parametrize("make,match", [
  (lambda: jaxcomm.local_sgd(optax.sgd(0.1), 0), "period"),
  (lambda: jaxcomm.local_sgd("sgd", 4), "inner"),
  (lambda: jaxcomm.local_sgd(optax.sgd(0.1), 4, start_step=-1),
   "start_step"),
  (lambda: jaxcomm.diloco(optax.sgd(0.1), None, 4), "outer"),
  (lambda: jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), 4, fragments=5),
   "fragments"),
  (lambda: jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), 4,
                          overlap_steps=4), "overlap_steps"),
  (lambda: jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), 4, alpha=0.5),
   "alpha"),
  (lambda: jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), 4,
                          compressor=optax.sgd(1.0)), "compressor"),
  (lambda: jaxcomm.diloco(optax.sgd(0.1), optax.sgd(1.0), 4,
                          compressor=jaxcomm.topk(0.1, axis_name="x")),
   "axis_name"),
  (lambda: jaxcomm.overlap_local_sgd(optax.sgd(0.1), 4, alpha=0.0),
   "alpha"),
  (lambda: jaxcomm.adacomm(optax.sgd(0.1), 4, interval=0), "interval"),
  (lambda: jaxcomm.local_sgd(optax.sgd(0.1), 4, axis_name=3), "axis_name"),
  (lambda: jaxcomm.zero_one_adam(0.1, var_freeze_step=-1),
   "var_freeze_step"),
  (lambda: jaxcomm.zero_one_adam(0.1, var_freeze_step=2,
                                 local_step_clipper=0), "local_step_clipper"),
  (lambda: jaxcomm.zero_one_adam(0.1, b1=1.5, var_freeze_step=2), "b1"),
])
def test_bad_arguments_are_named(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_adacomm_without_the_loss_says_so():
  tx = jaxcomm.adacomm(optax.sgd(0.1), 2, axis_name=None)
  p = L.params()
  with pytest.raises(ValueError, match="value=loss"):
    tx.update(p, tx.init(p), p)


def test_one_device_without_collectives():
  """axis_name=None: one worker; a sync is the identity on its params."""
  tx = jaxcomm.diloco(optax.sgd(0.05), optax.sgd(1.0), 2, axis_name=None)
  p = L.params()
  s = tx.init(p)
  x, y = L.make_batches(1, n=1)[0]
  for _ in range(2):
    g = jax.grad(L.loss_fn)(p, (x, y))
    u, s = tx.update(g, s, p)
    p = jaxcomm.apply_updates(p, u, s)
  for k in p:
    np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(s.anchor[k]))


def test_local_sgd_under_pmap_matches_numpy():
  """The legacy pmap step: params are per device by construction there;
  the same numpy replay holds, and rows agree after each sync."""
  steps, period = 5, 2
  tx = jaxcomm.local_sgd(optax.sgd(0.05, momentum=0.9), period)
  step = parallel.pmap_train_step(L.loss_fn, tx)
  p = parallel.pmap_replicate(L.params())
  s = parallel.pmap_replicate(tx.init(L.params()))
  ref = np_local_sgd(steps, 0.05, 0.9, period)
  for t, (x, y) in enumerate(L.make_batches(steps)):
    batch = (x.reshape(N, B, D_IN), y.reshape(N, B, D_OUT))
    p, s, _ = step(p, s, batch)
    got = jax.tree.map(L.rows, p)
    L.close(got, ref[t])
    assert L.agree(got) == ((t + 1) % period == 0)


def np_zero_one_adam(steps, lr, vfs, vus, lss, lsc, b1=0.9, b2=0.999,
                     eps=1e-8):
  """0/1 Adam (Lu et al. 2022, DeepSpeed's schedule) in float64 numpy
  around the numpy 1-bit exchange of tests.entries_quantization (worker
  error added here; ``b`` is small, so the leaf policy sends it dense)."""
  from tests.entries_quantization import _onebit_ref_step
  batches = L.make_batches(steps)
  zeros = lambda: {k: np.zeros_like(v) for k, v in L.np_params().items()}
  anchor = L.np_params()
  xs = [{k: v.copy() for k, v in anchor.items()} for _ in range(N)]
  mu = [zeros() for _ in range(N)]
  nu, acc, lrs = zeros(), [zeros() for _ in range(N)], 0.0
  ex = {w: ([np.zeros_like(anchor["w"]) for _ in range(N)],
            {"shapes": None, "server": None}) for w in ("g", "m")}

  def exchange(vals, which):
    res, server = ex[which]
    xw = [[vals[i]["w"] + res[i]] for i in range(N)]
    mean_w, sent, server = _onebit_ref_step(xw, server, None, None, N)
    ex[which] = ([xw[i][0] - sent[i][0] for i in range(N)], server)
    return {"b": np.mean([v["b"] for v in vals], 0), "w": mean_w[0]}

  vi, vc, li, lc = 1, 0, 1, 0
  out = []
  for t in range(steps):
    count = t + 1
    grads = [L.np_grad(xs[i], xi, yi)
             for i, (xi, yi) in enumerate(L.device_slices(*batches[t]))]
    denom = lambda: {k: np.sqrt(nu[k]) + eps for k in nu}  # noqa: B023
    if count <= vfs:
      is_var = count % vi == 0
      if is_var:
        gbar = {k: np.mean([g[k] for g in grads], 0) for k in nu}
        nu = {k: b2 * nu[k] + (1 - b2) * gbar[k] ** 2 for k in nu}
        vc += 1
        if vc == vus:
          vc, vi = 0, vi * 2
      else:
        gbar = exchange(grads, "g")
      m = {k: b1 * mu[0][k] + (1 - b1) * gbar[k] for k in nu}
      mu = [m for _ in range(N)]
      d = denom()
      anchor = {k: anchor[k] - lr * m[k] / d[k] for k in nu}
      xs = [{k: v.copy() for k, v in anchor.items()} for _ in range(N)]
    else:
      d = denom()
      for i in range(N):
        mu[i] = {k: b1 * mu[i][k] + (1 - b1) * grads[i][k] for k in nu}
        for k in nu:
          xs[i][k] = xs[i][k] - lr * mu[i][k] / d[k]
          acc[i][k] = acc[i][k] - lr * mu[i][k] / d[k]
      lrs += lr
      if count % li == 0:
        ubar = exchange([{k: acc[i][k] * d[k] for k in nu}
                         for i in range(N)], "m")
        m = {k: -ubar[k] / lrs for k in nu}
        mu = [m for _ in range(N)]
        anchor = {k: anchor[k] + ubar[k] / d[k] for k in nu}
        xs = [{k: v.copy() for k, v in anchor.items()} for _ in range(N)]
        acc, lrs = [zeros() for _ in range(N)], 0.0
      lc += 1
      if lc == lss:
        lc, li = 0, min(lsc, li * 2)
    out.append({k: np.stack([x[k] for x in xs]) for k in nu})
  return out


def test_zero_one_adam_matches_numpy():
  """Two dense variance steps, one 1-bit gradient step, then local steps
  whose sync interval doubles (1, 1, 2, ..., 4): each step's per-device
  params equal the numpy replay, and devices agree exactly after every
  synchronous step and sync, not between."""
  from jaxcomm.transforms.optimizers._zero_one_adam import zero_one_schedule
  steps, args = 8, dict(var_freeze_step=3, var_update_scaler=1,
                        local_step_scaler=2, local_step_clipper=4)
  branches = zero_one_schedule(steps, *args.values())
  assert branches == [0, 0, 1, 3, 3, 3, 2, 3]
  tx = jaxcomm.zero_one_adam(0.01, **args)
  _, _, _, hist = L.run(tx, steps)
  ref = np_zero_one_adam(steps, 0.01, 3, 1, 2, 4)
  for t, (p, _, _) in enumerate(hist):
    L.close(p, ref[t], rtol=1e-4, atol=1e-5)
    assert L.agree(p) == (branches[t] != 2), t
  params = L.params()
  for t, b in enumerate(branches):   # wire claims follow the schedule
    got = wire.claimed(tx, params, N, step=t)
    assert (got == []) == (b == 2), (t, got)


def test_zero_one_adam_var_freeze_step_zero_on_a_fresh_state():
  """``zero_one_adam(var_freeze_step=0)`` from ``init`` (no warm-up state
  restored): the first step was a local step on a zero variance and moved
  the params by about ``lr / eps``. Now it is the dense variance step, in
  numpy Adam on the mean gradient as 0/1 Adam takes it (``m = (1 - b1)
  gbar``, ``v = (1 - b2) gbar^2``, no bias correction, DeepSpeed's form):
  every device gets the same params, the state counts one variance
  update, and the whole run (syncs whose interval doubles, wire claims)
  is the one ``var_freeze_step=1`` takes."""
  lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
  args = dict(var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
  steps = 7
  tx = jaxcomm.zero_one_adam(lr, b1, b2, eps, var_freeze_step=0, **args)
  _, _, state, hist = L.run(tx, steps)
  x, y = L.make_batches(steps)[0]
  p0 = L.np_params()
  gbar = {k: np.mean([L.np_grad(p0, xi, yi)[k]
                      for xi, yi in L.device_slices(x, y)], 0) for k in p0}
  for k in p0:
    m, v = (1 - b1) * gbar[k], (1 - b2) * gbar[k] ** 2
    want = p0[k] - lr * m / (np.sqrt(v) + eps)
    np.testing.assert_allclose(hist[0][0][k], np.stack([want] * N),
                               rtol=1e-5, atol=1e-6, err_msg=k)
    # |m / sqrt(v)| = (1 - b1) / sqrt(1 - b2) = 3.16 at most.
    assert np.abs(hist[0][0][k] - p0[k]).max() < 3.2 * lr, k
  assert int(np.asarray(hist[0][1].inner.var_count).max()) == 1
  one = jaxcomm.zero_one_adam(lr, b1, b2, eps, var_freeze_step=1, **args)
  _, _, _, ref = L.run(one, steps)
  for t in range(steps):
    L.close(hist[t][0], ref[t][0], rtol=1e-6, atol=1e-7)
  params = L.params()
  for t in range(steps):
    assert wire.claimed(tx, params, N, step=t) == wire.claimed(
      one, params, N, step=t), t
  assert int(np.asarray(state.inner.var_count).max()) == 1


@pytest.mark.parametrize("name", ["diloco_topk", "zero_one_adam"])
def test_kernel_paths_inside_the_local_step(name, monkeypatch):
  """The Pallas paths (interpreted on CPU) of the compressors a
  local-update optimizer calls inside its sync branch give the plain-XLA
  path's params, in the DataParallel shard_map step."""
  out = {}
  for mode in ("never", "always"):
    monkeypatch.setenv("JAXCOMM_KERNELS", mode)
    _, p, _, _ = L.run(_methods()[name], 5)
    out[mode] = jax.tree.map(L.rows, p)
  for k in out["never"]:
    np.testing.assert_allclose(out["always"][k], out["never"][k],
                               rtol=1e-6, atol=1e-7, err_msg=k)


# ----------------------------------------------------------------- MuLoCo --

def _two_bit(axis_name="data"):
  """MuLoCo's pseudo-gradient compressor: 2-bit block codes, requantized
  two-phase all-reduce, error feedback."""
  from jaxcomm import _compressor
  from jaxcomm.transforms.quantize._integer import _block_int
  return _compressor.compressed(_block_int("int2", 2, None, None, True),
                                axis_name=axis_name, error_feedback=True)


def test_two_bit_requantized_exchange_matches_its_definition(mesh):
  """The 2-bit requantized all-reduce (ternary codes of a bf16 step per
  128-element block, the owner's rounding kept as server error) equals the
  numpy definition the int8/int4 battery entries use, at 2 bits, over 3
  steps on 8 devices; its wire claim is the compiled HLO's."""
  from tests import entries_quantization as eq
  from tests import registry as battery
  entry = battery.Entry(
    name="int2_requantized", ref_init=lambda shapes: {"server": None},
    ref_step=eq._requantized_ref(2, 128),
    make=lambda axis_name="data", **kw: _two_bit(axis_name),
    rtol=1e-5, atol=1e-6)
  grads = harness.make_grads(3, 3)
  tx = _two_bit()
  updates, _, _ = harness.device_run(tx, mesh, grads)
  ref, _, _ = harness.numpy_run(entry, grads)
  for t, (got, want) in enumerate(zip(updates, ref)):
    for k in want:
      np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k],
                                 rtol=1e-5, atol=1e-6, err_msg=f"{k} {t}")
  params = harness.battery_params()
  hlo = wire.report(harness.lower_update(tx, mesh), params=params)
  claim = wire.summarize(wire.claimed(tx, params, harness.N), n=harness.N,
                         params=params)
  assert hlo.payload == claim.payload


def test_muloco_is_diloco_with_two_bit_pseudo_gradients():
  """The recipe: muloco(inner, H) is diloco(inner, Nesterov SGD 0.7 / 0.9,
  H, compressor=2-bit requantized with error feedback), step for step."""
  steps, period = 6, 2
  inner = optax.sgd(0.05)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  _, _, _, got = L.run(jaxcomm.muloco(inner, period), steps)
  _, _, _, want = L.run(jaxcomm.diloco(inner, outer, period,
                                       compressor=_two_bit()), steps)
  for (p, _, _), (q, _, _) in zip(got, want):
    for k in p:
      np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(q[k]))


def test_muloco_bad_bits_are_named():
  with pytest.raises(ValueError, match="bits"):
    jaxcomm.muloco(optax.sgd(0.1), 2, bits=3)
  with pytest.raises(ValueError, match="bits"):
    jaxcomm.muloco(optax.sgd(0.1), 2, bits=True)


@pytest.mark.parametrize("period", [1, 2])
def test_diloco_keeps_the_imaginary_part_of_a_complex_pseudo_gradient(
    period):
  """Outer and inner SGD at rate 1 on p = 1+2j with a constant gradient
  g = 1+1j, one worker: after each sync the params are
  p - (steps taken) g, plain SGD's closed form. The pseudo-gradient was
  formed in float32 and lost its imaginary part (2j where SGD gives 1j)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  tx = jaxcomm.diloco(optax.sgd(1.0), optax.sgd(1.0), period,
                      axis_name=None)
  p0 = np.complex64(1 + 2j)
  g = {"z": jnp.full((3,), 1 + 1j, jnp.complex64)}
  p = {"z": jnp.full((3,), p0, jnp.complex64)}
  s = tx.init(p)
  for t in range(1, 2 * period + 1):
    u, s = tx.update(g, s, p)
    p = jaxcomm.apply_updates(p, u, s)
    assert p["z"].dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(p["z"]),
                               np.full(3, p0 - t * (1 + 1j)), atol=1e-6)
