"""Tests of jaxcomm.kernels: every kernel interpreted on CPU vs references.

Each kernel runs with ``interpret=True`` and is compared with its jnp
reference and with an independent numpy computation (``np.packbits``,
stable ``np.argsort``, ``np.nonzero``). Sizes stay small: interpret mode is
slow. The last tests lower each kernel for TPU (Mosaic) and GPU (Triton) on
this CPU host, which checks the Python-side lowering only. In between:
every kernel inside an 8-device ``jax.shard_map`` with ``check_vma=True``,
and the ``JAXCOMM_KERNELS`` switch.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm import kernels
from jaxcomm.kernels import _dispatch
from jaxcomm.kernels import bitpack
from jaxcomm.kernels import threshold as threshold_kernels
from jaxcomm.kernels import topk

LENGTHS = (1, 31, 32, 33, 1000, 4097)


def _signal(length, seed=0, zeros_every=7):
  """Normal floats with exact zeros (both signs) sprinkled in."""
  x = np.random.default_rng(seed).standard_normal(length).astype(np.float32)
  x[::zeros_every] = 0.0
  x[3::zeros_every * 2] = -0.0
  return x


def _np_pack(positive):
  """Independent packer: little bit order, little-endian uint32 words."""
  u8 = np.packbits(np.asarray(positive, bool), bitorder="little")
  u8 = np.pad(u8, (0, -len(u8) % 4))
  return u8.view("<u4")


def _np_topk(x, k):
  return np.argsort(-np.abs(x), kind="stable")[:k]


def _np_select(x, threshold, capacity):
  sel = np.nonzero(np.abs(x) >= threshold)[0]
  idx = np.full(capacity, len(x), np.int64)
  idx[:min(capacity, len(sel))] = sel[:capacity]
  vals = np.where(idx < len(x), x[np.minimum(idx, len(x) - 1)], 0)
  return vals, idx, len(sel)


# ---------------------------------------------------------------- bitpack


@pytest.mark.parametrize("length", LENGTHS)
def test_pack_signs_matches_numpy(length):
  x = _signal(length)
  expected = _np_pack(x >= 0)
  outs = {
    "reference": bitpack.pack_signs_reference(x),
    "packbits": bitpack.pack_signs_packbits(x),
    "pallas": bitpack.pack_signs_pallas(x, interpret=True),
    "auto": kernels.pack_signs(x),
    "kernel": kernels.pack_signs(x, use_kernel=True),
  }
  for name, out in outs.items():
    chex.assert_shape(out, (bitpack.num_words(length),))
    assert out.dtype == jnp.uint32, name
    np.testing.assert_array_equal(np.asarray(out), expected, err_msg=name)


def test_pack_signs_zero_is_positive_and_padding_is_zero():
  x = np.zeros(33, np.float32)
  x[1] = -0.0
  x[2] = np.nan      # x >= 0 is false: packs as -1
  x[3] = -1.0
  for out in (bitpack.pack_signs_reference(x),
              bitpack.pack_signs_pallas(x, interpret=True)):
    np.testing.assert_array_equal(
      np.asarray(out), np.array([0xFFFFFFFF & ~0b1100, 1], np.uint32))


def test_pack_signs_many_blocks_bf16_and_shape():
  # 33 blocks of 32 words and a partial one; bf16; a 2-D input is flattened.
  x = _signal(32 * 32 * 33 + 5, seed=1).astype(jnp.bfloat16)
  x = jnp.asarray(x)
  expected = _np_pack(np.asarray(x, np.float32) >= 0)
  out = bitpack.pack_signs_pallas(x, block_words=32, interpret=True)
  np.testing.assert_array_equal(np.asarray(out), expected)
  x2 = x[:32 * 96].reshape(96, 32)
  np.testing.assert_array_equal(
    np.asarray(kernels.pack_signs(x2)), expected[:96])


@pytest.mark.parametrize("length", LENGTHS)
def test_unpack_signs_roundtrip(length):
  x = _signal(length, seed=2)
  words = _np_pack(x >= 0)
  expected = np.where(x >= 0, 1.0, -1.0)
  for out in (bitpack.unpack_signs_reference(words, length),
              bitpack.unpack_signs_pallas(words, length, interpret=True),
              kernels.unpack_signs(words, length, use_kernel=True),
              kernels.unpack_signs(jnp.asarray(words), length)):
    chex.assert_shape(out, (length,))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_unpack_signs_dtype_and_bad_words():
  words = _np_pack(np.arange(40) % 3 == 0)
  out = bitpack.unpack_signs_pallas(words, 40, jnp.bfloat16, interpret=True)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    np.asarray(out, np.float32), np.where(np.arange(40) % 3 == 0, 1, -1))
  with pytest.raises(ValueError, match="need uint32"):
    kernels.unpack_signs(words, 65)
  with pytest.raises(TypeError, match="uint32"):
    kernels.unpack_signs(words.astype(np.float32), 40)


def _np_vote(signs):
  """Majority of +/-1 rows; a tie (even n) gives +1."""
  return signs.sum(axis=0) >= 0


@pytest.mark.parametrize("n_workers", (1, 2, 3, 4, 7))
@pytest.mark.parametrize("length", (1, 33, 1000, 4097))
def test_vote_matches_numpy(n_workers, length):
  rng = np.random.default_rng(n_workers * 10_000 + length)
  signs = np.where(rng.random((n_workers, length)) < 0.5, 1, -1)
  words = np.stack([_np_pack(s > 0) for s in signs])
  expected = _np_pack(_np_vote(signs))
  outs = {
    "reference": bitpack.vote_reference(words, length),
    "bitsliced": bitpack.vote_bitsliced(words, length),
    "pallas": bitpack.vote_pallas(words, length, interpret=True),
    "auto": kernels.vote(words, length),
  }
  for name, out in outs.items():
    assert out.dtype == jnp.uint32, name
    np.testing.assert_array_equal(np.asarray(out), expected, err_msg=name)
  np.testing.assert_array_equal(
    np.asarray(kernels.count_votes(words, length)), signs.sum(axis=0))


def test_vote_ties_resolve_to_plus_one_and_padding_is_cleared():
  length = 40
  pos = _np_pack(np.ones(length, bool))
  neg = _np_pack(np.zeros(length, bool))
  # Even n, exact tie everywhere: +1 everywhere, padding bits 0.
  words = np.stack([pos, neg, neg, pos])
  # Garbage in the padding bits of every row must not leak into the result.
  words[:, -1] |= np.uint32(0xFFFFFF00)
  expected = _np_pack(np.ones(length, bool))
  for fn in (bitpack.vote_reference, bitpack.vote_bitsliced,
             functools.partial(bitpack.vote_pallas, interpret=True)):
    np.testing.assert_array_equal(np.asarray(fn(words, length)), expected)


def test_vote_many_workers_uses_loop():
  n_workers, length = 70, 100   # above the unroll limit: fori_loop path
  rng = np.random.default_rng(5)
  signs = np.where(rng.random((n_workers, length)) < 0.5, 1, -1)
  words = np.stack([_np_pack(s > 0) for s in signs])
  expected = _np_pack(_np_vote(signs))
  for out in (bitpack.vote_bitsliced(words, length),
              bitpack.vote_pallas(words, length, interpret=True)):
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_vote_bad_shape():
  with pytest.raises(ValueError, match="n_workers"):
    kernels.vote(np.zeros((3, 2), np.uint32), 100)


def test_dispatch_on_cpu(monkeypatch):
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)
  assert jax.default_backend() == "cpu"
  assert _dispatch.resolve("pack_signs", None, False) == (False, False)
  assert _dispatch.resolve("pack_signs", True, False) == (True, True)
  assert _dispatch.resolve("pack_signs", False, True) == (False, True)
  assert _dispatch.resolve("topk_abs", None, False, k=1) == (False, False)


def test_dispatchers_under_jit():
  x = _signal(100, seed=3)

  @jax.jit
  def roundtrip(x):
    words = kernels.pack_signs(x)
    voted = kernels.vote(jnp.stack([words, words, words]), x.size)
    return kernels.unpack_signs(voted, x.size)

  np.testing.assert_array_equal(np.asarray(roundtrip(x)),
                                np.where(x >= 0, 1.0, -1.0))


# ------------------------------------------------------------------- topk


TOPK_CASES = (
  (1, 1), (31, 5), (33, 33), (1000, 1), (1000, 100),
  (4097, 100),    # 3 blocks of 2048, last one mostly padding
  (4097, 2047),   # picks just under the block size
  (4097, 3000),   # k larger than a block: no per-block selection to do
  (4097, 4097),   # k == length
)


@pytest.mark.parametrize("length,k", TOPK_CASES)
def test_topk_abs_matches_numpy(length, k):
  x = _signal(length, seed=length + k)
  expected = _np_topk(x, k)
  outs = {
    "reference": topk.topk_abs_reference(x, k),
    "pallas": topk.topk_abs_pallas(x, k, block_size=2048, interpret=True),
    "auto": kernels.topk_abs(x, k),
  }
  for name, (values, indices) in outs.items():
    chex.assert_shape((values, indices), (k,))
    assert indices.dtype == jnp.int32, name
    np.testing.assert_array_equal(np.asarray(indices), expected,
                                  err_msg=name)
    np.testing.assert_array_equal(np.asarray(values), x[expected],
                                  err_msg=name)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_topk_abs_of_magnitudes(use_kernel):
  """``nonnegative=True`` (magnitudes read as they are) selects what the
  signed input selects, lower index first among ties, under jit and on the
  kernel path (interpreted)."""
  x = _signal(5000, seed=3)
  mag = np.abs(x)
  expected = _np_topk(x, 50)
  f = jax.jit(lambda m: topk.topk_abs(m, 50, nonnegative=True,
                                      use_kernel=use_kernel,
                                      interpret=use_kernel))
  values, indices = f(mag)
  np.testing.assert_array_equal(np.asarray(indices), expected)
  np.testing.assert_array_equal(np.asarray(values), mag[expected])
  ((gv, gi),) = topk.topk_abs_groups(mag, [(1000, 2, 2000, 50)],
                                     nonnegative=True)
  for row in range(2):
    seg = mag[1000 + 2000 * row:1000 + 2000 * (row + 1)]
    want = 1000 + 2000 * row + _np_topk(seg, 50)
    np.testing.assert_array_equal(np.asarray(gi[row]), want)
    np.testing.assert_array_equal(np.asarray(gv[row]), mag[want])


@pytest.mark.parametrize("length,k", ((300, 40), (5000, 64)))
def test_topk_abs_ties(length, k):
  # Few distinct magnitudes: many ties at the k-th value.
  rng = np.random.default_rng(length)
  x = rng.integers(-3, 4, length).astype(np.float32)
  expected = _np_topk(x, k)
  for values, indices in (topk.topk_abs_reference(x, k),
                          topk.topk_abs_pallas(x, k, interpret=True)):
    # The selected magnitudes are right whatever the tie rule...
    np.testing.assert_array_equal(np.sort(np.abs(np.asarray(values))),
                                  np.sort(np.abs(x[expected])))
    # ...and the documented rule (lower index first) gives these indices.
    np.testing.assert_array_equal(np.asarray(indices), expected)


def test_topk_abs_all_zero():
  x = np.zeros(3000, np.float32)
  for values, indices in (topk.topk_abs_reference(x, 10),
                          topk.topk_abs_pallas(x, 10, interpret=True)):
    np.testing.assert_array_equal(np.asarray(indices), np.arange(10))
    np.testing.assert_array_equal(np.asarray(values), np.zeros(10))


def test_topk_abs_approximate_candidates():
  x = _signal(4097 * 4, seed=9)
  values, indices = topk.topk_abs_pallas(x, 50, block_size=2048,
                                         candidates_per_block=16,
                                         interpret=True)
  indices = np.asarray(indices)
  assert len(np.unique(indices)) == 50
  np.testing.assert_array_equal(np.asarray(values), x[indices])
  mags = np.abs(np.asarray(values))
  assert np.all(np.diff(mags) <= 0)
  # 16 candidates from each 2048-block: ~6 of the top-50 fall in a block.
  assert len(np.intersect1d(indices, _np_topk(x, 50))) >= 45
  # Too few candidates per block are raised so that k of them exist.
  _, indices = topk.topk_abs_pallas(x, 50, block_size=4096,
                                    candidates_per_block=1, interpret=True)
  assert len(np.unique(np.asarray(indices))) == 50


BRACKET_CASES = (
  ("normal", 20_000, 10), ("normal", 20_000, 300), ("normal", 100_000, 7),
  ("sparse", 20_000, 200),      # fewer nonzeros than k: ties at zero
  ("integers", 20_000, 150),    # few distinct magnitudes: ties at the k-th
  ("huge", 20_000, 50),         # 1e30 scale and an infinity
  ("zeros", 10_000, 100), ("constant", 10_000, 100),
  ("subnormal", 20_000, 40),
  ("small", 300, 40),           # no selection to gain: lax.top_k
)


def _bracket_input(kind, length, k, seed=0):
  rng = np.random.default_rng(seed + length + k)
  if kind == "normal":
    return rng.standard_normal(length).astype(np.float32)
  if kind == "sparse":
    x = np.zeros(length, np.float32)
    x[rng.choice(length, k // 2, replace=False)] = rng.standard_normal(k // 2)
    return x
  if kind == "integers":
    return rng.integers(-3, 4, length).astype(np.float32)
  if kind == "huge":
    x = (rng.standard_normal(length) * 1e30).astype(np.float32)
    x[length // 3] = -np.inf
    return x
  if kind == "zeros":
    return np.zeros(length, np.float32)
  if kind == "constant":
    return np.full(length, -3.0, np.float32)
  if kind == "subnormal":
    return (rng.standard_normal(length) * 1e-40).astype(np.float32)
  return rng.standard_normal(length).astype(np.float32)


@pytest.mark.parametrize("kind,length,k", BRACKET_CASES)
def test_topk_abs_bracketed_is_exact(kind, length, k):
  # Independent reference: a stable numpy sort by decreasing |x| (lower
  # index first among ties), whatever the ties and magnitudes.
  x = _bracket_input(kind, length, k)
  expected = _np_topk(x, k)
  values, indices = topk.topk_abs_bracketed(x, k)
  np.testing.assert_array_equal(np.asarray(indices), expected)
  np.testing.assert_array_equal(np.asarray(values), x[expected])


def test_topk_abs_bracketed_batched_rows():
  # Rows of a bucket (one vmap): each row's own search, ties included.
  rows = np.stack([_bracket_input(kind, 20_000, 100)
                   for kind in ("normal", "sparse", "zeros", "integers")])
  values, indices = jax.jit(jax.vmap(
    lambda r: topk.topk_abs_bracketed(r, 100)))(rows)
  for r in range(rows.shape[0]):
    expected = _np_topk(rows[r], 100)
    np.testing.assert_array_equal(np.asarray(indices[r]), expected)
    np.testing.assert_array_equal(np.asarray(values[r]), rows[r][expected])


def test_topk_abs_segments_is_exact_per_segment():
  # Groups of equal segments side by side, each with its own k and its
  # own kind of input (ties, zeros, huge values); every segment's result
  # against a stable numpy sort of that segment alone.
  parts, groups, off = [], [], 0
  for kind, count, size, k in (("normal", 3, 5000, 40),
                               ("sparse", 2, 4000, 60),
                               ("integers", 1, 6000, 700),
                               ("zeros", 2, 3000, 10),
                               ("huge", 1, 20_000, 5),
                               ("normal", 2, 300, 100)):   # k near size
    for r in range(count):
      parts.append(_bracket_input(kind, size, k, seed=r))
    groups.append((off, count, size, k))
    off += count * size
  x = np.concatenate(parts)
  out = jax.jit(lambda v: topk.topk_abs_segments(v, groups))(x)
  for (o, count, size, k), (values, indices) in zip(groups, out):
    chex.assert_shape((values, indices), (count, k))
    for r in range(count):
      start = o + r * size
      expected = start + _np_topk(x[start:start + size], k)
      np.testing.assert_array_equal(np.asarray(indices[r]), expected)
      np.testing.assert_array_equal(np.asarray(values[r]), x[expected])


def test_segment_ids_and_bad_bounds():
  # Empty segments included: each position's segment, as numpy's
  # searchsorted of the boundaries gives it.
  bounds = (0, 3, 3, 7, 8, 8, 12)
  want = np.searchsorted(np.asarray(bounds[1:]), np.arange(12), "right")
  np.testing.assert_array_equal(np.asarray(topk.segment_ids(bounds)), want)
  for bad in ((1, 4), (0, 5, 3), (0,)):
    with pytest.raises(ValueError, match="bounds must be"):
      topk.segment_ids(bad)
  # Narrower ids: the same values in the type narrowest_ids picks.
  for segments, dtype in ((6, np.int8), (128, np.int8), (129, np.int16),
                          (40_000, np.int32)):
    assert threshold_kernels.narrowest_ids(segments) == dtype, segments
  narrow = threshold_kernels.narrowest_ids(len(bounds) - 1)
  ids = topk.segment_ids(bounds, narrow)
  assert ids.dtype == np.int8
  np.testing.assert_array_equal(np.asarray(ids), want)
  many = tuple(range(0, 3 * 200 + 1, 3))   # 200 segments of 3
  with pytest.raises(ValueError, match="do not fit"):
    topk.segment_ids(many, np.int8)
  np.testing.assert_array_equal(
    np.asarray(topk.segment_ids(many, np.int16)), np.arange(600) // 3)
  x = np.ones(10, np.float32)
  words = topk.threshold_mask(x, 0.5)
  with pytest.raises(ValueError, match="bounds must end"):
    topk.compact_segments(x, words, (0, 4, 9), (2, 2))
  with pytest.raises(ValueError, match="capacities must"):
    topk.compact_segments(x, words, (0, 4, 10), (2,))
  with pytest.raises(ValueError, match="cover x contiguously"):
    topk.topk_abs_segments(x, [(1, 1, 9, 2)])


def test_topk_abs_groups_same_on_every_path(monkeypatch):
  # The dispatcher's two paths (segments searched together, as on a GPU;
  # per group, as on CPU) give the same exact result, positions in x.
  groups = [(0, 2, 5000, 30), (10_000, 1, 3000, 700), (13_000, 3, 300, 4)]
  x = _bracket_input("integers", 13_900, 30, seed=5)
  plain = topk.topk_abs_groups(x, groups)
  monkeypatch.setattr(_dispatch, "auto_bracketed_topk",
                      lambda backend, k=None: True)
  searched = topk.topk_abs_groups(x, groups)
  for (off, count, size, k), (v1, i1), (v2, i2) in zip(groups, plain,
                                                        searched):
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i2))
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(v2))
    for r in range(count):
      start = off + r * size
      np.testing.assert_array_equal(
        np.asarray(i1[r]), start + _np_topk(x[start:start + size], k))


def test_topk_abs_bracketed_on_gpu_dispatch():
  # The jnp path of topk_abs is the bracketed one on GPU only, and only
  # where it selects from at least 4x its candidates.
  assert _dispatch.auto_bracketed_topk("gpu", 512)
  assert not _dispatch.auto_bracketed_topk("gpu", 511)
  assert not _dispatch.auto_bracketed_topk("cpu", 10_000)
  assert not _dispatch.auto_bracketed_topk("tpu", 10_000)
  assert topk.bracket_pays(100, 4 * (2 * 100 + 64) + 1)
  assert not topk.bracket_pays(100, 4 * (2 * 100 + 64))


def test_topk_abs_bad_k():
  with pytest.raises(ValueError, match="k must be"):
    kernels.topk_abs(np.ones(5, np.float32), 6)


@pytest.mark.parametrize("length", LENGTHS)
def test_threshold_select_matches_numpy(length):
  x = _signal(length, seed=11)
  for threshold in (0.0, 0.7, 1e9):
    for capacity in sorted({1, max(1, length // 3), length + 3}):
      expected = _np_select(x, threshold, capacity)
      outs = {
        "reference": topk.threshold_select_reference(x, threshold, capacity),
        "packed": topk.threshold_select_packed(x, threshold, capacity),
        "auto": kernels.threshold_select(x, threshold, capacity),
      }
      if capacity == max(1, length // 3):   # the kernel path, once per size
        outs["pallas"] = topk.threshold_select_pallas(
          x, threshold, capacity, interpret=True)
      for name, (values, indices, count) in outs.items():
        msg = f"{name} threshold={threshold} capacity={capacity}"
        assert indices.dtype == jnp.int32, msg
        np.testing.assert_array_equal(np.asarray(values), expected[0],
                                      err_msg=msg)
        np.testing.assert_array_equal(np.asarray(indices), expected[1],
                                      err_msg=msg)
        assert int(count) == expected[2], msg


def test_threshold_select_all_zero_and_overflow():
  x = np.zeros(1000, np.float32)
  # threshold 0 keeps everything (|0| >= 0), overflowing the buffer.
  for fn in (topk.threshold_select_reference, topk.threshold_select_packed,
             functools.partial(topk.threshold_select_pallas,
                               interpret=True)):
    values, indices, count = fn(x, 0.0, 16)
    np.testing.assert_array_equal(np.asarray(indices), np.arange(16))
    assert int(count) == 1000
    values, indices, count = fn(x, 1e-30, 16)
    np.testing.assert_array_equal(np.asarray(indices), np.full(16, 1000))
    np.testing.assert_array_equal(np.asarray(values), np.zeros(16))
    assert int(count) == 0


def test_threshold_select_traced_threshold_and_sentinel_drops():
  x = _signal(500, seed=12)

  @jax.jit
  def densify(x, t):
    values, indices, _ = kernels.threshold_select(x, t, 600)
    return jnp.zeros_like(x).at[indices].add(values, mode="drop")

  np.testing.assert_array_equal(np.asarray(densify(x, 1.0)),
                                np.where(np.abs(x) >= 1.0, x, 0))


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_compact_segments_matches_numpy(seed):
  # Segments of odd sizes (boundaries inside words), capacities under and
  # over each segment's count, an empty-of-selection segment; numpy's
  # np.nonzero per segment is the reference.
  rng = np.random.default_rng(seed)
  sizes = [1, 31, 64, 100, 7, 333, 40, 1000]
  bounds = tuple(int(b) for b in np.cumsum([0] + sizes))
  x = rng.standard_normal(bounds[-1]).astype(np.float32)
  x[bounds[4]:bounds[5]] = 0.0                     # nothing selected there
  caps = tuple(int(c) for c in rng.integers(1, 60, len(sizes)))
  t = 0.8
  words = topk.threshold_mask(x, t)
  vals, idx, counts = topk.compact_segments(x, words, bounds, caps)
  vals, idx, counts = map(np.asarray, (vals, idx, counts))
  start = 0
  for j, cap in enumerate(caps):
    lo, hi = bounds[j], bounds[j + 1]
    sel = lo + np.nonzero(np.abs(x[lo:hi]) >= t)[0]
    assert counts[j] == len(sel)
    want = np.full(cap, len(x))
    want[:min(cap, len(sel))] = sel[:cap]
    np.testing.assert_array_equal(idx[start:start + cap], want)
    np.testing.assert_array_equal(
      vals[start:start + cap], np.where(want < len(x), x[np.minimum(
        want, len(x) - 1)], 0.0))
    start += cap


def test_threshold_mask_kernel_matches_reference():
  x = _signal(32 * 64 + 3, seed=13)
  np.testing.assert_array_equal(
    np.asarray(topk.threshold_mask_pallas(x, 0.5, block_words=32,
                                          interpret=True)),
    _np_pack(np.abs(x) >= 0.5))


def test_sampled_threshold():
  x = np.random.default_rng(14).standard_normal(20_000).astype(np.float32)
  k = 200
  kth = np.sort(np.abs(x))[-k]
  # The whole array as the sample: the exact k-th largest magnitude.
  assert float(kernels.sampled_threshold(x, k, None, x.size)) == kth
  for key in (None, jax.random.key(0)):
    t = kernels.sampled_threshold(x, k, key, 4000)
    assert t.dtype == jnp.float32 and t.shape == ()
    kept = int((np.abs(x) >= float(t)).sum())
    assert k / 2 <= kept <= 2 * k, (key, kept)


# ------------------------------------------------- inside shard_map (vma)


SHARD_LENGTH = 1000
SHARD_WORKERS = 5


def _shard_ops(kernel: bool):
  """Each dispatcher on one device's data, kernel or jnp path forced.

  Each takes the device's block ``x`` (float32[SHARD_WORKERS, SHARD_LENGTH])
  and returns a tuple of arrays.
  """
  length = SHARD_LENGTH

  def pack(x):
    return (kernels.pack_signs(x[0], use_kernel=kernel),)

  def unpack(x):
    words = bitpack.pack_signs_reference(x[0])
    return (kernels.unpack_signs(words, length, use_kernel=kernel),)

  def vote(x):
    words = jax.vmap(bitpack.pack_signs_reference)(x)
    return (kernels.vote(words, length, use_kernel=kernel),)

  def vote_gathered(x):
    # The signSGD pattern: every device's packed signs, all-gathered.
    words = lax.all_gather(bitpack.pack_signs_reference(x[0]), "data")
    return (kernels.vote(words, length, use_kernel=kernel),)

  def topk_abs(x):
    return kernels.topk_abs(x[0], 16, use_kernel=kernel)

  def threshold_select(x):
    # A constant (invariant) and a per-device (varying) threshold.
    fixed = kernels.threshold_select(x[0], 1.5, 64, use_kernel=kernel)
    t = jnp.max(jnp.abs(x[1])) / 2
    own = kernels.threshold_select(x[0], t, 64, use_kernel=kernel)
    return fixed + own

  def sampled_threshold(x):
    return (kernels.sampled_threshold(x[0], 40, None, length,
                                      use_kernel=kernel),
            kernels.sampled_threshold(x[0], 40, jax.random.key(1), 500,
                                      use_kernel=kernel))

  return {"pack_signs": pack, "unpack_signs": unpack, "vote": vote,
          "vote_gathered": vote_gathered, "topk_abs": topk_abs,
          "threshold_select": threshold_select,
          "sampled_threshold": sampled_threshold}


def _per_device_signal(n_dev):
  x = np.random.default_rng(21).standard_normal(
    (n_dev, SHARD_WORKERS, SHARD_LENGTH)).astype(np.float32)
  x[:, :, ::9] = 0.0
  return x


@pytest.mark.parametrize("name", sorted(_shard_ops(True)))
def test_kernels_inside_shard_map_check_vma(mesh, name):
  """Per-device data, varying in, varying out, equal to the jnp path."""
  n_dev = mesh.shape["data"]
  x = _per_device_signal(n_dev)
  kernel_op, jnp_op = _shard_ops(True)[name], _shard_ops(False)[name]
  typed = []

  def body(xb):
    outs = kernel_op(xb[0])
    typed.append([_dispatch.varying_axes(o) for o in outs])
    return tuple(o[None] for o in outs)

  def reference(xb):
    return tuple(o[None] for o in jnp_op(xb[0]))

  def shard(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                 out_specs=P("data"), check_vma=True))

  run = shard(body)
  outs = run(x)
  assert "pallas_call" in str(jax.make_jaxpr(run)(x))
  assert "pallas_call" not in str(jax.make_jaxpr(shard(reference))(x))
  assert all(axes == {"data"} for axes in typed[0]), typed
  expected = shard(reference)(x)
  assert len(outs) == len(expected)
  for i, (got, want) in enumerate(zip(outs, expected)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=f"{name} output {i}")
  if name != "vote_gathered":   # per device, outside shard_map too
    for d in range(n_dev):
      for got, want in zip(outs, jnp_op(x[d])):
        np.testing.assert_array_equal(np.asarray(got[d]), np.asarray(want))


@pytest.mark.parametrize("name", sorted(set(_shard_ops(True))
                                        - {"vote_gathered"}))
def test_kernels_inside_shard_map_invariant_inputs(mesh, name):
  """Replicated inputs give replicated outputs: out_specs=P() type-checks."""
  x = _per_device_signal(1)[0]
  kernel_op, jnp_op = _shard_ops(True)[name], _shard_ops(False)[name]
  typed = []

  def body(xb):
    outs = kernel_op(xb)
    typed.append([_dispatch.varying_axes(o) for o in outs])
    return outs

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                              check_vma=True))
  outs = run(x)
  assert all(not axes for axes in typed[0]), typed
  for got, want in zip(outs, jnp_op(x)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vote_many_workers_inside_shard_map(mesh):
  # Above the unroll limit: the kernel's fori_loop runs on varying data.
  n_workers, length = 70, 64
  rng = np.random.default_rng(22)
  signs = rng.random((mesh.shape["data"], n_workers, length)) < 0.5
  words = np.stack([np.stack([_np_pack(s) for s in dev]) for dev in signs])

  def body(w):
    return kernels.vote(w[0], length, use_kernel=True)[None]

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                              out_specs=P("data"), check_vma=True))(words)
  for d in range(mesh.shape["data"]):
    expected = _np_pack(_np_vote(np.where(signs[d], 1, -1)))
    np.testing.assert_array_equal(np.asarray(out[d]), expected)


# ------------------------------------------------------ JAXCOMM_KERNELS


def _dispatchers():
  """Every public dispatcher, on small inputs, as ``name -> (fn, args)``."""
  x = jnp.asarray(_signal(3000, seed=31))
  words = bitpack.pack_signs_reference(x)
  return {
    "pack_signs": (kernels.pack_signs, (x,)),
    "unpack_signs": (lambda w: kernels.unpack_signs(w, 3000), (words,)),
    "vote": (lambda w: kernels.vote(w, 3000), (jnp.stack([words] * 3),)),
    "topk_abs": (lambda x: kernels.topk_abs(x, 16), (x,)),
    "threshold_select": (lambda x: kernels.threshold_select(x, 1.0, 64),
                         (x,)),
    "sampled_threshold": (
      lambda x: kernels.sampled_threshold(x, 16, None, 3000), (x,)),
  }


def _fresh(fn):
  """A new function object: jit's trace cache is keyed on the function."""
  return lambda *args: fn(*args)


