"""FetchSGD (Rothchild et al. 2020): bytes flat in devices and model size,
heavy hitters recovered from the averaged sketch, the learning rate kept
outside the sketch, the sketch state kept on a skipped step, bad arguments.

The battery (``tests/entries_sketch.py``) checks it against the paper's
algorithm in numpy on 8 devices; these tests add what the battery cannot
see."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm.transforms.sparsify import _sketch
from tests import entries_sketch
from tests import harness
from tests import references
from tests import registry


@functools.lru_cache(maxsize=None)
def _mesh(n):
  return jax.make_mesh((n,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])


def _codec_state(state):
  return jaxcomm.compress_states(state)[0].codec


# ------------------------------------------------------------ bytes ----

def test_bytes_are_flat_in_devices_and_model_size():
  """The compiled step's collectives carry the sketch (4 rows cols bytes)
  plus the one-float flag of the fused psum, whatever the number of
  devices and the model size; the dense mean's grow with the model."""
  rows, cols = 3, 128
  small = {"w": jnp.zeros((64, 48), jnp.float32)}
  large = {"w": jnp.zeros((256, 256), jnp.float32),
           "v": jnp.zeros((128, 96), jnp.float32)}
  seen = {}
  for n in (2, 4, 8):
    if len(jax.devices()) < n:
      pytest.skip(f"needs {n} devices")
    for label, params in (("small", small), ("large", large)):
      tx = jaxcomm.fetchsgd(0.001, rows=rows, cols=cols)
      hlo = jaxcomm.wire.report(harness.lower_update(tx, _mesh(n), params),
                                params=params)
      seen[n, label] = hlo.payload
      dense = jaxcomm.wire.report(
        harness.lower_update(jaxcomm.mean_gradients(), _mesh(n), params),
        params=params)
      seen[n, label, "dense"] = dense.payload["all-reduce"]
  want = {"all-reduce": 4 * rows * cols + 4}
  for n in (2, 4, 8):
    assert seen[n, "small"] == want, seen
    assert seen[n, "large"] == want, seen
    # The test can tell: the dense mean's bytes follow the model.
    assert seen[n, "large", "dense"] > 10 * seen[n, "small", "dense"]


# ---------------------------------------------------- heavy hitters ----

_HEAVY = (7, 1000, 23456, 40000, 65535)
_VALUES = (5.0, -4.0, 3.0, -6.0, 2.5)


def _heavy_grads(n, seed):
  """Per device: a share of the heavy values plus dense noise that
  cancels over the devices, so the device mean is exactly the heavy
  vector while every device's own gradient is dense and noisy."""
  rng = np.random.RandomState(seed)
  size = 256 * 256
  mean = np.zeros(size)
  mean[list(_HEAVY)] = _VALUES
  noise = rng.randn(n // 2, size) * 3.0
  noise = np.concatenate([noise, -noise])            # sums to 0 exactly
  share = rng.rand(n, len(_HEAVY))
  share = share / share.sum(axis=0) * n               # mean 1 per coord
  g = noise.copy()
  g[:, list(_HEAVY)] += share * np.asarray(_VALUES)
  return mean, {"w": g.reshape(n, 256, 256).astype(np.float32)}


def test_heavy_hitters_recovered_from_the_summed_sketch(mesh):
  """The mean gradient is 5 large coordinates (every device's gradient is
  dense, noise of std 3): with k = 5 the update is exactly those values
  at those coordinates and zero elsewhere, the error sketch is emptied,
  and the next step with the same gradients recovers them again."""
  rows, cols = 5, 1024
  k_ratio = 5 / (256 * 256)
  params = {"w": jnp.zeros((256, 256), jnp.float32)}
  # Precondition from the hash's definition: no two heavy coordinates
  # share a cell in any row.
  h, _ = entries_sketch.count_sketch_hash(np.asarray(_HEAVY), rows, cols)
  for r in range(rows):
    assert len(set(h[r])) == len(_HEAVY)
  want, g = _heavy_grads(harness.N, seed=0)
  for dev in g["w"]:      # no device's own top-5 is the heavy set
    assert set(np.argsort(-np.abs(dev.ravel()))[:5]) != set(_HEAVY)
  tx = jaxcomm.fetchsgd(k_ratio, rows=rows, cols=cols, momentum=0.9)
  upd, state, _ = harness.device_run(tx, mesh, [g, g], params=params)
  for t in range(2):
    got = np.asarray(upd[t]["w"], np.float64).ravel()
    assert set(np.flatnonzero(got)) == set(_HEAVY), t
    np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"step {t}")
  s_u, s_e = _codec_state(state)[0]
  # S_e lost exactly what was extracted; S_u was zeroed in those cells.
  assert np.abs(np.asarray(s_e)).max() < 1e-4
  assert np.abs(np.asarray(s_u)).max() < 1e-4


