"""Variance-based sparsification (Tsuzuku, Imachi, Akiba 2018) against a
numpy replay of the paper on 8 devices, fed known per-example gradients
through ``grad_variance``: which elements are sent (``alpha v < r^2``,
codes in range, the capacity's cut), the powers of two they are sent as,
the residual ``r`` and the state ``v``; mass conservation of the residual;
the statistic without ``grad_variance`` (each step's gradient squared);
``grad_and_variance``; the message's bytes in the compiled step with the
statistic handed in; bad arguments refused by name."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel
from jaxcomm.transforms.sparsify import _variance
from tests import harness
from tests.entries_sparsification import variance_bucket_ref
from tests.entries_sparsification import variance_capacity_ref
from tests.entries_sparsification import variance_run_ref

N = harness.N
COMP = harness.COMPRESSED          # ("conv", "w"): one bucket, conv first
EXAMPLES = 4                       # per device


def _params():
  return {k: v for k, v in harness.battery_params().items() if k != "step"}


def _examples(seed, steps, n=N):
  """Per step, per-example gradients ``[n, EXAMPLES, *shape]`` (float32):
  a direction shared by every example plus noise whose scale varies by
  element, so that some elements are unambiguous and others are not."""
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(steps):
    step = {}
    for k, p in _params().items():
      shape = p.shape
      mean = rng.randn(*shape)
      noise = np.exp(rng.uniform(-3.0, 2.0, size=shape))
      step[k] = (mean + noise * rng.randn(n, EXAMPLES, *shape)).astype(
        np.float32)
    out.append(step)
  return out


def _moments(examples):
  """``(grads, grad_variance)`` per step: each device's mean gradient and
  the paper's ``(1 / B^2) sum_z g_z^2``, in float32 as handed over."""
  grads, variances = [], []
  for step in examples:
    grads.append({k: e.mean(axis=1, dtype=np.float32) for k, e in
                  step.items()})
    variances.append({k: (np.square(e).sum(axis=1, dtype=np.float32)
                          / np.float32(EXAMPLES * EXAMPLES))
                      for k, e in step.items()})
  return grads, variances


@functools.lru_cache(maxsize=None)
def _stepper(tx, mesh, handed):
  """tx.update on each device's gradients (and statistic), in shard_map."""
  params = _params()
  layout = parallel.state_layout(tx, params, mesh, "data")
  specs = parallel.state_specs(layout, "data")

  def step(params, state, grads, var):
    grads = jax.tree.map(lambda g: g[0], grads)
    local = parallel.to_local(state, layout)
    if handed:
      var = jax.tree.map(lambda v: v[0], var)
      upd, new = tx.update(grads, local, params, grad_variance=var)
    else:
      upd, new = tx.update(grads, local, params)
    return upd, parallel.to_global(new, layout)

  fn = jax.jit(jax.shard_map(step, mesh=mesh,
                             in_specs=(P(), specs, P("data"), P("data")),
                             out_specs=(P(), specs)))
  return fn, layout


def _run(tx, mesh, grads_seq, var_seq=None):
  handed = var_seq is not None
  fn, layout = _stepper(tx, mesh, handed)
  params = _params()
  state = parallel.init_state(tx, params, mesh, "data", layout)
  rep = parallel.replicate(params, mesh)
  updates, states = [], []
  for t, grads in enumerate(grads_seq):
    g = parallel.shard_batch(grads, mesh, "data")
    v = parallel.shard_batch(var_seq[t] if handed else grads, mesh, "data")
    upd, state = fn(rep, state, g, v)
    jax.block_until_ready((upd, state))
    updates.append(jax.device_get(upd))
    states.append(jax.device_get(state))
  return updates, states


def _codec_state(state):
  return jaxcomm.compress_states(state)[0].codec[0]


def _split(buf):
  """A bucket buffer ``[n, size]`` -> per compressed leaf ``[n, *shape]``."""
  shapes = [tuple(_params()[k].shape) for k in COMP]
  return harness.split_buckets([np.asarray(buf)], shapes)


# Capacity 70% of the bucket: with these gradients the first step's
# candidates exceed it on every device, the later steps' do not.
KW = dict(alpha=1.0, residual_decay=0.5, capacity_ratio=0.7,
          exponent_bits=3)


