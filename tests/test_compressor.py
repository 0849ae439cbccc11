"""The shared mechanism of jaxcomm._compressor, checked with a toy codec.

The toy codec sends, per leaf, only the element of largest magnitude (a
"top-1" sparsifier, exchanged with a plain psum of the dense sparse vector):
simple enough that every expectation below is written in plain numpy.
"""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import _compressor
from jaxcomm.collectives import _core
from tests import harness


def _top1(x):
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  i = np.unravel_index(np.argmax(np.abs(x)), x.shape)
  out[i] = x[i]
  return out


@dataclasses.dataclass(frozen=True)
class _Top1(jaxcomm.CodecBase):
  """Top-1 of each leaf of the bucket (a per-leaf loop: a test codec)."""

  name = "top1"

  def apply(self, x, state, ctx):
    sent = []
    for leaf in ctx.layout.split(x):
      flat = leaf.ravel()
      i = jnp.argmax(jnp.abs(flat))
      sent.append(jnp.zeros_like(flat).at[i].set(flat[i]))
    sent = jnp.concatenate(sent)
    mean = _core.psum(sent, ctx.axis_name) / ctx.num_devices
    return _compressor.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    return [("all-reduce", 4 * layout.size)]


def _codec():
  return _Top1()


def _grads(seed, steps, shape=(4, 5)):
  r = np.random.RandomState(seed)
  return [{"w": r.randn(*shape).astype(np.float32)} for _ in range(steps)]


