"""jaxcomm.parallel: layout, DataParallel, pmap, hand-written shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel
from tests import harness

RNG = np.random.RandomState(0)
W_TRUE = RNG.randn(16, 4).astype(np.float32)


def _params():
  return {"w": np.zeros((16, 4), np.float32), "b": np.zeros((4,), np.float32)}


def _loss(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _batch(step, size=32):
  r = np.random.RandomState(100 + step)
  x = r.randn(size, 16).astype(np.float32)
  return x, x @ W_TRUE


def _reference(steps, lr=0.1, momentum=0.9):
  """Single-device full-batch SGD: the mean of equal local losses' grads."""
  params = jax.tree.map(jnp.asarray, _params())
  tx = optax.sgd(lr, momentum=momentum)
  state = tx.init(params)
  for t in range(steps):
    g = jax.grad(_loss)(params, _batch(t))
    u, state = tx.update(g, state)
    params = optax.apply_updates(params, u)
  return params


def test_dense_data_parallel_equals_single_device(mesh):
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1, momentum=0.9))
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  losses = []
  for t in range(4):
    params, state, m = dp.step(params, state, _batch(t))
    losses.append(float(m["loss"]))
  ref = _reference(4)
  for k in ref:
    np.testing.assert_allclose(params[k], ref[k], rtol=1e-5, atol=1e-6)
  assert losses[-1] < losses[0]
  # Downstream momentum sees only replicated updates: stays replicated.
  assert not any(jax.tree.leaves(dp.layout))


def test_train_step_moves_only_what_the_transform_sends(mesh):
  """No hidden dense psum from differentiating through replicated params."""
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  rep = jaxcomm.wire.report(dp.lower(params, state, dp.shard_batch(_batch(0))))
  # The fused gradient psum (16*4 + 4 + 1 flag floats) and the loss pmean.
  assert rep.payload == {"all-reduce": 4 * (64 + 4 + 1) + 4}


def test_pmap_step_matches_shard_map_step(mesh):
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1, momentum=0.9))
  step = parallel.pmap_train_step(_loss, tx)
  n = jax.local_device_count()
  params = parallel.pmap_replicate(jax.tree.map(jnp.asarray, _params()))
  state = parallel.pmap_replicate(tx.init(_params()))
  for t in range(4):
    x, y = _batch(t)
    params, state, _ = step(params, state, (x.reshape(n, -1, 16),
                                            y.reshape(n, -1, 4)))
  ref = _reference(4)
  for k in ref:
    np.testing.assert_allclose(params[k][0], ref[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(params[k][0], params[k][n - 1])


def test_layout_marks_residuals_per_device(mesh):
  tx = optax.chain(jaxcomm.cast(jnp.bfloat16, error_feedback=True,
                                policy=jaxcomm.LeafPolicy(min_size=16)),
                   optax.adam(1e-3))
  layout = parallel.state_layout(tx, _params(), mesh)
  comp = layout[0]
  assert comp.residual == (True,)            # only "w" (64 elements)
  assert comp.count is False and comp.key is False
  assert comp.stats.residual_norm is True
  # Adam's moments see the replicated update: replicated.
  assert not any(jax.tree.leaves(layout[1]))
  state = parallel.init_state(tx, _params(), mesh, layout=layout)
  assert state[0].residual[0].shape == (8, 64)   # one flat bucket
  assert state[0].residual[0].sharding.spec == P("data")


def test_hand_written_shard_map_recipe(mesh):
  """The README recipe: specs from state_layout, to_local/to_global."""
  tx = optax.chain(jaxcomm.cast(jnp.bfloat16, error_feedback=True,
                                policy=jaxcomm.LeafPolicy(min_size=16)),
                   optax.sgd(0.1))
  params = _params()
  layout = parallel.state_layout(tx, params, mesh)
  specs = parallel.state_specs(layout)
  opt_state = parallel.init_state(tx, params, mesh, layout=layout)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")),
                 out_specs=(P(), specs, P()))
  def train_step(params, opt_state, batch):
    local = parallel.to_local(opt_state, layout)
    loss, grads = jax.value_and_grad(_loss)(
      jaxcomm.collectives.pvary(params, "data"), batch)
    updates, local = tx.update(grads, local, params)
    return (optax.apply_updates(params, updates),
            parallel.to_global(local, layout),
            jax.lax.pmean(loss, "data"))

  params = parallel.replicate(params, mesh)
  first = None
  for t in range(5):
    params, opt_state, loss = train_step(
      params, opt_state, parallel.shard_batch(_batch(t), mesh))
    first = float(loss) if first is None else first
  assert float(loss) < first
  # The recipe is the managed step: DataParallel on the same batches ends
  # with the same params and the same per-device residuals.
  dp = parallel.DataParallel(_loss, tx, mesh, donate=False)
  want, state = dp.init(_params())
  for t in range(5):
    want, state, _ = dp.step(want, state, _batch(t))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
    np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7), params, want)
  np.testing.assert_allclose(np.asarray(opt_state[0].residual[0]),
                             np.asarray(state[0].residual[0]), rtol=1e-6,
                             atol=1e-7)