def test_criterion_values_and_residual_match_numpy_on_8_devices(mesh):
  """Three steps with known per-example gradients handed in: each step's
  update, the residual ``r``, the state ``v`` and the count meeting the
  criterion equal the numpy replay (``zeta = 0.5``: exact in float32);
  what each device sent (``x - r'``) is exactly the replay's powers of
  two, each within ``2^exponent_bits - 1`` octaves of its leaf's largest;
  the capacity binds at some steps and not at others."""
  steps = 3
  grads, variances = _moments(_examples(0, steps))
  tx = jaxcomm.variance_sparsification(**KW)
  updates, states = _run(tx, mesh, grads, variances)
  run = variance_run_ref(KW["alpha"], KW["residual_decay"],
                         KW["capacity_ratio"], KW["exponent_bits"],
                         comp=COMP, dense=("b",))
  ref_up, _, ref_sent = run(grads, N, variances)
  size = sum(int(np.prod(_params()[k].shape)) for k in COMP)
  cap = variance_capacity_ref(size, KW["capacity_ratio"])
  bound, free = False, False
  res_prev = [np.zeros((N,) + tuple(_params()[k].shape), np.float32)
              for k in COMP]
  for t in range(steps):
    for k in ref_up[t]:
      np.testing.assert_allclose(updates[t][k], ref_up[t][k], rtol=1e-5,
                                 atol=1e-7, err_msg=f"update {k}, step {t}")
    res = harness.residuals_of(states[t], _params())
    for j, k in enumerate(COMP):
      # x = zeta e + g, formed in float32 as compressed() forms it.
      x = (np.float32(0.5) * res_prev[j] + grads[t][k]).astype(np.float32)
      sent = x - res[j]
      want = np.stack([ref_sent[t][i][j] for i in range(N)])
      np.testing.assert_array_equal(sent, want,
                                    err_msg=f"sent {k}, step {t}")
      nz = sent[sent != 0]
      assert np.all(np.log2(np.abs(nz)) == np.round(np.log2(np.abs(nz))))
      for i in range(N):
        mine = np.abs(sent[i][sent[i] != 0])
        if mine.size:
          assert mine.min() >= mine.max() / 2 ** 7, (k, t, i)
    res_prev = res
    codec = _codec_state(states[t])
    counts = np.asarray(codec.selected)
    sent_counts = np.asarray(codec.sent)
    assert np.all(sent_counts == np.minimum(counts, cap))
    bound |= bool(np.any(counts > cap))
    free |= bool(np.any((counts > 0) & (counts <= cap)))
  assert bound and free, "the capacity's cut or its absence is untested"
  # v: the replay's, 0 exactly where the last step sent.
  got_v = _split(_codec_state(states[-1]).variance)
  for j in range(len(COMP)):
    want = np.stack([run.last["variance"][i][j] for i in range(N)])
    np.testing.assert_allclose(got_v[j], want, rtol=1e-6, atol=0,
                               err_msg=f"v of {COMP[j]}")
    sent_last = np.stack([ref_sent[-1][i][j] for i in range(N)])
    assert np.all(got_v[j][sent_last != 0] == 0)
  np.testing.assert_array_equal(
    np.asarray(_codec_state(states[-1]).selected),
    np.asarray(run.last["selected"][-1]))


