"""Flax NNX and Linen: the README's recipes, stats on NNX optimizer
states, DataParallel's model_state and rng, and the NNX messages."""

import pathlib
import re
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel
from models.mlp import MLP

N = 8
RNG = np.random.RandomState(0)
W_TRUE = RNG.randn(16, 4).astype(np.float32)


def _batch(step, size=64):
  r = np.random.RandomState(100 + step)
  x = r.randn(size, 16).astype(np.float32)
  return x, np.tanh(x @ W_TRUE)


def _mse(out, y):
  return jnp.mean((out - y) ** 2)


def _topk_residual(g, ratio):
  """numpy top-k's unsent part: g without its ceil(ratio L) largest |g|."""
  flat = np.asarray(g, np.float64).ravel()
  k = max(1, int(np.ceil(ratio * flat.size)))
  out = flat.copy()
  out[np.argsort(-np.abs(flat), kind="stable")[:k]] = 0
  return out


# ------------------------------------------------- the NNX recipe (README) --

def _nnx_recipe(tx, mesh, steps):
  """The README's NNX recipe, verbatim apart from the loop's bookkeeping."""
  model = MLP(16, (32,), 4, rngs=nnx.Rngs(0))
  # --- README: Flax NNX ---
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

  layout = parallel.state_layout(tx, params, mesh)
  specs = parallel.state_specs(layout)
  opt_state = parallel.init_state(tx, params, mesh, layout=layout)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")),
                 out_specs=(P(), specs, P()))
  def train_step(params, opt_state, batch):
    local = parallel.to_local(opt_state, layout)
    loss, grads = jax.value_and_grad(loss_fn)(
      jaxcomm.collectives.pvary(params, "data"), batch)
    updates, local = tx.update(grads, local, params)
    return (optax.apply_updates(params, updates),
            parallel.to_global(local, layout), jax.lax.pmean(loss, "data"))
  # --- end ---
  params = parallel.replicate(params, mesh)
  losses, states = [], []
  for t in range(steps):
    params, opt_state, loss = train_step(params, opt_state,
                                         parallel.shard_batch(_batch(t), mesh))
    losses.append(float(loss))
    states.append(jax.device_get(opt_state))
  nnx.update(model, params)  # the trained model, back in its module
  return model, losses, states


def _nnx_reference(steps, lr=0.1):
  """Plain single-device SGD on the full batch, written with nnx.grad."""
  model = MLP(16, (32,), 4, rngs=nnx.Rngs(0))
  for t in range(steps):
    x, y = _batch(t)
    grads = nnx.grad(lambda m, x=x, y=y: _mse(m(x), y))(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
  return model


def test_nnx_recipe_dense_equals_single_device_sgd(mesh):
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))
  model, losses, _ = _nnx_recipe(tx, mesh, 4)
  ref = _nnx_reference(4)
  got = jax.tree.leaves(nnx.state(model, nnx.Param))
  want = jax.tree.leaves(nnx.state(ref, nnx.Param))
  assert len(got) == len(want) == 4
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert losses[-1] < losses[0]


def test_nnx_recipe_with_topk_trains_and_reports_stats(mesh):
  ratio = 0.1
  tx = optax.chain(jaxcomm.topk(ratio), optax.sgd(0.1))
  _, losses, states = _nnx_recipe(tx, mesh, 30)
  assert losses[-1] < 0.5 * losses[0]
  (stats,) = jaxcomm.stats(states[-1])
  assert np.shape(stats.residual_norm) == (N,)  # one per device
  assert int(stats.nonfinite_steps) == 0
  # After the first step each device's residual is its own gradient minus
  # its top-k (only hidden_0's 16x32 kernel has LeafPolicy's 256 elements).
  model = MLP(16, (32,), 4, rngs=nnx.Rngs(0))
  x, y = _batch(0)
  want = []
  for i in range(N):
    sl = slice(i * 8, (i + 1) * 8)
    g = nnx.grad(lambda m, sl=sl: _mse(m(x[sl]), y[sl]))(model)
    want.append(np.linalg.norm(_topk_residual(g["hidden_0"]["kernel"][...],
                                              ratio)))
  (first,) = jaxcomm.stats(states[0])
  np.testing.assert_allclose(first.residual_norm, want, rtol=1e-5)


# --------------------------------------------- the Linen recipe (README) --

class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


