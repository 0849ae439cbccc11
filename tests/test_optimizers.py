"""1-bit Adam and 1-bit LAMB beyond the battery: the warm-up against
optax's own Adam/AdamW/LAMB on the mean gradient, the balance of the
momentum's mass through the 1-bit exchange, a ``freeze_step=0`` program
continuing a warm-up run, and moving the state to another device count.
(The battery, ``tests/entries_optimizers.py``, checks the compressed steps
against numpy references of the papers' algorithms.)"""

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


def test_freeze_step_zero_continues_a_warm_up_run_without_its_psum(mesh):
  """A warm-up run's state continued by ``freeze_step=0`` takes the same
  steps as the run that never stopped, and that program holds only the
  compressed exchange: the warm-up's all-reduce of every compressed
  element is gone from the compiled HLO."""
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
  hlo = {}
  for name, tx in (("warm", warm), ("cont", cont)):
    report = jaxcomm.wire.report(harness.lower_update(tx, mesh),
                                 params=params)
    claim = jaxcomm.wire.summarize(
      jaxcomm.wire.claimed(tx, params, harness.N), n=harness.N,
      params=params)
    assert report.payload == claim.payload, (name, report.payload,
                                             claim.payload)
    hlo[name] = report.payload
  assert hlo["warm"]["all-reduce"] - hlo["cont"]["all-reduce"] == 4 * comp
  # What a compressed step moves is the same in both programs.
  assert (jaxcomm.wire.claimed(warm, params, harness.N, step=2)
          == jaxcomm.wire.claimed(cont, params, harness.N))


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