def test_two_axis_mesh_compresses_over_data_only():
  mesh = parallel.make_mesh(4, model=2)
  assert dict(mesh.shape) == {"data": 4, "model": 2}
  tx = optax.chain(jaxcomm.cast(jnp.bfloat16, error_feedback=True,
                                policy=jaxcomm.LeafPolicy(min_size=16)),
                   optax.sgd(0.1))
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  assert state[0].residual[0].shape == (4, 64)
  for t in range(3):
    params, state, m = dp.step(params, state, _batch(t))
  assert np.isfinite(float(m["loss"]))


def test_explicit_axis_mesh_is_accepted():
  mesh = jax.make_mesh((8,), ("data",))   # Explicit axis types by default
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1, momentum=0.9))
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  for t in range(4):
    params, state, _ = dp.step(params, state, _batch(t))
  ref = _reference(4)
  np.testing.assert_allclose(params["w"], ref["w"], rtol=1e-5, atol=1e-6)


def test_resize_state_keeps_what_residuals_owe_the_averaged_update(mesh):
  """Residuals are averaged over merged devices and copied to split ones:
  their device mean (what they add to the averaged update) is kept."""
  tx = optax.chain(jaxcomm.cast(jnp.bfloat16, error_feedback=True,
                                policy=jaxcomm.LeafPolicy(min_size=16)),
                   optax.sgd(0.1))
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  for t in range(2):
    params, state, _ = dp.step(params, state, _batch(t))
  host = jax.device_get(state)
  owed = host[0].residual[0].mean(axis=0)
  assert np.abs(owed).max() > 0
  four = parallel.resize_state(host, dp.layout, 4)
  assert four[0].residual[0].shape == (4, 64)
  np.testing.assert_allclose(four[0].residual[0].mean(axis=0), owed,
                             rtol=1e-6, atol=1e-7)
  # Devices 2k and 2k+1 became device k: their mean.
  np.testing.assert_allclose(
    four[0].residual[0],
    host[0].residual[0].reshape(4, 2, 64).mean(axis=1), rtol=1e-6)
  back = parallel.resize_state(four, dp.layout, 8)
  np.testing.assert_allclose(back[0].residual[0].mean(axis=0), owed,
                             rtol=1e-6, atol=1e-7)
  assert back[0].count == host[0].count
  with pytest.raises(ValueError, match="divide"):
    parallel.resize_state(host, dp.layout, 3)
  for bad in (0, -4, 2.0, True):
    with pytest.raises(ValueError, match="num_devices must be"):
      parallel.resize_state(host, dp.layout, bad)


