"""Family tests for the quantization compressors (beyond the battery).

Unbiasedness of the stochastic quantizers (mean over many keys within a
bound from the estimated variance), independent noise per device, the server
error's share of onebit's mass balance, bytes on the wire across 2, 4 and 8
devices (majority-vote traffic does not grow with ``n``), the exchange
chosen by the quantized allreduce, packing round trips, bad input, and a
least-squares convergence test (onebit with error feedback reaches the dense
optimum; sign compression without it stalls above it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import parallel
from jaxcomm.collectives import _quantized
from jaxcomm.collectives import _signs
from tests import entries_quantization
from tests import harness


def _submesh(k):
  if len(jax.devices()) < k:
    pytest.skip(f"needs {k} devices")
  return jax.make_mesh((k,), ("data",), devices=jax.devices()[:k],
                       axis_types=(jax.sharding.AxisType.Auto,))


# -------------------------------------------------------- unbiasedness --


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.qsgd(levels=3, bucket_size=64, axis_name=None),
  lambda: jaxcomm.terngrad(axis_name=None),
  lambda: jaxcomm.natural(axis_name=None),
], ids=["qsgd", "terngrad", "natural"])
def test_stochastic_quantizers_are_unbiased(make):
  tx = make()
  rng = np.random.RandomState(0)
  g = {"w": jnp.asarray(rng.randn(300) * np.exp(rng.randn(300)),
                        jnp.float32)}
  state = tx.init(g)
  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(4000))

  def one(key):
    return tx.update(g, state._replace(key=key))[0]["w"]

  q = np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)   # [K, 300]
  k = q.shape[0]
  mean, var = q.mean(axis=0), q.var(axis=0, ddof=1)
  se = np.sqrt(var / k)
  x = np.asarray(g["w"], np.float64)
  noisy = var > 0
  z = np.abs(mean - x)[noisy] / se[noisy]
  # 300 coordinates: the largest |z| of 300 normals is about 3; 5 leaves
  # room without hiding a bias (a bias of a tenth of a quantization step
  # would give |z| in the tens here).
  assert z.max() < 5.0, z.max()
  np.testing.assert_allclose(mean[~noisy], x[~noisy], rtol=1e-6)
  assert noisy.mean() > 0.9     # it did quantize
  # Not the identity: the variance is of the expected order.
  assert var.mean() > 1e-4 * np.mean(x * x)


def test_noise_is_independent_per_device(mesh):
  """Same gradient on every device: the TernGrad average takes values
  between the ternary levels, so the devices drew independent noise."""
  tx = jaxcomm.terngrad()
  params = {"w": jnp.zeros((512,), jnp.float32)}
  g = np.random.RandomState(1).randn(512).astype(np.float32)
  grads = [{"w": np.broadcast_to(g, (harness.N, 512)).copy()}]
  upd, _, _ = harness.device_run(tx, mesh, grads, params=params)
  steps = np.asarray(upd[0]["w"], np.float64) / np.abs(g).max() * harness.N
  np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
  # Shared noise would give only 0 or +-N.
  assert (np.abs(np.round(steps)) % harness.N != 0).mean() > 0.3


# -------------------------------------------------------------- onebit --


def _server_error_closes_the_mass_balance(mesh, tx, server_mass):
  """Three steps of ``tx``: the mass balance (what was applied plus the
  devices' residuals against what the devices computed) is off by a
  visible amount without ``server_mass(state)`` (one array per compressed
  leaf), and closes with it."""
  grads = harness.make_grads(seed=1, steps=3)
  updates, state, _ = harness.device_run(tx, mesh, grads)
  res = harness.residuals_of(state)
  extra = server_mass(state)
  for j, k in enumerate(harness.COMPRESSED):
    total = sum(np.asarray(g[k], np.float64).sum(axis=0) for g in grads)
    applied = harness.N * sum(np.asarray(u[k], np.float64) for u in updates)
    partial = applied + res[j].astype(np.float64).sum(axis=0)
    scale = np.abs(total).max()
    assert np.abs(partial - total).max() > 1e-2 * scale
    np.testing.assert_allclose(partial + extra[j], total, atol=1e-4 * scale)


def test_onebit_server_error_closes_the_mass_balance(mesh):
  """Without the server error the balance is off by a visible amount."""
  _server_error_closes_the_mass_balance(
    mesh, jaxcomm.onebit(), entries_quantization._onebit_extra_mass)


def test_onebit_server_error_lives_on_the_chunk_owner(mesh):
  tx = jaxcomm.onebit()
  _, state, _ = harness.device_run(tx, mesh, harness.make_grads(2, 1))
  err = np.asarray(entries_quantization.codec_state(state).server_error)
  length = err.shape[1]
  c = _signs.chunk_length(length, harness.N)
  for k in range(harness.N):
    outside = np.ones(length, bool)
    outside[k * c:(k + 1) * c] = False
    assert np.all(err[k][outside] == 0)
    assert np.any(err[k][~outside] != 0)


# A leaf of 50,500 values: its server error is stored as 51,200 (whole
# tiles of 1,024), and on 8 devices the chunks of that width (6,400) are
# not those of the leaves' total (6,336).
_LONG = (202, 250)


@pytest.mark.parametrize("name,tx,ref", [
  ("onebit", lambda: jaxcomm.onebit(axis_name=harness.AXIS),
   entries_quantization._onebit_ref_step),
  ("int8", lambda: jaxcomm.int8(bucket_size=128, exchange="requantized",
                                axis_name=harness.AXIS),
   entries_quantization._requantized_ref(8, 128))])
def test_server_error_of_a_long_bucket_is_stored_in_whole_tiles(
    mesh, name, tx, ref):
  """The exchange's updates equal the numpy reference's (chunks of the
  stored width, ``stored_of``) over 3 steps with worker error feedback;
  the server error is 51,200 wide, zero past 50,500, and each device's is
  zero outside its own chunk of the stored width; resized to 4 devices its
  total is kept, on the new chunks' owners."""
  size = _LONG[0] * _LONG[1]
  width = entries_quantization.stored_of(size)
  assert (size, width) == (50_500, 51_200)
  c8 = entries_quantization.chunk_of(width, harness.N)
  assert c8 != entries_quantization.chunk_of(size, harness.N)
  params = {"w": jnp.zeros(_LONG, jnp.float32)}
  grads = harness.make_grads(5, 3, params=params)
  outs, state, layout = harness.device_run(tx(), mesh, grads, params=params)
  e = [np.zeros(_LONG) for _ in range(harness.N)]
  rstate = {"server": None, "shapes": None}
  for t, (g, out) in enumerate(zip(grads, outs)):
    xs = [[np.asarray(g["w"][i], np.float64) + e[i]] for i in
          range(harness.N)]
    mean, sent, rstate = ref(xs, rstate, t, None, harness.N)
    np.testing.assert_allclose(np.asarray(out["w"], np.float64), mean[0],
                               rtol=1e-4, atol=1e-5, err_msg=f"{name} {t}")
    e = [x[0] - s[0] for x, s in zip(xs, sent)]
  err = np.asarray(entries_quantization.codec_state(state).server_error)
  assert err.shape == (harness.N, width)
  np.testing.assert_array_equal(err[:, size:], 0.0)
  for k in range(harness.N):
    mine = np.zeros(width, bool)
    mine[k * c8:(k + 1) * c8] = True
    assert np.all(err[k][~mine] == 0) and np.any(err[k][mine] != 0), k
  four = np.asarray(entries_quantization.codec_state(
    parallel.resize_state(state, layout, 4)).server_error)
  c4 = entries_quantization.chunk_of(width, 4)
  np.testing.assert_allclose(four.sum(axis=0), err.sum(axis=0), rtol=1e-6,
                             atol=1e-6)
  for k in range(4):
    np.testing.assert_array_equal(four[k][:k * c4], 0.0)
    np.testing.assert_array_equal(four[k][(k + 1) * c4:], 0.0)


# Leaves with no common block width: the server stage and the decode
# take the per-element path (scales spread over segments by
# _signs._fill), whose chunk boundaries fall inside leaves.
_NO_WIDTH = {"a": (37, 29), "b": (41, 53), "c": (13, 97), "d": (211, 5)}


def test_onebit_on_leaves_without_a_common_width_equals_the_reference(mesh):
  """onebit's per-element path against the numpy reference over 3 steps
  with worker error feedback: the chunks' scales, read per leaf segment,
  reach every element of it (segments that start before a chunk, inside
  it, and the padding's)."""
  params = {k: jnp.zeros(v, jnp.float32) for k, v in _NO_WIDTH.items()}
  sizes = [int(np.prod(v)) for v in _NO_WIDTH.values()]
  width = entries_quantization.stored_of(sum(sizes))
  assert _signs._chunk_blocks(sizes, width - sum(sizes), _signs.chunk_length(
    width, harness.N)) is None
  grads = harness.make_grads(7, 3, params=params)
  outs, _, _ = harness.device_run(jaxcomm.onebit(axis_name=harness.AXIS),
                                  mesh, grads, params=params)
  keys = sorted(_NO_WIDTH)
  e = {i: [np.zeros(_NO_WIDTH[k]) for k in keys] for i in range(harness.N)}
  rstate = {"server": None, "shapes": None}
  for t, (g, out) in enumerate(zip(grads, outs)):
    xs = [[np.asarray(g[k][i], np.float64) + e[i][j]
           for j, k in enumerate(keys)] for i in range(harness.N)]
    mean, sent, rstate = entries_quantization._onebit_ref_step(
      xs, rstate, t, None, harness.N)
    for j, k in enumerate(keys):
      np.testing.assert_allclose(np.asarray(out[k], np.float64), mean[j],
                                 rtol=1e-4, atol=1e-5, err_msg=f"{k} {t}")
    e = {i: [x - s_ for x, s_ in zip(xs[i], sent[i])]
         for i in range(harness.N)}


def test_fill_spreads_segment_values_exactly():
  """``_signs._fill`` against numpy: each element gets its segment's value
  bit for bit (values of very different magnitudes, NaN-free), starts
  before 0 collapse onto 0, starts past the end are dropped."""
  rng = np.random.default_rng(0)
  vals = (rng.normal(size=(2, 6)) * 10.0 ** rng.integers(-30, 30, (2, 6))
          ).astype(np.float32)
  starts = np.array([-9, -2, 0, 5, 17, 40], np.int32)
  got = np.asarray(_signs._fill(jnp.asarray(vals), jnp.asarray(starts), 30))
  want = np.empty((2, 30), np.float32)
  for j in range(30):
    want[:, j] = vals[:, np.nonzero(np.maximum(starts, 0) <= j)[0][-1]]
  np.testing.assert_array_equal(got, want)


def test_a_server_error_of_the_old_width_is_refused_by_name():
  """A state saved when a long bucket's server error was as wide as the
  bucket (50,500, not its stored 51,200) is refused, naming the cause."""
  params = {"w": jnp.zeros(_LONG, jnp.float32)}
  tx = jaxcomm.onebit(axis_name=None)
  state = tx.init(params)
  codec = state.codec[0]
  assert codec.server_error.shape == (51_200,)
  old = state._replace(codec=(codec._replace(
    server_error=codec.server_error[:50_500]),))
  with pytest.raises(ValueError, match="whole tiles of 1,024"):
    tx.update(params, old, params)


@pytest.mark.parametrize("new", (2, 4, 16))
def test_onebit_server_error_resize_lands_on_the_new_owners(mesh, new):
  # Resizing 8 -> new devices keeps the total server error, and every
  # element of it sits in the chunk its new owner reads (chunk bounds
  # depend on the device count), none elsewhere.
  tx = jaxcomm.onebit()
  _, state, layout = harness.device_run(tx, mesh, harness.make_grads(2, 2))
  old = np.asarray(entries_quantization.codec_state(state).server_error)
  resized = parallel.resize_state(state, layout, new)
  err = np.asarray(entries_quantization.codec_state(resized).server_error)
  length = old.shape[1]
  assert err.shape == (new, length)
  np.testing.assert_allclose(err.sum(axis=0), old.sum(axis=0), rtol=1e-6,
                             atol=1e-6)
  c = _signs.chunk_length(length, new)
  for k in range(new):
    inside = np.zeros(length, bool)
    inside[k * c:(k + 1) * c] = True
    assert np.all(err[k][~inside] == 0)
    np.testing.assert_array_equal(err[k][inside], old.sum(axis=0)[inside])


# ------------------------------------------------------------------ wire --


_BIG = {"w": jnp.zeros((256, 256), jnp.float32)}   # 65536 elements


def _wire(tx, k):
  mesh = _submesh(k)
  hlo = jaxcomm.wire.report(harness.lower_update(tx, mesh, params=_BIG),
                            params=_BIG)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, _BIG, k), n=k,
                                 params=_BIG)
  assert hlo.payload == claim.payload, (k, hlo.payload, claim.payload)
  # Leave out the fused dense psum (one flag float: 4 bytes payload).
  flag = 2.0 * (k - 1) / k * 4
  return hlo.total_sent - flag, hlo.dense_sent