def _linen_recipe(tx, mesh, steps):
  model = _LinenMLP()
  variables = model.init(jax.random.key(0), jnp.zeros((1, 16)))
  # --- README: Linen ---
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=variables["params"], tx=tx)
  layout = parallel.state_layout(tx, state.params, mesh)
  state = state.replace(
    params=parallel.replicate(state.params, mesh),
    opt_state=parallel.init_state(tx, state.params, mesh, layout=layout))
  specs = state.replace(step=P(), params=P(),
                        opt_state=parallel.state_specs(layout))

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(specs, P("data")),
                 out_specs=(specs, P()))
  def train_step(state, batch):
    def loss_fn(params):
      x, y = batch
      return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(
      jaxcomm.collectives.pvary(state.params, "data"))
    state = state.replace(opt_state=parallel.to_local(state.opt_state, layout))
    state = state.apply_gradients(grads=grads)
    return (state.replace(opt_state=parallel.to_global(state.opt_state,
                                                       layout)),
            jax.lax.pmean(loss, "data"))
  # --- end ---
  losses = []
  for t in range(steps):
    state, loss = train_step(state, parallel.shard_batch(_batch(t), mesh))
    losses.append(float(loss))
  return variables, state, losses


def test_linen_train_state_recipe_dense_equals_single_device_sgd(mesh):
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))
  variables, state, losses = _linen_recipe(tx, mesh, 4)
  params = variables["params"]
  for t in range(4):
    x, y = _batch(t)
    g = jax.grad(lambda p, x=x, y=y: _mse(
      _LinenMLP().apply({"params": p}, x), y))(params)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g)
  for path, want in jax.tree_util.tree_leaves_with_path(params):
    got = state.params
    for k in path:
      got = got[k.key]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert int(state.step) == 4
  assert losses[-1] < losses[0]


def test_linen_train_state_recipe_with_powersgd_trains(mesh):
  tx = optax.chain(jaxcomm.powersgd(2), optax.sgd(0.1))
  _, state, losses = _linen_recipe(tx, mesh, 30)
  assert losses[-1] < 0.5 * losses[0]
  # stats finds the compressor's state inside the TrainState itself.
  (stats,) = jaxcomm.stats(state)
  (same,) = jaxcomm.stats(state.opt_state)
  np.testing.assert_array_equal(stats.residual_norm, same.residual_norm)
  assert np.shape(stats.residual_norm) == (N,)
  assert np.all(np.asarray(stats.residual_norm) > 0)
  assert int(stats.nonfinite_steps) == 0


# ------------------------------------------- stats on nnx.Optimizer states --

def test_stats_find_compressor_states_in_nnx_optimizer_states():
  ratio = 0.1
  model = MLP(16, (32,), 4, rngs=nnx.Rngs(0))
  tx = optax.chain(jaxcomm.topk(ratio, axis_name=None),
                   optax.sgd(0.1, momentum=0.9))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x, y = _batch(0)
  grads = nnx.grad(lambda m: _mse(m(x), y))(model)
  want = _topk_residual(grads["hidden_0"]["kernel"][...], ratio)
  optimizer.update(model, grads)
  for tree in (optimizer.opt_state, nnx.state(optimizer), optimizer,
               nnx.state(optimizer)["opt_state"]):
    (stats,) = jaxcomm.stats(tree)
    assert isinstance(stats.residual_norm, jax.Array)  # not an nnx Variable
    np.testing.assert_allclose(stats.residual_norm, np.linalg.norm(want),
                               rtol=1e-5)
    assert int(stats.nonfinite_steps) == 0
    (state,) = jaxcomm.compress_states(tree)
    assert int(state.count) == 1
    np.testing.assert_allclose(state.residual[0], want, rtol=1e-5,
                               atol=1e-7)
  assert jaxcomm.stats(nnx.state(model)) == []  # no compressor there


def test_stats_find_powersgd_state_in_nnx_state():
  model = MLP(16, (32,), 4, rngs=nnx.Rngs(0))
  tx = optax.chain(jaxcomm.powersgd(2, axis_name=None), optax.adam(1e-3))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  (stats,) = jaxcomm.stats(nnx.state(optimizer))
  assert float(stats.residual_norm) == 0.0
  (state,) = jaxcomm.compress_states(nnx.state(optimizer))
  # PowerSGD's Q, back as a tuple: one group of one 16 x 32 kernel, rank 2.
  assert [np.shape(q) for q in state.codec[0]["q"]] == [(1, 32, 2)]


