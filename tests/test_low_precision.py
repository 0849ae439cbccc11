"""float16 and bfloat16 gradients through every registered method.

Each compressor, whole optimizer and delay method runs on the 8-device
mesh with float16 and bfloat16 params and gradients:

* Gradients near float16's largest value (65,504), after a tiny first
  step: the averaged update overflows the leaf dtype after the method's
  math (error feedback adding a residual, FetchSGD's decoding, 1-bit
  Adam's frozen variance). Each step is either taken with an update finite
  in the leaf's dtype, or skipped: counted in ``nonfinite_steps`` on every
  device, its update NaN everywhere (``optax.apply_if_finite`` after it
  leaves the params as they were) and the state's residuals, moments and
  codec state as they were. Never an uncounted inf or NaN.
* Gradients of normal size: the update equals the same method's update on
  float32 params and the same gradients, cast to the dtype.

The local methods (``registry.methods("local")``) and ``zero_one_adam``
keep params per device between syncs and skip a non-finite step on the
device that saw it; they run under ``DataParallel``'s local mode, not in
this harness's replicated step, in the last test below: steps of a
quarter of the dtype's range, every device's params finite at every
step, the steps that would leave the range counted in ``skipped``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import parallel
from tests import harness

N = harness.N
DTYPES = (jnp.float16, jnp.bfloat16)
# Per-device params kept between syncs: not this harness's step.
_LOCAL_UPDATE = ("zero_one_adam",)
_NAMES = [m.name for m in jaxcomm.registry.methods()
          if m.family in ("compressor", "optimizer", "delay")
          and m.name not in _LOCAL_UPDATE]
# Methods whose update overflows float16 on these gradients: the test
# fails if they were not pushed past it (a test that cannot fail).
_OVERFLOWS_FLOAT16 = ("topk", "fetchsgd", "atomo", "onebit_adam",
                      "onebit_lamb", "pipe_sgd")
# The fields a skipped step moves on: step counters, the PRNG key, the
# statistics.
_MOVING = ("count", "key", "stats")


def _params(dtype):
  # w (3,072 values) is compressed by the default policy, b travels in
  # the fused dense psum.
  return {"b": jnp.zeros((48,), dtype), "w": jnp.zeros((64, 48), dtype)}


def _make(name):
  m = jaxcomm.registry.get(name)
  args = harness.required_args(m)
  if m.family == "delay":
    # Delay a compressor with error feedback, which overflows here.
    args["exchange"] = jaxcomm.topk(0.25)
  return m.make(**args)


def _run(tx, mesh, params, grads_seq):
  """Per step: (update, state before, state after), host arrays."""
  layout = parallel.state_layout(tx, params, mesh, harness.AXIS)
  key = (id(tx), str(jax.tree.structure(layout)),
         tuple(jax.tree.leaves(layout)))
  harness._LAYOUTS[key] = layout   # pylint: disable=protected-access
  state = parallel.init_state(tx, params, mesh, harness.AXIS, layout)
  fn = harness._stepper(tx, mesh, key)   # pylint: disable=protected-access
  params_g = parallel.replicate(params, mesh)
  out = []
  for grads in grads_seq:
    before = jax.device_get(state)
    upd, state = fn(params_g, state,
                    parallel.shard_batch(grads, mesh, harness.AXIS))
    out.append((jax.device_get(upd), before, jax.device_get(state)))
  return out


def _nonfinite_steps(state) -> np.ndarray:
  found = jaxcomm.stats(state)
  assert found, "no CompressStats in the state"
  return np.concatenate([np.ravel(np.asarray(s.nonfinite_steps))
                         for s in found])


def _kept(state, family) -> list:
  """What a skipped step must leave as it was: every state leaf but the
  counters, keys and statistics; for a delay method the inner
  compressor's residuals and codec state (its queue holds the skipped
  step's NaN update, applied later as a NaN and skipped then)."""
  if family == "delay":
    state = [(s.residual, s.momentum, s.codec, s.estimate, s.estimate_mean)
             for s in jaxcomm.compress_states(state)]
  leaves = jax.tree_util.tree_leaves_with_path(state)
  return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in leaves
          if not any(getattr(k, "name", None) in _MOVING for k in p)]


def _as_f32(tree):
  return [np.asarray(x).astype(np.float32) for x in jax.tree.leaves(tree)]


def _overflow_grads(dtype):
  """A tiny step, then two near float16's (or bfloat16's) largest value,
  the same on every device (the mean is as large as each)."""
  rng = np.random.RandomState(0)
  big = float(jnp.finfo(dtype).max) * 0.98
  out = []
  for scale in (2.0 ** -10, big, big):
    g = {}
    for k, v in _params(jnp.float32).items():
      base = np.sign(rng.randn(*v.shape)) * rng.uniform(0.5, 1.0, v.shape)
      g[k] = np.broadcast_to(base * scale, (N,) + v.shape).astype(dtype)
    out.append(g)
  return out