def test_majority_vote_traffic_does_not_grow_with_devices():
  elems = 65536
  bits = {}
  for k in (2, 4, 8):
    sent, _ = _wire(jaxcomm.signsgd(), k)
    bits[k] = 8 * sent / elems
  # Two phases of (n-1)/n packed bits each: 2 (n-1)/n bits per element.
  for k, b in bits.items():
    np.testing.assert_allclose(b, 2 * (k - 1) / k, rtol=1e-3)
  assert bits[8] < 2.0 and bits[8] / bits[2] < 2.0   # all-gather: 7x


def test_onebit_sends_about_a_32nd_of_the_dense_psum():
  for k in (2, 8):
    sent, dense = _wire(jaxcomm.onebit(), k)
    # Packed signs plus one scale per leaf and per chunk.
    assert 31.0 < dense / sent <= 32.0, (k, dense / sent)


def test_quantized_exchange_choice_and_bytes():
  # n <= 3: one all-gather of the codes; n >= 4: all-to-all + all-gather
  # (int8: 8 + 16 bits per element against 8 n; they tie at n = 3).
  for n in (2, 3):
    assert _quantized.plan(4096, 127, n).kind == "gather"
  for n in (4, 8, 64):
    assert _quantized.plan(4096, 127, n).kind == "scatter"
  assert _quantized.plan(4096, 1, 8).sum_bits == 8   # |sum| <= 8: 5 bits
  for k in (2, 4):
    sent, dense = _wire(jaxcomm.int8(exchange="exact"), k)
    # int8 codes (+ 16-bit sums) and a float per 128-element bucket.
    assert dense / sent > 2.5
  # natural: 9-bit codes in two phases (an all-gather would send 63 bits
  # per element at n = 8, more than the 56 of the float32 psum).
  sent, dense = _wire(jaxcomm.natural(), 8)
  np.testing.assert_allclose(8 * sent / 65536, 2 * 9 * 7 / 8, rtol=1e-3)