def _runs_kernel(fn, args):
  return "pallas_call" in str(jax.make_jaxpr(_fresh(fn))(*args))


@pytest.mark.parametrize("name", sorted(_dispatchers()))
def test_env_switch_picks_the_path(monkeypatch, name):
  fn, args = _dispatchers()[name]
  monkeypatch.setenv("JAXCOMM_KERNELS", "always")
  assert _runs_kernel(fn, args)
  kernel_out = jax.jit(_fresh(fn))(*args)
  monkeypatch.setenv("JAXCOMM_KERNELS", "never")
  assert not _runs_kernel(fn, args)
  chex.assert_trees_all_equal(kernel_out, jax.jit(_fresh(fn))(*args))
  for auto in ("auto", " AUTO ", ""):      # the default on CPU: jnp
    monkeypatch.setenv("JAXCOMM_KERNELS", auto)
    assert not _runs_kernel(fn, args)
  monkeypatch.delenv("JAXCOMM_KERNELS")
  assert not _runs_kernel(fn, args)


def test_explicit_use_kernel_overrides_env(monkeypatch):
  x = jnp.asarray(_signal(500, seed=32))
  monkeypatch.setenv("JAXCOMM_KERNELS", "never")
  assert _runs_kernel(lambda x: kernels.pack_signs(x, use_kernel=True), (x,))
  assert _runs_kernel(lambda x: kernels.topk_abs(x, 8, use_kernel=True),
                      (x,))
  monkeypatch.setenv("JAXCOMM_KERNELS", "always")
  assert not _runs_kernel(
    lambda x: kernels.pack_signs(x, use_kernel=False), (x,))
  assert not _runs_kernel(
    lambda x: kernels.threshold_select(x, 1.0, 8, use_kernel=False), (x,))