def _normal_grads(steps=2):
  """Gradients exactly representable in float16 and bfloat16 (multiples
  of 1/64 with at most 8 significant bits), different per device, of one
  sign per coordinate: no mean near 0 (1-bit Adam's frozen variance would
  make the next step ``lr / eps``, past float16's range)."""
  rng = np.random.RandomState(1)
  out = []
  for _ in range(steps):
    g = {}
    for k, v in _params(jnp.float32).items():
      codes = (rng.randint(32, 256, (N,) + v.shape)
               * np.sign(rng.randn(*v.shape)))
      per = 2.0 ** (np.arange(N) % 3 - 1).reshape((N,) + (1,) * v.ndim)
      g[k] = (codes / 64.0 * per).astype(np.float32)
    out.append(g)
  return out


def _refused(tx, params, dtype) -> bool:
  """True if init refuses the dtype, naming it; other errors propagate."""
  try:
    tx.init(params)
  except ValueError as e:
    assert jnp.dtype(dtype).name in str(e), str(e)
    return True
  return False


def _check_overflow(name, family, tx, mesh, dtype) -> int:
  """Runs :func:`_overflow_grads`; each step is taken with an update
  finite in ``dtype``, or skipped alike on every device with the state
  kept. Returns the number of skipped steps."""
  counted = 0
  queued = 0   # a delay method applies a skipped step's NaN later
  for t, (upd, before, after) in enumerate(
      _run(tx, mesh, _params(dtype), _overflow_grads(dtype))):
    where = f"{name} {jnp.dtype(dtype).name} step {t}"
    for x in jax.tree.leaves(upd):
      assert x.dtype == dtype, (where, x.dtype)
    values = _as_f32(upd)
    finite = all(np.isfinite(v).all() for v in values)
    n0, n1 = _nonfinite_steps(before), _nonfinite_steps(after)
    step_counted = np.all(n1 == n0 + 1)
    assert step_counted or np.all(n1 == n0), (where, n0, n1)
    counted += int(step_counted)
    if not finite:
      # NaN everywhere: apply_if_finite skips it on every device.
      assert all(np.isnan(v).all() for v in values), where
      queued += 1
      assert queued <= counted, f"{where}: an uncounted non-finite update"
      if family != "delay":
        assert step_counted, f"{where}: an uncounted non-finite update"
    if step_counted:
      for (path, a), (_, b) in zip(_kept(after, family),
                                   _kept(before, family), strict=True):
        np.testing.assert_array_equal(
          a, b, err_msg=f"{where}: {path} moved on a skipped step")
  return counted


@pytest.mark.parametrize("name", _NAMES)
def test_an_overflow_is_a_counted_skip_and_a_normal_step_is_exact(
    name, mesh):
  m = jaxcomm.registry.get(name)
  tx = _make(name)
  normal = _normal_grads()
  want = [u for u, _, _ in _run(tx, mesh, _params(jnp.float32), normal)]
  for dtype in DTYPES:
    params = _params(dtype)
    if _refused(tx, params, dtype):
      continue
    counted = _check_overflow(name, m.family, tx, mesh, dtype)
    if name in _OVERFLOWS_FLOAT16 and dtype == jnp.float16:
      assert counted, f"{name}: the gradients did not overflow float16"
    # Normal magnitudes: the float32 computation, cast to the dtype.
    got = [u for u, _, _ in _run(tx, mesh, params, [
      jax.tree.map(lambda x, d=dtype: x.astype(d), g) for g in normal])]
    for t, (a, b) in enumerate(zip(got, want)):
      for k in a:
        assert a[k].dtype == dtype
        _assert_within_one_ulp(
          np.asarray(a[k]).astype(np.float32),
          np.asarray(b[k]).astype(dtype).astype(np.float32), dtype,
          f"{name} {jnp.dtype(dtype).name} step {t} {k}")


def _assert_within_one_ulp(got, want, dtype, where):
  """``got`` equals ``want`` to one unit in the last place of ``dtype``,
  beyond float32's rounding of the leaf's arithmetic.

  Both are a float32 computation cast to ``dtype``, from two programs (the
  params' dtype differs). A compiler that fuses the float32 arithmetic
  differently (jaxlib 0.12 uses fused multiply-adds where 0.10 did not)
  moves a result by a few float32 ulps of the leaf's largest terms, which
  can flip the narrow cast's rounding by one ulp of ``dtype`` (seen: 1 of
  3,072 values, powersgd and uint8 in float16; powersgd's at 1.2e-4 in a
  leaf whose values reach ~1, off by 1.2e-7). The bound: one ulp of
  ``dtype`` at the value plus 4 float32 epsilons of the leaf's largest
  magnitude. Anything more is a real difference."""
  mant = {jnp.dtype(jnp.float16): 10, jnp.dtype(jnp.bfloat16): 7}[
    jnp.dtype(dtype)]
  scale = np.maximum(np.abs(want), np.finfo(np.float32).tiny)
  ulp = 2.0 ** (np.floor(np.log2(scale)) - mant)
  f32 = 4 * np.finfo(np.float32).eps * np.max(np.abs(want), initial=0.0)
  bad = np.abs(got - want) > ulp + f32
  assert not bad.any(), (
    f"{where}: {int(bad.sum())} of {bad.size} values more than one ulp "
    f"of {jnp.dtype(dtype).name} off; first {got[bad][:3]} vs "
    f"{want[bad][:3]}")