# ------------------------------------------------------- packing, input --


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
def test_pack_codes_round_trip(bits):
  per = 32 // bits
  m = per * 7
  rng = np.random.RandomState(bits)
  u = rng.randint(0, 2 ** min(bits, 31), size=(3, m)).astype(np.uint32)
  w = _quantized.pack_codes(jnp.asarray(u), bits)
  assert w.shape == (3, m // per) and w.dtype == jnp.uint32
  np.testing.assert_array_equal(_quantized.unpack_codes(w, bits, m), u)


def test_integer_allreduce_is_exact_on_one_device():
  codes = jnp.asarray([-3, 0, 3, 1, -1], jnp.int32)
  np.testing.assert_array_equal(
    _quantized.integer_allreduce(codes, 3, None), codes)


def test_non_floating_input_is_a_value_error():
  with pytest.raises(ValueError, match="x must be a floating"):
    _signs.majority_vote(jnp.arange(40), None)
  with pytest.raises(ValueError, match="codes must be an integer"):
    _quantized.integer_allreduce(jnp.ones(4), 1, None)
  with pytest.raises(ValueError, match="values must be float32"):
    _quantized.natural_allreduce(jnp.arange(4), None, lambda c: c)


def test_natural_round_matches_the_paper_and_keeps_nonfinite():
  rng = np.random.RandomState(5)
  # Normal float32 values over many binades, and exact powers of two.
  x = np.concatenate([
    rng.randn(2000) * 10.0 ** rng.uniform(-30, 30, 2000),
    [1.0, 1.5, -3.0, 2.0 ** -126, -(2.0 ** 100), 0.0]]).astype(np.float32)
  key = jax.random.PRNGKey(3)
  y = np.asarray(jaxcomm.transforms.quantize._natural.natural_round(
    jnp.asarray(x), key))
  np.testing.assert_array_equal(y, entries_quantization.natural_ref(x, key))
  assert y[-6] == 1.0 and y[-3] == 2.0 ** -126 and y[-1] == 0
  # Where the transform departs from the paper's power-of-two rounding:
  # a subnormal rounds to 0 or the smallest normal, the largest binade
  # does not round up to inf, and non-finite values stay non-finite.
  edge = jnp.asarray([-0.0, 1e-40, 3.4e38, np.inf, np.nan], jnp.float32)
  e = np.asarray(jaxcomm.transforms.quantize._natural.natural_round(edge, key))
  assert e[0] == 0 and e[1] in (0.0, np.float32(2.0 ** -126))
  assert np.isfinite(e[2]) and e[2] == np.float32(2.0 ** 127)
  assert np.isinf(e[3]) and not np.isfinite(e[4])


# ---------------------------------------------------------- convergence --


def _least_squares(tx, steps=1500, lr=None):
  """8 devices, each with its own rows of a least-squares problem.

  Returns ``||w_T - w*|| / ||w*||`` with ``w*`` the dense optimum. The
  devices' data are heterogeneous (their local gradients do not vanish at
  ``w*``), so error feedback keeps a residual of the order of the local
  gradients and leaves ``w`` within ``O(lr)`` of ``w*``: the learning rate
  decays (halved every 200 steps) so that this neighbourhood shrinks.
  """
  lr = optax.exponential_decay(0.2, 200, 0.5) if lr is None else lr
  mesh = _submesh(harness.N)
  n, m, d = harness.N, 128, 256
  rng = np.random.RandomState(0)
  a = rng.randn(n, m, d).astype(np.float32)
  # Heterogeneous devices: each fits its own target vector.
  w_true = rng.randn(n, d).astype(np.float32)
  b = np.einsum("nmd,nd->nm", a, w_true).astype(np.float32)
  w_star = np.linalg.lstsq(a.reshape(-1, d).astype(np.float64),
                           b.reshape(-1).astype(np.float64), rcond=None)[0]
  params = {"w": jnp.zeros((d,), jnp.float32)}
  full = optax.chain(tx, optax.sgd(lr))
  layout = parallel.state_layout(full, params, mesh, "data")
  specs = parallel.state_specs(layout, "data")
  state = parallel.init_state(full, params, mesh, "data", layout)

  def run(params, state, a, b):
    local = parallel.to_local(state, layout)
    a, b = a[0], b[0]

    def body(carry, _):
      p, s = carry
      w = jax.lax.pcast(p["w"], ("data",), to="varying")
      g = {"w": a.T @ (a @ w - b) / m}
      u, s = full.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (p, s), _ = jax.lax.scan(body, (params, local), None, length=steps)
    return p, parallel.to_global(s, layout)

  fn = jax.jit(jax.shard_map(run, mesh=mesh,
                             in_specs=(P(), specs, P("data"), P("data")),
                             out_specs=(P(), specs)))
  p, _ = fn(parallel.replicate(params, mesh), state,
            parallel.shard_batch(a, mesh), parallel.shard_batch(b, mesh))
  w = np.asarray(p["w"], np.float64)
  return np.linalg.norm(w - w_star) / np.linalg.norm(w_star)


@pytest.mark.slow
def test_onebit_with_error_feedback_converges_without_it_stalls():
  dense = _least_squares(jaxcomm.mean_gradients())
  ef = _least_squares(jaxcomm.onebit())
  no_ef = _least_squares(jaxcomm.ef_signsgd(error_feedback=False))
  # Measured: dense 3e-7, onebit 1.8e-3, signs without EF 0.66 (the
  # fixed point where the devices' scaled signs cancel is not w*).
  assert dense < 1e-4, dense
  assert ef < 1e-2, ef
  assert no_ef > 0.3 and no_ef > 50 * ef, (ef, no_ef)


def test_onebit_server_scales_each_leaf_segment(mesh):
  """A small leaf sharing a server chunk with a large one: with one scale
  per chunk its summed update was 30x its summed mean gradient after 5
  steps (sign noise at the large leaf's scale); scaled per leaf segment it
  tracks its gradient like the large leaf does."""
  params = {"big": jnp.zeros((64, 64)), "small": jnp.zeros((16, 16))}
  rng = np.random.RandomState(0)
  grads = [{"big": rng.randn(8, 64, 64).astype(np.float32),
            "small": (0.01 * rng.randn(8, 16, 16)).astype(np.float32)}
           for _ in range(5)]
  updates, _, _ = harness.device_run(jaxcomm.onebit(), mesh, grads,
                                     params=params)
  for k in params:
    u = sum(np.asarray(x[k], np.float64) for x in updates)
    g = sum(np.asarray(x[k], np.float64).mean(axis=0) for x in grads)
    ratio = np.linalg.norm(u) / np.linalg.norm(g)
    assert 0.8 < ratio < 1.25, (k, ratio)


@pytest.mark.parametrize("shapes", [{"big": (64, 64), "small": (16, 16)},
                                    {"a": (48, 32), "b": (32, 32)}],
                         ids=["chunk-straddling", "padded"])
def test_onebit_server_on_blocks_equals_the_per_element_server(
    mesh, shapes, monkeypatch):
  """Leaves, padding and chunk length sharing a block width: the server
  stage reads scales per block (no per-element leaf index). Its updates
  and server errors equal the per-element path's (forced by finding no
  common block) over 3 steps, to float rounding of the block sums."""
  params = {k: jnp.zeros(v) for k, v in shapes.items()}
  rng = np.random.RandomState(3)
  grads = [{k: rng.randn(8, *v).astype(np.float32) for k, v in
            shapes.items()} for _ in range(3)]
  sizes = sorted(int(np.prod(v)) for v in shapes.values())
  length = sum(sizes)
  c = _signs.chunk_length(length, 8)
  assert _signs._chunk_blocks(sizes, 8 * c - length, c) is not None
  blocks, s_blocks, _ = harness.device_run(jaxcomm.onebit(), mesh, grads,
                                           params=params)
  monkeypatch.setattr(_signs, "_chunk_blocks", lambda *a: None)
  elems, s_elems, _ = harness.device_run(jaxcomm.onebit(), mesh, grads,
                                         params=params)
  for a, b in zip(blocks, elems):
    for k in shapes:
      np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]),
                                 rtol=1e-5, atol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(s_blocks), jax.tree.leaves(s_elems)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5)


