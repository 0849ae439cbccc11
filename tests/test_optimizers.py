"""1-bit Adam and 1-bit LAMB beyond the battery: the warm-up against
optax's own Adam/AdamW/LAMB on the mean gradient, the balance of the
momentum's mass through the 1-bit exchange, a ``freeze_step=0`` program
continuing a warm-up run, and moving the state to another device count.
(The battery, ``tests/entries_optimizers.py``, checks the compressed steps
against numpy references of the papers' algorithms.) DeMo at the end: its
DCT, its tiles of leaves of any shape, its momentum's balance, the paper's
lr-weighted momentum under a schedule, and convergence."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import parallel
from tests import entries_quantization
from tests import harness


def _params(seed=0):
  r = np.random.RandomState(seed)
  p = harness.battery_params()
  return {k: (jnp.asarray(r.randn(*v.shape) * 0.1, jnp.float32)
              if v.dtype == jnp.float32 else v) for k, v in p.items()}


def _submesh(k):
  return jax.make_mesh((k,), ("data",), devices=jax.devices()[:k],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _floats(tree):
  return {k: v for k, v in tree.items() if k != "step"}


@pytest.mark.parametrize("which", ["adamw", "lamb"])
def test_warmup_is_optax_on_the_mean_gradient(mesh, which):
  """Before the freeze every step is optax's AdamW / LAMB applied to the
  exact mean of the devices' gradients (weight decay and a schedule on)."""
  lr = optax.cosine_decay_schedule(0.1, 10)
  if which == "adamw":
    tx = jaxcomm.onebit_adam(lr, weight_decay=0.01, freeze_step=10)
    ref = optax.adamw(lr, weight_decay=0.01)
  else:
    tx = jaxcomm.onebit_lamb(lr, weight_decay=0.01, freeze_step=10,
                             min_coeff=1e-12, max_coeff=1e12)
    ref = optax.lamb(lr, weight_decay=0.01)
  params = _params()
  grads = harness.make_grads(4, 3)
  updates, _, _ = harness.device_run(tx, mesh, grads, params=params)
  state = ref.init(_floats(params))
  for t, g in enumerate(grads):
    mean = {k: jnp.asarray(np.asarray(v).mean(axis=0))
            for k, v in _floats(g).items()}
    want, state = ref.update(mean, state, _floats(params))
    for k in want:
      np.testing.assert_allclose(updates[t][k], want[k], rtol=2e-5,
                                 atol=1e-7, err_msg=f"{which} {k} step {t}")


@pytest.mark.parametrize("which", ["adamw", "lamb"])
def test_long_moments_are_stored_in_whole_tiles(mesh, which):
  """50,750 floating values (a 202 x 250 matrix and a bias): the flat
  moments are stored as 51,200 (whole tiles of 1,024, zeros past 50,750).
  The warm-up is still optax's on the mean gradient, and the stored
  momentum and variance are optax's, leaf by leaf in tree order; a state of
  the unpadded width is refused by name. Then a compressed step."""
  lr = 0.01
  kw = dict(weight_decay=0.01, freeze_step=2)
  if which == "adamw":
    tx = jaxcomm.onebit_adam(lr, **kw)
    ref = optax.adamw(lr, weight_decay=0.01)
  else:
    tx = jaxcomm.onebit_lamb(lr, **kw, min_coeff=1e-12, max_coeff=1e12)
    ref = optax.lamb(lr, weight_decay=0.01)
  r = np.random.RandomState(2)
  params = {"b": jnp.asarray(r.randn(250) * 0.1, jnp.float32),
            "w": jnp.asarray(r.randn(202, 250) * 0.1, jnp.float32)}
  size, width = 50_750, entries_quantization.stored_of(50_750)
  assert width == 51_200
  grads = harness.make_grads(6, 3, params=params)
  updates, state, _ = harness.device_run(tx, mesh, grads[:2], params=params)
  ref_state = ref.init(params)
  means = []
  for t, g in enumerate(grads[:2]):
    mean = {k: jnp.asarray(np.asarray(v).mean(axis=0)) for k, v in g.items()}
    means.append(np.concatenate([np.ravel(x) for x in
                                 jax.tree.leaves(mean)]).astype(np.float64))
    want, ref_state = ref.update(mean, ref_state, params)
    for k in want:
      np.testing.assert_allclose(updates[t][k], want[k], rtol=2e-5,
                                 atol=1e-7, err_msg=f"{which} {k} step {t}")
  adam = next(s for s in jax.tree.leaves(
    ref_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if isinstance(s, optax.ScaleByAdamState))
  fields = ["mu", "nu"] + (["nu_fresh"] if which == "lamb" else [])
  for f in fields:
    got = np.asarray(getattr(state, f))
    assert got.shape == (width,), f
    np.testing.assert_array_equal(got[size:], 0.0)
  for f in ("mu", "nu"):
    want = np.concatenate([np.ravel(x) for x in
                           jax.tree.leaves(getattr(adam, f))])
    got = np.asarray(getattr(state, f))[:size]
    if f == "nu":
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9, err_msg=f)
      continue
    # mu = b1 (1 - b1) g0 + (1 - b1) g1 (g: the mean gradients). Where the
    # two terms nearly cancel (|mu| ~1e-5 against terms ~0.3) a bound
    # relative to mu measures float32 rounding, not the code. jaxlib
    # 0.12.0.1's CPU compiler at its default flags contracts the update
    # into a fused multiply-add: each mu was numpy's float32
    # round(fma(b1, mu, round((1 - b1) g))), one rounding fewer than
    # optax's multiply then add. That moved 10 of 50,750 moments by up to
    # 1.4e-8 (3e-4 to 1e-3 of mu), 1.0 float32 eps of the terms' size
    # b1 |mu| + (1 - b1) |g|; both stayed within 1.1 eps of that size from
    # a float64 recurrence on the same gradients (jaxcomm the closer). At
    # -O0 (conftest's flags) both jaxlibs give optax's bits. The bound: 2
    # eps of the terms' size, element by element.
    terms = 0.9 * np.abs(0.1 * means[0]) + 0.1 * np.abs(means[1])
    np.testing.assert_array_less(
      np.abs(got.astype(np.float64) - want),
      2 * np.finfo(np.float32).eps * terms, err_msg=f)
  after, state3, _ = harness.device_run(tx, mesh, grads[2:], params=params,
                                        state=state)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in
             jax.tree.leaves(after))
  np.testing.assert_array_equal(np.asarray(state3.mu)[size:], 0.0)
  short = state._replace(mu=np.asarray(state.mu)[:size])
  with pytest.raises(ValueError, match="momentum"):
    harness.device_run(tx, mesh, grads[2:], params=params, state=short)