def test_env_switch_bad_value(monkeypatch):
  x = jnp.ones((64,), jnp.float32)
  monkeypatch.setenv("JAXCOMM_KERNELS", "sometimes")
  for call in (kernels.mode, lambda: kernels.pack_signs(x),
               lambda: kernels.topk_abs(x, 4, use_kernel=False)):
    with pytest.raises(ValueError,
                       match="JAXCOMM_KERNELS.*auto, always, never"):
      call()


def test_auto_table():
  auto = _dispatch.auto_uses_kernel
  for backend in ("cpu", "gpu", "tpu", "METAL"):
    for op in ("pack_signs", "unpack_signs", "vote", "threshold_select"):
      # TPU's vote: the kernel, by the compiler's estimate.
      want = op == "vote" and backend == "tpu"
      assert auto(op, backend) == want, (op, backend)
  assert not auto("topk_abs", "cpu", k=1)
  for backend in ("gpu", "tpu"):
    assert auto("topk_abs", backend, k=16)
    assert auto("topk_abs", backend, k=64)
    assert not auto("topk_abs", backend, k=65)
    assert not auto("topk_abs", backend, k=1024)
  with pytest.raises(ValueError, match="unknown kernel op"):
    auto("sort", "gpu")


# ---------------------------------------------------------------- lowering