# ------------------------------------------ unbiased codecs, and DIANA --
# Codec.unbiased says E[sent] = x over the codec's own randomness; DIANA
# (error_feedback="diana") needs it. Every registered compressor's codec
# that says so is checked statistically here; a wrong mark fails.

_UNBIASED_KEYS = 2000


def _sent_samples(tx, x, keys=_UNBIASED_KEYS):
  """What the codec of compressor ``tx`` decodes its own message of ``x``
  (one ``[d]`` leaf, one device, no exchange) to, under ``keys`` step keys:
  ``[keys, d]`` float64."""
  spec = jaxcomm.spec_of(tx)
  # A matrix codec (ATOMO) takes no vector: the probe as a 32-row matrix.
  shape = x.shape if spec.codec.accepts(x.shape) else (32, x.size // 32)
  params = {"w": jnp.zeros(shape, jnp.float32)}
  layouts = spec.layouts(params)
  assert len(layouts) == 1 and layouts[0].size == x.size, spec.codec.name
  layout = layouts[0]
  codec = spec.codec
  state = codec.init(layout)
  flat = jnp.asarray(x, jnp.float32)

  def one(key):
    ctx = jaxcomm.Context(axis_name=None, num_devices=1,
                          device_index=jnp.zeros([], jnp.int32),
                          step=jnp.zeros([], jnp.int32), key=key,
                          layout=layout)
    return codec.apply(flat, state, ctx).sent

  ks = jax.random.split(jax.random.PRNGKey(7), keys)
  return np.asarray(jax.jit(jax.vmap(one))(ks), np.float64)


def _bias_ratio(samples, want) -> float:
  """The largest ``|mean - want|`` over its tolerance, per element: 5
  standard errors of the mean (the variance floored at its average over
  the elements: an element whose rare rounding never fired in these draws
  shows no variance, but its bias is far below the floor) plus 1e-6 of
  ``max |want|`` (float32 arithmetic). Above 1: biased."""
  k = samples.shape[0]
  var = samples.var(axis=0, ddof=1)
  se = np.sqrt(np.maximum(var, var.mean()) / k)
  tol = 5.0 * se + 1e-6 * np.abs(want).max()
  return float(np.max(np.abs(samples.mean(axis=0) - want) / tol))


def _probe(d=512, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(d) * np.exp(rng.randn(d))).astype(np.float32)


_COMPRESSORS = {m.attr: m for m in jaxcomm.registry.methods("compressor")
                if m.attr != "mean_gradients"}


@pytest.mark.parametrize("name", sorted(_COMPRESSORS))
def test_codecs_marked_unbiased_are_unbiased(name):
  """Every registered compressor whose codec sets ``unbiased``: the mean
  of its decoded message over 2000 keys is the input within 5 standard
  errors per element, and along ``sign(x)`` (where a shrinking bias, such
  as random-k's unscaled ``k / L``, adds up) within 5 standard errors."""
  m = _COMPRESSORS[name]
  tx = m.factory(**harness.required_args(m), axis_name=None)
  if not jaxcomm.spec_of(tx).codec.unbiased:
    pytest.skip(f"{name}'s codec does not say it is unbiased")
  x = _probe()
  samples = _sent_samples(tx, x)
  want = x.astype(np.float64)
  assert _bias_ratio(samples, want) < 1.0, name
  proj = samples @ np.sign(want)
  se = proj.std(ddof=1) / np.sqrt(proj.size)
  assert abs(proj.mean() - np.abs(want).sum()) < 5 * se + 1e-6 * np.abs(
    want).sum(), name
  # It is a random compressor, not the identity.
  assert samples.var(axis=0).mean() > 1e-4 * np.mean(want * want), name


def test_unbiased_marks_and_the_check_sees_a_bias():
  """Which codecs say they are unbiased, and the statistical check above
  catching the biased ones: random-k sends the chosen coordinates
  unscaled (``E[sent] = (k / L) x``, not ``x``), int8 rounds
  deterministically, TernGrad's clipping cuts the tails."""
  codec = lambda tx: jaxcomm.spec_of(tx).codec
  for tx in (jaxcomm.qsgd(axis_name=None), jaxcomm.terngrad(axis_name=None),
             jaxcomm.natural(axis_name=None)):
    assert codec(tx).unbiased, codec(tx).name
  x = _probe()
  want = x.astype(np.float64)
  for tx in (jaxcomm.randomk(0.5, axis_name=None),
             jaxcomm.int8(axis_name=None),
             jaxcomm.terngrad(clip_sigma=1.0, axis_name=None),
             jaxcomm.topk(0.5, axis_name=None)):
    assert not codec(tx).unbiased, codec(tx).name
    assert _bias_ratio(_sent_samples(tx, x, keys=200), want) > 1.0, \
      codec(tx).name


def test_diana_is_refused_for_biased_codecs_and_shift_rate_needs_it():
  for make, why in (
      (lambda: jaxcomm.topk(0.1, error_feedback="diana"), "biased"),
      (lambda: jaxcomm.randomk(0.1, error_feedback="diana"), "biased"),
      (lambda: jaxcomm.int8(error_feedback="diana"), "biased"),
      (lambda: jaxcomm.terngrad(clip_sigma=2.5, error_feedback="diana"),
       "biased"),
      (lambda: jaxcomm.signsgd(error_feedback="diana"), "not the mean"),
      (lambda: jaxcomm.natural(error_feedback="diana"), "not the mean")):
    with pytest.raises(ValueError, match=r"error_feedback='diana' needs an "
                       rf"unbiased codec.*{why}"):
      make()
  with pytest.raises(ValueError, match="shift_rate=0.5 .*needs "
                     "error_feedback='diana'"):
    jaxcomm.qsgd(shift_rate=0.5)
  with pytest.raises(ValueError, match="momentum"):
    jaxcomm.qsgd(error_feedback="diana", momentum=0.9)


_ALPHA = 0.5


@pytest.mark.parametrize("make", [
  lambda: jaxcomm.qsgd(levels=7, bucket_size=128, error_feedback="diana",
                       shift_rate=_ALPHA, axis_name=None),
  lambda: jaxcomm.terngrad(error_feedback="diana", shift_rate=_ALPHA,
                           axis_name=None),
], ids=["qsgd", "terngrad"])
def test_diana_shift_learns_a_fixed_gradient(make):
  """A fixed gradient g, T steps, 400 seeds: the shift's error ``e_t = g -
  h_t`` moves as ``e' = e - alpha C(e)``, so ``E[h_t] = (1 - (1 -
  alpha)^t) g`` (the paper's closed form with C unbiased); every update
  ``h + C(g - h)`` is unbiased, ``E[u_t] = g``; and ``E||e||^2`` contracts
  (these codecs' variance on this gradient is below ``2 / alpha - 1``:
  ``E||e'||^2 <= (1 - 2 alpha + alpha^2 (1 + omega)) E||e||^2``, about
  0.65 a step for both), so after 30 steps the shift is within 1% of g
  and so is the update."""
  tx = make()
  steps = 30
  g = {"w": jnp.asarray(np.random.RandomState(3).randn(512), jnp.float32)}
  want = np.asarray(g["w"], np.float64)

  def run(key):
    def step(s, _):
      u, s = tx.update(g, s)
      return s, (u["w"], s.estimate[0])
    return jax.lax.scan(step, tx.init(g)._replace(key=key), None,
                        length=steps)[1]

  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(400))
  ups, hs = jax.jit(jax.vmap(run))(keys)
  ups, hs = np.asarray(ups, np.float64), np.asarray(hs, np.float64)
  for t in (0, 1, 2, 4):
    shrink = 1.0 - (1.0 - _ALPHA) ** (t + 1)
    assert _bias_ratio(hs[:, t], shrink * want) < 1.0, t
    assert _bias_ratio(ups[:, t], want) < 1.0, t
  err = np.sum((hs - want) ** 2, axis=-1).mean(axis=0)   # E||e_t||^2
  assert np.all(np.diff(err[:15]) < 0), err
  assert err[0] < np.sum(want ** 2)
  assert err[-1] < 1e-4 * np.sum(want ** 2), err[-1]
  norm = np.sqrt(np.sum(want ** 2))
  rel = np.sqrt(np.sum((hs[:, -1] - want) ** 2, axis=-1)) / norm
  assert rel.max() < 1e-2, rel.max()
  # The update's quantization noise shrinks with the shift's error (plain
  # quantization of g keeps it: ||C(g) - g|| is of the order of ||g||).
  rel_u = np.sqrt(np.sum((ups[:, -1] - want) ** 2, axis=-1)) / norm
  assert rel_u.max() < 1e-2, rel_u.max()
  assert np.sqrt(np.sum((ups[:, 0] - want) ** 2, axis=-1)).min() > 0.3 * norm


