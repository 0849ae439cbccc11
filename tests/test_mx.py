"""OCP microscaling formats and FP8 casts: the codes against ``ml_dtypes``,
blocks within each leaf (and each device's shard of it) against per-tensor
numpy MX, the bytes against bf16 and the claim from the compiled HLO, bad
input."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.transforms.quantize import _mx
from tests import entries_mx
from tests import harness
from tests import sharded


@pytest.mark.parametrize("fmt", sorted(_mx.FORMATS))
def test_blocks_round_as_the_spec_says(fmt):
  """Random blocks over 11 decades, a zero block, a block with one huge
  value (its neighbours flush to zero), exact powers of two and values at
  the saturation edge: the decoded blocks equal the OCP definition
  computed with ml_dtypes' conversions (``entries_mx.mx_round``)."""
  rng = np.random.default_rng(len(fmt))
  x = rng.standard_normal(32 * 12) * np.exp(rng.uniform(-12, 12, 32 * 12))
  x[32:64] = 0.0
  x[64:96] = 1e-3
  x[64] = 1e6
  x[96:128] = 2.0 ** rng.integers(-20, 20, 32)
  x[128:160] = np.linspace(-1.999, 1.999, 32) * 2.0 ** 5
  x = np.concatenate([x, np.zeros(128 - x.size % 128)]).astype(np.float32)
  words = _mx.encode(jnp.asarray(x), fmt)
  assert words.shape == (_mx.words_per(x.size, fmt),)
  got = np.asarray(_mx.decode(words, x.size, fmt), np.float64)
  np.testing.assert_array_equal(got, entries_mx.mx_round(x, fmt))


def _tiny_and_large():
  """A leaf of 300 values (9 whole blocks and 12 left over) next to one
  of 1.0: a block cut from the bucket would take a's last 12 values and
  b's first 20, and MXFP4 would round the 1e-3s to 0 under b's scale."""
  return {"a": jnp.full((300,), 1e-3, jnp.float32),
          "b": jnp.ones((256,), jnp.float32)}


@pytest.mark.parametrize("fmt", sorted(_mx.FORMATS))
def test_blocks_stay_within_each_leaf(fmt):
  """One device: each leaf equals its own per-tensor MX rounding (numpy,
  blocks from the leaf's start, a short last block scaled by its own
  values). Before, a's last 12 entries shared b's block: MXFP4 gave 0
  where per-tensor MXFP4 gives 2^-10 = 0.00097656."""
  tx = jaxcomm.mx(fmt, axis_name=None)
  g = _tiny_and_large()
  upd, _ = tx.update(g, tx.init(g))
  for k in g:
    np.testing.assert_array_equal(np.asarray(upd[k], np.float64),
                                  entries_mx.mx_tensor(g[k], fmt),
                                  err_msg=k)
  np.testing.assert_array_equal(np.asarray(upd["a"])[288:], 2.0 ** -10)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_blocks_stay_within_each_leaf_on_8_devices(fmt, mesh):
  """The two-phase exchange on 8 devices, each device's leaves a ramp
  around its own scale: the update and each device's residual equal the
  per-tensor numpy rounding of every leaf, in both phases."""
  params = {"a": jnp.zeros((300,)), "b": jnp.zeros((256,)),
            "c": jnp.zeros((3, 100)), "d": jnp.zeros((3, 100))}
  n = harness.N
  scale = {"a": 1e-3, "b": 1.0, "c": 3e-2, "d": 5.0}
  grads = {k: np.stack([(1 + i / n) * scale[k] * np.linspace(
    0.5, 1.0, v.size).reshape(v.shape) for i in range(n)]).astype(np.float32)
           for k, v in params.items()}
  tx = jaxcomm.mx(fmt, error_feedback=True)
  upd, state, _ = harness.device_run(tx, mesh, [grads], params=params)
  names = sorted(params)
  res = dict(zip(names, harness.split_buckets(
    jaxcomm.compress_states(state)[0].residual,
    [params[k].shape for k in names])))
  for k in names:
    sent = [entries_mx.mx_tensor(grads[k][i], fmt) for i in range(n)]
    want = entries_mx.mx_tensor(np.sum(sent, axis=0).astype(np.float32),
                                fmt) / n
    np.testing.assert_array_equal(np.asarray(upd[0][k], np.float64), want,
                                  err_msg=k)
    np.testing.assert_allclose(res[k], grads[k] - np.stack(sent),
                               rtol=1e-6, atol=1e-9, err_msg=k)