def _lowering_cases():
  x = jnp.ones((5000,), jnp.float32)
  words = jnp.ones((157,), jnp.uint32)
  return {
    "pack_signs": (functools.partial(bitpack.pack_signs_pallas), (x,)),
    "unpack_signs": (functools.partial(bitpack.unpack_signs_pallas,
                                       length=5000), (words,)),
    "vote": (functools.partial(bitpack.vote_pallas, length=5000),
             (jnp.stack([words] * 3),)),
    "topk_abs": (functools.partial(topk.topk_abs_pallas, k=40), (x,)),
    "threshold_select": (functools.partial(topk.threshold_select_pallas,
                                           capacity=64), (x, 0.5)),
  }


_NO_GPU = "No supported GPU devices found"


def _abstract_gpu_mesh(mesh=None):
  """An abstract mesh on an abstract H100 (None where JAX has no such API).

  From JAX 0.11 the Triton lowering asks for a GPU's compute capability and,
  with no GPU present, for an abstract GPU device
  (``jax.sharding.AbstractDevice`` in an abstract mesh) to read it from.
  ``mesh``: the axes to copy (default: one device, one Explicit axis).
  """
  if not hasattr(jax.sharding, "AbstractDevice"):
    return None
  if mesh is None:
    sizes, names = (1,), ("gpu",)
    types = (jax.sharding.AxisType.Explicit,)
  else:
    sizes, names = tuple(mesh.shape.values()), tuple(mesh.axis_names)
    types = tuple(mesh.axis_types)
  try:
    device = jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    return jax.sharding.AbstractMesh(sizes, names, axis_types=types,
                                     abstract_device=device)
  except TypeError:          # a JAX whose AbstractMesh takes no device
    return None