def test_diana_on_8_devices_learns_each_device_gradient(mesh):
  """Each device repeats its own gradient: every shift ``h_i`` reaches
  ``g_i``, ``h = mean_i h_i`` stays the aggregate, and the update reaches
  ``mean_i g_i``; a NaN step then leaves ``h_i`` and ``h`` unchanged."""
  tx = jaxcomm.qsgd(levels=7, bucket_size=128, error_feedback="diana",
                    shift_rate=_ALPHA)
  params = {"w": jnp.zeros((64, 48), jnp.float32)}
  # Equal scales on every device (the quantizer's scale is shared: the
  # max over devices of the bucket norms).
  g = {"w": np.random.RandomState(4).randn(harness.N, 64, 48).astype(
    np.float32)}
  upd, state, _ = harness.device_run(tx, mesh, [g] * 30, params=params)
  comp = jaxcomm.compress_states(state)[0]
  h_i = np.asarray(comp.estimate[0], np.float64).reshape(harness.N, 64, 48)
  want = g["w"].astype(np.float64)
  first = np.abs(want).max()
  assert np.abs(h_i - want).max() < 1e-4 * first
  h = np.asarray(comp.estimate_mean[0], np.float64).reshape(64, 48)
  np.testing.assert_allclose(h, h_i.mean(axis=0), atol=1e-6 * first)
  np.testing.assert_allclose(upd[-1]["w"], want.mean(axis=0),
                             atol=1e-4 * first)
  bad = {"w": g["w"].copy()}
  bad["w"][2, 0, 0] = np.nan
  _, after, _ = harness.device_run(tx, mesh, [bad], params=params,
                                   state=state)
  comp2 = jaxcomm.compress_states(after)[0]
  np.testing.assert_array_equal(comp2.estimate[0], comp.estimate[0])
  np.testing.assert_array_equal(comp2.estimate_mean[0],
                                comp.estimate_mean[0])
  assert int(np.asarray(comp2.stats.nonfinite_steps).max()) == 1


