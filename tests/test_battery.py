"""The shared battery, run over every compressor in the registry.

For each entry: jit of init/update; shard_map on 8 devices with a replicated
update (``check_vma`` on, ``out_specs=P()``); equality with the entry's numpy
reference; conservation of gradient mass with error feedback; dtypes;
``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.apply_if_finite``
and ``optax.clip_by_global_norm`` around it (``MultiSteps`` also in the
8-device step, ``apply_if_finite`` around it refused there); an orbax
round-trip of the state; bad arguments; an unbound axis; non-float and
empty pytrees.
"""

from __future__ import annotations

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxcomm
from jaxcomm import _buckets
from jaxcomm import _compressor
from jaxcomm.kernels import _dispatch
from tests import harness
from tests import registry

ENTRIES = registry.load()
NAMES = sorted(ENTRIES)
STEPS = 5


def entry_param(fn):
  return pytest.mark.parametrize("name", NAMES)(fn)


def _device_run(entry, tx, mesh, grads):
  """``harness.device_run``, plus the residuals before each step (for a
  ``forced_memory`` entry; else None)."""
  if not entry.forced_memory:
    return (*harness.device_run(tx, mesh, grads), None)
  updates, state, memory = [], None, [None]
  for t, g in enumerate(grads):
    if t > 0:
      res = harness.residuals_of(state)
      memory.append([[r[i] for r in res] for i in range(res[0].shape[0])])
    upd, state, layout = harness.device_run(tx, mesh, [g], state=state)
    updates += upd
  return updates, state, layout, memory


@functools.lru_cache(maxsize=None)
def _run(name, mesh):
  """One 8-device run per entry, shared by several tests."""
  entry = ENTRIES[name]
  tx = entry.make(axis_name="data")
  grads = harness.make_grads(seed=1, steps=STEPS)
  updates, state, layout, memory = _device_run(entry, tx, mesh, grads)
  return tx, grads, updates, state, layout, memory


@entry_param
def test_jit_init_and_update(name):
  entry = ENTRIES[name]
  tx = entry.make(axis_name=None)
  params = harness.battery_params()
  state = jax.jit(tx.init)(params)
  grads = jax.tree.map(lambda g: g[0], harness.make_grads(0, 1)[0])
  upd, state2 = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(upd, grads)
  chex.assert_trees_all_equal_structs(state, state2)
  assert np.all(np.isfinite(np.asarray(upd["w"])))
  # The non-float leaf passes through untouched.
  np.testing.assert_array_equal(upd["step"], grads["step"])


def _check_reference(name, grads, updates, state, n, memory=None):
  entry = ENTRIES[name]
  ref, ref_res, _ = harness.numpy_run(entry, grads, n=n, memory=memory)
  assert len(updates) == len(ref) == len(grads)
  for t in range(len(grads)):
    for k in ref[t]:
      np.testing.assert_allclose(
        updates[t][k], ref[t][k], rtol=entry.rtol, atol=entry.atol,
        err_msg=f"{name}: update of {k!r} at step {t} on {n} devices")
  if entry.error_feedback:
    res = harness.residuals_of(state)
    for j, r in enumerate(res):
      want = np.stack([ref_res[i][j] for i in range(n)])
      np.testing.assert_allclose(r, want, rtol=entry.rtol,
                                 atol=entry.atol * 10,
                                 err_msg=f"{name}: residual {j} on {n} "
                                 "devices")


def _run_and_check(name, mesh, *, seed, n=harness.N):
  """A fresh run of entry ``name`` on ``mesh`` (``n`` devices), checked
  against its numpy reference."""
  entry = ENTRIES[name]
  tx = entry.make(axis_name="data")
  grads = harness.make_grads(seed=seed, steps=STEPS, n=n)
  updates, state, _, memory = _device_run(entry, tx, mesh, grads)
  _check_reference(name, grads, updates, state, n, memory)


@entry_param
def test_matches_numpy_reference_on_8_devices(name, mesh):
  _, grads, updates, state, _, memory = _run(name, mesh)
  _check_reference(name, grads, updates, state, harness.N, memory)


# The selection a TPU takes (jaxcomm.kernels.topk's radix search: no sort
# of the leaves), forced on this CPU: every entry it serves matches its
# numpy reference on it too.
RADIX_ENTRIES = ("dgc_warmup_exact", "gmc_ef", "gtopk_ef", "mgs_merged",
                 "scalecom_ef", "sparcml_ef", "stc_ef",
                 "threshold_ef", "topk_2bit", "topk_ef", "topk_model_noef")