# ------------------------------------------- DataParallel with NNX params --

def test_data_parallel_takes_nnx_params(mesh):
  """No helper needed: DataParallel takes nnx.split's params State."""
  model = MLP(16, (32,), 4, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params, batch):
    x, y = batch
    return _mse(nnx.merge(graphdef, params)(x), y)

  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1, momentum=0.9))
  dp = parallel.DataParallel(loss_fn, tx, mesh)
  params, opt_state = dp.init(params)
  for t in range(3):
    params, opt_state, _ = dp.step(params, opt_state, _batch(t))
  nnx.update(model, params)
  ref = MLP(16, (32,), 4, rngs=nnx.Rngs(0))
  ref_tx = optax.sgd(0.1, momentum=0.9)
  ref_params = nnx.state(ref, nnx.Param)
  ref_state = ref_tx.init(ref_params)
  for t in range(3):
    x, y = _batch(t)
    g = nnx.grad(lambda m, x=x, y=y: _mse(m(x), y))(ref)
    u, ref_state = ref_tx.update(g, ref_state)
    nnx.update(ref, optax.apply_updates(nnx.state(ref, nnx.Param), u))
  for g, w in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref, nnx.Param))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_local_sgd_on_nnx_params(mesh):
  """Per-device NNX params (a local-update optimizer): period 1 follows
  single-device SGD on the whole batch, and the devices agree bit for bit
  after each sync (jaxcomm.apply_updates finds the LocalState)."""
  graphdef, params = nnx.split(MLP(16, (32,), 4, rngs=nnx.Rngs(0)),
                               nnx.Param)

  def loss_fn(params, batch):
    return _mse(nnx.merge(graphdef, params)(batch[0]), batch[1])

  dp = parallel.DataParallel(loss_fn, jaxcomm.local_sgd(optax.sgd(0.1), 1),
                             mesh)
  params, opt_state = dp.init(params)
  assert dp.per_device_params
  for t in range(3):
    params, opt_state, _ = dp.step(params, opt_state, _batch(t))
    for x in jax.tree.leaves(params):
      rows = np.asarray(x)
      assert all(np.array_equal(rows[0], r) for r in rows[1:])
  ref = _nnx_reference(3)
  for g, w in zip(jax.tree.leaves(dp.synchronized(params)),
                  jax.tree.leaves(nnx.state(ref, nnx.Param))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


class _BNDropNet(nnx.Module):
  """BatchNorm on the inputs, dropout, a linear head."""

  def __init__(self, rngs):
    self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x, rngs=None):
    return self.head(self.drop(self.bn(x), rngs=rngs))


def test_data_parallel_model_state_and_rng_readme(mesh):
  """The README's BatchNorm + dropout step against a single-device loop
  over the 8 shards (nnx.grad, each shard's key fold_in(fold_in(key, t),
  i), gradients and new statistics averaged) and the running statistics
  against numpy."""
  model = _BNDropNet(nnx.Rngs(0))
  reference = nnx.clone(model)
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))
  batches = [_batch(t) for t in range(3)]
  want_mean, want_var = np.zeros(16), np.ones(16)  # BatchNorm's init
  # --- README: model state ---
  graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  def loss_fn(params, batch, model_state, rng):
    model = nnx.merge(graphdef, params, model_state)
    x, y = batch
    loss = jnp.mean((model(x, rngs=rng) - y) ** 2)
    return loss, nnx.state(model, nnx.BatchStat)

  dp = parallel.DataParallel(loss_fn, tx, mesh)
  params, opt_state = dp.init(params)
  key = jax.random.key(7)
  for t, batch in enumerate(batches):
    params, opt_state, metrics, batch_stats = dp.step(
      params, opt_state, batch, model_state=batch_stats,
      rng=jax.random.fold_in(key, t))
  # --- end ---
    x, y = batch
    grads, stats, masks = [], [], []
    for i in range(N):
      sl, k = slice(8 * i, 8 * (i + 1)), jax.random.fold_in(
        jax.random.fold_in(key, t), i)
      m = nnx.clone(reference)
      grads.append(nnx.grad(lambda m, x=x, y=y, sl=sl, k=k: _mse(
        m(x[sl], rngs=k), y[sl]))(m))
      stats.append(nnx.state(m, nnx.BatchStat))
      masks.append(np.asarray(jax.random.bernoulli(k, 0.5, (8, 16))))
    assert len({mk.tobytes() for mk in masks}) == N  # masks differ
    nnx.update(reference, jax.tree.map(
      lambda p, *g: p - 0.1 * sum(g) / N, nnx.state(reference, nnx.Param),
      *grads))
    nnx.update(reference, jax.tree.map(lambda *s: sum(s) / N, *stats))
    # numpy: BatchNorm reads the inputs, so its statistics are the device
    # mean of each shard's batch mean and (biased) variance.
    xs = x.astype(np.float64).reshape(N, 8, 16)
    want_mean = 0.9 * want_mean + 0.1 * xs.mean(axis=1).mean(axis=0)
    want_var = 0.9 * want_var + 0.1 * xs.var(axis=1).mean(axis=0)
    np.testing.assert_allclose(batch_stats["bn"]["mean"][...], want_mean,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch_stats["bn"]["var"][...], want_var,
                               rtol=1e-5, atol=1e-6)
  got = jax.tree.leaves(params) + jax.tree.leaves(batch_stats)
  want = (jax.tree.leaves(nnx.state(reference, nnx.Param))
          + jax.tree.leaves(nnx.state(reference, nnx.BatchStat)))
  assert len(got) == len(want) == 6
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert np.isfinite(float(metrics["loss"]))