@pytest.mark.parametrize("bias", [64, 5])
def test_lamb_layer_norms_by_blocks_and_by_positions(mesh, bias):
  """LAMB's per-layer norms, through either id path of ``_Flat``: leaves of
  64 and 4,096 values tile by blocks of 64 (per-block partials, then per
  leaf), a leaf of 5 does not (an id per position). Both warm-up steps
  equal optax's LAMB on the mean gradient, layer by layer."""
  from jaxcomm.transforms.optimizers import _onebit_common
  r = np.random.RandomState(bias)
  params = {"b": jnp.asarray(r.randn(bias) * 0.1, jnp.float32),
            "w": jnp.asarray(r.randn(64, 64) * 0.1, jnp.float32)}
  block, _ = _onebit_common._Flat.of(params).segments()
  assert block == (64 if bias == 64 else 1)
  tx = jaxcomm.onebit_lamb(0.1, weight_decay=0.01, freeze_step=10,
                           min_coeff=1e-12, max_coeff=1e12)
  ref = optax.lamb(0.1, weight_decay=0.01)
  grads = harness.make_grads(7, 2, params=params)
  updates, _, _ = harness.device_run(tx, mesh, grads, params=params)
  state = ref.init(params)
  for t, g in enumerate(grads):
    mean = {k: jnp.asarray(np.asarray(v).mean(axis=0)) for k, v in g.items()}
    want, state = ref.update(mean, state, params)
    for k in want:
      np.testing.assert_allclose(updates[t][k], want[k], rtol=2e-5,
                                 atol=1e-7, err_msg=f"{bias} {k} step {t}")


def _mu_leaves(mu):
  """The flat momentum (floating leaves b, conv, w in tree order) per leaf."""
  p = harness.battery_params()
  out, off = {}, 0
  for k in ("b", "conv", "w"):
    size = p[k].size
    out[k] = np.asarray(mu, np.float64)[off:off + size].reshape(p[k].shape)
    off += size
  return out


def test_momentum_mass_is_conserved_through_the_exchange(mesh):
  """After the freeze each device's local momentum ``b1 m + (1 - b1) g_i``
  enters the 1-bit exchange; what the devices agreed on (``n m`` per step),
  the worker errors and the chunk owners' server errors add up to the sum
  of every local momentum, exactly."""
  b1 = 0.9
  tx = jaxcomm.onebit_adam(0.01, b1=b1, freeze_step=1)
  grads = harness.make_grads(6, 5)
  state, total, agreed = None, {}, {}
  mu_prev = None
  for t, g in enumerate(grads):
    _, state, _ = harness.device_run(tx, mesh, [g], state=state)
    mu = _mu_leaves(state.mu)
    if t >= 1:   # compressed steps
      for k in harness.COMPRESSED:
        local = b1 * mu_prev[k] + (1 - b1) * np.asarray(g[k], np.float64)
        total[k] = total.get(k, 0) + local.sum(axis=0)
        agreed[k] = agreed.get(k, 0) + harness.N * mu[k]
    mu_prev = mu
  worker = harness.residuals_of(state)
  server = entries_quantization._onebit_extra_mass(state)
  for j, k in enumerate(harness.COMPRESSED):
    balance = agreed[k] + worker[j].astype(np.float64).sum(axis=0) + server[j]
    scale = np.abs(total[k]).max()
    # The errors are not negligible: without them the balance fails.
    assert np.abs(agreed[k] - total[k]).max() > 1e-3 * scale
    np.testing.assert_allclose(balance, total[k], atol=1e-5 * scale,
                               err_msg=f"momentum mass of {k}")