def test_capacity_cut_largest_powers_of_two_then_lower_positions():
  """More candidates than slots: the largest powers of two travel, and at
  the last exponent that fits, the lower positions; the rest waits with
  its ``v`` (one device, hand-made values)."""
  size = 300
  x = np.full(size, 0.3, np.float32)       # rounds to 2^-2
  x[[5, 17, 250]] = [3.0, -5.0, 2.5]       # 2^2, -2^2, 2^1
  x[[40, 41, 280]] = 0.001                 # 2^-10: no code (8 octaves)
  params = {"w": jnp.zeros((size,), jnp.float32)}
  tx = jaxcomm.variance_sparsification(
    0.5, capacity_ratio=0.02, exponent_bits=3, residual_decay=1.0,
    axis_name=None)
  upd, state = tx.update({"w": jnp.asarray(x)}, tx.init(params), params)
  cap = variance_capacity_ref(size, 0.02)             # 6 slots
  assert cap == 6
  sent = np.asarray(upd["w"])
  kept = np.flatnonzero(sent)
  # 3 with larger exponents, then the 3 lowest positions of the 2^-2's.
  np.testing.assert_array_equal(kept, [0, 1, 2, 5, 17, 250])
  np.testing.assert_array_equal(sent[[5, 17, 250]], [4.0, -4.0, 2.0])
  np.testing.assert_array_equal(sent[[0, 1, 2]], 0.25)
  codec = jaxcomm.compress_states(state)[0].codec[0]
  assert int(codec.selected) == size - 3 and int(codec.sent) == cap
  v = np.asarray(codec.variance)
  assert np.all(v[kept] == 0) and np.all(v[np.setdiff1d(np.arange(size),
                                                        kept)] > 0)
  # The numpy replay agrees.
  ref, _, count = variance_bucket_ref([x], [np.zeros(size)],
                                      [np.square(x)], 0.5, 1.0, 0.02, 3)
  np.testing.assert_array_equal(sent, ref[0])
  assert count == size - 3


def test_residual_conserves_mass_on_8_devices(mesh):
  """With ``zeta = 1`` nothing is lost, only delayed: ``n sum_t mean_t +
  sum_i r_i = sum_t sum_i g_i`` per element."""
  steps = 6
  grads, variances = _moments(_examples(1, steps))
  tx = jaxcomm.variance_sparsification(1.0, residual_decay=1.0,
                                       capacity_ratio=0.05)
  updates, states = _run(tx, mesh, grads, variances)
  res = harness.residuals_of(states[-1], _params())
  for j, k in enumerate(COMP):
    total = sum(np.asarray(g[k], np.float64).sum(axis=0) for g in grads)
    applied = N * sum(np.asarray(u[k], np.float64) for u in updates)
    held = res[j].astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(applied + held, total,
                               atol=1e-5 * np.abs(total).max(), err_msg=k)
    assert np.abs(held).max() > 0.1      # something is delayed


def test_without_grad_variance_the_statistic_is_the_gradient_squared(mesh):
  """No extra argument (DataParallel's step): ``s = g^2``, the same steps
  as handing ``grad_variance = g^2``; and the battery's numpy replay."""
  grads = harness.make_grads(seed=4, steps=3, params=_params())
  squares = [{k: np.square(np.asarray(g[k], np.float32)) for k in g}
             for g in grads]
  tx = jaxcomm.variance_sparsification(0.5, capacity_ratio=0.1,
                                       residual_decay=0.5)
  plain, s1 = _run(tx, mesh, grads)
  handed, s2 = _run(tx, mesh, grads, squares)
  for t in range(len(grads)):
    for k in plain[t]:
      np.testing.assert_array_equal(plain[t][k], handed[t][k])
    for a, b in zip(jax.tree.leaves(s1[t]), jax.tree.leaves(s2[t])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  run = variance_run_ref(0.5, 0.5, 0.1, 3, comp=COMP, dense=("b",))
  ref, _, _ = run(grads, N)
  for t in range(len(grads)):
    for k in ref[t]:
      np.testing.assert_allclose(plain[t][k], ref[t][k], rtol=1e-5,
                                 atol=1e-7, err_msg=f"{k}, step {t}")


def test_handed_statistic_moves_the_claimed_bytes(mesh):
  """The compiled step with ``grad_variance`` handed in moves what the
  compressor claims: one all-gather of ``4 n (c + leaves)`` bytes."""
  tx = jaxcomm.variance_sparsification(capacity_ratio=0.05)
  fn, layout = _stepper(tx, mesh, True)
  params = _params()
  state = parallel.init_state(tx, params, mesh, "data", layout)
  grads, variances = _moments(_examples(2, 1))
  lowered = fn.lower(parallel.replicate(params, mesh), state,
                     parallel.shard_batch(grads[0], mesh, "data"),
                     parallel.shard_batch(variances[0], mesh, "data"))
  hlo = jaxcomm.wire.report(lowered, params=params)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, N), n=N,
                                 params=params)
  assert hlo.payload == claim.payload
  size = sum(int(np.prod(params[k].shape)) for k in COMP)
  words = variance_capacity_ref(size, 0.05) + len(COMP)
  assert ("all-gather", 4 * N * words) in jaxcomm.wire.claimed(tx, params, N)