def _run(tx, grads):
  params = {"w": jnp.zeros(grads[0]["w"].shape)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  outs = []
  for g in grads:
    u, state = update(g, state, params)
    outs.append(np.asarray(u["w"], np.float64))
  return outs, state


POLICY = jaxcomm.LeafPolicy(min_size=1)


def test_error_feedback_matches_numpy():
  grads = _grads(0, 5)
  outs, state = _run(_compressor.compressed(_codec(), axis_name=None,
                                            policy=POLICY), grads)
  e = np.zeros((4, 5))
  for g, out in zip(grads, outs):
    x = g["w"] + e
    sent = _top1(x)
    np.testing.assert_allclose(out, sent, rtol=1e-6, atol=1e-7)
    e = x - sent
  np.testing.assert_allclose(state.residual[0].reshape(e.shape), e,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state.stats.residual_norm, np.linalg.norm(e),
                             rtol=1e-5)


def test_without_error_feedback_nothing_is_kept():
  grads = _grads(1, 3)
  outs, state = _run(_compressor.compressed(
    _codec(), axis_name=None, error_feedback=False, policy=POLICY), grads)
  assert state.residual == ()
  for g, out in zip(grads, outs):
    np.testing.assert_allclose(out, _top1(g["w"]), rtol=1e-6)


def test_lr_aware_residual_rescaling():
  lrs = [0.1, 0.1, 0.05, 0.025]
  sched = lambda t: jnp.asarray(lrs)[jnp.minimum(t, 3)]
  grads = _grads(2, 4)
  outs, _ = _run(_compressor.compressed(
    _codec(), axis_name=None, lr_schedule=sched, policy=POLICY), grads)
  e = np.zeros((4, 5))
  for t, (g, out) in enumerate(zip(grads, outs)):
    if t > 0:
      e = e * lrs[t - 1] / lrs[t]
    x = g["w"] + e
    sent = _top1(x)
    np.testing.assert_allclose(out, sent, rtol=1e-5, atol=1e-6)
    e = x - sent


def test_momentum_correction_and_masking():
  m = 0.9
  grads = _grads(3, 4)
  outs, state = _run(_compressor.compressed(
    _codec(), axis_name=None, momentum=m, policy=POLICY), grads)
  u = np.zeros((4, 5))
  v = np.zeros((4, 5))
  for g, out in zip(grads, outs):
    u = m * u + g["w"]
    v = v + u
    sent = _top1(v)
    np.testing.assert_allclose(out, sent, rtol=1e-5, atol=1e-6)
    v = v - sent
    u = np.where(sent != 0, 0.0, u)        # momentum factor masking
  np.testing.assert_allclose(state.momentum[0].reshape(u.shape), u,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state.residual[0].reshape(v.shape), v,
                             rtol=1e-5, atol=1e-6)
  # The sent coordinate's momentum is zero after the step.
  assert np.all(np.asarray(state.momentum[0]).reshape(sent.shape)[sent != 0]
                == 0)


def test_dense_phase_before_start_step():
  grads = _grads(4, 4)
  outs, state = _run(_compressor.compressed(
    _codec(), axis_name=None, start_step=2, policy=POLICY), grads)
  np.testing.assert_allclose(outs[0], grads[0]["w"], rtol=1e-6)
  np.testing.assert_allclose(outs[1], grads[1]["w"], rtol=1e-6)
  np.testing.assert_allclose(outs[2], _top1(grads[2]["w"]), rtol=1e-6)
  assert int(state.count) == 4


def test_local_clipping_scales_with_sqrt_n(mesh):
  tx = _compressor.compressed(_codec(), clip_norm=1.0, error_feedback=False,
                              policy=jaxcomm.LeafPolicy(min_size=1))
  params = {"w": jnp.zeros((6,))}
  g = np.zeros((harness.N, 6), np.float32)
  g[:, 0] = 10.0 * (1 + np.arange(harness.N))
  upd, _, _ = harness.device_run(tx, mesh, [{"w": g}], params=params)
  # Each device's gradient is clipped to norm 1/sqrt(8) before sending.
  want = 1.0 / np.sqrt(harness.N)
  np.testing.assert_allclose(upd[0]["w"][0], want, rtol=1e-5)


def test_bad_arguments():
  with pytest.raises(ValueError, match="momentum"):
    _compressor.compressed(_codec(), momentum=1.5)
  with pytest.raises(ValueError, match="clip_norm"):
    _compressor.compressed(_codec(), clip_norm=0.0)
  with pytest.raises(ValueError, match="start_step"):
    _compressor.compressed(_codec(), start_step=-1)
  with pytest.raises(ValueError, match="error_feedback"):
    _compressor.compressed(_codec(), error_feedback="yes")
  with pytest.raises(ValueError, match="lr_schedule"):
    _compressor.compressed(_codec(), lr_schedule=0.1)
  with pytest.raises(ValueError, match="mask"):
    tx = _compressor.compressed(_codec(), axis_name=None,
                                policy=jaxcomm.LeafPolicy(mask=[True] * 3))
    tx.init({"w": jnp.zeros(3)})
  with pytest.raises(ValueError, match="jaxcomm compressor"):
    jaxcomm.wire.claimed(optax.sgd(0.1), {"w": jnp.zeros(3)}, 8)


def test_leaf_policy_routes_leaves():
  policy = jaxcomm.LeafPolicy(min_size=10, min_ndim=2,
                              mask=lambda g: {k: k != "skip" for k in g})
  grads = {"big": jnp.zeros((4, 4)), "vec": jnp.zeros((100,)),
           "small": jnp.zeros((2, 2)), "skip": jnp.zeros((8, 8)),
           "int": jnp.zeros((8, 8), jnp.int32)}
  paths = dict(zip(sorted(grads), policy.plan(grads, lambda s: True)))
  assert paths == {"big": "compress", "vec": "dense", "small": "dense",
                   "skip": "dense", "int": "skip"}
  rejecting = policy.plan(grads, lambda s: False)
  assert "compress" not in rejecting


def test_stats_are_found_in_a_chain():
  tx = optax.chain(optax.clip(1.0), _compressor.compressed(
    _codec(), axis_name=None, policy=POLICY), optax.sgd(0.1))
  state = tx.init({"w": jnp.zeros((3,))})
  found = jaxcomm.stats(state)
  assert len(found) == 1 and int(found[0].nonfinite_steps) == 0


@pytest.mark.parametrize("make", [jaxcomm.mean_gradients,
                                  lambda: jaxcomm.topk(0.1)],
                         ids=["mean_gradients", "topk"])
def test_complex_leaves_are_averaged_under_pmap(make):
  # A complex leaf is never compressed: its real and imaginary parts travel
  # in the fused dense psum, so every device gets the mean over devices
  # (numpy's), in its own dtype; the float leaf beside it is unaffected.
  n = jax.device_count()
  rng = np.random.default_rng(0)
  z = (rng.standard_normal((n, 3, 5))
       + 1j * rng.standard_normal((n, 3, 5))).astype(np.complex64)
  w = rng.standard_normal((n, 400)).astype(np.float32)
  params = {"w": jnp.zeros((400,), jnp.float32),
            "z": jnp.zeros((3, 5), jnp.complex64)}
  tx = make()
  assert jaxcomm.spec_of(tx).paths(params)[1] == "dense"     # z
  state = jax.pmap(lambda _: tx.init(params), axis_name="data")(
    jnp.arange(n))
  upd, _ = jax.pmap(lambda g, s: tx.update(g, s), axis_name="data")(
    {"w": w, "z": z}, state)
  assert upd["z"].dtype == jnp.complex64
  for i in range(n):
    np.testing.assert_allclose(np.asarray(upd["z"][i]), z.mean(axis=0),
                               rtol=1e-5, atol=1e-6)
  if make is jaxcomm.mean_gradients:
    np.testing.assert_allclose(np.asarray(upd["w"][0]), w.mean(axis=0),
                               rtol=1e-5, atol=1e-6)


def test_cast_names_the_accepted_dtypes():
  for bad in ("foo", jnp.float32, 3):
    with pytest.raises(ValueError, match="dtype must be one of"):
      jaxcomm.cast(bad)


# The arguments each compressor and whole optimizer needs, from the
# registry: every other argument keeps its default, which
# optax.inject_hyperparams must not need listed as static.
_REQUIRED = {m.attr: harness.required_args(m)
             for m in jaxcomm.registry.methods()
             if m.family in ("compressor", "optimizer")
             and m.name != "zero_one_adam"}


def test_required_arguments_are_the_registry_defaults():
  """Each registered method's required parameters have a value from the
  registry's defaults or (whole optimizers: a rate and a freeze step) from
  the harness's table by parameter name; every public factory is a
  registered method or a helper."""
  for m in jaxcomm.registry.methods():
    args = harness.required_args(m)
    needed = {k for k, p in m.parameters().items() if p.default is p.empty
              and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert set(args) == needed, m.name
    m.factory(**args, axis_name=None)
  from jaxcomm import transforms  # pylint: disable=import-outside-toplevel
  public = {n for n in dir(transforms) if not n.startswith("_")
            and inspect.isfunction(getattr(transforms, n))}
  # spy: a solver for L1-regularized problems (Grishchenko et al.), not a
  # method for train.py's models.
  helpers = {"apply_updates", "local_states", "lupa_increment", "spy"}
  assert public == {m.attr for m in jaxcomm.registry.methods()} | helpers


@pytest.mark.parametrize("name", sorted(_REQUIRED))
def test_inject_hyperparams_needs_only_the_passed_static_args(name):
  """``inject_hyperparams(f, static_args=<what is passed>)`` works with every
  default left out, and gives the plain factory's update."""
  factory = getattr(jaxcomm, name)
  args = dict(_REQUIRED[name], axis_name=None)
  # The passed arguments that set shapes: what the registry derived from
  # the factory's signature (plus its ``static=``), and the axis.
  method = next(m for m in jaxcomm.registry.methods() if m.attr == name)
  static = tuple(k for k in args
                 if k in method.static_args or k == "axis_name")
  injected = optax.inject_hyperparams(factory, static_args=static)(**args)
  plain = factory(**args)
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((48,))}
  rng = np.random.default_rng(0)
  grads = {"w": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32),
           "b": jnp.asarray(rng.normal(size=(48,)), jnp.float32)}
  state = injected.init(params)
  u1, _ = jax.jit(injected.update)(grads, state, params)
  u2, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  for k in grads:
    np.testing.assert_allclose(np.asarray(u1[k]), np.asarray(u2[k]),
                               rtol=1e-6, atol=1e-6, err_msg=name)