@pytest.mark.parametrize("name", RADIX_ENTRIES)
def test_matches_numpy_reference_on_the_radix_selection(name, mesh,
                                                        monkeypatch):
  from jaxcomm.kernels import topk  # pylint: disable=import-outside-toplevel
  taken = []
  monkeypatch.setattr(_dispatch, "auto_radix_topk",
                      lambda backend, size: True)
  for fn in ("_radix_segments",):
    real = getattr(topk, fn)
    monkeypatch.setattr(topk, fn, lambda *a, real=real, **k: (
      taken.append(k["order"]), real(*a, **k))[1])
  _run_and_check(name, mesh, seed=1)
  assert taken, f"{name} did not take the radix selection"


# The entries whose per-leaf work batches short leaves of similar lengths
# (jaxcomm._rows: zero-padded rows of one batch instead of one op per leaf
# shape). The battery's two compressed leaves (1,152 and 3,072 values)
# fall in different length classes; with one class for every length they
# are batched together, and each entry must still match its numpy
# reference (which knows nothing of batches).
ROWS_ENTRIES = ("adacomp_ef", "dgc_warmup_exact", "ecq_sgd", "ef_signsgd",
                "gmc_ef", "gtopk_ef", "mgs_layerwise", "sidco_exp_ef",
                "sidco_gpareto_ef", "sparcml_ef", "stc_ef", "terngrad_diana",
                "topk_2bit", "topk_ef", "topk_ef21",
                "variance_sparsification")
# Leaves with no common block width (the quantizers' one bucket per leaf
# then takes the per-segment statistics).
NO_COMMON_BLOCK = ("ecq_sgd", "terngrad_diana")


@pytest.mark.parametrize("name", ROWS_ENTRIES)
def test_matches_numpy_reference_with_short_leaves_batched(name, mesh,
                                                           monkeypatch):
  from jaxcomm import _rows  # pylint: disable=import-outside-toplevel
  batched = []
  real_plan = _rows.plan
  monkeypatch.setattr(_rows, "_width_class", lambda size: 4096)

  def plan(*args, **kwargs):
    batches, alone = real_plan(*args, **kwargs)
    batched.extend(b.rows for b in batches)
    return batches, alone

  monkeypatch.setattr(_rows, "plan", plan)
  if name in NO_COMMON_BLOCK:
    monkeypatch.setattr(_buckets, "leaf_blocks", lambda sizes: None)
  _run_and_check(name, mesh, seed=3)
  assert batched, f"{name} batched no short leaves"


# Entries whose exchange depends on the device count beyond the mean's
# 1/n (chunk owners, vote counts, recursive-doubling rounds, the n <= 2
# path of natural, per-n sampling) run on 2 and 4 devices too: a third of
# the registry, to keep the battery's time (every entry runs on 8).
SUB_MESH_ENTRIES = ("cast_bfloat16_ef", "csc_ef", "gtopk_ef", "ibcd",
                    "natural", "onebit", "onebit_adam", "powersgd_r2",
                    "qsgd_partial_buckets", "signum", "sparcml_ef", "topk_ef",
                    "int8_requantized")