# ----------------------------------------------------- learning rate ----

def _paper_run(grads_seq, k, rows, cols, rho, lrs):
  """Algorithm 1 with its learning rate inside the sketch: weight
  changes ``Delta_t`` (flat) per step."""
  s_u = s_e = np.zeros((rows, cols))
  out = []
  for grads, lr in zip(grads_seq, lrs):
    delta, s_u, s_e = entries_sketch.fetchsgd_step(
      grads, s_u, s_e, k, rows, cols, rho, lr=lr)
    out.append(delta)
  return out


@pytest.mark.parametrize("scheduled", [False, True])
def test_learning_rate_outside_the_sketch_is_the_papers(scheduled):
  """``chain(fetchsgd, sgd(lr))`` moves the weights by the paper's
  ``Delta`` (whose sketch accumulates ``lr S_u``): exactly with a constant
  rate, and with a schedule when it is passed as ``lr_schedule``."""
  rates = (0.1, 0.03, 0.5, 0.2)
  lrs = rates if scheduled else (0.1,) * len(rates)
  sched = (lambda t: jnp.asarray(rates)[jnp.minimum(t, len(rates) - 1)])
  rows, cols, rho, k_ratio = 3, 200, 0.9, 0.01
  params = {"w": jnp.zeros((64, 48), jnp.float32)}
  rng = np.random.RandomState(3)
  grads_seq = [rng.randn(64 * 48).astype(np.float32) for _ in rates]
  tx = optax.chain(
    jaxcomm.fetchsgd(k_ratio, rows=rows, cols=cols, momentum=rho,
                     axis_name=None,
                     lr_schedule=sched if scheduled else None),
    optax.sgd(sched if scheduled else 0.1))
  state = first = tx.init(params)
  update = jax.jit(tx.update)
  k = references.topk_count(k_ratio, 64 * 48)
  want = _paper_run([[g.astype(np.float64)] for g in grads_seq], k, rows,
                    cols, rho, lrs)
  for t, g in enumerate(grads_seq):
    upd, state = update({"w": jnp.asarray(g.reshape(64, 48))}, state,
                        params)
    got = -np.asarray(upd["w"], np.float64).ravel()
    np.testing.assert_allclose(got, want[t], rtol=1e-4, atol=1e-5,
                               err_msg=f"step {t}")
  # The state keeps its types (a lax.cond or scan over steps type-checks).
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(first)):
    assert jax.typeof(a) == jax.typeof(b), (jax.typeof(a), jax.typeof(b))
  if scheduled:
    # Without the schedule the compressor's error is at the wrong scale.
    tx2 = optax.chain(
      jaxcomm.fetchsgd(k_ratio, rows=rows, cols=cols, momentum=rho,
                       axis_name=None), optax.sgd(sched))
    s2 = tx2.init(params)
    for g in grads_seq:
      upd2, s2 = jax.jit(tx2.update)({"w": jnp.asarray(g.reshape(64, 48))},
                                     s2, params)
    assert not np.allclose(-np.asarray(upd2["w"]).ravel(), want[-1],
                           rtol=1e-3, atol=1e-4)


# ------------------------------------------------------- non-finite ----

def test_nonfinite_step_keeps_the_sketch_state(mesh):
  """A NaN on one device: the update is skipped on every device and the
  momentum and error sketches are exactly those of the step before."""
  params = {k: v for k, v in harness.battery_params().items() if k != "step"}
  tx = optax.chain(jaxcomm.fetchsgd(0.01, cols=256),
                   optax.apply_if_finite(optax.sgd(1.0), 5))
  grads = harness.make_grads(5, 2, params=params)
  bad = jax.tree.map(np.array, grads[1])
  bad["w"][3, 0, 0] = np.nan
  _, s1, _ = harness.device_run(tx, mesh, grads[:1], params=params)
  upd, s2, _ = harness.device_run(tx, mesh, [bad], state=s1, params=params)
  before, after = _codec_state(s1)[0], _codec_state(s2)[0]
  assert np.abs(np.asarray(before[1])).max() > 0
  for a, b in zip(before, after):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(np.all(upd[0][k] == 0) for k in ("w", "conv", "b"))
  assert int(jaxcomm.stats(s2)[0].nonfinite_steps) == 1


# -------------------------------------------------- bad arguments ----