def test_float64_gradients_warn_that_they_are_averaged_in_float32():
  tx = jaxcomm.topk(0.5, axis_name=None)
  with jax.enable_x64(True):
    params = {"w": jnp.zeros((32, 16), jnp.float64)}
    grads = {"w": jnp.full((32, 16), 1.0 + 1e-12, jnp.float64)}
    with pytest.warns(UserWarning, match="float64 gradients are compressed "
                      "and averaged in float32"):
      upd, _ = tx.update(grads, tx.init(params), params)
    assert upd["w"].dtype == jnp.float64
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.update({"w": jnp.ones((32, 16))}, tx.init({"w": jnp.ones((32, 16))}))


def test_sign_compressors_move_zero_gradients_unless_masked_out():
  """sign(0) = +1 (documented): all-zero gradients move params by the
  scale; a leaf masked out of the policy gets the exact dense mean, 0."""
  params = {"frozen": jnp.zeros((32, 16)), "w": jnp.zeros((32, 16))}
  zeros = jax.tree.map(jnp.zeros_like, params)
  for make in (jaxcomm.signsgd, jaxcomm.signum):
    tx = make(axis_name=None)
    upd, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(upd["frozen"]), 1.0)
    policy = jaxcomm.LeafPolicy(mask={"frozen": False, "w": True})
    tx = make(axis_name=None, policy=policy)
    upd, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(upd["frozen"]), 0.0)
    np.testing.assert_array_equal(np.asarray(upd["w"]), 1.0)