@pytest.mark.parametrize("which", ["adam", "lamb"])
def test_a_coordinate_that_never_had_a_gradient_takes_no_step(mesh, which):
  """An input feature that is always zero (a blank pixel) or a dead unit
  gives coordinates whose gradient is exactly 0 on every device: their
  variance freezes at 0. The 1-bit exchange still hands them a sign times
  the chunk's scale, and the paper's step divides that by ``sqrt(0) +
  eps``: a step of ``lr * scale / eps``. They take no step (their momentum
  error stays in the error buffers); every other coordinate's step stays
  within Adam's usual bound of a few ``lr``."""
  lr = 1e-3
  if which == "adam":
    tx = jaxcomm.onebit_adam(lr, freeze_step=2)
  else:
    tx = jaxcomm.onebit_lamb(lr, freeze_step=2)
  grads = harness.make_grads(7, 6)
  for g in grads:       # the first 16 entries of w never see a gradient
    w = np.array(g["w"])
    w.reshape(harness.N, -1)[:, :16] = 0.0
    g["w"] = jnp.asarray(w)
  params = _params()
  updates, _, _ = harness.device_run(tx, mesh, grads, params=params)
  for t, u in enumerate(updates):
    w = np.asarray(u["w"]).reshape(-1)
    np.testing.assert_array_equal(w[:16], 0.0, err_msg=f"step {t}")
    for k in harness.COMPRESSED:
      assert np.all(np.isfinite(u[k])), (k, t)
      assert np.abs(u[k]).max() < 100 * lr, (which, k, t,
                                            np.abs(u[k]).max())


def test_freeze_step_zero_continues_a_warm_up_run_without_its_psum(mesh):
  """A warm-up run's state continued by ``freeze_step=0`` takes the same
  steps as the run that never stopped (compressed steps: ``nu_count > 0``),
  and outside conditional branches that program holds only the compressed
  exchange: the warm-up's all-reduce of every compressed element is gone
  from what every step runs. The dense Adam step for a fresh state
  (``nu_count == 0``) sits behind a ``lax.cond``, and the claim lists it."""
  grads = harness.make_grads(7, 4)
  warm = jaxcomm.onebit_adam(0.01, freeze_step=2)
  cont = jaxcomm.onebit_adam(0.01, freeze_step=0)
  full, _, _ = harness.device_run(warm, mesh, grads)
  _, s2, _ = harness.device_run(warm, mesh, grads[:2])
  rest, _, _ = harness.device_run(cont, mesh, grads[2:], state=s2)
  for t in range(2):
    for k in ("b", "conv", "w"):
      np.testing.assert_allclose(rest[t][k], full[2 + t][k], rtol=1e-6,
                                 atol=1e-9)
  params = harness.battery_params()
  comp = sum(params[k].size for k in harness.COMPRESSED)
  floating = sum(v.size for v in params.values()
                 if jnp.issubdtype(v.dtype, jnp.floating))
  always = {}
  for name, tx in (("warm", warm), ("cont", cont)):
    lowered = harness.lower_update(tx, mesh)
    report = jaxcomm.wire.report(lowered, params=params)
    claim = jaxcomm.wire.summarize(
      jaxcomm.wire.claimed(tx, params, harness.N), n=harness.N,
      params=params)
    assert report.payload == claim.payload, (name, report.payload,
                                             claim.payload)
    always[name] = sum(op.payload for op in jaxcomm.wire.collectives(
      lowered, outside_branches=True) if op.kind == "all-reduce")
  ops = jaxcomm.wire.collectives(harness.lower_update(cont, mesh))
  assert any(op.kind == "all-reduce" and op.payload == 4 * floating
             for op in ops)
  assert always["cont"] < 4 * comp
  # What a compressed step moves is the same in both programs.
  assert (jaxcomm.wire.claimed(warm, params, harness.N, step=2)
          == jaxcomm.wire.claimed(cont, params, harness.N, step=2))
  assert jaxcomm.wire.claimed(cont, params, harness.N, step=0) == [
    ("all-reduce", 4 * floating)]