def test_one_ulp_check_can_fail():
  """The comparison above refuses two ulps and accepts one (the float32
  allowance, 4 eps of 1024, is far below an ulp of float16 there)."""
  want = np.array([1.0, 1024.0], np.float32)
  one = np.array([1.0 + 2.0 ** -10, 1024.0 + 1.0], np.float32)
  _assert_within_one_ulp(one, want, jnp.float16, "one ulp")
  with pytest.raises(AssertionError):
    _assert_within_one_ulp(want + 2 * (one - want), want, jnp.float16,
                           "two ulps")


def test_demo_casting_a_large_step_is_a_counted_skip(mesh):
  """DeMo scales the exchanged update by its learning rate after the
  exchange's own check, then casts it: with ``sign=False`` and a rate of
  100, a float16 update near 6e4 becomes 6e6 in float32. The step is
  skipped and counted (before: inf, uncounted, the residual moved on)."""
  tx = jaxcomm.demo(100.0, sign=False)
  assert _check_overflow("demo", "optimizer", tx, mesh, jnp.float16) >= 1


# ------------------------------------------- per-device params (local) --

# Its outer step pulls the params back at every sync (period 2): they
# never reach the range's end here.
_PULLED_BACK = ("diloco",)
_PER_DEVICE = ([m.name for m in jaxcomm.registry.methods("local")]
               + list(_LOCAL_UPDATE))


def _per_device_tx(name, step):
  """``name`` with an inner SGD (or, for zero_one_adam, a rate) that moves
  every param by ``step`` a local step, and the axis names it runs on."""
  m = jaxcomm.registry.get(name)
  args = harness.required_args(m)
  if "inner" in args:
    args["inner"] = optax.sgd(1.0)
  if name in _LOCAL_UPDATE:   # Adam: a step of about the rate
    args["learning_rate"] = float(step)
  axes = "data"
  if name == "hierarchical_sgd":
    axes = ("dcn", "ici")
    args["axis_name"] = axes
  return m.make(**args), axes


@pytest.mark.parametrize("name", _PER_DEVICE)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_per_device_params_never_leave_the_dtype_uncounted(name, dtype):
  """Each local step raises every param by a quarter of the dtype's range
  (a constant gradient, SGD at rate 1; Adam at that rate): the fifth
  would pass the largest finite value. Every device's params stay finite
  at every step, in their dtype; a step that would leave the range is
  skipped where it happens and counted in ``skipped`` (its params as
  before). That includes a sync whose result overflows (an outer step
  that extrapolates, a mean past the range) and the gossip methods'
  mixing: before either was checked, dpsgd, CHOCO, SGP, DCD/ECD-PSGD and
  SQuARM turned inf uncounted, MuLoCo and Overlap Local SGD inf at a
  sync."""
  step = float(jnp.finfo(dtype).max) / 4.4
  tx, axes = _per_device_tx(name, step)
  mesh = (parallel.make_pod_mesh(2) if isinstance(axes, tuple)
          else parallel.make_mesh(N))

  def loss_fn(p, x):
    # d loss / d p = -x[0, 0] everywhere (every device the same gradient);
    # the loss itself 0, not a sum past the range.
    return sum(jnp.sum(-x[0, 0] * (v - jax.lax.stop_gradient(v)))
               for v in jax.tree.leaves(p)).astype(jnp.float32)

  dp = parallel.DataParallel(loss_fn, tx, mesh, axis_name=axes,
                             donate=False)
  p, s = dp.init(_params(dtype))
  # Adam moves by about its rate whatever the gradient's size.
  g = 1.0 if name in _LOCAL_UPDATE else step
  batch = np.full((2 * N, 1), g, np.float32)
  for t in range(10):
    p, s, _ = dp.step(p, s, batch)
    w = np.asarray(jax.device_get(p["w"])).astype(np.float32)
    assert np.isfinite(w).all(), f"{name}: step {t}: params not finite"
  assert np.abs(w).max() > step / 2, f"{name}: no step taken"
  if name in _PULLED_BACK:
    return
  # Ten steps of a quarter of the range each cannot all have been taken.
  skipped = np.asarray(jax.device_get(s.skipped)).reshape(-1)
  assert skipped.shape == (N,) and skipped.min() >= 1, (name, skipped)