@functools.lru_cache(maxsize=None)
def _sub_mesh(n):
  return jax.make_mesh((n,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", SUB_MESH_ENTRIES)
def test_matches_numpy_reference_on_2_and_4_devices(name, n):
  """The same reference equality on a sub-mesh of the 8 CPU devices."""
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices, have {len(jax.devices())}")
  _run_and_check(name, _sub_mesh(n), seed=6, n=n)


def test_sub_mesh_entries_are_registered():
  assert set(SUB_MESH_ENTRIES) <= set(NAMES)


@entry_param
def test_conserves_gradient_mass(name, mesh):
  entry = ENTRIES[name]
  if not (entry.error_feedback and entry.conserves):
    pytest.skip(f"{name}: no error feedback or not a linear aggregation")
  _, grads, updates, state, _, _ = _run(name, mesh)
  res = harness.residuals_of(state)
  if entry.error_feedback in ("ef21", "diana"):
    # EF21's invariant: the aggregate the update returns is the mean of the
    # devices' estimates, and each estimate moved by exactly what its
    # device sent (the numpy twin checks the sends). DIANA keeps the same
    # aggregate h = mean_i h_i, but returns h + mean_i C(g_i - h_i) before
    # moving h by shift_rate times that mean (the twin checks the update).
    comp = jaxcomm.compress_states(state)[0]
    shapes = [tuple(harness.battery_params()[k].shape)
              for k in harness.COMPRESSED]
    agg = harness.split_buckets(comp.estimate_mean, shapes)
    for j, k in enumerate(harness.COMPRESSED):
      mean_h = res[j].astype(np.float64).mean(axis=0)
      scale = np.abs(mean_h).max()
      np.testing.assert_allclose(agg[j], mean_h, atol=1e-5 * scale,
                                 err_msg=f"{name}: h != mean_i h_i ({k})")
      if entry.error_feedback == "ef21":
        np.testing.assert_allclose(updates[-1][k], mean_h,
                                   atol=1e-5 * scale,
                                   err_msg=f"{name}: update != h ({k})")
    return
  for j, k in enumerate(harness.COMPRESSED):
    total_g = sum(np.asarray(g[k], np.float64).sum(axis=0) for g in grads)
    applied = harness.N * sum(np.asarray(u[k], np.float64) for u in updates)
    held = res[j].astype(np.float64).sum(axis=0)
    balance = applied + held
    if entry.extra_mass is not None:
      balance = balance + entry.extra_mass(state)[j]
    scale = np.abs(total_g).max()
    np.testing.assert_allclose(balance, total_g, atol=1e-4 * scale,
                               err_msg=f"{name}: mass of {k!r} not conserved")


@pytest.mark.parametrize("name", ("qsgd", "terngrad", "natural"))
def test_stochastic_quantizers_conserve_mass_with_error_feedback(name, mesh):
  """The stochastic quantizers with error feedback switched on: at every
  step, summed over devices, what the paper's quantizer sends (the numpy
  reference, drawing with the transform's key of that step) plus the new
  residual equals the gradient plus the old residual; and the update is
  the reference's mean of those messages."""
  entry = ENTRIES[name]
  assert entry.stochastic and not entry.error_feedback
  tx = entry.make(axis_name="data", error_feedback=True)
  n = harness.N
  params = harness.battery_params()
  shapes = [tuple(params[k].shape) for k in harness.COMPRESSED]
  old = [np.zeros((n,) + s, np.float32) for s in shapes]
  ref_state = entry.ref_init(shapes)
  key = jax.random.PRNGKey(0)   # the factories' default seed
  state = None
  for t, g in enumerate(harness.make_grads(seed=13, steps=STEPS)):
    key, sub = jax.random.split(key)
    upd, state, _ = harness.device_run(tx, mesh, [g], state=state)
    new = harness.residuals_of(state)
    # x = g + e, formed in float32 as the transform forms it.
    xs = [[(np.asarray(g[k][i], np.float32) + old[j][i]).astype(np.float64)
           for j, k in enumerate(harness.COMPRESSED)] for i in range(n)]
    mean, sent, ref_state = entry.ref_step(xs, ref_state, t, sub, n)
    moved = 0.0
    for j, k in enumerate(harness.COMPRESSED):
      before = sum(xs[i][j] for i in range(n))
      after = sum(sent[i][j] + new[j][i].astype(np.float64) for i in range(n))
      scale = np.abs(before).max()
      np.testing.assert_allclose(
        after, before, atol=1e-5 * scale,
        err_msg=f"{name}: mass of {k!r} not conserved at step {t}")
      np.testing.assert_allclose(
        upd[0][k], mean[j], rtol=entry.rtol, atol=entry.atol,
        err_msg=f"{name}: update of {k!r} at step {t}")
      moved = max(moved, float(np.abs(new[j]).max()))
    assert moved > 0, f"{name}: error feedback kept nothing at step {t}"
    old = new


@entry_param
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keeps_gradient_dtype_and_state_types_through_cond(name, dtype):
  """Updates keep the gradients' dtype, and (Optax's stability check) the
  state an update returns has the shapes and dtypes, weak types included,
  of the state it was given: a ``lax.cond`` between updating and keeping
  the state (or a ``scan`` over steps) type-checks."""
  entry = ENTRIES[name]
  tx = entry.make(axis_name=None)
  params = jax.tree.map(
    lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating)
    else p, harness.battery_params())

  @jax.jit
  def step(grads, state, pick):
    updates, new_state = jax.lax.cond(
      pick, lambda: tx.update(grads, state, params),
      lambda: (jax.tree.map(jnp.zeros_like, grads), state))
    return updates, new_state, jax.lax.cond(pick, lambda: new_state,
                                            lambda: state)

  state = jax.jit(tx.init)(params)
  for t, g in enumerate(harness.make_grads(0, 2, dtype=dtype, params=params)):
    g = jax.tree.map(lambda x: x[0], g)
    updates, new_state, kept = step(g, state, jnp.asarray(t == 0))
    chex.assert_trees_all_equal_dtypes(updates, g)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
      assert jax.typeof(a).weak_type == jax.typeof(b).weak_type, name
    if t == 0:
      assert any(np.any(np.asarray(x) != 0)
                 for x in jax.tree.leaves(updates)), name
    state = kept


def _numeric_options(entry, kwargs) -> dict:
  """Shared numeric options of ``compressed()`` that change this entry's
  result, for ``optax.inject_hyperparams`` to inject on top of the entry's
  own arguments: a clipping threshold the battery's gradients exceed, and
  (with classic error feedback) a residual decay, whose effect shows from
  the second step on."""
  accepted = inspect.signature(entry.factory).parameters
  shared = dict(_compressor.SHARED_OPTIONS)
  extra = {}
  if "clip_norm" in accepted and "clip_norm" not in kwargs:
    assert "clip_norm" in shared
    extra["clip_norm"] = 20.0
  if ("residual_decay" in accepted and entry.error_feedback is True
      and "residual_decay" not in kwargs):
    assert "residual_decay" in shared
    extra["residual_decay"] = 0.5
  return extra


def _host(tree):
  """Host arrays, PRNG key arrays as their raw data (comparable)."""
  def leaf(x):
    if jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return jax.tree.map(leaf, tree)


@entry_param
def test_inject_hyperparams(name):
  """``optax.inject_hyperparams`` of the factory, with every numeric
  argument traced, gives the same updates and the same state over two
  steps as the plain factory. Each entry gets a shared numeric option on
  top of its own (see ``_numeric_options``)."""
  entry = ENTRIES[name]
  if entry.factory is None:
    pytest.skip("no public factory")
  kwargs = dict(entry.kwargs, axis_name=None)
  kwargs.update(_numeric_options(entry, kwargs))
  # Only the structural arguments the user passes are listed: a default
  # (a seed, a bucket size, a sample ratio) must never need listing.
  static = tuple((set(entry.static_args) & set(kwargs)) | {"axis_name"})
  injected = optax.inject_hyperparams(entry.factory, static_args=static)(
    **kwargs)
  plain = entry.factory(**kwargs)
  params = harness.battery_params()
  numeric = {k for k, p in inspect.signature(entry.factory).parameters.items()
             if isinstance(kwargs.get(k, p.default), (int, float))
             and not isinstance(kwargs.get(k, p.default), bool)
             and k not in static}
  s1, s2 = injected.init(params), plain.init(params)
  assert set(s1.hyperparams) == numeric, (set(s1.hyperparams), numeric)
  if not numeric:
    # mean_gradients takes axis_name only: there is nothing to inject.
    assert entry.factory is jaxcomm.mean_gradients, name
  for t, g in enumerate(harness.make_grads(2, 2)):
    g = jax.tree.map(lambda x: x[0], g)
    u1, s1 = jax.jit(injected.update)(g, s1, params)
    u2, s2 = jax.jit(plain.update)(g, s2, params)
    chex.assert_trees_all_close(u1, u2, rtol=1e-6, atol=1e-6,
                                custom_message=f"{name}: update {t}")
    chex.assert_trees_all_close(_host(s1.inner_state), _host(s2),
                                rtol=1e-6, atol=1e-6,
                                custom_message=f"{name}: state {t}")
    chex.assert_trees_all_equal_dtypes(s1.inner_state, s2)


@entry_param
def test_multisteps(name):
  entry = ENTRIES[name]
  tx = optax.MultiSteps(harness.chain_sgd(entry.make(axis_name=None)),
                        every_k_schedule=2)
  params = harness.battery_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads_seq = harness.make_grads(3, 4)
  for t, g in enumerate(grads_seq):
    g = jax.tree.map(lambda x: x[0], g)
    upd, state = update(g, state, params)
    if t % 2 == 0:   # accumulating: no update yet
      assert float(jnp.abs(upd["w"]).max()) == 0.0
    else:
      assert float(jnp.abs(upd["w"]).max()) > 0.0


def test_registry_load_fails_loudly():
  """A family whose entries module is gone, or registers nothing, is an
  error, not a battery that quietly shrank."""
  with pytest.raises(ModuleNotFoundError, match="entries_deleted"):
    registry.load(["tests.entries_deleted"])
  with pytest.raises(AssertionError, match="registered no battery entry"):
    registry.load(["tests.procs"])
  # Every entry comes from a listed module, and every module gave some.
  assert set(registry.SOURCES.values()) == set(registry.MODULES)


def _clip_numpy(tree, max_norm):
  """clip_by_global_norm in float64 numpy (float leaves only)."""
  floats = {k: np.asarray(v, np.float64) for k, v in tree.items()
            if np.issubdtype(np.asarray(v).dtype, np.floating)}
  norm = np.sqrt(sum(np.sum(v * v) for v in floats.values()))
  scale = min(1.0, max_norm / norm)
  return {k: (floats[k] * scale).astype(np.float32) if k in floats
          else np.asarray(v) for k, v in tree.items()}, norm


def _accumulated(grads_seq, k):
  """Each device's mean of its ``k`` local gradients, accumulated as
  ``optax.MultiSteps`` does (``a += (g - a) / (j + 1)`` in float32)."""
  out = []
  for start in range(0, len(grads_seq), k):
    acc = None
    for j, g in enumerate(grads_seq[start:start + k]):
      g = jax.tree.map(lambda x: np.asarray(x, np.float32), g)
      acc = g if acc is None else jax.tree.map(
        lambda a, x, j=j: a + (x - a) / np.float32(j + 1), acc, g)
    out.append(acc)
  return out


@entry_param
def test_multisteps_on_8_devices(name, mesh):
  """``optax.MultiSteps`` around compressor + SGD inside the 8-device step:
  nothing moves while accumulating; every k-th step the update is the
  numpy reference of the compressor fed each device's mean of its k
  local gradients (the reference's steps count emissions only)."""
  entry = ENTRIES[name]
  k = 2
  tx = optax.MultiSteps(harness.chain_sgd(entry.make(axis_name="data")),
                        every_k_schedule=k)
  params = {k_: v for k_, v in harness.battery_params().items()
            if k_ != "step"}
  # Seed 1, as the battery's own run: uint8 with error feedback rounds to
  # nearest, and float32/float64 residual drift can move a value that sits
  # on a rounding tie by one level (seed 6 has one such value of 1152).
  grads = harness.make_grads(seed=1, steps=2 * k, params=params)
  updates, state, layout = harness.device_run(tx, mesh, grads, params=params)
  assert layout.acc_grads["w"] is True and layout.mini_step is False
  ref, _, _ = harness.numpy_run(entry, _accumulated(grads, k))
  for t, upd in enumerate(updates):
    if t % k != k - 1:
      for key in upd:
        assert np.all(upd[key] == 0), f"{name}: step {t} moved {key}"
      continue
    for key, want in ref[t // k].items():
      got = -np.asarray(upd[key], np.float64)
      if entry.forced_memory and t // k > 0:
        # Deterministic rounding to a coarse grid (Entry.forced_memory):
        # after the first emission the twin's residual has drifted by
        # float32 ulps and may cross a rounding tie. At most 0.1% of the
        # values may then sit one code step away; the rest must match.
        close = np.isclose(got, want, rtol=entry.rtol, atol=entry.atol)
        assert close.mean() >= 0.999, (name, key, t, close.mean())
        step = (want.max() - want.min()) / 255 * 1.5
        assert np.all(np.abs(got - want)[~close] <= step), (name, key, t)
        continue
      np.testing.assert_allclose(
        got, want, rtol=entry.rtol,
        atol=entry.atol, err_msg=f"{name}: update of {key!r} at step {t}")
  assert int(state.gradient_step) == 2


@entry_param
def test_apply_if_finite_around_the_compressor_is_refused(name, mesh):
  """``optax.apply_if_finite`` wrapped around the compressor decides on
  each device's own gradient, so devices would skip differently: the
  layout probe names the rule instead of a shard_map type error."""
  entry = ENTRIES[name]
  tx = optax.apply_if_finite(harness.chain_sgd(entry.make(axis_name="data")),
                             3)
  # (optax.sgd turns an int leaf's update into a float: no int leaf here.)
  params = {k: v for k, v in harness.battery_params().items() if k != "step"}
  with pytest.raises(ValueError, match=r"updates differ between devices "
                     r"\(\['b'\], \['conv'\], \['w'\] vary over 'data'\).*"
                     r"optax.chain\(compressor, optax.apply_if_finite"):
    jaxcomm.parallel.state_layout(tx, params, mesh)


@entry_param
def test_clip_then_compress(name):
  """clip_by_global_norm before the compressor: the compressor sees the
  clipped gradient (its update equals the compressor's on a gradient
  clipped in numpy), and the clip did act (the raw norm is far above it)."""
  entry = ENTRIES[name]
  tx = optax.chain(optax.clip_by_global_norm(1.0), entry.make(axis_name=None),
                   optax.sgd(1.0))
  alone = harness.chain_sgd(entry.make(axis_name=None))
  params = harness.battery_params()
  grads = jax.tree.map(lambda g: g[0] * 100.0, harness.make_grads(4, 1)[0])
  clipped, norm = _clip_numpy(grads, 1.0)
  assert norm > 100.0
  upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  want, _ = jax.jit(alone.update)(clipped, alone.init(params), params)
  unclipped, _ = jax.jit(alone.update)(grads, alone.init(params), params)
  chex.assert_trees_all_close(upd, want, rtol=entry.rtol, atol=entry.atol)
  assert np.all(np.isfinite(np.asarray(upd["w"])))
  if entry.dense_optimizer is None:
    # A compressor passes the dense leaf through as the (clipped) mean:
    # on one device the update is -lr times the clipped gradient, not the
    # raw one.
    np.testing.assert_allclose(upd["b"], -clipped["b"], rtol=1e-5,
                               atol=1e-7)
    assert not np.allclose(unclipped["b"], upd["b"], rtol=0.5)


@entry_param
def test_nonfinite_gradient_on_one_device(name, mesh):
  """A NaN on one device: every device skips, residuals stay unchanged."""
  entry = ENTRIES[name]
  tx = optax.chain(entry.make(axis_name="data"),
                   optax.apply_if_finite(optax.sgd(1.0), 5))
  # (optax.sgd turns an int leaf's update into a float: no int leaf here.)
  params = {k: v for k, v in harness.battery_params().items() if k != "step"}
  grads = harness.make_grads(5, 2, params=params)
  bad = jax.tree.map(np.array, grads[1])
  bad["w"][3, 0, 0] = np.nan
  _, s1, _ = harness.device_run(tx, mesh, grads[:1], params=params)
  upd, s2, _ = harness.device_run(tx, mesh, [bad], state=s1, params=params)
  for k in ("w", "conv", "b"):
    assert np.all(upd[0][k] == 0), f"{name}: update of {k} not skipped"
  r1, r2 = harness.residuals_of(s1), harness.residuals_of(s2)
  for a, b in zip(r1, r2):
    np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(b))
  stats = jaxcomm.stats(s2)[0]
  assert int(np.asarray(stats.nonfinite_steps).max()) == 1
  assert int(s2[1].total_notfinite) == 1


@entry_param
def test_orbax_round_trip(name, mesh, tmp_path):
  entry = ENTRIES[name]
  tx, _, _, state, _, _ = _run(name, mesh)
  ckpt = ocp.StandardCheckpointer()
  path = tmp_path / "state"
  ckpt.save(path, state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(path, target=state)
  chex.assert_trees_all_equal(restored, state)
  # Continuing from the restored state gives the same next update.
  more = harness.make_grads(seed=9, steps=1)
  u1, s1, _ = harness.device_run(tx, mesh, more, state=state)
  u2, s2, _ = harness.device_run(tx, mesh, more, state=restored)
  chex.assert_trees_all_equal(u1, u2)
  chex.assert_trees_all_equal(s1, s2)
  del entry


@entry_param
def test_bad_arguments_name_the_argument(name):
  entry = ENTRIES[name]
  if not entry.bad_args:
    pytest.skip("no bad arguments declared")
  for kwargs, arg in entry.bad_args:
    with pytest.raises(ValueError, match=arg):
      entry.make(axis_name="data", **kwargs)


@entry_param
def test_unbound_axis_is_a_clear_error(name):
  entry = ENTRIES[name]
  tx = entry.make(axis_name="data")
  params = harness.battery_params()
  with pytest.raises(ValueError, match="axis_name='data' is not bound"):
    tx.update(params, tx.init(params), params)
  # A malformed axis name is refused when the transform is built.
  for bad in (5, ("data", 3), ()):
    with pytest.raises(ValueError, match="axis_name must be"):
      entry.make(axis_name=bad)


@entry_param
def test_empty_and_nonfloat_pytrees(name):
  entry = ENTRIES[name]
  tx = entry.make(axis_name=None)
  upd, _ = tx.update({}, tx.init({}), {})
  assert upd == {}
  ints = {"i": jnp.arange(4, dtype=jnp.int32)}
  upd, _ = tx.update(ints, tx.init(ints), ints)
  np.testing.assert_array_equal(upd["i"], ints["i"])


@entry_param
def test_mismatched_gradients_and_foreign_state_are_named(name):
  """Gradients that do not fit the params (or the state) are refused by
  leaf name instead of being broadcast into the update and the residual."""
  entry = ENTRIES[name]
  tx = entry.make(axis_name=None)
  params = harness.battery_params()
  state = tx.init(params)
  grads = dict(params)
  grads["w"] = jnp.zeros((4,) + params["w"].shape)      # a stray batch axis
  with pytest.raises(ValueError, match=r"gradient leaf \['w'\] has shape "
                     r"\(4, 64, 48\) but its param has shape \(64, 48\)"):
    tx.update(grads, state, params)
  grads["w"] = params["w"].T                             # transposed
  with pytest.raises(ValueError, match=r"\['w'\] has shape \(48, 64\)"):
    tx.update(grads, state, params)
  missing = {k: v for k, v in params.items() if k != "b"}
  with pytest.raises(ValueError, match=r"missing \['b'\]"):
    tx.update(missing, state, params)
  # Without params, a state that keeps residuals still names the mismatch.
  if entry.error_feedback:
    grads["w"] = jnp.zeros((4,) + params["w"].shape)
    with pytest.raises(ValueError, match="do not match the state"):
      tx.update(grads, state)
  # Another compressor's state (PowerSGD's for every other entry).
  other = (jaxcomm.powersgd(1, axis_name=None) if "powersgd" not in name
           else jaxcomm.topk(0.1, axis_name=None, error_feedback=False))
  foreign = other.init(params)
  if jax.tree.structure(foreign) != jax.tree.structure(state):
    with pytest.raises(ValueError, match="state"):
      tx.update(params, foreign, params)


@entry_param
def test_wire_bytes_match_compiled_hlo(name, mesh):
  """What the compressor claims to send is what the compiled step moves."""
  entry = ENTRIES[name]
  tx = entry.make(axis_name="data")
  params = harness.battery_params()
  hlo = jaxcomm.wire.report(harness.lower_update(tx, mesh), params=params)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, harness.N),
                                 n=harness.N, params=params)
  assert hlo.payload == claim.payload, (name, hlo.payload, claim.payload)