def test_freeze_step_zero_on_a_fresh_state_takes_a_dense_adam_step(mesh):
  """``onebit_adam(freeze_step=0)`` from ``init`` (no warm-up state
  restored): the first step moved the params by about ``lr / eps`` (8e4
  at lr 0.01: the variance was zero). Now it is Adam's first step on the
  mean gradient (numpy, Kingma & Ba: ``m = (1 - b1) g``, ``v = (1 - b2)
  g^2``, bias-corrected), the variance counts one update, the worker
  errors stay zero, and the next step is the compressed step a one-step
  warm-up (``freeze_step=1``) takes after it."""
  lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
  tx = jaxcomm.onebit_adam(lr, b1, b2, eps, freeze_step=0)
  grads = harness.make_grads(11, 2)
  updates, state, _ = harness.device_run(tx, mesh, grads[:1])
  for k in ("b", "conv", "w"):
    gbar = np.asarray(grads[0][k], np.float64).mean(axis=0)
    m = (1 - b1) * gbar / (1 - b1)
    v = (1 - b2) * gbar ** 2 / (1 - b2)
    np.testing.assert_allclose(updates[0][k], -lr * m / (np.sqrt(v) + eps),
                               rtol=1e-5, atol=1e-7, err_msg=k)
  assert int(state.nu_count) == 1
  assert int(state.exchange.count) == 1
  for r in harness.residuals_of(state):
    assert not np.any(r)
  more, state, _ = harness.device_run(tx, mesh, grads[1:], state=state)
  assert int(state.nu_count) == 1 and int(state.exchange.count) == 2
  one, _, _ = harness.device_run(
    jaxcomm.onebit_adam(lr, b1, b2, eps, freeze_step=1), mesh, grads)
  for k in ("b", "conv", "w"):
    np.testing.assert_allclose(more[0][k], one[1][k], rtol=1e-6, atol=1e-9)


def test_lamb_freeze_step_zero_on_a_fresh_state_takes_a_dense_lamb_step(
    mesh):
  """``onebit_lamb(freeze_step=0)`` from ``init``: the first step was a
  compressed step on a zero variance, ``lr * mu / eps`` scaled by init's
  trust ratio 1 (params moved by about 1e3 at lr 0.01). Now it is LAMB's
  first step on the mean gradient (numpy: ``m = (1 - b1) g``, ``v = (1 -
  b2) g^2``, bias-corrected, ``u = m / (sqrt(v) + eps) + wd p``, the
  leaf's trust ratio ``|p| / |u|`` clipped to ``[min_coeff, max_coeff]``),
  the variance counts one update, the worker errors stay zero, and the
  run goes on as the one-step warm-up (``freeze_step=1``) does; the dense
  psum is claimed at step 0."""
  lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-6, 0.01
  params = _params(1)
  tx = jaxcomm.onebit_lamb(lr, b1, b2, eps, wd, freeze_step=0)
  grads = harness.make_grads(12, 3)
  updates, state, _ = harness.device_run(tx, mesh, grads, params=params)
  for k, p in _floats(params).items():
    p = np.asarray(p, np.float64)
    gbar = np.asarray(grads[0][k], np.float64).mean(axis=0)
    m = (1 - b1) * gbar / (1 - b1)
    v = (1 - b2) * gbar ** 2 / (1 - b2)
    u = m / (np.sqrt(v) + eps) + wd * p
    ratio = np.clip(np.linalg.norm(p) / np.linalg.norm(u), 0.01, 10.0)
    np.testing.assert_allclose(updates[0][k], -lr * ratio * u, rtol=1e-5,
                               atol=1e-7, err_msg=k)
  assert int(state.nu_count) == 1
  assert int(state.exchange.count) == 3
  one = jaxcomm.onebit_lamb(lr, b1, b2, eps, wd, freeze_step=1)
  want, _, _ = harness.device_run(one, mesh, grads, params=params)
  for t in range(3):
    for k in want[t]:
      np.testing.assert_allclose(updates[t][k], want[t][k], rtol=1e-6,
                                 atol=1e-9, err_msg=f"{k} step {t}")
  floating = sum(v.size for v in _floats(params).values())
  assert jaxcomm.wire.claimed(tx, params, harness.N, step=0) == [
    ("all-reduce", 4 * floating)]
  assert (jaxcomm.wire.claimed(tx, params, harness.N, step=1)
          == jaxcomm.wire.claimed(one, params, harness.N, step=1))
  lowered = harness.lower_update(tx, mesh, params=params)
  report = jaxcomm.wire.report(lowered, params=params)
  claim = jaxcomm.wire.summarize(
    jaxcomm.wire.claimed(tx, params, harness.N), n=harness.N, params=params)
  assert report.payload == claim.payload


@pytest.mark.parametrize("factory", [jaxcomm.onebit_adam,
                                     jaxcomm.onebit_lamb])
