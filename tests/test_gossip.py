"""Gossip averaging against numpy mixing matrices, and its bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.collectives import _gossip


def _mixing(topology, n, rnd):
  w = np.zeros((n, n))
  if topology == "ring":
    for i in range(n):
      for j in (i - 1, i, i + 1):
        w[i, j % n] += 1 / 3
  else:
    bit = 1 << (rnd % int(np.log2(n)))
    for i in range(n):
      w[i, i] += 0.5
      w[i, i ^ bit] += 0.5
  return w


@pytest.mark.parametrize("topology", ["ring", "hypercube"])
def test_gossip_matches_mixing_matrix(mesh, topology):
  n, rounds = 8, 3
  x = np.random.RandomState(0).randn(n, 5).astype(np.float32)
  fn = jax.jit(jax.shard_map(
    lambda a: _gossip.gossip_average(a, "data", topology=topology,
                                     rounds=rounds),
    mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  got = np.asarray(fn(x))
  want = x.astype(np.float64)
  for r in range(rounds):
    want = _mixing(topology, n, r) @ want
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Mixing is doubly stochastic: the mean is preserved.
  np.testing.assert_allclose(got.mean(0), x.mean(0), rtol=1e-5, atol=1e-6)
  if topology == "hypercube":   # log2(8) = 3 rounds give the exact mean
    np.testing.assert_allclose(got, np.broadcast_to(x.mean(0), got.shape),
                               rtol=1e-5, atol=1e-6)


def test_gossip_bytes_do_not_grow_with_devices(mesh):
  x = jnp.zeros((8, 1000), jnp.float32)
  fn = jax.jit(jax.shard_map(
    lambda a: jaxcomm.collectives.gossip_average(a, "data"), mesh=mesh,
    in_specs=P("data"), out_specs=P("data")))
  rep = jaxcomm.wire.report(fn.lower(x))
  # Two neighbours: two permutes of the 4,000-byte buffer, for any n.
  assert rep.payload == {"collective-permute": 8000}
  assert rep.sent["collective-permute"] == pytest.approx(8000)


def test_gossip_bad_input_and_single_device():
  x = {"a": jnp.ones(3)}
  assert jaxcomm.collectives.gossip_average(x, None) is x
  with pytest.raises(ValueError, match="topology"):
    jaxcomm.collectives.gossip_average(x, None, topology="star")
  with pytest.raises(ValueError, match="rounds"):
    jaxcomm.collectives.gossip_average(x, None, rounds=-1)
  with pytest.raises(ValueError, match="power-of-two"):
    _gossip.gossip_weights("hypercube", 6)


@pytest.mark.parametrize("method", ["dcd_psgd", "ecd_psgd"])
def test_replica_methods_refuse_a_compressor_on_another_axis(method):
  """DCD-/ECD-PSGD refuse a compressor built on another data axis than
  their own, as fedcom does (it would be laid out for the wrong axis)."""
  import optax
  make = getattr(jaxcomm, method)
  with pytest.raises(ValueError, match="axis_name='dcn'.*'data'"):
    make(optax.sgd(0.1), jaxcomm.topk(0.5, axis_name="dcn"))
  with pytest.raises(ValueError, match="axis_name='data'.*'dcn'"):
    make(optax.sgd(0.1), jaxcomm.topk(0.5), axis_name="dcn")
  # The same axis, or the default compressor, is accepted on either axis.
  make(optax.sgd(0.1), jaxcomm.topk(0.5, axis_name="dcn"), axis_name="dcn")
  make(optax.sgd(0.1), axis_name="dcn")
