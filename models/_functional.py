"""Pure-function views of NNX models, and the loss each model trains on.

``functional(model)`` splits an NNX module into a pure ``apply(params, x)``
and ``params``, a nested ``dict`` of arrays (string keys only), so that a
training step can be written the Optax way::

  fn = models.functional(models.create("mlp"))
  loss_fn = models.make_loss_fn("mlp", fn.apply)
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      fn.params, {"image": x, "label": y})

Batches are dicts: classifiers read ``image`` and ``label``; ``charlm`` reads
``inputs`` and ``targets`` (both int ``(batch, time)``). An optional boolean
or 0/1 ``mask`` of shape ``(batch,)`` drops padded examples (see
``models.data.eval_batches``).
"""

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import _registry

Params = dict[str, Any]
Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]


class Functional(NamedTuple):
  """A model as a pure function of its parameters.

  Attributes:
    apply: ``apply(params, *inputs) -> outputs``, a pure function that can be
      jitted, differentiated and run inside ``jax.shard_map``.
    params: the model's ``nnx.Param`` values as a nested ``dict`` of arrays.
    static: ``(graphdef, rest)``: the module structure and its non-parameter
      state (empty for every model in this package). ``rest`` is frozen:
      ``apply`` discards any change the module makes to it.
  """

  apply: Callable[..., Any]
  params: Params
  static: tuple[nnx.GraphDef, nnx.State]

  def to_module(self, params: Params | None = None) -> nnx.Module:
    """Rebuilds an NNX module holding ``params`` (default ``self.params``)."""
    graphdef, rest = self.static
    return nnx.merge(graphdef, self.params if params is None else params,
                     rest)


def functional(model: nnx.Module) -> Functional:
  """Splits ``model`` into ``apply(params, x)``, ``params`` and static parts.

  ``apply(params, x)`` is ``nnx.merge(graphdef, params, rest)(x)``, where
  ``graphdef, params, rest = nnx.split(model, nnx.Param, ...)``. The module
  passed in is not modified or referenced by ``apply`` afterwards.

  Args:
    model: any NNX module; its ``nnx.Param`` variables become ``params``.

  Returns:
    A :class:`Functional` ``(apply, params, static)``; it unpacks as a tuple.

  Example:
    >>> import jax.numpy as jnp
    >>> import models
    >>> apply, params, _ = models.functional(models.create("mlp"))
    >>> apply(params, jnp.zeros((4, 64))).shape
    (4, 10)
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def apply(params: Params, *args, **kwargs):
    return nnx.merge(graphdef, params, rest)(*args, **kwargs)

  return Functional(apply, nnx.to_pure_dict(params), (graphdef, rest))


def _masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Mean of ``values`` over all axes; ``mask`` weights the leading axis."""
  if mask is None:
    return jnp.mean(values)
  weights = jnp.broadcast_to(
      mask.astype(values.dtype).reshape(
          mask.shape + (1,) * (values.ndim - mask.ndim)), values.shape)
  return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _classification_loss(
    logits: jax.Array, labels: jax.Array,
    mask: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(logits.dtype)
  loss = _masked_mean(losses, mask)
  return loss, {"loss": loss, "accuracy": _masked_mean(correct, mask)}


def _language_model_loss(
    logits: jax.Array, targets: jax.Array,
    mask: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  loss, metrics = _classification_loss(logits, targets, mask)
  metrics["bits_per_char"] = loss / jnp.log(2.0).astype(loss.dtype)
  return loss, metrics


_LOSSES = {
    _registry.CLASSIFY: _classification_loss,
    _registry.LANGUAGE_MODEL: _language_model_loss,
}

# Task -> (input key, label key) in a batch dict.
_BATCH_KEYS = {
    _registry.CLASSIFY: ("image", "label"),
    _registry.LANGUAGE_MODEL: ("inputs", "targets"),
}


def loss_and_metrics(
    name: str) -> Callable[..., tuple[jax.Array, Metrics]]:
  r"""The loss of model ``name`` as ``fn(logits, labels, mask=None)``.

  Classifiers: mean softmax cross-entropy over the batch, metrics ``loss``
  and ``accuracy``. ``charlm``: mean per-character cross-entropy over batch
  and time, metrics ``loss``, ``accuracy`` (next-character) and
  ``bits_per_char`` (loss / ln 2).

  .. math::
    \ell = -\frac{1}{|B|} \sum_{i \in B} \log \mathrm{softmax}(z_i)_{y_i}

  Args:
    name: a registered model name.

  Returns:
    ``fn(logits, labels, mask=None) -> (loss, metrics)``; ``loss`` is a
    scalar and ``metrics`` a dict of scalars. ``mask`` (shape ``(batch,)``)
    excludes padded examples from every mean.

  Raises:
    ValueError: ``name`` is not registered.
  """
  _registry.check_name(name)
  return _LOSSES[_registry.TASKS[name]]


def batch_keys(name: str) -> tuple[str, str]:
  """``(input_key, label_key)`` of the batch dicts model ``name`` trains on."""
  _registry.check_name(name)
  return _BATCH_KEYS[_registry.TASKS[name]]


def make_loss_fn(
    name: str, apply: Callable[..., jax.Array]
) -> Callable[[Params, Batch], tuple[jax.Array, Metrics]]:
  """``loss_fn(params, batch) -> (loss, metrics)`` for model ``name``.

  Args:
    name: a registered model name.
    apply: the pure ``apply(params, inputs)`` from :func:`functional`.

  Returns:
    A pure function for ``jax.value_and_grad(..., has_aux=True)``. It reads
    the keys given by :func:`batch_keys` and an optional ``mask``.
  """
  loss = loss_and_metrics(name)
  input_key, label_key = batch_keys(name)

  def loss_fn(params: Params, batch: Batch) -> tuple[jax.Array, Metrics]:
    logits = apply(params, batch[input_key])
    return loss(logits, batch[label_key], batch.get("mask"))

  return loss_fn