def test_state_moves_to_another_device_count(mesh, factory):
  """8 -> 4 devices: what the worker errors owe the averaged update (their
  device mean) and the server errors' totals are kept (DeepSpeed resets
  both on load), the moments are replicated and kept, and the resized
  state trains on the 4-device mesh."""
  tx = factory(0.01, freeze_step=1)
  params = _params(1)
  _, state, layout = harness.device_run(tx, mesh, harness.make_grads(8, 3),
                                        params=params)
  four = parallel.resize_state(state, layout, 4)
  for a, b in zip(harness.residuals_of(state), harness.residuals_of(four)):
    assert b.shape[0] == 4
    np.testing.assert_allclose(b.mean(axis=0), a.mean(axis=0), rtol=1e-5,
                               atol=1e-6)
  for a, b in zip(entries_quantization._onebit_extra_mass(state),
                  entries_quantization._onebit_extra_mass(four)):
    assert np.any(a != 0)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(four.mu, state.mu)
  np.testing.assert_array_equal(four.nu, state.nu)
  upd, after, _ = harness.device_run(
    tx, _submesh(4), harness.make_grads(9, 1, n=4), params=params,
    state=four)
  for k in ("b", "conv", "w"):
    assert np.all(np.isfinite(upd[0][k])) and np.any(upd[0][k] != 0)
  assert int(after.exchange.count) == 4


def test_lamb_freezes_the_trust_ratio_and_bounds_its_rescaling(mesh):
  """After the freeze 1-bit LAMB's per-layer ratio stays the warm-up's
  moving average and its rescaling factor moves at most 10% a step."""
  tx = jaxcomm.onebit_lamb(0.01, freeze_step=2)
  params = _params(2)
  state, coeffs, factors = None, [], []
  for g in harness.make_grads(10, 5):
    _, state, _ = harness.device_run(tx, mesh, [g], params=params,
                                     state=state)
    coeffs.append(np.asarray(state.coeff))
    factors.append(np.asarray(state.factor))
  assert not np.allclose(coeffs[0], coeffs[1])     # still warm: it moves
  for c in coeffs[2:]:
    np.testing.assert_array_equal(c, coeffs[1])    # frozen
  np.testing.assert_array_equal(factors[1], 1.0)
  for a, b in zip(factors[1:], factors[2:]):
    assert np.all(b <= a * 1.1 + 1e-6) and np.all(b >= a * 0.9 - 1e-6)
    assert np.all((b >= 0.5) & (b <= 4.0))


def test_errors_name_the_argument():
  with pytest.raises(TypeError, match="freeze_step"):
    jaxcomm.onebit_adam(0.1)                        # freeze_step is needed
  tx = jaxcomm.onebit_adam(0.1, weight_decay=0.1, freeze_step=0,
                           axis_name=None)
  p = _floats(_params())
  with pytest.raises(ValueError, match="weight_decay needs params"):
    tx.update(p, tx.init(p))
  lamb = jaxcomm.onebit_lamb(0.1, freeze_step=0, axis_name=None)
  with pytest.raises(ValueError, match="needs params"):
    lamb.update(p, lamb.init(p))
  c = {"z": jnp.zeros((4,), jnp.complex64)}
  with pytest.raises(ValueError, match=r"\['z'\] is complex"):
    tx.update(c, tx.init(c), c)