def test_init_state_traces_and_restore_needs_a_target(mesh, tmp_path):
  """init_state runs under jax.eval_shape (an abstract restore target); a
  state restored without one (dicts and lists) is named by resize_state
  instead of failing on a tuple index."""
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = optax.chain(jaxcomm.topk(0.25, policy=jaxcomm.LeafPolicy(min_size=16)),
                   optax.sgd(0.1, momentum=0.9))
  dp = parallel.DataParallel(_loss, tx, mesh, donate=False)
  params, state = dp.init(_params())
  for t in range(2):
    params, state, _ = dp.step(params, state, _batch(t))
  abstract = jax.eval_shape(lambda: parallel.init_state(tx, _params(), mesh))
  also = jax.eval_shape(lambda p: parallel.init_state(tx, p, mesh), _params())
  for tree in (abstract, also):
    assert jax.tree.structure(tree) == jax.tree.structure(state)
    for a, x in zip(jax.tree.leaves(tree), jax.tree.leaves(state)):
      assert (a.shape, a.dtype) == (x.shape, x.dtype)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "s", state)
  ckpt.wait_until_finished()
  host = jax.device_get(state)
  untargeted = ckpt.restore(tmp_path / "s")
  with pytest.raises(ValueError, match="restored from a checkpoint without a "
                     "target.*target=jax.eval_shape"):
    parallel.resize_state(jax.device_get(untargeted), dp.layout, 4)
  restored = jax.device_get(ckpt.restore(tmp_path / "s", target=abstract))
  jax.tree.map(np.testing.assert_array_equal, restored, host)
  four = parallel.resize_state(restored, dp.layout, 4)
  np.testing.assert_allclose(four[0].residual[0].mean(axis=0),
                             host[0].residual[0].mean(axis=0), rtol=1e-6,
                             atol=1e-7)
  # Any other mismatch of trees is named too.
  with pytest.raises(ValueError, match="layout's tree structure"):
    parallel.resize_state(host[0], dp.layout, 4)


def _drained(tx, state, n, steps=12):
  """The summed updates ``tx`` delivers from ``state`` on ``n`` devices
  when every gradient is 0 afterwards (what the state still owes)."""
  sub = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                      axis_types=(jax.sharding.AxisType.Auto,))
  zeros = {"w": np.zeros((n, 64), np.float32)}
  updates, _, _ = harness.device_run(tx, sub, [zeros] * steps,
                                     params={"w": jnp.zeros(64)}, state=state)
  return sum(np.asarray(u["w"], np.float64) for u in updates)