# Whole optimizers: their exchange's options are theirs, not compressed()'s.
# Whole optimizers take no shared compressor options (from the registry).
_OPTIMIZERS = {m.attr for m in jaxcomm.registry.methods("optimizer")}


@pytest.mark.parametrize("name", sorted(set(_REQUIRED) - {"mean_gradients"}
                                        - _OPTIMIZERS))
def test_every_factory_forwards_the_shared_options(name):
  """start_step, clip_norm, momentum and lr_schedule reach compressed():
  the dense phase is exact, a momentum buffer is kept, the schedule is
  read, a bad clip_norm is refused by name, an unknown option too."""
  factory = getattr(jaxcomm, name)
  args = dict(_REQUIRED[name], axis_name=None)
  calls = []

  def schedule(step):
    calls.append(step)
    return 0.1

  # DGC passes its own momentum to compressed(); FetchSGD's ``momentum``
  # is its sketch's (kept in the codec state, no per-device buffer); GMC's
  # is the global one (beta) and ECQ-SGD compensates its own quantization
  # error: both refuse a local momentum by name.
  own_momentum = ("dgc", "fetchsgd", "gmc", "ecq_sgd")
  extra = {} if name in own_momentum else {"momentum": 0.5}
  if name in ("gmc", "ecq_sgd"):
    with pytest.raises(ValueError, match="momentum"):
      factory(**args, momentum=0.5)
  # A method that runs on EF21's estimates only (lag) keeps no delayed
  # mass to rescale: it refuses a schedule by name and runs without one.
  ef21_only = inspect.signature(factory).parameters.get(
    "error_feedback").default == "ef21"
  if ef21_only:
    with pytest.raises(ValueError, match="lr_schedule"):
      factory(**args, lr_schedule=schedule)
    calls.append("refused")
  sched = {} if ef21_only else {"lr_schedule": schedule}
  tx = factory(**args, start_step=2, **sched, **extra)
  assert jaxcomm.spec_of(tx).start_step == 2
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((48,))}
  rng = np.random.default_rng(2)
  state = tx.init(params)
  # A momentum buffer per bucket.
  assert len(state.momentum) == (
    0 if name in ("fetchsgd", "gmc", "ecq_sgd") else 1)
  update = jax.jit(tx.update)
  for _ in range(2):                        # dense phase: the exact mean
    grads = {"w": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32),
             "b": jnp.asarray(rng.normal(size=(48,)), jnp.float32)}
    upd, state = update(grads, state, params)
    np.testing.assert_array_equal(np.asarray(upd["w"]),
                                  np.asarray(grads["w"]))
  assert calls, "lr_schedule was never read"
  with pytest.raises(ValueError, match="clip_norm"):
    factory(**args, clip_norm=-1.0)
  with pytest.raises(ValueError, match="residual_decay"):
    factory(**args, residual_decay=1.5)
  if name == "fetchsgd" or ef21_only:   # no residual to decay: refused
    with pytest.raises(ValueError, match="residual_decay"):
      factory(**args, residual_decay=0.5)
  else:
    decayed = factory(**args, residual_decay=0.5, **extra)
    assert jaxcomm.compress_states(decayed.init(params))
  with pytest.raises(ValueError, match="unknown option"):
    factory(**args, bucket_cap=3)


