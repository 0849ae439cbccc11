"""Tests for the models package: shapes, training signal, functional API."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from models import partition

# (registry name, constructor kwargs, input shape, input dtype)
_FORWARD_CASES = [
    ("mlp", {}, (3, 8, 8, 1), jnp.float32),
    ("mlp", {"in_features": 12, "hidden_sizes": ()}, (3, 12), jnp.float32),
    ("cnn", {}, (3, 8, 8, 1), jnp.float32),
    ("cnn", {"in_channels": 3, "image_size": 32}, (2, 32, 32, 3),
     jnp.float32),
    ("resnet20", {}, (2, 32, 32, 3), jnp.float32),
    ("charlm", {"vocab_size": 30, "hidden_size": 32, "embed_dim": 8},
     (2, 7), jnp.int32),
]


def _inputs(shape, dtype, key=0):
  key = jax.random.key(key)
  if dtype == jnp.int32:
    return jax.random.randint(key, shape, 0, 30)
  return jax.random.normal(key, shape)


@pytest.mark.parametrize("name,kwargs,shape,dtype", _FORWARD_CASES)
def test_forward_shape(name, kwargs, shape, dtype):
  model = models.create(name, rngs=0, **kwargs)
  apply, params, _ = models.functional(model)
  out = jax.jit(apply)(params, _inputs(shape, dtype))
  if name == "charlm":
    chex.assert_shape(out, shape + (kwargs["vocab_size"],))
  else:
    chex.assert_shape(out, (shape[0], 10))
  chex.assert_tree_all_finite(out)
  # Each example's output is its own: applied alone, it is the same row.
  x = _inputs(shape, dtype)
  for i in range(shape[0]):
    np.testing.assert_allclose(np.asarray(jax.jit(apply)(params, x[i:i + 1])),
                               np.asarray(out[i:i + 1]), rtol=2e-5, atol=2e-5)
  if name == "charlm":
    # Causal: changing the last token leaves every earlier position's
    # prediction unchanged, and changes the last one.
    y = x.at[:, -1].set((x[:, -1] + 1) % 30)
    out2 = jax.jit(apply)(params, y)
    np.testing.assert_allclose(np.asarray(out2[:, :-1]),
                               np.asarray(out[:, :-1]), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(out2[:, -1]), np.asarray(out[:, -1]))


def test_default_parameter_counts():
  counts = {name: sum(p.size for p in jax.tree.leaves(
      models.functional(models.create(name)).params)) for name in models.MODELS}
  # ResNet-20 with the paper's option-A shortcuts has 0.27M parameters
  # (GroupNorm has the same scale and bias per channel as BatchNorm).
  assert counts == {"mlp": 26_122, "cnn": 53_002, "resnet20": 269_722,
                    "charlm": 895_104, "transformer": 443_008}


# (small model of each family, input shape, registry name for the loss, SGD
# learning rate). The ResNet case is ResNet-8 on 8x8 images to stay fast.
_TRAIN_CASES = [
    (lambda r: models.MLP(64, (32,), 10, rngs=r), (8, 8, 8, 1), "mlp", 0.3),
    (lambda r: models.CNN(1, 10, 8, channels=(8, 16), hidden=32, rngs=r),
     (8, 8, 8, 1), "cnn", 0.1),
    (lambda r: models.ResNet(depth=8, widths=(4, 8, 8), rngs=r),
     (4, 8, 8, 3), "resnet20", 0.3),
    (lambda r: models.CharLM(vocab_size=30, embed_dim=8, hidden_size=32,
                             num_layers=2, rngs=r), (4, 12), "charlm", 3.0),
]


@pytest.mark.parametrize("make,shape,name,lr", _TRAIN_CASES,
                         ids=[c[2] for c in _TRAIN_CASES])
def test_sgd_steps_reduce_loss(make, shape, name, lr):
  apply, params, _ = models.functional(make(nnx.Rngs(0)))
  if name == "charlm":
    # A learnable pattern: the next token is the current one plus 7.
    tokens = (7 * jnp.arange(shape[1] + 1)[None]
              + jnp.arange(shape[0])[:, None]) % 30
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  else:
    batch = {"image": _inputs(shape, jnp.float32, 1),
             "label": jnp.arange(shape[0]) % 10}
  loss_fn = models.make_loss_fn(name, apply)
  tx = optax.sgd(lr)

  @jax.jit
  def step(params, opt_state):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics

  opt_state = tx.init(params)
  losses = []
  for _ in range(6):
    params, opt_state, loss, metrics = step(params, opt_state)
    losses.append(float(loss))
  chex.assert_trees_all_close(metrics["loss"], loss)
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0
  assert np.isfinite(losses).all()
  assert losses[1] < losses[0], losses
  assert losses[-1] < losses[0] - 0.05, losses


def test_create_rejects_unknown_name_listing_choices():
  with pytest.raises(ValueError) as info:
    models.create("resnet50")
  for name in ("mlp", "cnn", "resnet20", "charlm", "transformer",
               "resnet50"):
    assert name in str(info.value)
  with pytest.raises(ValueError, match="charlm"):
    models.loss_and_metrics("gpt2")


def test_create_accepts_rngs_or_seed():
  a = models.functional(models.create("mlp", rngs=3)).params
  b = models.functional(models.create("mlp", rngs=nnx.Rngs(3))).params
  c = models.functional(models.create("mlp", rngs=4)).params
  chex.assert_trees_all_equal(a, b)
  assert not np.allclose(a["head"]["kernel"], c["head"]["kernel"])


def test_functional_matches_module_and_params_are_pure():
  model = models.create("cnn", channels=(4, 8), hidden=16)
  x = _inputs((2, 8, 8, 1), jnp.float32)
  expected = model(x)
  fn = models.functional(model)
  apply, params, (graphdef, rest) = fn
  assert isinstance(graphdef, nnx.GraphDef)
  assert len(jax.tree.leaves(rest)) == 0  # no hidden non-parameter state
  # A plain nested dict with string keys and array leaves.
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert all(isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)
             for path in paths for k in path)
  assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(params))
  chex.assert_trees_all_close(apply(params, x), expected)
  chex.assert_trees_all_close(jax.jit(apply)(params, x), expected)
  # New params change the output; the module stays untouched.
  doubled = jax.tree.map(lambda p: 2 * p, params)
  assert not np.allclose(apply(doubled, x), expected)
  chex.assert_trees_all_close(model(x), expected)
  chex.assert_trees_all_close(fn.to_module(doubled)(x), apply(doubled, x))


def test_charlm_is_causal():
  apply, params, _ = models.functional(
      models.CharLM(vocab_size=12, embed_dim=4, hidden_size=8, num_layers=1,
                    rngs=nnx.Rngs(0)))
  tokens = jnp.array([[1, 2, 3, 4, 5, 6]])
  changed = tokens.at[0, 4].set(9)
  a, b = apply(params, tokens), apply(params, changed)
  chex.assert_trees_all_close(a[:, :4], b[:, :4])
  assert not np.allclose(a[:, 4:], b[:, 4:])


def test_losses_and_mask():
  logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [5.0, 0.0]])
  labels = jnp.array([0, 0, 1])
  loss_fn = models.loss_and_metrics("mlp")
  loss, metrics = loss_fn(logits, labels)
  expected = optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()
  chex.assert_trees_all_close(loss, expected)
  chex.assert_trees_all_close(metrics["accuracy"], 1.0 / 3.0)
  # A masked-out example does not count.
  masked, metrics = loss_fn(logits, labels, jnp.array([True, True, False]))
  chex.assert_trees_all_close(
      masked, optax.softmax_cross_entropy_with_integer_labels(
          logits[:2], labels[:2]).mean())
  chex.assert_trees_all_close(metrics["accuracy"], 0.5)
  # Language model: per-character mean, and bits per character.
  lm_loss, lm_metrics = models.loss_and_metrics("charlm")(
      jnp.zeros((2, 5, 4)), jnp.zeros((2, 5), jnp.int32))
  chex.assert_trees_all_close(lm_loss, jnp.log(4.0))
  chex.assert_trees_all_close(lm_metrics["bits_per_char"], 2.0, rtol=1e-6)
  assert models.batch_keys("charlm") == ("inputs", "targets")
  assert models.batch_keys("resnet20") == ("image", "label")


def test_bad_configurations_raise():
  with pytest.raises(ValueError, match="6n"):
    models.ResNet(depth=21, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_groups"):
    models.ResNet(widths=(16, 32, 64), num_groups=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="divisible"):
    models.CNN(image_size=10, rngs=nnx.Rngs(0))


def test_data_parallel_grads_match_full_batch(mesh):
  """The pure loss works inside jax.shard_map (check_vma on).

  Per-device gradients need the replicated params cast to varying first;
  differentiating the replicated params directly makes JAX insert the psum
  (the transpose of the implicit broadcast), giving the sum of the devices'
  gradients. Both are checked against the full-batch gradient.
  """
  from jax.sharding import PartitionSpec as P

  apply, params, _ = models.functional(models.MLP(64, (16,), rngs=nnx.Rngs(0)))
  loss_fn = models.make_loss_fn("mlp", apply)
  batch = {"image": _inputs((16, 8, 8, 1), jnp.float32),
           "label": jnp.arange(16) % 10}
  n = mesh.shape["data"]

  def grads(params, batch):
    local = jax.grad(lambda p: loss_fn(p, batch)[0])(
        jax.lax.pcast(params, "data", to="varying"))
    summed = jax.grad(lambda p: loss_fn(p, batch)[0])(params)
    return jax.lax.pmean(local, "data"), summed

  sharded = jax.jit(jax.shard_map(
      grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
  expected = jax.grad(lambda p: loss_fn(p, batch)[0])(params)
  mean_of_local, summed = sharded(params, batch)
  chex.assert_trees_all_close(mean_of_local, expected, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(jax.tree.map(lambda g: g / n, summed), expected,
                              rtol=1e-5, atol=1e-6)


def test_partition_accepts_numpy_integers():
  """np.int64 counts are integers: the split is the one Python ints give."""
  labels = np.arange(40) % 4
  a = partition.dirichlet_split(labels, np.int64(4), 1.0, np.int64(2),
                                min_size=np.int32(1), max_tries=np.int64(5))
  b = partition.dirichlet_split(labels, 4, 1.0, 2, min_size=1, max_tries=5)
  assert len(a) == 4
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(np.sort(np.concatenate(a)), np.arange(40))


@pytest.mark.parametrize("kwargs,match", [
  ({"max_tries": 0}, "max_tries must be an int >= 1, got 0"),
  ({"max_tries": 2.5}, "max_tries must be an int >= 1"),
  ({"num_devices": np.float64(4)}, "num_devices must be an int >= 1"),
  ({"num_devices": True}, "num_devices must be an int >= 1"),
])
def test_partition_split_bad_counts_are_named(kwargs, match):
  args = {"labels": np.arange(20) % 4, "num_devices": 4, "alpha": 1.0,
          "seed": 0}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    partition.dirichlet_split(**args)


def test_partition_label_counts_checks_its_labels():
  labels = np.array([0, 1, 2, 2, 1])
  counts = partition.label_counts(labels, [np.array([0, 1]),
                                           np.array([2, 3, 4])], 3)
  np.testing.assert_array_equal(counts, [[1, 1, 0], [0, 1, 2]])
  with pytest.raises(ValueError, match=r"\[0, num_classes=2\).* 0 to 2"):
    partition.label_counts(labels, [np.arange(5)], 2)
  with pytest.raises(ValueError, match="labels must lie"):
    partition.label_counts(np.array([-1, 0]), [np.arange(2)], 2)
  with pytest.raises(ValueError, match="num_classes must be an int >= 1"):
    partition.label_counts(labels, [np.arange(5)], 0)
  with pytest.raises(ValueError, match="shards must hold at least one"):
    partition.label_counts(labels, [], 3)


def test_partition_device_batches_refuses_an_empty_shard():
  arrays = {"x": np.arange(6) * 10}
  with pytest.raises(ValueError, match=r"shards\[1\] is empty"):
    partition.device_batches(arrays, [np.array([0, 1]), np.array([], int)],
                             2, seed=0)
  with pytest.raises(ValueError, match="shards must hold at least one"):
    partition.device_batches(arrays, [], 2, seed=0)
  with pytest.raises(ValueError, match="per_device must be an int >= 1"):
    partition.device_batches(arrays, [np.array([0])], 0, seed=0)
  batch = next(partition.device_batches(
    arrays, [np.array([0, 1]), np.array([5])], 3, seed=0))
  assert set(batch["x"][:3]) <= {0, 10} and list(batch["x"][3:]) == [50] * 3