@pytest.mark.parametrize("new", [4, 2])
def test_resized_residuals_deliver_what_they_owed(mesh, new):
  """One step of top-k(0.25) on 8 devices, every device with the same
  gradient; then zero gradients. Drained on 8 devices, on ``new`` devices
  after a resize, and on a ``new``-device run that took the same step: all
  three deliver the same total update (a resize that summed residuals
  delivered 8/new times as much)."""
  tx = jaxcomm.topk(0.25, policy=jaxcomm.LeafPolicy(min_size=16))
  params = {"w": jnp.zeros(64)}
  g = np.random.default_rng(0).normal(size=64).astype(np.float32)
  updates, state, layout = harness.device_run(
    tx, mesh, [{"w": np.tile(g, (8, 1))}], params=params)
  # The step sent the top 16 of 64 (numpy); the rest is owed.
  owed = g.astype(np.float64)
  owed[np.argsort(-np.abs(g))[:16]] = 0.0
  np.testing.assert_allclose(np.asarray(updates[0]["w"]), g - owed,
                             rtol=1e-6, atol=1e-6)
  stay = _drained(tx, state, 8)
  moved = _drained(tx, parallel.resize_state(state, layout, new), new)
  np.testing.assert_allclose(stay, owed, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(moved, owed, rtol=1e-5, atol=1e-6)
  sub = jax.make_mesh((new,), ("data",), devices=jax.devices()[:new],
                      axis_types=(jax.sharding.AxisType.Auto,))
  _, small, _ = harness.device_run(tx, sub, [{"w": np.tile(g, (new, 1))}],
                                   params=params)
  # ... and the resized residuals are those of that run.
  np.testing.assert_allclose(
    np.asarray(parallel.resize_state(state, layout, new).residual[0]),
    np.asarray(small.residual[0]), rtol=1e-6, atol=1e-7)


def test_resize_state_keeps_ef21_aggregate_the_mean_of_estimates(mesh):
  """EF21's per-device estimates are not delayed mass: resizing averages
  merged devices and copies to new ones, so ``h = mean_i h_i`` still
  holds (summing them, as residuals are, would break it)."""
  tx = optax.chain(jaxcomm.topk(0.1, error_feedback="ef21",
                                policy=jaxcomm.LeafPolicy(min_size=16)),
                   optax.sgd(0.1))
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  for t in range(2):
    params, state, _ = dp.step(params, state, _batch(t))
  host = jax.device_get(state)
  agg = host[0].estimate_mean[0]
  np.testing.assert_allclose(host[0].estimate[0].mean(axis=0), agg,
                             rtol=1e-5, atol=1e-6)
  assert np.abs(agg).max() > 0
  for n in (4, 16):
    resized = parallel.resize_state(host, dp.layout, n)
    assert resized[0].estimate[0].shape == (n, 64)
    np.testing.assert_array_equal(resized[0].estimate_mean[0], agg)
    np.testing.assert_allclose(resized[0].estimate[0].mean(axis=0), agg,
                               rtol=1e-5, atol=1e-6)


def test_bad_arguments():
  with pytest.raises(ValueError, match="model"):
    parallel.make_mesh(model=0)
  with pytest.raises(ValueError, match="num_devices"):
    parallel.make_mesh(16)
  mesh = parallel.make_mesh()
  with pytest.raises(ValueError, match="axis_name='batch'"):
    parallel.DataParallel(_loss, optax.sgd(0.1), mesh, axis_name="batch")
  with pytest.raises(ValueError, match="process_id"):
    parallel.initialize("localhost:1234", 2, 5)
  with pytest.raises(ValueError, match="coordinator_address"):
    parallel.initialize("localhost:1234")
  dp = parallel.DataParallel(_loss, optax.sgd(0.1), mesh)
  with pytest.raises(ValueError, match="init"):
    dp.step(_params(), None, _batch(0))
  with pytest.raises(ValueError, match="LeafPolicy"):
    jaxcomm.cast(policy="big")
  with pytest.raises(ValueError, match="min_size"):
    jaxcomm.LeafPolicy(min_size=-1)


def test_reusing_donated_buffers_is_a_clear_error(mesh):
  # DataParallel donates params and state: stepping again from the old
  # ones is refused in Python (jaxlib would crash the process).
  tx = optax.chain(jaxcomm.topk(0.5), optax.sgd(0.1))
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  new_params, new_state, _ = dp.step(params, state, _batch(0))
  jax.block_until_ready((new_params, new_state))
  with pytest.raises(ValueError, match="donated"):
    dp.step(params, new_state, _batch(1))
  with pytest.raises(ValueError, match="state holds buffers donated"):
    dp.step(new_params, state, _batch(1))
  # The returned ones work.
  dp.step(new_params, new_state, _batch(1))


def test_integer_params_and_uneven_batches_are_named(mesh):
  tx = optax.chain(jaxcomm.topk(0.25), optax.sgd(0.1))
  dp = parallel.DataParallel(_loss, tx, mesh)
  with pytest.raises(ValueError, match=r"params leaf \['count'\] is int32"):
    dp.init(dict(_params(), count=np.zeros((), np.int32)))
  params, state = dp.init(_params())
  x, y = _batch(0, size=10)
  with pytest.raises(ValueError, match=r"batch leaf \[0\] has shape \(10, 16\)"
                     r".*multiple of 8"):
    dp.step(params, state, (x, y))
  # A batch that splits evenly still trains.
  params, state, m = dp.step(params, state, _batch(0, size=16))
  assert np.isfinite(float(m["loss"]))


def test_pmap_step_names_inputs_without_a_device_axis(mesh):
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))
  step = parallel.pmap_train_step(_loss, tx)
  n = jax.local_device_count()
  params = parallel.pmap_replicate(jax.tree.map(jnp.asarray, _params()))
  state = parallel.pmap_replicate(tx.init(_params()))
  x, y = _batch(0)
  with pytest.raises(ValueError, match=r"batch leaf \[0\] has shape \(32, 16\)"
                     rf".*leading device axis of {n}"):
    step(params, state, (x, y))
  with pytest.raises(ValueError,
                     match=r"batch leaf \[0\] has shape \(4, 8, 16\)"):
    step(params, state, (x.reshape(4, 8, 16), y.reshape(4, 8, 4)))
  with pytest.raises(ValueError, match=r"params leaf \['b'\]"):
    step(jax.tree.map(jnp.asarray, _params()), state,
         (x.reshape(n, -1, 16), y.reshape(n, -1, 4)))