# ------------------------------------------------- requantized exchange --


def test_requantized_int8_moves_under_1_7x_less_than_bf16_per_the_hlo():
  """One 1M-element leaf on 8 devices, bytes from the compiled HLO: int8
  (which picks the requantized exchange there) against cast(bfloat16)'s
  two-phase bf16 exchange; int4 about twice as far."""
  mesh = _submesh(8)
  big = {"w": jnp.zeros((1024, 1024), jnp.float32)}

  def sent(tx):
    rep = jaxcomm.wire.report(harness.lower_update(tx, mesh, params=big),
                              params=big)
    return rep.total_sent, rep.payload

  bf16, _ = sent(jaxcomm.cast(jnp.bfloat16))
  int8, kinds = sent(jaxcomm.int8())
  exact, exact_kinds = sent(jaxcomm.int8(exchange="exact"))
  int4, _ = sent(jaxcomm.int4())
  # The requantized exchange: no pmax of shared scales, and codes of the
  # same width in both phases.
  assert set(kinds) == {"all-to-all", "all-gather", "all-reduce"}
  assert kinds["all-to-all"] == kinds["all-gather"]
  assert exact_kinds["all-gather"] == 2 * exact_kinds["all-to-all"]
  assert bf16 / int8 >= 1.7, bf16 / int8
  assert exact / int8 > 1.4, exact / int8
  assert bf16 / int4 >= 3.4, bf16 / int4