def test_compress_states_are_found_through_optax_wrappers():
  params = {"w": jnp.zeros((32, 16))}
  inner = jaxcomm.topk(0.5, axis_name=None)
  wrapped = optax.chain(
    optax.MultiSteps(optax.chain(inner, optax.sgd(0.1)), every_k_schedule=2),
    optax.masked(jaxcomm.int8(axis_name=None), {"w": True}),
    optax.inject_hyperparams(jaxcomm.signum, static_args=("axis_name",))(
      axis_name=None))
  found = jaxcomm.compress_states(wrapped.init(params))
  assert len(found) == 3
  assert all(isinstance(s, jaxcomm.CompressState) for s in found)
  assert len(jaxcomm.stats(wrapped.init(params))) == 3


def _opts(**kw):
  base = dict(codec=None, axis_name=None, clip_norm=None, lr_schedule=None,
              momentum=None, momentum_masking=True, keep_residual=True,
              use_momentum=False, start_step=0)
  base.update(kw)
  return _compressor._Options(**base)


def test_accumulate_decays_the_residual():
  """residual_decay = beta: x = beta e + g (SparseLoCo's decayed error
  feedback); a compressor without a residual refuses it by name."""
  rng = np.random.default_rng(5)
  g = [rng.normal(size=12).astype(np.float32)]
  e = [rng.normal(size=12).astype(np.float32)]
  state = _compressor.CompressState(
    count=jnp.int32(3), residual=tuple(jnp.asarray(x) for x in e),
    momentum=(), codec=(), key=jax.random.PRNGKey(0),
    stats=None)
  _, xs, _, residual = _compressor.accumulate(
    _opts(residual_decay=0.25), [jnp.asarray(x) for x in g], state, 8)
  np.testing.assert_allclose(np.asarray(xs[0]), 0.25 * e[0] + g[0],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(residual[0]), 0.25 * e[0],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="residual_decay"):
    jaxcomm.topk(0.1, error_feedback=False, residual_decay=0.9)