def test_blocks_stay_within_each_devices_shard(monkeypatch):
  """A sharded step (``dcn`` manual, ``fsdp=4`` auto): each device
  compresses its shards, and its blocks start at each shard's first
  element. ``a`` is 4 rows of 300 split by rows, rows alternating 1e-3
  and 1.0: blocks of the whole leaf would put row 0's last 12 values with
  row 1's first 20, blocks of the device's bucket with b's first 20; in
  MXFP4 both give 0 there. Every shard's update equals per-tensor numpy
  MXFP4 of the shard, the two slices as the exchange's devices."""
  fmt = "mxfp4"
  params = {"a": jnp.zeros((4, 300)), "b": jnp.zeros((1024,))}
  specs = {"a": P("fsdp", None), "b": P("fsdp")}
  monkeypatch.setitem(sharded.MESHES, "mx_dcn2_fsdp4",
                      ({"dcn": 2, "fsdp": 4}, specs))
  monkeypatch.setattr(harness, "battery_params", lambda: params)
  rows = np.where(np.arange(4)[:, None] % 2, 1.0, 1e-3)
  base = {"a": rows * np.linspace(0.75, 1.0, 300),
          "b": np.linspace(0.5, 1.0, 1024)}
  grads = {k: np.stack([(1 + i / 2) * v for i in range(2)]).astype(
    np.float32) for k, v in base.items()}
  tx = jaxcomm.mx(fmt, axis_name=sharded.DATA)
  upd, _, _ = sharded.device_run(tx, "mx_dcn2_fsdp4", [grads])
  blocks = sharded.block_indices("mx_dcn2_fsdp4")
  assert len(blocks) == 4
  for b, idx in enumerate(blocks):
    for k in params:
      sent = [entries_mx.mx_tensor(grads[k][i][idx[k]], fmt)
              for i in range(2)]
      want = entries_mx.mx_tensor(np.sum(sent, axis=0).astype(np.float32),
                                  fmt) / 2
      np.testing.assert_array_equal(
        np.asarray(upd[0][k][idx[k]], np.float64), want,
        err_msg=f"{k}, shard {b}")
  assert np.all(np.asarray(upd[0]["a"])[0, 288:] > 0)


def test_wire_claim_counts_the_short_blocks(mesh):
  """20 leaves of 300 (9 blocks and 12 values each): each is sent as 10
  blocks, 6400 elements, in chunks of 896 (6000 elements would fit 768);
  the claim equals the compiled step's bytes."""
  params = {"l": [jnp.zeros((3, 100)) for _ in range(20)]}
  for fmt in ("mxfp4", "mxfp8"):
    tx = jaxcomm.mx(fmt)
    hlo = jaxcomm.wire.report(harness.lower_update(tx, mesh, params),
                              params=params)
    ops = jaxcomm.wire.claimed(tx, params, harness.N)
    claim = jaxcomm.wire.summarize(ops, n=harness.N, params=params)
    assert hlo.payload == claim.payload, (fmt, hlo.payload, claim.payload)
    want = 4 * harness.N * _mx.words_per(896, fmt)
    assert [b for kind, b in ops if kind == "all-to-all"] == [want], ops


def test_bits_per_element_match_the_format():
  assert _mx.bits_per_element("mxfp8") == 8.25
  assert _mx.bits_per_element("mxfp6") == 6.25
  assert _mx.bits_per_element("mxfp4") == 4.25
  table = _mx.magnitudes("mxfp4")
  np.testing.assert_array_equal(table, [0, .5, 1, 1.5, 2, 3, 4, 6])
  assert _mx.magnitudes("mxfp8")[-1] == 448.0


def test_mx_moves_fewer_bytes_than_bf16_in_the_compiled_step(mesh):
  """One 1M-element leaf on 8 devices, bytes read from the compiled HLO:
  MXFP8 moves 8.25 / 16 of bf16's, MXFP4 4.25 / 16, FP8 8 / 16."""
  params = {"w": jnp.zeros((1024, 1024))}

  def moved(tx):
    payload = jaxcomm.wire.report(harness.lower_update(tx, mesh, params),
                                  params=params).payload
    # Both phases of the exchange, without the fused dense psum's 4-byte
    # non-finite flag (the same for all three).
    return sum(b for kind, b in payload.items() if kind != "all-reduce")

  bf16 = moved(jaxcomm.cast(jnp.bfloat16))
  for tx, ratio in ((jaxcomm.mx("mxfp8"), 8.25 / 16),
                    (jaxcomm.mx("mxfp4"), 4.25 / 16),
                    (jaxcomm.cast("float8_e4m3fn"), 8 / 16)):
    assert math.isclose(moved(tx), bf16 * ratio, rel_tol=1e-3), (
      repr(tx), moved(tx), bf16)


def test_fp8_cast_scales_instead_of_saturating(mesh):
  """E4M3FN has no infinity and its largest value is 448: a mean of 1000
  saturated at 448 (a NaN would have skipped the step). Scaled by a power
  of two first, it is 1000 rounded to E4M3 (1024), not NaN."""
  tx = jaxcomm.cast("float8_e4m3fn", axis_name=None)
  params = {"w": jnp.zeros((16, 16))}
  upd, state = tx.update({"w": jnp.full((16, 16), 1000.0)}, tx.init(params))
  want = float(np.float32(1000 / 8).astype(ml_dtypes.float8_e4m3fn)) * 8
  assert want == 1024.0
  np.testing.assert_array_equal(np.asarray(upd["w"]), want)
  assert int(state.stats.nonfinite_steps) == 0


