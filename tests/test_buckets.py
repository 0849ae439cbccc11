"""Bucket layout (jaxcomm._buckets) and the bucketed engine around it."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import _buckets
from tests import harness


def test_plan_groups_equal_shapes_in_first_occurrence_order():
  shapes = [(4, 3), (5,), (4, 3), (2, 2), (5,), (4, 3)]
  (lay,) = _buckets.plan(shapes)
  assert lay.leaves == (0, 2, 5, 1, 4, 3)
  assert [(g.shape, g.count, g.first, g.offset) for g in lay.groups] == [
    ((4, 3), 3, 0, 0), ((5,), 2, 3, 36), ((2, 2), 1, 5, 46)]
  assert lay.size == 50
  assert lay.offsets == (0, 12, 24, 36, 41, 46)


def test_plan_caps_buckets_without_splitting_leaves():
  shapes = [(10,), (10,), (100,), (10,)]
  lays = _buckets.plan(shapes, bucket_bytes=4 * 25)
  # Groups: (10,) x3 (120 bytes: split after two), then (100,) alone.
  assert [lay.leaves for lay in lays] == [(0, 1), (3,), (2,)]
  assert [lay.size for lay in lays] == [20, 10, 100]
  assert _buckets.plan([]) == ()
  with pytest.raises(ValueError, match="bucket_bytes"):
    jaxcomm.LeafPolicy(bucket_bytes=0)


def test_layout_helpers_against_numpy():
  shapes = [(3, 2), (4,), (3, 2)]
  (lay,) = _buckets.plan(shapes)
  rng = np.random.RandomState(0)
  leaves = [rng.randn(*s).astype(np.float32) for s in shapes]
  flat = _buckets.flatten([leaves[j] for j in lay.leaves])
  np.testing.assert_array_equal(
    flat, np.concatenate([leaves[j].ravel() for j in (0, 2, 1)]))
  # Per-segment reduction and broadcast, segment order = bucket order.
  sums = lay.reduce(lambda v: v.sum(axis=1), flat)
  np.testing.assert_allclose(sums, [leaves[j].sum() for j in (0, 2, 1)],
                             rtol=1e-6)
  np.testing.assert_array_equal(
    lay.broadcast(jnp.arange(3.0)), np.repeat([0.0, 1.0, 2.0], [6, 6, 4]))
  for j, part in zip(lay.leaves, lay.split(flat)):
    np.testing.assert_array_equal(part, leaves[j])
  np.testing.assert_array_equal(lay.join(lay.views(flat)), flat)
  # Leading axes are kept by split (a stored per-device state).
  two = jnp.stack([flat, 2 * flat])
  assert lay.split(two)[0].shape == (2, 3, 2)


def _params():
  return {"a": jnp.zeros((16, 20), jnp.float32),
          "b": jnp.zeros((300,), jnp.float32),
          "c": jnp.zeros((16, 20), jnp.float32),
          "d": jnp.zeros((8,), jnp.float32)}


# Short leaves of many shapes (a model's biases and norms): lengths in
# three classes, equal shapes next to each other, two long leaves between.
SHORT_SHAPES = [(300,), (17, 20), (290,), (290,), (9000,), (7, 50), (70,),
                (3, 31), (100,), (120, 41), (333,), (2, 2)]


def test_short_runs_batched_by_length_class():
  from jaxcomm import _rows  # pylint: disable=import-outside-toplevel
  (lay,) = _buckets.plan(SHORT_SHAPES)
  runs = [(g.offset, g.count, g.leaf_size) for g in lay.groups]
  batches, alone = _rows.plan(runs)
  sizes = [r[2] for r in runs]
  # Classes by the power of two above the length (at least 128): up to
  # 128 and 257-512 hold several runs each; the long leaves are left
  # alone (past SHORT entries).
  got = sorted((b.width, sorted(sizes[m[0]] for m in b.members))
               for b in batches)
  assert got == [(100, [4, 70, 93, 100]),
                 (350, [290, 300, 333, 340, 350])]
  assert sorted(sizes[i] for i in alone) == [4920, 9000]
  assert batches[0].rows == sum(m[2] for m in batches[0].members)
  with pytest.raises(ValueError, match="short and multiple"):
    _rows.plan(runs, short=0)
  # Bins: each width a multiple of the bin.
  assert all(b.width % 50 == 0 for b in _rows.plan(runs, multiple=50)[0])


def test_batched_rows_round_trip_against_numpy():
  from jaxcomm import _rows  # pylint: disable=import-outside-toplevel
  (lay,) = _buckets.plan(SHORT_SHAPES)
  x = np.arange(lay.size, dtype=np.float32) + 1
  batches, _ = _rows.plan([(g.offset, g.count, g.leaf_size)
                           for g in lay.groups])
  for b, slices in [(b, s) for b in batches for s in (False, True)]:
    rows = np.asarray(b.gather(jnp.asarray(x), -7.0, slices=slices))
    assert rows.shape == (b.rows, b.width)
    r = 0
    for (_, off, count, size), flat in zip(b.members,
                                           b.unpad(jnp.asarray(rows))):
      want = x[off:off + count * size].reshape(count, size)
      np.testing.assert_array_equal(rows[r:r + count, :size], want)
      assert (rows[r:r + count, size:] == -7.0).all()
      np.testing.assert_array_equal(np.asarray(flat), want.reshape(-1))
      r += count


def test_layout_reduce_and_broadcast_batched_against_numpy():
  (lay,) = _buckets.plan(SHORT_SHAPES)
  rng = np.random.default_rng(0)
  x = rng.standard_normal(lay.size).astype(np.float32)
  want = np.array([np.abs(x[o:o + s]).max()
                   for o, s in zip(lay.offsets, lay.sizes)], np.float32)
  got = lay.reduce(lambda v: jnp.max(jnp.abs(v), axis=-1), jnp.asarray(x),
                   pad=0.0)
  np.testing.assert_array_equal(np.asarray(got), want)
  sums = lay.reduce(lambda v: jnp.sum(jnp.abs(v), axis=-1), jnp.asarray(x),
                    pad=0.0)
  np.testing.assert_allclose(
    np.asarray(sums), [np.abs(x[o:o + s]).sum()
                       for o, s in zip(lay.offsets, lay.sizes)], rtol=1e-5)
  per = rng.standard_normal(lay.num_segments).astype(np.float32)
  np.testing.assert_array_equal(
    np.asarray(lay.broadcast(jnp.asarray(per))), np.repeat(per, lay.sizes))



@pytest.mark.parametrize("make", [
  lambda p: jaxcomm.topk(0.05, policy=p),
  # The exact exchange: per-leaf buckets (the requantized one cuts its
  # blocks from each bucket's device chunks, so they move with it).
  lambda p: jaxcomm.int8(policy=p, exchange="exact"),
  lambda p: jaxcomm.powersgd(2, policy=p),
], ids=["topk", "int8", "powersgd"])
def test_several_buckets_equal_one_bucket_on_8_devices(make, mesh):
  """Per-leaf compressors give the same steps, residuals and bytes whether
  the leaves share one bucket or are spread over several."""
  params = _params()
  grads = harness.make_grads(7, 3, params=params)
  one = make(jaxcomm.LeafPolicy())
  many = make(jaxcomm.LeafPolicy(bucket_bytes=4 * 320))
  assert len(jaxcomm.spec_of(many).layouts(params)) > 1
  u1, s1, _ = harness.device_run(one, mesh, grads, params=params)
  u2, s2, _ = harness.device_run(many, mesh, grads, params=params)
  for a, b in zip(u1, u2):
    for k in params:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
  r1 = jaxcomm.spec_of(one).leaves_of(s1.residual, params)
  r2 = jaxcomm.spec_of(many).leaves_of(s2.residual, params)
  for a, b in zip(r1, r2):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # The claim equals the compiled HLO with several buckets too.
  hlo = jaxcomm.wire.report(harness.lower_update(many, mesh, params),
                            params=params)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(many, params, 8), n=8,
                                 params=params)
  assert hlo.payload == claim.payload


def test_state_mismatch_is_named():
  tx = jaxcomm.topk(0.1, axis_name=None)
  params = _params()
  state = tx.init(params)
  bad = dict(params, a=jnp.zeros((4, 16, 20)))
  with pytest.raises(ValueError, match=r"gradient leaf \['a'\] has shape"):
    tx.update(bad, state, params)
  with pytest.raises(ValueError, match="do not match the state's residual"):
    tx.update(bad, state)
  with pytest.raises(ValueError, match="CompressState"):
    tx.update(params, optax.EmptyState(), params)


def test_leaf_blocks_tile_every_leaf():
  assert _buckets.leaf_blocks([1152, 3072]) == 384
  assert _buckets.leaf_blocks([1728, 36864, 5120]) == 64
  assert _buckets.leaf_blocks([2**20, 2**21]) == _buckets.LEAF_BLOCK_MAX
  assert _buckets.leaf_blocks([48, 100]) is None        # gcd 4: too narrow
  sizes = [96, 32, 32, 160]
  ids = np.asarray(_buckets.block_leaf_ids(sizes, 32))
  np.testing.assert_array_equal(ids, [0, 0, 0, 1, 2, 3, 3, 3, 3, 3])


@pytest.mark.parametrize("sizes", [[96, 32, 32, 160], [50, 70, 70, 3]])
def test_per_leaf_scales_match_numpy_on_both_paths(sizes):
  """Blocks (sizes sharing a wide divisor) and runs (they do not) give the
  per-leaf scale ||x_l|| / sqrt(d_l) and its broadcast of numpy."""
  from jaxcomm.collectives import _signs
  rng = np.random.default_rng(1)
  x = rng.normal(size=sum(sizes)).astype(np.float32)
  ends = np.cumsum(sizes)
  parts = np.split(x.astype(np.float64), ends[:-1])
  want = np.asarray([np.sqrt(np.sum(p * p) / p.size) for p in parts])
  blocks = _signs._blocks(sizes)
  assert (blocks is None) == (sizes == [50, 70, 70, 3])
  got = np.asarray(_signs.worker_scales(jnp.asarray(x), sizes, blocks))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  vals = rng.normal(size=(2, sum(sizes))).astype(np.float32)
  scales = rng.normal(size=(2, len(sizes))).astype(np.float32)
  want = vals * np.repeat(scales, sizes, axis=1)
  got = np.asarray(_signs._per_leaf(jnp.asarray(vals), jnp.asarray(scales),
                                    sizes, blocks))
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_flatten_unflatten_round_trip():
  shapes = [(2, 3), (4,), (), (1, 2, 2)]
  leaves = [jnp.asarray(np.arange(np.prod(s)).reshape(s) + 10 * i,
                        jnp.float32) for i, s in enumerate(shapes)]
  flat = _buckets.flatten(leaves)
  np.testing.assert_array_equal(
    flat, np.concatenate([np.ravel(np.asarray(x)) for x in leaves]))
  back = _buckets.unflatten(flat, shapes)
  for a, b in zip(back, leaves):
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b)