def _lower(fn, args, platform, abstract_mesh=None):
  """Lowers for ``platform``; for GPU, on an abstract H100 where JAX has it.
  Skips the test where this jaxlib cannot lower for ``platform``."""
  def lower():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))

  if platform == "cuda" and abstract_mesh is None:
    abstract_mesh = _abstract_gpu_mesh()
  try:
    if platform != "cuda" or abstract_mesh is None:
      return lower()
    with jax.sharding.use_abstract_mesh(abstract_mesh):
      return lower()
  except ImportError as e:   # jaxlib built without that backend's dialects
    pytest.skip(f"no {platform} lowering in this jaxlib: {e}")
  except RuntimeError as e:
    if _NO_GPU not in str(e):
      raise
    pytest.skip(f"this JAX lowers Triton kernels only for a GPU it can "
                f"name, and none could be given: {e}")


@pytest.mark.parametrize("platform,backend,marker", (
  ("tpu", "tpu", "tpu_custom_call"), ("cuda", "gpu", "triton")))
@pytest.mark.parametrize("name", sorted(_lowering_cases()))
def test_kernels_lower_for_accelerators(name, platform, backend, marker):
  fn, args = _lowering_cases()[name]
  fn = functools.partial(fn, platform=backend)
  assert marker in _lower(fn, args, platform).as_text()