def test_accumulate_stage_against_numpy():
  """Clipping to clip_norm / sqrt(n), the residual rescaled by
  lr_{t-1} / lr_t, then momentum correction u = m u + g, x = e + u."""
  rng = np.random.default_rng(4)
  g = [rng.normal(size=12).astype(np.float32)]
  e = [rng.normal(size=12).astype(np.float32)]
  m = [rng.normal(size=12).astype(np.float32)]
  state = _compressor.CompressState(
    count=jnp.asarray(3, jnp.int32), residual=tuple(map(jnp.asarray, e)),
    momentum=tuple(map(jnp.asarray, m)), codec=((),), key=None, stats=None)
  opts = _opts(clip_norm=0.5, lr_schedule=lambda s: 1.0 / (1.0 + s),
               momentum=0.9, use_momentum=True)
  g2, xs, u, res = _compressor.accumulate(opts, list(map(jnp.asarray, g)),
                                          state, 4)
  norm = np.linalg.norm(g[0].astype(np.float64))
  gc = g[0] * min(1.0, 0.5 / np.sqrt(4) / norm)
  ratio = (1.0 / 3.0) / (1.0 / 4.0)              # lr_2 / lr_3
  np.testing.assert_allclose(g2[0], gc, rtol=1e-5)
  np.testing.assert_allclose(res[0], e[0] * ratio, rtol=1e-5)
  np.testing.assert_allclose(u[0], 0.9 * m[0] + gc, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(xs[0], e[0] * ratio + 0.9 * m[0] + gc,
                             rtol=1e-5, atol=1e-6)


def test_agree_finite_stage_sees_inputs_and_outputs():
  ok = [jnp.ones(4)]
  dense = jnp.arange(3.0)
  bad, mean = _compressor.agree_finite(_opts(), ok, ok, ok, dense, 1)
  assert not bool(bad)
  np.testing.assert_array_equal(mean, dense)
  inf = [jnp.array([1.0, jnp.inf])]
  for args in ((inf, ok, ok), (ok, inf, ok), (ok, ok, inf)):
    bad, _ = _compressor.agree_finite(_opts(), *args, dense, 1)
    assert bool(bad)
  bad, _ = _compressor.agree_finite(_opts(), ok, ok, ok,
                                    jnp.array([3e38, 3e38]), 1)
  assert not bool(bad)


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.fetchsgd(0.1, cols=64, axis_name=None),
  lambda: jaxcomm.atomo(2, error_feedback=True, axis_name=None),
], ids=["fetchsgd", "atomo"])
def test_an_update_that_overflows_the_leaf_dtype_is_a_skipped_step(make):
  """float16 leaves, gradients up to 3e4: the codec decodes in float32,
  and its mean can exceed float16's range (65504). The step is taken iff
  numpy's float16 of the float32 run's update is finite, and then equals
  it; the first step where it is not is counted in ``nonfinite_steps``,
  its update is NaN (for ``apply_if_finite``) and the residual and codec
  state stay as they were. Before, the cast came after the finite check:
  the update left as inf with ``nonfinite_steps`` 0 (and the residual
  moved on)."""
  rng = np.random.RandomState(0)
  grads = [(rng.normal(size=(16, 16)) * s).clip(-6e4, 6e4).astype(
    np.float16) for s in (1e3, 1e3, 3e4, 3e4)]
  runs = {}
  for dt in (jnp.float32, jnp.float16):
    tx = make()
    params = {"w": jnp.zeros((16, 16), dt)}
    state, step = tx.init(params), jax.jit(tx.update)
    out = []
    for g in grads:
      u, new = step({"w": jnp.asarray(g, dt)}, state, params)
      out.append((np.asarray(u["w"]), state, new))
      state = new
    runs[dt] = out
  overflowed = False
  for (u32, _, _), (u16, before, after) in zip(runs[jnp.float32],
                                               runs[jnp.float16]):
    want = u32.astype(np.float16)
    count = int(jaxcomm.compress_states(after)[0].stats.nonfinite_steps)
    with np.errstate(over="ignore"):
      finite = np.all(np.isfinite(want))
    if finite:
      assert count == 0
      np.testing.assert_allclose(u16.astype(np.float32),
                                 want.astype(np.float32), rtol=2e-3)
      continue
    assert count == 1
    assert np.all(np.isnan(u16.astype(np.float32)))
    kept = lambda s: jax.tree.leaves(
      (s.residual, s.momentum, s.codec, s.estimate, s.estimate_mean))
    for a, b in zip(kept(jaxcomm.compress_states(after)[0]),
                    kept(jaxcomm.compress_states(before)[0])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    overflowed = True
    break   # the float32 run took the step: the two part here
  assert overflowed, "the gradients did not overflow float16"


@pytest.mark.parametrize("name,arg,extra", [
    ("stc", "ratio", {}), ("sbc", "ratio", {}), ("sidco", "ratio", {}),
    ("fetchsgd", "k_ratio", {"cols": 64}), ("topk", "ratio", {}),
    ("topk", "ratio", {"granularity": "model"}),
    ("topk", "ratio", {"value_bits": 4}), ("randomk", "ratio", {}),
    ("randomk", "ratio", {"granularity": "model"})])
def test_a_ratio_that_keeps_less_than_one_element_everywhere_is_refused(
    name, arg, extra):
  """The battery's compressed leaves have 1152 and 3072 elements (one
  bucket of 4224; FetchSGD and ``granularity="model"`` take k per bucket):
  ``k = ratio * L`` is below 1 on every one iff ``ratio < 1 / 3072``
  (``1 / 4224``). Such a ratio was accepted (1e-30: STC, SBC, top-k and
  random-k sent one element per leaf, SIDCo and FetchSGD nothing); it is
  refused at init, naming the argument, and the smallest ratio keeping one
  element of the largest is accepted."""
  params = harness.battery_params()
  per_bucket = name == "fetchsgd" or extra.get("granularity") == "model"
  big = 4224 if per_bucket else 3072

  def init(r):
    return getattr(jaxcomm, name)(r, axis_name=None, **extra).init(params)
  for r in (1e-30, 0.999 / big):
    with pytest.raises(ValueError, match=rf"{arg}={r!r}.*fewer than one"):
      init(r)
  init(1.0 / big)


@pytest.mark.parametrize("value", ["1", True])
def test_a_number_given_as_a_string_or_bool_is_refused_by_name(value):
  """lag(zeta="1") was accepted (float("1") passed the check) and failed
  inside the first traced step."""
  with pytest.raises(ValueError, match="zeta must be a number"):
    jaxcomm.lag(zeta=value)


def test_long_buckets_are_stored_in_whole_tiles(mesh):
  """A bucket of 75,000 values (a multiple of 1,024 pads 776 <= 1/64 of
  it) keeps its residual as 75,776: the first 75,000 the top-k residual of
  numpy's arithmetic per device, the tail zeros; a bucket whose padding
  would exceed 1/64 keeps its size. Resizing the state to 4 devices keeps
  the residuals' mean (what the averaged update is owed)."""
  from jaxcomm import _buckets
  from jaxcomm import parallel
  params = {"w": jnp.zeros((300, 250), jnp.float32)}
  size, k = 75_000, 750
  lay = _buckets.plan([(300, 250)])[0]
  assert lay.stored_size == 75_776
  assert _buckets.plan([(40, 25)])[0].stored_size == 1_000
  tx = jaxcomm.topk(0.01, axis_name=harness.AXIS)
  grads = harness.make_grads(3, 3, params=params)
  outs, state, layout = harness.device_run(tx, mesh, grads, params=params)
  e = np.zeros((harness.N, size))
  for g, out in zip(grads, outs):
    x = e + np.asarray(g["w"], np.float64).reshape(harness.N, size)
    sent = np.zeros_like(x)
    for d in range(harness.N):
      top = np.argsort(-np.abs(x[d]), kind="stable")[:k]
      sent[d, top] = x[d, top]
    np.testing.assert_allclose(np.asarray(out["w"]).reshape(-1),
                               sent.mean(axis=0), rtol=1e-5, atol=1e-6)
    e = x - sent
  res = np.asarray(state.residual[0])
  assert res.shape == (harness.N, 75_776)
  np.testing.assert_allclose(res[:, :size], e, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(res[:, size:], 0.0)
  four = parallel.resize_state(state, layout, 4)
  got = np.asarray(four.residual[0])
  assert got.shape == (4, 75_776)
  np.testing.assert_allclose(got.mean(axis=0), res.mean(axis=0),
                             rtol=1e-5, atol=1e-6)


def test_a_bucket_past_int32_positions_still_traces():
  """A bucket of 2^31 values (one leaf of a 46k x 46k matrix) has no int32
  index past its end; the step still traces (it raised OverflowError in
  the materializing scatter, seen compiling a large MLP for TPU)."""
  big = jax.ShapeDtypeStruct((2**31,), jnp.float32)
  out = jax.eval_shape(
    lambda x: _compressor._materialized(x, jnp.zeros([], jnp.int32)), big)
  assert out.shape == big.shape and out.dtype == big.dtype
  small = jnp.arange(5.0)
  np.testing.assert_array_equal(
    _compressor._materialized(small, jnp.zeros([], jnp.int32)), small)