def _fp8_cast_np(xs, np_dtype):
  """numpy FP8 cast exchange of one bucket (``xs``: [n, L] float64, each
  device's ``g + e``): the shared power of two ``2^k`` with ``max |x| /
  2^k < 2^t <= top / 2``, each device's ``x / (n 2^k)`` rounded to FP8,
  their float32 sum rounded to FP8 again; returns (mean, sent)."""
  n = xs.shape[0]
  top = float(ml_dtypes.finfo(np_dtype).max)
  t = np.frexp(top / 2)[1] - 1
  k = int(np.frexp(np.float32(np.abs(xs).max()))[1]) - t
  low = (np.ldexp(xs, -k) / n).astype(np.float32).astype(np_dtype)
  low = low.astype(np.float64)
  assert np.abs(low).max() <= top / n * 1.125
  total = low.sum(axis=0).astype(np.float32)
  assert np.abs(total).max() < top               # nothing saturates
  mean = np.ldexp(total.astype(np_dtype).astype(np.float64), k)
  return mean, np.ldexp(low * n, k)


@pytest.mark.parametrize("dtype,np_dtype", [
  ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
  ("float8_e5m2", ml_dtypes.float8_e5m2)])
@pytest.mark.parametrize("scale", [1e3, 1e5])
def test_fp8_cast_with_error_feedback_conserves_mass(mesh, dtype, np_dtype,
                                                     scale):
  """``cast("float8_*", error_feedback=True)``, gradients ``scale`` times
  a ramp in ``[0.5, 1]``, the same on all 8 devices, 3 steps: the update
  plus the device mean of the residuals' change is the mean gradient.
  Before, the chunk sums (8 x 125 at g = 1000) were cast to FP8 again and
  saturated at 448 (E5M2: 57344) outside the error feedback: updates of
  448 while the residual stayed 32 (3.9e5 at g = 1e5). Each step equals
  the numpy exchange with the bucket's shared power of two."""
  n = harness.N
  tx = jaxcomm.cast(dtype, error_feedback=True)
  params = harness.battery_params()
  grads = {}
  for k, v in params.items():
    if k == "step":
      grads[k] = np.zeros((n,), np.int32)
      continue
    ramp = np.linspace(0.5, 1.0, v.size, dtype=np.float32).reshape(v.shape)
    grads[k] = np.broadcast_to(np.float32(scale) * ramp,
                               (n,) + v.shape).copy()
  res = np.zeros((n, sum(params[k].size for k in harness.COMPRESSED)))
  state, before = None, [np.zeros((n,) + params[k].shape)
                         for k in harness.COMPRESSED]
  for t in range(3):
    upd, state, _ = harness.device_run(tx, mesh, [grads], state=state)
    after = harness.residuals_of(state)
    g = np.concatenate([grads[k].reshape(n, -1).astype(np.float64)
                        for k in harness.COMPRESSED], axis=1)
    mean, sent = _fp8_cast_np(np.float32(g + res), np_dtype)
    res = np.float32(g + res) - sent
    off = 0
    for j, k in enumerate(harness.COMPRESSED):
      size = params[k].size
      got = np.asarray(upd[0][k], np.float64).reshape(-1)
      np.testing.assert_array_equal(got, mean[off:off + size],
                                    err_msg=f"{k} step {t}")
      change = (after[j] - before[j]).reshape(n, -1).mean(axis=0)
      np.testing.assert_allclose(
        got + change, grads[k][0].reshape(-1), rtol=1e-6,
        err_msg=f"mass of {k} at step {t}")
      np.testing.assert_allclose(after[j].reshape(n, -1),
                                 res[:, off:off + size], rtol=1e-6,
                                 atol=1e-6 * scale)
      off += size
    before = after
  st = jaxcomm.compress_states(state)[0]
  assert int(np.asarray(st.stats.nonfinite_steps).max()) == 0


def test_bad_format_is_named():
  with pytest.raises(ValueError, match="fmt"):
    jaxcomm.mx("mxfp5")
  with pytest.raises(ValueError, match="dtype"):
    jaxcomm.cast("float8_e4m3")
  assert ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max == 6.0


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_e5m2"])
def test_fp8_rounding_by_convert_equals_the_table(fmt):
  """FP8 elements round by XLA's convert: the same codes as rounding to
  the nearest entry of ml_dtypes' table (ties to even, saturating) at
  every midpoint between neighbours, one ulp either side, every table
  value, and beyond the largest."""
  t = _mx.magnitudes(fmt)
  mids = ((t[1:].astype(np.float64) + t[:-1]) / 2).astype(np.float32)
  a = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                      t, np.float32([t[-1] * 1.5, 1e30, 0.0])])
  a = jnp.asarray(a, jnp.float32)
  native = _mx._round_native(a, t, _mx._NATIVE[fmt])
  table = _mx._round_to_table(a, t)
  np.testing.assert_array_equal(np.asarray(native), np.asarray(table))