def _recipe_step(tx, mesh, layout, *, pvary=True, check_vma=True):
  """The README's hand-written step; ``pvary=False`` drops its pvary line
  (gradients taken with respect to the replicated params)."""
  specs = parallel.state_specs(layout)

  def train_step(params, opt_state, batch):
    local = parallel.to_local(opt_state, layout)
    at = jaxcomm.collectives.pvary(params, "data") if pvary else params
    loss, grads = jax.value_and_grad(_loss)(at, batch)
    updates, local = tx.update(grads, local, params)
    return (optax.apply_updates(params, updates),
            parallel.to_global(local, layout), jax.lax.pmean(loss, "data"))

  return jax.jit(jax.shard_map(
    train_step, mesh=mesh, in_specs=(P(), specs, P("data")),
    out_specs=(P(), specs, P()), check_vma=check_vma))


def _run_recipe(tx, mesh, steps, **kw):
  params = _params()
  layout = parallel.state_layout(tx, params, mesh)
  state = parallel.init_state(tx, params, mesh, layout=layout)
  step = _recipe_step(tx, mesh, layout, **kw)
  params = parallel.replicate(params, mesh)
  for t in range(steps):
    params, state, _ = step(params, state,
                            parallel.shard_batch(_batch(t), mesh))
  return jax.device_get(params)


_SUMMED = r"already summed over axis 'data'.*pvary\(params, 'data'\)"


@pytest.mark.parametrize("make", [
  lambda: optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1)),
  lambda: optax.chain(jaxcomm.topk(0.25), optax.sgd(0.1)),
  lambda: optax.chain(jaxcomm.powersgd(1, policy=jaxcomm.LeafPolicy(
    min_size=16)), optax.sgd(0.1)),
  lambda: jaxcomm.onebit_adam(1e-3, freeze_step=2),
  lambda: jaxcomm.local_sgd(optax.sgd(0.1), period=2),
  lambda: jaxcomm.zero_one_adam(1e-3, var_freeze_step=2),
  lambda: jaxcomm.dpsgd(optax.sgd(0.1)),
  lambda: jaxcomm.choco(optax.sgd(0.1), jaxcomm.topk(0.25), gamma=0.5),
  lambda: jaxcomm.sgp(optax.sgd(0.1)),
], ids=["mean", "topk", "powersgd", "onebit_adam", "local_sgd",
        "zero_one_adam", "dpsgd", "choco", "sgp"])
def test_gradients_summed_by_jax_are_refused(mesh, make):
  """Without the recipe's pvary line JAX psums the gradients of the
  replicated params (n times the mean, a hidden dense all-reduce): the
  transform refuses them, naming the axis and the fix."""
  tx = make()
  params = jax.tree.map(jnp.asarray, _params())
  state = tx.init(params)

  def step(params, batch):
    grads = jax.grad(_loss)(params, batch)     # no pvary: psummed by JAX
    return tx.update(grads, state, params)[0]

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                     out_specs=P())
  with pytest.raises(ValueError, match=_SUMMED) as err:
    jax.eval_shape(fn, params, _batch(0))
  assert "['w']" in str(err.value) and "8 times the mean" in str(err.value)