@pytest.mark.parametrize("factory,bits", [(jaxcomm.int8, 8),
                                          (jaxcomm.int4, 4)])
def test_exchange_none_takes_the_cheaper_one_per_device_count(factory,
                                                             bits):
  """exchange=None claims what the cheaper exchange claims: the
  requantized one from n = 2 on (at n = 2 the codes tie, and its bf16
  steps cost less than the exact one's pmax of float32 scales), by a
  margin that grows with n (the exact sums widen by log2 n bits)."""
  params = {"w": jnp.zeros((256, 256), jnp.float32)}

  def cost(tx, n):
    return jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, n),
                                  n=n, params=params).total_sent

  auto = factory()
  ratios = []
  for n in (2, 3, 4, 8, 64):
    exact = cost(factory(exchange="exact"), n)
    requant = cost(factory(exchange="requantized"), n)
    assert requant < exact, (n, exact, requant)
    assert cost(auto, n) == requant, n
    ratios.append(exact / requant)
  assert ratios == sorted(ratios) and ratios[-1] > 1.5, ratios
  # One device: no collective, the exact exchange (no server error used).
  assert cost(auto, 1) == 0.0
  # At n = 8 the requantized exchange sends 2 (n-1)/n (b + 16/B) bits.
  n, elems = 8, 65536
  bits_sent = 8 * (cost(factory(exchange="requantized"), n)
                   - 2 * (n - 1) / n * 4) / elems
  np.testing.assert_allclose(bits_sent, 2 * (n - 1) / n * (bits + 16 / 128),
                             rtol=1e-3)


def test_requantized_server_error_closes_the_mass_balance(mesh):
  """Without the owners' server error the balance is off by a visible
  amount; with it, it closes."""
  def owners(state):
    err = np.asarray(entries_quantization.codec_state(state).server_error,
                     np.float64).sum(axis=0)
    return [err[:1152].reshape(3, 3, 8, 16), err[1152:].reshape(64, 48)]

  _server_error_closes_the_mass_balance(
    mesh, jaxcomm.int4(exchange="requantized"), owners)


@pytest.mark.parametrize("bound", [7, 127])
def test_block_codes_never_overflow(bound):
  """Codes stay in [-q, q] and within half a step of the value for blocks
  over 60 decades, a block of one repeated maximum, zero blocks and
  subnormal ones; the step is a bfloat16 value, so decoded values are
  exact in float32."""
  rng = np.random.RandomState(0)
  v = (rng.randn(64, 128) * 10.0 ** rng.uniform(-30, 30, (64, 1))).astype(
    np.float32)
  v[0] = 0.0
  v[1] = np.float32(3e38) * np.sign(rng.randn(128))
  v[2] = np.float32(1e-40) * rng.randn(128)
  v[3, :] = -1.7
  q, s = jax.jit(lambda x: _quantized.block_quantize(x, bound))(v)
  q, s = np.asarray(q), np.asarray(s)
  assert np.abs(q).max() == bound and np.all(np.abs(q) <= bound)
  assert np.all(s.view(np.uint32) & 0xFFFF == 0)            # bf16 steps
  dec = q.astype(np.float64) * s[:, None].astype(np.float64)
  np.testing.assert_array_equal(np.float32(dec), dec)        # exact
  assert np.all(q[0] == 0) and s[0] == 0
  # Subnormal blocks may be flushed to zero (XLA's CPU backend does):
  # within float32's smallest normal number of the value.
  assert np.all(np.abs(dec[2] - v[2]) < np.finfo(np.float32).tiny)
  normal = np.arange(64) != 2
  half = 0.5 * s[normal, None].astype(np.float64)
  assert np.all(np.abs(dec[normal] - v[normal]) <= half)


def test_requantized_allreduce_bad_input():
  x = jnp.ones(100, jnp.float32)
  err = jnp.zeros(100, jnp.float32)
  for kwargs, arg in (({"bits": 6, "block": 128}, "bits"),
                      ({"bits": 3, "block": 128}, "bits"),
                      ({"bits": True, "block": 128}, "bits"),
                      ({"bits": 8, "block": 0}, "block"),
                      ({"bits": 8, "block": 12.0}, "block")):
    with pytest.raises(ValueError, match=arg):
      _quantized.requantized_allreduce(x, err, None, **kwargs)
  with pytest.raises(ValueError, match="server_error"):
    _quantized.requantized_allreduce(x, err[:50], None, bits=8, block=64)
  with pytest.raises(ValueError, match="x must be a floating"):
    _quantized.requantized_allreduce(x.astype(jnp.int32), err, None, bits=8,
                                     block=64)