def test_params_sharded_over_a_model_axis_compress_over_data_only():
  """On a (data=4, model=2) mesh with ``w`` and ``b`` split over ``model``,
  1-bit Adam with ``axis_name="data"`` runs inside ``shard_map``
  (``check_vma`` on) and each model shard gets exactly what a 4-device
  data-parallel run on that shard alone gets; every collective in the
  compiled step spans the 4 data devices, none crosses the model axis."""
  from jax.sharding import PartitionSpec as P
  mesh2 = jax.make_mesh((4, 2), ("data", "model"),
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  r = np.random.RandomState(3)
  params = {"b": jnp.asarray(r.randn(48) * 0.1, jnp.float32),
            "w": jnp.asarray(r.randn(64, 48) * 0.1, jnp.float32)}
  grads = [{"b": r.randn(4, 48).astype(np.float32),
            "w": r.randn(4, 64, 48).astype(np.float32)} for _ in range(3)]
  pspec = {"b": P("model"), "w": P(None, "model")}
  gspec = {"b": P("data", "model"), "w": P("data", None, "model")}
  make = lambda: jaxcomm.onebit_adam(0.01, freeze_step=1, axis_name="data")

  def run(params, gs):
    tx = make()
    state = tx.init(params)
    out = []
    for g in gs:
      g = jax.tree.map(lambda x: x[0], g)
      upd, state = tx.update(g, state, params)
      out.append(upd)
    return out

  fn = jax.jit(jax.shard_map(run, mesh=mesh2, in_specs=(pspec, [gspec] * 3),
                             out_specs=[pspec] * 3))
  got = jax.device_get(fn(params, grads))
  groups = {c.group for c in jaxcomm.wire.collectives(
    fn.lower(params, grads).compile())}
  assert groups == {4}, groups
  half = 24
  for m in range(2):
    cut = lambda x, m=m: x[..., m * half:(m + 1) * half]
    want, _, _ = harness.device_run(
      make(), _submesh(4), [jax.tree.map(cut, g) for g in grads],
      params=jax.tree.map(cut, params))
    for t in range(3):
      for k in ("b", "w"):
        np.testing.assert_allclose(cut(got[t][k]), want[t][k], rtol=1e-6,
                                   atol=1e-8, err_msg=f"shard {m} {k} {t}")


# ------------------------------------------------------------------ DeMo --

from jaxcomm.transforms.optimizers import _demo  # noqa: E402
from tests import entries_optimizers  # noqa: E402
from tests import linear_model  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 7, 8, 35, 64])
def test_demo_dct_is_the_orthonormal_dct_ii(n):
  """The DCT matrix is DCT-II's closed form, entry by entry, and
  orthonormal: ``D D^T = D^T D = I``."""
  d = _demo.dct_matrix(n)
  np.testing.assert_allclose(d, entries_optimizers.demo_dct(n), atol=1e-14)
  np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-12)
  np.testing.assert_allclose(d.T @ d, np.eye(n), atol=1e-12)
  # Row k oscillates k/2 times: a constant is all in the first coefficient.
  c = d @ np.ones(n)
  np.testing.assert_allclose(c[1:], 0.0, atol=1e-12)
  assert np.isclose(c[0], np.sqrt(n))


def _demo_params(seed=5):
  """Leaves whose tiles differ: 64 x 64 (uint16 indices), a vector cut
  into 60s, a 50 x 35 tile, a 3-D leaf as the matrix (35, 9), a leaf
  whose prime dimension leaves tiles of 3 coefficients (dense), and a
  bias below the policy's minimum size (dense)."""
  r = np.random.RandomState(seed)
  shapes = {"a": (128, 64), "b": (48,), "m": (100, 70), "p": (3, 331),
            "t": (5, 7, 9), "v": (300,)}
  return {k: jnp.asarray(r.randn(*s) * 0.1, jnp.float32)
          for k, s in shapes.items()}