def test_summed_gradient_raises_but_recipe_and_untyped_steps_train(mesh):
  """The README recipe with its pvary line, DataParallel (tested above)
  and a check_vma=False step (no typing, so no implicit psum: each device
  differentiates its own loss) all equal single-device SGD; the recipe
  without the pvary line is refused at trace time."""
  make = lambda: optax.chain(jaxcomm.mean_gradients(),
                             optax.sgd(0.1, momentum=0.9))
  ref = _reference(3)
  for kw in ({}, {"pvary": False, "check_vma": False}):
    got = _run_recipe(make(), mesh, 3, **kw)
    for k in ref:
      np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{kw}: {k}")
  with pytest.raises(ValueError, match=_SUMMED):
    _run_recipe(make(), mesh, 1, pvary=False)


def test_one_invariant_leaf_is_named_and_can_be_marked(mesh):
  """A leaf averaged over the axis before the compressor is refused by
  name; marked varying with collectives.pvary it is averaged again
  (equal values: unchanged) and the update is the mean gradient."""
  tx = jaxcomm.mean_gradients()
  params = jax.tree.map(jnp.asarray, _params())
  state = tx.init(params)

  def step(params, batch, mark):
    grads = jax.grad(_loss)(jaxcomm.collectives.pvary(params, "data"), batch)
    grads["b"] = jax.lax.pmean(grads["b"], "data")
    if mark:
      grads["b"] = jaxcomm.collectives.pvary(grads["b"], "data")
    return tx.update(grads, state, params)[0]

  fn = lambda mark: jax.jit(jax.shard_map(
    lambda p, b: step(p, b, mark), mesh=mesh, in_specs=(P(), P("data")),
    out_specs=P()))
  with pytest.raises(ValueError, match=r"summed over axis 'data': \['b'\] "
                     r"typed invariant"):
    fn(False)(params, _batch(0))
  got = fn(True)(params, _batch(0))
  want = jax.grad(_loss)(params, _batch(0))   # full batch on one device
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_multisteps_and_apply_if_finite_in_data_parallel(mesh):
  """optax.MultiSteps around the whole chain trains in DataParallel: four
  steps with k=2 equal two single-device SGD steps on the mean gradient of
  two batches each. optax.apply_if_finite around the whole chain (a
  per-device decision) is refused by name at init."""
  k, lr = 2, 0.1
  tx = optax.MultiSteps(optax.chain(jaxcomm.topk(1.0), optax.sgd(lr)),
                        every_k_schedule=k)
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  for t in range(2 * k):
    params, state, _ = dp.step(params, state, _batch(t))
  ref = jax.tree.map(jnp.asarray, _params())
  for s in range(2):
    g = jax.tree.map(lambda *x: sum(x) / k,
                     *[jax.grad(_loss)(ref, _batch(s * k + j))
                       for j in range(k)])
    ref = jax.tree.map(lambda p, d: p - lr * d, ref, g)
  for key in ref:
    np.testing.assert_allclose(params[key], ref[key], rtol=1e-5, atol=1e-6)
  bad = optax.apply_if_finite(optax.chain(jaxcomm.topk(0.5), optax.sgd(lr)),
                              3)
  with pytest.raises(ValueError, match=r"updates differ between devices.*"
                     r"apply_if_finite"):
    parallel.DataParallel(_loss, bad, mesh).init(_params())