def test_ef21_with_exchange_none_takes_the_exact_exchange():
  tx = jaxcomm.int8(error_feedback="ef21")
  assert jaxcomm.spec_of(tx).codec.mean_of_sent
  with pytest.raises(ValueError, match="error_feedback='ef21'"):
    jaxcomm.int8(error_feedback="ef21", exchange="requantized")


@pytest.mark.parametrize("words", [4, 256])
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
def test_pack_fields_against_numpy_and_back(bits, words):
  """``collectives.pack_fields``: word ``i`` of ``q`` holds code ``j q + i``
  in bits ``[j bits, (j + 1) bits)`` (numpy's arithmetic), rows packed
  independently; ``unpack_fields`` inverts it; a bad width or length is
  named. ``q = 256``: whole rows of 128 lanes (the other layout)."""
  from jaxcomm import collectives
  per = 32 // bits
  rng = np.random.default_rng(bits)
  u = rng.integers(0, 2 ** bits, size=(3, words * per), dtype=np.uint64)
  q = u.shape[1] // per
  want = np.zeros((3, q), np.uint64)
  for j in range(per):
    want |= u[:, j * q:(j + 1) * q] << np.uint64(j * bits)
  got = jax.jit(lambda a: collectives.pack_fields(a, bits))(
    jnp.asarray(u.astype(np.uint32)))
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.uint32))
  back = collectives.unpack_fields(got, bits, u.shape[1] - 1)
  np.testing.assert_array_equal(np.asarray(back), u[:, :-1])
  with pytest.raises(ValueError, match="bits must divide 32"):
    collectives.pack_fields(jnp.zeros((8,), jnp.uint32), 3)
  if per > 1:
    with pytest.raises(ValueError, match="multiple of"):
      collectives.pack_fields(jnp.zeros((per + 1,), jnp.uint32), bits)


# ------------------------------------------------------------- chunks --


@pytest.mark.parametrize("n", (1, 2, 3, 8))
@pytest.mark.parametrize("length", (1, 31, 33, 4095 * 8, 4096 * 8 + 1,
                                    100_003, 31_107_840, 10**9))
def test_chunks_align_long_vectors_and_pad_little(length, n):
  # The owned chunk follows the documented rule (tests/
  # entries_quantization.chunk_of, written from it), covers the vector,
  # and pads at most 31 elements or 1/64 of the chunk; long chunks are a
  # multiple of 1,024 words of any code width (q = c / (32 / bits)).
  c = _signs.chunk_length(length, n)
  assert c == entries_quantization.chunk_of(length, n)
  c0 = -(-length // n)
  assert c * n >= length and c % 32 == 0
  assert c - c0 <= max(31, c0 // 64)
  if c0 >= 64 * 32768:
    assert c % 32768 == 0


def _data_mesh(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("shape", ((100,), (1000,), (1024,), (3, 1024),
                                   (2, 256, 2)))
def test_psum_as_tiles_of_rows_is_the_sum(shape):
  """The TPU path of ``collectives._core.psum`` (rows of 128 padded to
  whole (8, 128) tiles, one more tile when already whole), run here on 8
  CPU devices: numpy's sum over the devices, in ``x``'s shape; and
  ``psum_layout`` / ``psum_laid_out`` give it too (on CPU the values as
  they are)."""
  from jaxcomm.collectives import _core
  mesh = _data_mesh(8)
  x = np.random.default_rng(len(shape)).normal(size=(8,) + shape)
  x = x.astype(np.float32)

  def run(a):
    a = a[0]
    rows, restore = _core.psum_layout(a)
    return (_core._dense_rows_psum(a, "data")[None],
            restore(_core.psum_laid_out(rows, "data"))[None])

  spec = jax.sharding.PartitionSpec("data")
  tiles, laid = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec,
                                      out_specs=(spec, spec)))(x)
  for got in (tiles, laid):
    assert got.shape == (8,) + shape
    np.testing.assert_allclose(np.asarray(got)[3], x.sum(axis=0),
                               rtol=1e-5, atol=1e-5)
  if int(np.prod(shape)) >= 128:
    rows, _ = _core._tile_rows(jnp.zeros(shape))
    assert rows.shape[1] == 128 and rows.size % 1024 == 0
    assert rows.size > int(np.prod(shape))


@pytest.mark.parametrize("old,new", ((2, 4), (4, 2), (2, 1), (4, 1),
                                     (1, 2)))
def test_int8_state_resizes_between_the_exact_and_requantized_exchanges(
    old, new):
  # int8 takes the exact exchange on 1 and 2 devices and the requantized
  # one on 4: its server error is one row per device on every count, so a
  # state resizes between them and the step runs on it; the server error's
  # total and the residuals' mean are kept (what the update is owed).
  tx = jaxcomm.int8(axis_name="data")
  _, state, layout = harness.device_run(
    tx, _data_mesh(old), harness.make_grads(0, 2, n=old))
  err = np.asarray(entries_quantization.codec_state(state).server_error)
  res = np.asarray(harness.residuals_of(state)[0])
  resized = parallel.resize_state(state, layout, new)
  got = np.asarray(entries_quantization.codec_state(resized).server_error)
  assert err.shape[0] == old and got.shape[0] == new
  np.testing.assert_allclose(got.sum(axis=0), err.sum(axis=0), atol=1e-6)
  got_res = np.asarray(harness.residuals_of(resized)[0])
  np.testing.assert_allclose(got_res.mean(axis=0), res.mean(axis=0),
                             atol=1e-6)
  _, after, _ = harness.device_run(tx, _data_mesh(new),
                                   harness.make_grads(1, 1, n=new),
                                   state=resized)
  assert np.asarray(
    entries_quantization.codec_state(after).server_error).shape[0] == new