def _linear_loss(w, batch):
  return 0.5 * jnp.mean(jnp.square(batch["x"] @ w - batch["y"]))


def test_grad_and_variance_per_example_and_per_micro_batch():
  """``grad_and_variance``: the batch gradient and ``(1 / M^2) sum_m
  g_m^2`` over per-example (``micro_batches=None``) or per-micro-batch
  gradients, against numpy's on a linear least-squares loss."""
  rng = np.random.RandomState(3)
  b, d = 8, 5
  x = rng.randn(b, d).astype(np.float32)
  y = rng.randn(b).astype(np.float32)
  w = rng.randn(d).astype(np.float32)
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
  per_example = (x @ w - y)[:, None] * x                 # [b, d]
  for m in (None, 2):
    fn = jaxcomm.variance_sparsification.grad_and_variance(
      _linear_loss, micro_batches=m)
    loss, g, var = fn(jnp.asarray(w), batch)
    mm = b if m is None else m
    parts = per_example.reshape(mm, b // mm, d).mean(axis=1)
    np.testing.assert_allclose(g, per_example.mean(axis=0), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(var, np.square(parts).sum(axis=0) / mm ** 2,
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
      loss, 0.5 * np.mean(np.square(x @ w - y)), rtol=1e-5)
  with pytest.raises(ValueError, match="micro_batches"):
    jaxcomm.variance_sparsification.grad_and_variance(_linear_loss,
                                                      micro_batches=0)
  with pytest.raises(ValueError, match="micro_batches=3"):
    jaxcomm.variance_sparsification.grad_and_variance(
      _linear_loss, micro_batches=3)(jnp.asarray(w), batch)


def test_statistic_that_overflows_skips_the_step(mesh):
  """A gradient whose square overflows float32 (``|g| > 1.8e19``): the
  step is skipped on every device and counted, ``r`` and ``v`` kept."""
  params = _params()
  tx = optax.chain(jaxcomm.variance_sparsification(0.5),
                   optax.apply_if_finite(optax.sgd(1.0), 5))
  grads = harness.make_grads(seed=5, steps=2, params=params)
  big = jax.tree.map(np.array, grads[1])
  big["w"][2, 3, 4] = 1e20
  _, s1, _ = harness.device_run(tx, mesh, grads[:1], params=params)
  upd, s2, _ = harness.device_run(tx, mesh, [big], state=s1, params=params)
  assert int(np.asarray(jaxcomm.stats(s2)[0].nonfinite_steps).max()) == 1
  for k in params:
    assert np.all(upd[0][k] == 0)
  for a, b in zip(harness.residuals_of(s1, params),
                  harness.residuals_of(s2, params)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(
    np.asarray(jaxcomm.compress_states(s1)[0].codec[0].variance),
    np.asarray(jaxcomm.compress_states(s2)[0].codec[0].variance))


@pytest.mark.parametrize("kwargs, name", [
  ({"alpha": -1.0}, "alpha"),
  ({"alpha": float("nan")}, "alpha"),
  ({"alpha": float("inf")}, "alpha"),
  ({"alpha": "1"}, "alpha"),
  ({"capacity_ratio": 0.0}, "capacity_ratio"),
  ({"capacity_ratio": 1.5}, "capacity_ratio"),
  ({"exponent_bits": 0}, "exponent_bits"),
  ({"exponent_bits": 9}, "exponent_bits"),
  ({"exponent_bits": 2.5}, "exponent_bits"),
  ({"exponent_bits": True}, "exponent_bits"),
  ({"residual_decay": 1.5}, "residual_decay"),
  ({"residual_decay": -0.1}, "residual_decay"),
  ({"error_feedback": False}, "error_feedback"),
  ({"error_feedback": "ef21"}, "error_feedback"),
  ({"clip_norm": -1.0}, "clip_norm"),
  ({"bucket_cap": 3}, "bucket_cap"),
])
def test_bad_arguments_are_refused_by_name(kwargs, name):
  with pytest.raises(ValueError, match=name):
    jaxcomm.variance_sparsification(**kwargs)


def test_bad_statistic_and_oversized_buckets_are_refused_by_name():
  params = _params()
  tx = jaxcomm.variance_sparsification(axis_name=None)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  with pytest.raises(ValueError, match="grad_variance must have the "
                     "gradients' tree structure"):
    tx.update(grads, state, params, grad_variance={"w": grads["w"]})
  wrong = dict(grads, w=jnp.ones((48, 64)))
  with pytest.raises(ValueError, match=r"grad_variance leaf has shape "
                     r"\(48, 64\) where its gradient has \(64, 48\)"):
    tx.update(grads, state, params, grad_variance=wrong)
  # 8 exponent bits leave 23 position bits: a bucket of 2^23 elements is
  # refused at init, naming the fix (nothing is allocated: eval_shape).
  big = {"w": jax.ShapeDtypeStruct((1 << 23,), jnp.float32)}
  with pytest.raises(ValueError, match="exponent_bits=8.*bucket_bytes"):
    jax.eval_shape(jaxcomm.variance_sparsification(
      exponent_bits=8, axis_name=None).init, big)
  assert _variance.max_bucket(8) == (1 << 23) - 2


def test_data_parallel_hands_each_devices_batch_statistic(mesh):
  """``DataParallel(update_args=...)``: each device's per-example
  statistic reaches ``tx.update`` (``grad_variance``), and the step equals
  the codec handed numpy's per-device ``(1 / B^2) sum_z g_z^2`` by hand;
  without it the step differs (the ``g^2`` fallback)."""
  rng = np.random.RandomState(5)
  d, b = 256, 4
  w = rng.randn(d).astype(np.float32) * 0.1
  x = rng.randn(N * b, d).astype(np.float32)
  y = rng.randn(N * b).astype(np.float32)

  def loss_fn(p, batch):
    return _linear_loss(p["w"], batch)

  stat = jaxcomm.variance_sparsification.grad_and_variance(loss_fn)
  kw = dict(alpha=1.0, capacity_ratio=0.5, axis_name="data")
  tx = optax.chain(jaxcomm.variance_sparsification(**kw), optax.sgd(1.0))
  batch = parallel.shard_batch({"x": x, "y": y}, mesh, "data")

  def one_step(update_args):
    dp = parallel.DataParallel(loss_fn, tx, mesh, update_args=update_args,
                               donate=False)
    p, s = dp.init({"w": jnp.asarray(w)})
    p, _, _ = dp.step(p, s, batch)
    return np.asarray(jax.device_get(p["w"]))

  got = one_step(lambda p, bt: {"grad_variance": stat(p, bt)[2]})
  fallback = one_step(None)
  # By hand: per device, per-example gradients in numpy.
  r = (x @ w - y)[:, None] * x                      # [N b, d]
  per = r.reshape(N, b, d)
  grads = per.mean(axis=1)
  var = np.square(per).sum(axis=1) / np.float32(b * b)
  params = {"w": jnp.asarray(w)}
  layout = parallel.state_layout(tx, params, mesh, "data")
  specs = parallel.state_specs(layout, "data")

  def step(params, state, g, v):
    local = parallel.to_local(state, layout)
    upd, _ = tx.update({"w": g[0]}, local, params,
                       grad_variance={"w": v[0]})
    return upd

  fn = jax.jit(jax.shard_map(step, mesh=mesh,
                             in_specs=(P(), specs, P("data"), P("data")),
                             out_specs=P()))
  state = parallel.init_state(tx, params, mesh, "data", layout)
  upd = fn(parallel.replicate(params, mesh), state,
           parallel.shard_batch(grads, mesh, "data"),
           parallel.shard_batch(var, mesh, "data"))
  want = w + np.asarray(jax.device_get(upd["w"]))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(got - fallback).max() > 1e-4
  with pytest.raises(ValueError, match="update_args"):
    parallel.DataParallel(loss_fn, tx, mesh, update_args=3)