def test_cpu_step_waits_for_the_previous_step(mesh, monkeypatch):
  """On a mesh of CPU devices DataParallel keeps one step in flight: each
  step first waits for the params and state the previous one returned
  (XLA's CPU collectives abort when many queued steps make a rendezvous
  wait past their timeout). block=False dispatches freely; one device
  has no collective to wait for."""
  waited = []
  real = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready",
                      lambda x: waited.append(x) or real(x))
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))
  for block, expect in ((None, True), (False, False), (True, True)):
    dp = parallel.DataParallel(_loss, tx, mesh, block=block)
    assert dp.block is expect
    params, state = dp.init(_params())
    waited.clear()
    given = []
    for t in range(3):
      given.append((params, state))
      params, state, _ = dp.step(params, state, _batch(t))
    if expect:
      assert len(waited) == 3
      for (p, s), w in zip(given, waited):
        assert w[0] is p and w[1] is s
    else:
      assert not waited
  assert parallel.DataParallel(_loss, tx, parallel.make_mesh(1)).block is False
  with pytest.raises(ValueError, match="block must be a bool"):
    parallel.DataParallel(_loss, tx, mesh, block="yes")


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.onebit_adam(1e-2, freeze_step=1,
                              policy=jaxcomm.LeafPolicy(min_size=16)),
  lambda: jaxcomm.zero_one_adam(1e-2, var_freeze_step=1),
  lambda: jaxcomm.local_sgd(optax.sgd(0.05, momentum=0.9), period=4),
], ids=["onebit_adam", "zero_one_adam", "local_sgd_momentum"])
@pytest.mark.parametrize("new", [4, 16])
def test_resize_keeps_what_every_per_device_buffer_owes(mesh, make, new):
  """Every per-device buffer kind after 3 steps on 8 devices (worker and
  server errors, local momenta, per-device params): on ``new`` devices
  a buffer the averaged update reads keeps its device mean, a chunk-owned
  one (the server error) its total, and per-device params their mean."""
  tx = make()
  dp = parallel.DataParallel(_loss, tx, mesh)
  params, state = dp.init(_params())
  for t in range(3):
    params, state, _ = dp.step(params, state, _batch(t))
  host = jax.device_get(state)
  moved = parallel.resize_state(host, dp.layout, new)
  leaves = jax.tree.leaves(host)
  after = jax.tree.leaves(moved)
  layout = jax.tree.leaves(dp.layout)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_leaves_with_path(host)]
  seen = set()
  for path, x, y, b in zip(paths, leaves, after, layout):
    x, y = np.asarray(x), np.asarray(y)
    if not b:
      np.testing.assert_array_equal(x, y, err_msg=path)
      continue
    assert y.shape == (new,) + x.shape[1:], path
    if not np.issubdtype(x.dtype, np.floating):
      continue
    if "server_error" in path:
      want, got, kind = x.sum(axis=0), y.sum(axis=0), "total"
    else:
      want, got, kind = x.mean(axis=0), y.mean(axis=0), "mean"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                               err_msg=f"{path}: {kind}")
    if np.abs(x).max() > 0:
      seen.add(path.split(".")[-1].split("[")[0] or path)
  assert seen, "no nonzero per-device float buffer was checked"
  if dp.per_device_params:
    p = jax.device_get(params)
    q = parallel.resize_params(p, new)
    for k in p:
      np.testing.assert_allclose(np.asarray(q[k]).mean(axis=0),
                                 np.asarray(p[k]).mean(axis=0), rtol=1e-5,
                                 atol=1e-7)


def test_update_args_keyword_no_transform_reads_is_refused(mesh):
  """Optax offers ``update_args``' keywords to every transformation of the
  chain and each takes what it knows: ``grad_variance`` handed to a chain
  of top-k and SGD would be dropped unread, so the first step refuses it
  by name; with ``jaxcomm.variance_sparsification`` in the chain it is
  read; a keyword no jaxcomm method reads (another library's) is passed
  on with a warning."""
  x = np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 100
  batch = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)}

  def loss_fn(params, b):
    return jnp.mean((b["x"] @ params["w"] - b["y"]) ** 2)

  def variance(params, b):
    return {"grad_variance": jax.tree.map(jnp.ones_like, params)}

  def run(tx, update_args):
    dp = parallel.DataParallel(loss_fn, tx, mesh, update_args=update_args,
                               donate=False)
    params, state = dp.init({"w": jnp.zeros(4)})
    return dp.step(params, state, batch)[0]["w"]

  policy = jaxcomm.LeafPolicy(min_size=1)
  topk = optax.chain(jaxcomm.topk(0.5, policy=policy), optax.sgd(0.1))
  with pytest.raises(ValueError, match="'grad_variance'.*"
                     "jaxcomm.variance_sparsification"):
    run(topk, variance)
  vs = optax.chain(jaxcomm.variance_sparsification(policy=policy),
                   optax.sgd(0.1))
  assert np.all(np.isfinite(np.asarray(run(vs, variance))))
  with pytest.warns(UserWarning, match="'learning_rate_scale'"):
    run(topk, lambda p, b: {"learning_rate_scale": jnp.float32(1.0)})