def _overflow_grads(scale, one_device=False):
  """Finite gradients far from float32's usual range: ``scale`` times a
  +-1 pattern on all devices, or a single ``scale`` element on device 3."""
  params = {k: v for k, v in harness.battery_params().items() if k != "step"}
  g = harness.make_grads(11, 1, params=params)[0]
  if one_device:
    g = jax.tree.map(np.array, g)
    g["w"][3, 1, 2] = scale
    return params, g
  return params, jax.tree.map(lambda x: np.sign(x) * np.float32(scale), g)


@entry_param
def test_overflow_inside_compressor_never_poisons_state(name, mesh):
  """Finite gradients whose norms, scales or sums overflow float32 (1e20
  everywhere, 1e30 in one element of one device, 1e38 everywhere).

  Whatever the codec makes of them, either the step goes through with
  finite updates and residuals, or it is skipped and counted on every
  device with the residuals untouched; a normal step after it is finite.
  """
  entry = ENTRIES[name]
  tx = optax.chain(entry.make(axis_name="data"),
                   optax.apply_if_finite(optax.sgd(1.0), 5))
  params, _ = _overflow_grads(1.0)
  normal = harness.make_grads(12, 2, params=params)
  _, s0, _ = harness.device_run(tx, mesh, normal[:1], params=params)
  for case, scale, one in (("1e20_all", 1e20, False),
                           ("1e30_one", 1e30, True),
                           ("1e38_all", 1e38, False)):
    _, big = _overflow_grads(scale, one_device=one)
    upd, s1, _ = harness.device_run(tx, mesh, [big], state=s0,
                                    params=params)
    r0, r1 = harness.residuals_of(s0), harness.residuals_of(s1)
    for r in r1:
      assert np.all(np.isfinite(r)), f"{name}/{case}: non-finite residual"
    skipped = int(np.asarray(jaxcomm.stats(s1)[0].nonfinite_steps).max()) \
      - int(np.asarray(jaxcomm.stats(s0)[0].nonfinite_steps).max())
    if skipped:
      assert skipped == 1
      for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
      for k in ("w", "conv", "b"):
        assert np.all(upd[0][k] == 0), f"{name}/{case}: skip moved {k}"
    else:
      for k in ("w", "conv", "b"):
        assert np.all(np.isfinite(upd[0][k])), f"{name}/{case}: {k}"
    upd2, s2, _ = harness.device_run(tx, mesh, normal[1:], state=s1,
                                     params=params)
    for k in ("w", "conv", "b"):
      assert np.all(np.isfinite(upd2[0][k])), f"{name}/{case}: next {k}"
    for r in harness.residuals_of(s2):
      assert np.all(np.isfinite(r)), f"{name}/{case}: next residual"