def test_each_device_and_step_draws_its_own_dropout_mask(mesh):
  """The masks themselves (an aux output, averaged over devices), with a
  compressor in the chain."""
  model = _BNDropNet(nnx.Rngs(0))
  graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  def loss_fn(params, batch, model_state, rng):
    model = nnx.merge(graphdef, params, model_state)
    x, y = batch
    loss = _mse(model(x, rngs=rng), y)
    mask = model.drop(jnp.ones_like(x), rngs=rng)  # the mask, as drawn
    return (loss, mask), nnx.state(model, nnx.BatchStat)

  # The head's 16 x 4 kernel is compressed, the rest travels dense.
  tx = optax.chain(jaxcomm.topk(0.25, policy=jaxcomm.LeafPolicy(min_size=64)),
                   optax.sgd(0.1))
  dp = parallel.DataParallel(loss_fn, tx, mesh, has_aux=True)
  params, opt_state = dp.init(params)
  key = jax.random.key(3)
  seen = []
  for t in range(2):
    params, opt_state, metrics, batch_stats = dp.step(
      params, opt_state, _batch(t), model_state=batch_stats,
      rng=jax.random.fold_in(key, t))
    masks = np.stack([
      np.asarray(jax.random.bernoulli(
        jax.random.fold_in(jax.random.fold_in(key, t), i), 0.5, (8, 16)))
      for i in range(N)])
    np.testing.assert_allclose(metrics["aux"], (masks / 0.5).mean(axis=0),
                               rtol=1e-6)
    assert len({m.tobytes() for m in masks}) == N  # differ between devices
    seen.append(masks)
  assert not np.array_equal(seen[0], seen[1])  # and between steps
  (stats,) = jaxcomm.stats(opt_state)
  assert np.shape(stats.residual_norm) == (N,)
  assert np.all(np.asarray(stats.residual_norm) > 0)


def test_model_state_and_rng_are_optional_and_checked(mesh):
  graphdef, params, batch_stats = nnx.split(_BNDropNet(nnx.Rngs(0)),
                                            nnx.Param, nnx.BatchStat)
  tx = optax.chain(jaxcomm.mean_gradients(), optax.sgd(0.1))

  def rng_only(params, batch, rng):
    x = jnp.where(jax.random.bernoulli(rng, 0.5, batch[0].shape), batch[0],
                  0.0)
    return _mse(x @ params["w"], batch[1])

  dp = parallel.DataParallel(rng_only, tx, mesh)
  p, s = dp.init({"w": np.zeros((16, 4), np.float32)})
  out = dp.step(p, s, _batch(0), rng=jax.random.key(0))
  assert len(out) == 3

  def no_new_state(params, batch, model_state):
    out = nnx.merge(graphdef, params, model_state)(
      batch[0], jax.random.key(0))
    return _mse(out, batch[1])  # forgot the new model state

  dp = parallel.DataParallel(no_new_state, tx, mesh)
  p, s = dp.init(params)
  with pytest.raises(ValueError, match=r"return \(out, new_model_state\)"):
    dp.step(p, s, _batch(0), model_state=batch_stats)

  def int_state(params, batch, model_state):
    loss = _mse(batch[0][:, :4] @ params["w"], batch[1])
    return loss, {"n": model_state["n"] + batch[0].shape[0]
                  + jnp.argmax(batch[0][0])}

  dp = parallel.DataParallel(int_state, tx, mesh)
  p, s = dp.init({"w": np.zeros((4, 4), np.float32)})
  with pytest.raises(ValueError, match=r"model_state leaf \['n'\] \(int32\) "
                     "differs between devices"):
    dp.step(p, s, _batch(0), model_state={"n": np.zeros((), np.int32)})