def test_demo_tiles_leaves_of_any_shape_as_the_reference(mesh):
  """Default chunk 64 and top-32 on leaves whose dimensions do not divide
  by 64 or are smaller: three steps with decoupled weight decay match the
  float64 reference (updates and each device's momentum), a leaf whose
  tiles hold at most 32 coefficients travels in the dense psum, and the
  claimed bytes are what the compiled step moves."""
  params = _demo_params()
  tx = jaxcomm.demo(0.05, compression_decay=0.8, weight_decay=0.1)
  grads = harness.make_grads(11, 3, params=params)
  updates, state, _ = harness.device_run(tx, mesh, grads, params=params)
  comp = ["a", "m", "t", "v"]
  assert _demo.DemoCodec(32, 64).accepts((3, 331)) is False
  want, mom, _ = entries_optimizers.demo_run(
    grads, harness.N, params, comp, lr=0.05, decay=0.8, topk=32, chunk=64,
    weight_decay=0.1)
  for t in range(3):
    for k in params:
      np.testing.assert_allclose(updates[t][k], want[t][k], rtol=1e-5,
                                 atol=1e-7, err_msg=f"{k} step {t}")
  got = harness.split_buckets(jaxcomm.compress_states(state)[0].residual,
                              [tuple(params[k].shape) for k in comp])
  for j, k in enumerate(comp):
    np.testing.assert_allclose(
      got[j], np.stack([mom[i][j] for i in range(harness.N)]), rtol=1e-4,
      atol=1e-5, err_msg=f"momentum of {k}")
  hlo = jaxcomm.wire.report(harness.lower_update(tx, mesh, params),
                            params=params)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, harness.N),
                                 n=harness.N, params=params)
  assert hlo.payload == claim.payload, (hlo.payload, claim.payload)
  # 2 + 5 + 4 + 1 tiles of 32 pairs: float32 values, uint16 indices (the
  # 64 x 64 tile's 4096 positions) two to a word; p and b (and the
  # non-finite flag) in the fused psum.
  pairs = 32 * (2 + 5 + 4 + 1)
  assert claim.payload["all-gather"] == 4 * harness.N * (pairs + pairs // 2)
  assert claim.payload["all-reduce"] == 4 * (3 * 331 + 48 + 1)


def test_demo_momentum_is_what_was_not_sent(mesh):
  """With ``sign=False`` and rate 1 the step is ``-Q``: on every step and
  compressed leaf, summed over devices, the decayed momenta plus the
  gradients equal ``n Q`` plus the new momenta (the fast components left
  the momentum and nothing else did), and the momenta differ between
  devices (they are never synchronized)."""
  beta = 0.7
  tx = jaxcomm.demo(1.0, compression_decay=beta, sign=False,
                    compression_topk=6, compression_chunk=8)
  state, prev = None, None
  for g in harness.make_grads(12, 3):
    upd, state, _ = harness.device_run(tx, mesh, [g], state=state)
    mom = harness.residuals_of(state)
    for j, k in enumerate(harness.COMPRESSED):
      old = 0.0 if prev is None else prev[j].astype(np.float64)
      before = (beta * old + np.asarray(g[k], np.float64)).sum(axis=0)
      after = (-harness.N * np.asarray(upd[0][k], np.float64)
               + mom[j].astype(np.float64).sum(axis=0))
      scale = np.abs(before).max()
      np.testing.assert_allclose(after, before, atol=1e-5 * scale,
                                 err_msg=k)
      assert np.abs(mom[j][0] - mom[j][1]).max() > 0.1 * scale
    prev = mom


def test_demo_with_a_schedule_is_the_papers_lr_weighted_momentum(mesh):
  """The reference optimizer accumulates ``delta = beta delta + lr_t g``;
  jaxcomm keeps the momentum in gradient units and rescales it by
  ``lr_{t-1} / lr_t``: with a changing rate the steps are the paper's."""
  rates = [0.1, 0.05, 0.2, 0.01]
  sched = lambda t: jnp.asarray(rates)[jnp.minimum(t, 3)]
  beta, n = 0.9, harness.N
  tx = jaxcomm.demo(sched, compression_decay=beta, compression_topk=6,
                    compression_chunk=8)
  grads = harness.make_grads(13, 4)
  updates, _, _ = harness.device_run(tx, mesh, grads)
  ex = entries_optimizers
  delta = {k: [np.zeros(harness.battery_params()[k].shape)] * n
           for k in harness.COMPRESSED}
  for t, g in enumerate(grads):
    for k in harness.COMPRESSED:
      total = 0.0
      for i in range(n):
        x = beta * delta[k][i] + rates[t] * np.asarray(g[k][i], np.float64)
        c = ex.demo_extract(x, 6, 8)
        delta[k][i] = x - ex.demo_inverse(c, x.shape)
        total = total + c
      want = -rates[t] * np.sign(ex.demo_inverse(total / n, x.shape))
      np.testing.assert_allclose(updates[t][k], want, rtol=1e-6,
                                 err_msg=f"{k} step {t}")


def test_demo_converges_as_dense_sign_and_adam_methods():
  """Least squares on 8 devices, 300 steps, cosine rate from 0.01: DeMo
  (top-32 of each 24 x 16 tile, momentum 0.9) reaches the noise floor as
  dense signum and Adam do, on a held-out batch."""
  steps = 300
  data = linear_model.make_batches(steps + 1, seed=1)

  def held_out(tx):
    _, p, _, _ = linear_model.run(tx, steps, batches=data)
    return float(linear_model.loss_fn(jax.device_get(p), data[-1]))

  sched = optax.cosine_decay_schedule(0.01, steps)
  start = float(linear_model.loss_fn(linear_model.params(), data[-1]))
  demo = held_out(jaxcomm.demo(sched, compression_decay=0.9))
  signum = held_out(optax.chain(jaxcomm.mean_gradients(),
                                optax.signum(sched, beta=0.9)))
  adam = held_out(optax.chain(jaxcomm.mean_gradients(), optax.adam(
    optax.cosine_decay_schedule(0.03, steps))))
  assert demo < 0.01 * start, (demo, start)
  assert demo < 1.2 * signum and demo < 1.2 * adam, (demo, signum, adam)


def test_demo_errors_name_the_argument():
  with pytest.raises(ValueError, match="compression_topk"):
    jaxcomm.demo(0.1, compression_topk=64 * 64)   # every tile whole
  with pytest.raises(ValueError, match="compression_chunk"):
    jaxcomm.demo(0.1, compression_chunk=8.0)
  with pytest.raises(ValueError, match="compression_decay"):
    jaxcomm.demo(0.1, compression_decay=1.0)
  jaxcomm.demo(0.1, compression_topk=63, compression_chunk=8)   # 63 < 64
  tx = jaxcomm.demo(0.1, weight_decay=0.1, axis_name=None)
  p = _floats(_params())
  with pytest.raises(ValueError, match="weight_decay needs params"):
    tx.update(p, tx.init(p))
  with pytest.raises(ValueError, match="DeMoState"):
    tx.update(p, jaxcomm.onebit_adam(0.1, freeze_step=0).init(p), p)
  c = {"z": jnp.zeros((4,), jnp.complex64)}
  with pytest.raises(ValueError, match=r"\['z'\] is complex"):
    tx.update(c, tx.init(c), c)


# ------------------------------------------- 0/1 Adam against DeepSpeed --

from tests import ref_zero_one_adam  # noqa: E402


def test_zero_one_adam_is_deepspeeds_zero_one_adam(mesh):
  """jaxcomm.zero_one_adam equals a float64 numpy replay of DeepSpeed's
  ZeroOneAdam.step and its NCCL compressed allreduce (padding, one worker
  scale per tensor, n server chunks; tests/ref_zero_one_adam.py) on the
  same gradients, to 1e-5 at every step and on every device, over 40
  steps that exercise dense variance steps whose interval doubles, 1-bit
  gradient steps, local steps with weight decay and 1-bit syncs whose
  interval doubles. Schedule: DeepSpeed's ``state['step']`` counted from 0
  (DeepSpeed's own first call only allocates buffers, so there it starts
  at 1) and its ``var_freeze_step`` one less (its last warm-up step is the
  first with ``step > var_freeze_step``). One 512-element leaf: jaxcomm's
  bucket chunks are DeepSpeed's chunks of that tensor."""
  from jaxcomm.transforms.optimizers._zero_one_adam import zero_one_schedule
  n, b, steps = 8, 4, 40
  r = np.random.RandomState(0)
  w0 = (r.randn(32, 16) * 0.1).astype(np.float32)
  w_true = r.randn(32, 16) * 0.3
  data = []
  for _ in range(steps):
    x = r.randn(n * b, 32).astype(np.float32)
    data.append((x, (x @ w_true + 0.1 * r.randn(n * b, 16)).astype(
      np.float32)))
  args = dict(var_freeze_step=12, var_update_scaler=3, local_step_scaler=4,
              local_step_clipper=8)
  assert set(zero_one_schedule(steps, *args.values())) == {0, 1, 2, 3}
  tx = jaxcomm.zero_one_adam(0.01, weight_decay=0.01, **args)
  dp = parallel.DataParallel(
    lambda p, bt: jnp.mean((bt[0] @ p["w"] - bt[1]) ** 2), tx, mesh,
    donate=False)
  p, s = dp.init({"w": jnp.asarray(w0)})

  def np_grad(p, bt):
    x, y = (np.asarray(a, np.float64) for a in bt)
    res = x @ p["w"] - y
    return {"w": 2.0 / res.size * x.T @ res}

  args["var_freeze_step"] -= 1
  want = ref_zero_one_adam.deepspeed_zero_one_adam(
    np_grad, {"w": w0}, [[(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
                          for i in range(n)] for x, y in data],
    n, 0.01, weight_decay=0.01, step0=0, **args)
  for t in range(steps):
    p, s, _ = dp.step(p, s, data[t])
    got = np.asarray(p["w"])
    assert got.shape == (n, 32, 16)
    np.testing.assert_allclose(got, want[t]["w"], rtol=0, atol=1e-5,
                               err_msg=f"step {t + 1}")
  # The replay moved: the local steps left the devices apart somewhere.
  assert any(np.ptp(w["w"], axis=0).max() > 1e-3 for w in want)


def test_zero_one_adam_leaves_coordinates_without_a_gradient_in_place(mesh):
  """0/1 Adam on a regression whose first 4 input features are always 0:
  their weights never get a gradient, their variance stays 0, and they
  stay where they started on every device (the 1-bit gradient and sync
  steps would otherwise give them ``lr * scale / eps`` steps: 971 after 5
  steps here), while the other weights train."""
  n, b = 8, 4
  r = np.random.RandomState(0)
  w0 = (r.randn(32, 16) * 0.1).astype(np.float32)
  w_true = r.randn(32, 16) * 0.3
  tx = jaxcomm.zero_one_adam(0.001, var_freeze_step=12, var_update_scaler=3,
                             local_step_scaler=4, local_step_clipper=8)
  dp = parallel.DataParallel(
    lambda p, bt: jnp.mean((bt[0] @ p["w"] - bt[1]) ** 2), tx, mesh,
    donate=False)
  p, s = dp.init({"w": jnp.asarray(w0)})
  for t in range(40):
    x = r.randn(n * b, 32).astype(np.float32)
    x[:, :4] = 0.0
    p, s, _ = dp.step(p, s, (x, (x @ w_true).astype(np.float32)))
    w = np.asarray(p["w"])
    np.testing.assert_array_equal(w[:, :4], np.broadcast_to(w0[:4], w[:, :4]
                                                            .shape),
                                  err_msg=f"step {t + 1}")
  assert np.abs(w[:, 4:] - w0[4:]).max() > 1e-2   # the others trained