@entry_param
def test_kernel_paths_agree_inside_shard_map(name, mesh, monkeypatch):
  """JAXCOMM_KERNELS=always (Pallas, interpreted on CPU) and =never (plain
  jnp) give the same steps inside the 8-device shard_map (check_vma on)."""
  entry = ENTRIES[name]
  grads = harness.make_grads(seed=3, steps=2)
  out = {}
  modes = ["always", "never"]
  if "topk" in name or "dgc" in name:
    # The GPU's jnp top-k (bracketed threshold search), forced on CPU.
    modes.append("bracketed")
  for mode in modes:
    with monkeypatch.context() as m:
      if mode == "bracketed":
        m.setenv("JAXCOMM_KERNELS", "never")
        m.setattr(_dispatch, "auto_bracketed_topk",
                  lambda backend, k=None: True)
      else:
        m.setenv("JAXCOMM_KERNELS", mode)
      tx = entry.make(axis_name="data")   # a fresh transform: a fresh trace
      updates, state, _ = harness.device_run(tx, mesh, grads)
    out[mode] = (updates, harness.residuals_of(state))
  for mode in modes[1:]:
    chex.assert_trees_all_close(out["always"], out[mode], rtol=1e-6,
                                atol=1e-6)


def _stacked_params(layers: int) -> dict:
  """``layers`` identical blocks (a kernel, a bias, a norm scale)."""
  out = {}
  for i in range(layers):
    out[f"l{i:02d}"] = {"k": jnp.zeros((32, 24), jnp.float32),
                        "b": jnp.zeros((24,), jnp.float32),
                        "s": jnp.zeros((16, 16), jnp.float32)}
  return out


def _hlo_ops(tx, params, mesh) -> int:
  text = harness.lower_update(tx, mesh, params).as_text()
  return sum(1 for line in text.splitlines() if " = " in line)


@entry_param
def test_program_does_not_grow_with_leaves(name, mesh):
  """Four times the leaves (same shapes) add no more ops to a compressor's
  step than to the dense mean's (whose per-leaf split is the floor)."""
  entry = ENTRIES[name]
  tx = entry.make(axis_name="data")
  # A whole optimizer is compared with the dense optimizer it replaces.
  dense = (entry.dense_baseline() if entry.dense_optimizer is not None
           else jaxcomm.mean_gradients())
  growth = {}
  for tx_name, t in (("dense", dense), (name, tx)):
    small = _hlo_ops(t, _stacked_params(4), mesh)
    large = _hlo_ops(t, _stacked_params(16), mesh)
    growth[tx_name] = large - small
  # The compressed leaves' per-leaf split and state add a few ops per leaf
  # at most; a per-leaf codec adds tens.
  assert growth[name] <= 2 * growth["dense"] + 64, growth