# ----------------------------------------------- what NNX users are told --

def test_nnx_trees_that_do_not_fit_are_named(mesh):
  model = _BNDropNet(nnx.Rngs(0))
  tx = optax.chain(jaxcomm.topk(0.25), optax.sgd(0.1))
  dp = parallel.DataParallel(lambda p, b: 0.0, tx, mesh)
  for whole in (nnx.state(model), model):
    for fn in (dp.init, lambda p: parallel.state_layout(tx, p, mesh),
               lambda p: parallel.init_state(tx, p, mesh)):
      with pytest.raises(ValueError, match=r"BatchStat, not an nnx.Param.*"
                         r"nnx.split\(model, nnx.Param"):
        fn(whole)
  params = nnx.state(model, nnx.Param)
  layout = parallel.state_layout(tx, params, mesh)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for tree in (optimizer.opt_state, nnx.state(optimizer)):
    for fn in (parallel.to_local, parallel.to_global,
               lambda s, lay: parallel.resize_state(s, lay, 4)):
      with pytest.raises(ValueError, match=r"Flax NNX containers.*"
                         r"init_state\(tx, params, mesh\)"):
        fn(tree, layout)


def test_resize_state_with_nnx_param_nodes_conserves_residuals(mesh):
  """optax states built on NNX params hold nnx.State/Param nodes (here
  momentum's trace): resize_state walks through them."""
  graphdef, params = nnx.split(MLP(16, (32,), 4, rngs=nnx.Rngs(0)),
                               nnx.Param)

  def loss_fn(params, batch):
    return _mse(nnx.merge(graphdef, params)(batch[0]), batch[1])

  tx = optax.chain(jaxcomm.topk(0.1), optax.sgd(0.1, momentum=0.9))
  dp = parallel.DataParallel(loss_fn, tx, mesh)
  p, s = dp.init(params)
  p, s, _ = dp.step(p, s, _batch(0))
  host = jax.device_get(s)
  small = parallel.resize_state(host, dp.layout, 4)
  (before,), (after,) = (jaxcomm.compress_states(host),
                         jaxcomm.compress_states(small))
  assert np.shape(after.residual[0])[0] == 4
  np.testing.assert_allclose(np.mean(after.residual[0], axis=0),
                             np.mean(before.residual[0], axis=0), rtol=1e-5,
                             atol=1e-6)
  # The replicated momentum (inside nnx Param nodes) is unchanged.
  for a, b in zip(jax.tree.leaves(host[1]), jax.tree.leaves(small[1])):
    np.testing.assert_array_equal(a, b)


def test_readme_flax_blocks_are_the_tested_code():
  """Every code block of the README's "Flax NNX and Linen" section appears,
  line for line, between a "README:" marker and "end" in this file."""
  root = pathlib.Path(__file__).resolve().parents[1]
  readme = (root / "README.md").read_text()
  section = readme.split("### Flax NNX and Linen\n", 1)[1].split("\n### ")[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks, "the README lost its Flax recipe"
  source = pathlib.Path(__file__).read_text()
  tested = [textwrap.dedent(b) for b in re.findall(
    r"# --- README: [^\n]*---\n(.*?)\n *# --- end ---", source, re.S)]

  def lines(text):
    return [l.strip() for l in text.splitlines() if l.strip()]

  for block in blocks:
    want = lines(block)
    assert any(any(got[i:i + len(want)] == want
                   for i in range(len(got) - len(want) + 1))
               for got in map(lines, tested)), block