@pytest.mark.parametrize("kwargs,name", [
  ({"k_ratio": 0.0, "cols": 64}, "k_ratio"),
  ({"k_ratio": 2.0, "cols": 64}, "k_ratio"),
  ({"k_ratio": 0.01, "cols": 0}, "cols"),
  ({"k_ratio": 0.01, "cols": 1.5}, "cols"),
  ({"k_ratio": 0.01, "cols": 64, "rows": 0}, "rows"),
  ({"k_ratio": 0.01, "cols": 64, "momentum": 1.0}, "momentum"),
  ({"k_ratio": 0.01, "cols": 64, "momentum": -0.5}, "momentum"),
  ({"k_ratio": 0.01, "cols": 64, "error_feedback": True}, "error_feedback"),
  ({"k_ratio": 0.01, "cols": 64, "error_feedback": "ef21"},
   "error_feedback"),
  ({"k_ratio": 0.01, "cols": 64, "lr_schedule": 0.1}, "lr_schedule"),
])
def test_bad_arguments_are_named(kwargs, name):
  with pytest.raises(ValueError, match=name):
    jaxcomm.fetchsgd(**kwargs)


def test_a_sketch_narrower_than_k_is_refused_at_init():
  """k = ceil(0.01 * 3072) = 31 heavy hitters need at least 31 columns."""
  params = {"w": jnp.zeros((64, 48), jnp.float32)}
  jaxcomm.fetchsgd(0.01, cols=31, axis_name=None).init(params)
  with pytest.raises(ValueError, match=r"cols=30 is smaller than k=31"):
    jaxcomm.fetchsgd(0.01, cols=30, axis_name=None).init(params)


@pytest.mark.parametrize("size,chunk", [(50, 7), (64, 16), (10, 64),
                                        (40_000, 16_384)])
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_sketch_and_unsketch_by_chunks_are_the_definition(size, chunk, rows):
  """The sketch and every position's median estimate, computed ``chunk``
  positions at a time (a last partial chunk, one chunk longer than the
  bucket, an even and odd row count), equal the count sketch and the
  median of the numpy definition."""
  cols = 37
  rng = np.random.RandomState(size + rows)
  vec = rng.randn(size).astype(np.float32)
  h, s = entries_sketch.count_sketch_hash(np.arange(size), rows, cols,
                                          seed=3)
  salts = _sketch._row_salts(3, rows)
  table = jax.jit(lambda v: _sketch._sketch_rows(
    jnp.zeros((rows, cols), jnp.float32), salts, v, chunk))(vec)
  np.testing.assert_allclose(np.asarray(table),
                             entries_sketch.sketch(vec, h, s, cols),
                             rtol=1e-5, atol=1e-4)
  tab = rng.randn(rows, cols).astype(np.float32)
  est = jax.jit(lambda t: _sketch._unsketch(t, salts, size, chunk))(tab)
  want = np.median(s * np.take_along_axis(tab.astype(np.float64), h,
                                          axis=1), axis=0)
  np.testing.assert_allclose(np.asarray(est), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size,k,chunk", [
  (1000, 7, 64), (1000, 300, 64), (1000, 1000, 64), (257, 5, 256),
  (4096, 40, 4096)])
def test_streamed_unsketch_topk_is_the_definition(size, k, chunk):
  """``_unsketch_topk`` (the TPU's streamed top-k) against numpy: the
  positions of the ``k`` largest ``|median estimate|``, in decreasing
  order, lower position first among ties. The table has many equal cells
  (rounded to a coarse grid, and zero columns), so ties decide; chunks
  that do not divide ``size`` and ``k`` close to ``size`` included."""
  rows, cols = 5, 29
  rng = np.random.RandomState(size + k)
  tab = np.round(rng.randn(rows, cols) * 2) / 2
  tab[:, rng.rand(cols) < 0.3] = 0.0
  tab = tab.astype(np.float32)
  h, s = entries_sketch.count_sketch_hash(np.arange(size), rows, cols,
                                          seed=3)
  est = np.abs(np.median(s * np.take_along_axis(tab.astype(np.float64), h,
                                                axis=1), axis=0))
  want = np.lexsort((np.arange(size), -est))[:k]
  salts = _sketch._row_salts(3, rows)
  got = jax.jit(lambda t: _sketch._unsketch_topk(t, salts, size, k,
                                                 chunk))(tab)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_streamed_step_matches_numpy_reference_on_8_devices(mesh,
                                                            monkeypatch):
  """FetchSGD's step with the TPU's streamed top-k (forced here, in chunks
  of 64 positions) equals the battery's numpy reference on 8 devices."""
  monkeypatch.setattr(_sketch, "_streamed", lambda: True)
  monkeypatch.setattr(_sketch, "_CHUNK", 64)
  entry = registry.load()["fetchsgd"]
  grads = harness.make_grads(seed=1, steps=3)
  updates, _, _ = harness.device_run(entry.make(axis_name="data"), mesh,
                                     grads)
  ref, _, _ = harness.numpy_run(entry, grads, n=harness.N)
  for t, (got, want) in enumerate(zip(updates, ref)):
    for name in want:
      np.testing.assert_allclose(np.asarray(got[name]), want[name],
                                 rtol=entry.rtol, atol=entry.atol,
                                 err_msg=f"step {t} {name}")