@pytest.mark.parametrize("platform,backend,marker", (
  ("tpu", "tpu", "tpu_custom_call"), ("cuda", "gpu", "triton")))
def test_kernels_lower_inside_shard_map(mesh, platform, backend, marker):
  """The compiled (not interpreted) kernels type-check inside shard_map."""
  length = 5000

  def body(x):
    x = x[0]
    words = bitpack.pack_signs_pallas(x, platform=backend)
    gathered = lax.all_gather(words, "data")
    voted = bitpack.vote_pallas(gathered, length, platform=backend)
    signs = bitpack.unpack_signs_pallas(voted, length, platform=backend)
    top = topk.topk_abs_pallas(x, 16, platform=backend)
    sel = topk.threshold_select_pallas(x, 1.0, 64, platform=backend)
    return tuple(o[None] for o in (words, voted, signs, *top, *sel))

  abstract = _abstract_gpu_mesh(mesh) if platform == "cuda" else None
  fn = jax.shard_map(body, mesh=abstract or mesh, in_specs=P("data"),
                     out_specs=P("data"), check_vma=True)
  x = jnp.ones((mesh.shape["data"], length), jnp.float32)
  assert _lower(fn, (x,), platform, abstract).as_text().count(marker) >= 5


def test_platform_is_the_meshs_not_the_hosts():
  """``_dispatch.platform()`` inside a step reads the mesh in context: a
  step compiled for TPU devices on this CPU host resolves its kernels for
  TPU (compiled by Mosaic), outside any mesh the host's backend."""
  assert _dispatch.platform() == jax.default_backend()
  cpu = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  with jax.set_mesh(cpu):
    assert _dispatch.platform() == "cpu"
  from jaxcomm import aot
  mesh = aot.slice_mesh("v5e:2x2", 1, axes=("dcn", "fsdp"))
  seen = []

  def step(x):
    seen.append((_dispatch.platform(),
                 _dispatch.resolve("vote", None, False)))
    return x

  jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("fsdp"),
                        out_specs=P("fsdp"))).lower(
    jax.ShapeDtypeStruct((8,), jnp.float32,
                         sharding=jax.sharding.NamedSharding(
                           mesh, P("fsdp"))))
  assert seen == [("tpu", (True, False))]


# ------------------------------------------------------------- radix top-k


def _radix_groups():
  return [(0, 2, 5000, 30), (10_000, 1, 3000, 700), (13_000, 3, 300, 4),
          (13_900, 1, 7, 7)]


@pytest.mark.parametrize("kind", ["normal", "sparse", "integers", "huge",
                                  "zeros"])
@pytest.mark.parametrize("order", topk.ORDERS)
def test_radix_topk_matches_numpy(kind, order):
  # Every segment's k largest |x| with no sort of x, against numpy's
  # stable argsort (lower index first among ties): in the reference's
  # order, or as a set.
  groups = _radix_groups()
  x = _bracket_input(kind, 13_907, 30, seed=3)
  out = topk.topk_abs_radix_segments(jnp.asarray(x), groups, order=order)
  for (off, count, size, k), (v, i) in zip(groups, out):
    assert v.shape == i.shape == (count, k)
    for r in range(count):
      start = off + r * size
      want = start + _np_topk(x[start:start + size], k)
      got = np.asarray(i[r])
      if order == "value":
        np.testing.assert_array_equal(got, want)
      else:
        assert sorted(got.tolist()) == sorted(want.tolist())
      np.testing.assert_array_equal(np.asarray(v[r]), x[got])


def test_radix_topk_is_the_tpu_opt_in(monkeypatch):
  # JAXCOMM_TOPK_SEARCH=radix on a TPU: the radix search from
  # RADIX_TOPK_MIN_SIZE entries, and nowhere else; topk_abs_groups and
  # topk_abs then take it and give the sort's exact results.
  m = topk.RADIX_TOPK_MIN_SIZE
  monkeypatch.delenv(_dispatch.TOPK_SEARCH_VAR, raising=False)
  assert _dispatch.topk_search() == "sort"
  assert not _dispatch.auto_radix_topk("tpu", 10 * m)
  monkeypatch.setenv(_dispatch.TOPK_SEARCH_VAR, "radix")
  assert _dispatch.auto_radix_topk("tpu", m)
  assert not _dispatch.auto_radix_topk("tpu", m - 1)
  assert not _dispatch.auto_radix_topk("cpu", 10 * m)
  assert not _dispatch.auto_radix_topk("gpu", 10 * m)
  groups = [(0, 2, m, 100), (2 * m, 3, 300, 4)]
  x = jnp.asarray(_bracket_input("integers", 2 * m + 900, 100, seed=5))
  plain = {o: topk.topk_abs_groups(x, groups, order=o) for o in topk.ORDERS}
  single = topk.topk_abs(x[:m], 100)   # past the kernel's k <= 64
  taken = []
  real = topk._radix_segments  # pylint: disable=protected-access
  monkeypatch.setattr(topk, "_radix_segments", lambda *a, **k: (
    taken.append(k["order"]), real(*a, **k))[1])
  monkeypatch.setattr(_dispatch, "platform", lambda: "tpu")
  for o in ("value", "any"):
    for a, b in zip(plain[o], topk.topk_abs_groups(x, groups, order=o)):
      want, got = np.asarray(a[1]), np.asarray(b[1])
      if o == "any":                       # the same entries, any order
        want, got = np.sort(want, axis=-1), np.sort(got, axis=-1)
      np.testing.assert_array_equal(got, want)
  for a, b in zip(single, topk.topk_abs(x[:m], 100)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert taken == ["value", "any", "value"]
  with pytest.raises(ValueError, match="order must be one of"):
    topk.topk_abs_groups(x, groups, order="size")
  monkeypatch.setenv(_dispatch.TOPK_SEARCH_VAR, "bisect")
  with pytest.raises(ValueError, match="JAXCOMM_TOPK_SEARCH must be one of"):
    _dispatch.topk_search()


@pytest.mark.parametrize("n", [1, 7, 1024, 1025, 5000, 1024 * 1024 + 3])
def test_prefix_sum_matches_numpy(n):
  # The blocked prefix sum every 1-D cumsum of the library takes.
  from jaxcomm import _prefix  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(n)
  x = rng.integers(0, 5, n).astype(np.int32)
  np.testing.assert_array_equal(
    np.asarray(_prefix.prefix_sum(jnp.asarray(x))), np.cumsum(x))
  np.testing.assert_array_equal(
    np.asarray(_prefix.prefix_sum(jnp.asarray(x > 2), jnp.int16)[:1000]),
    np.cumsum(x[:1000] > 2).astype(np.int16))
  with pytest.raises(ValueError, match="dtype must be an integer"):
    _prefix.prefix_sum(jnp.asarray(x), jnp.float32)
