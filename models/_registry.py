"""The model registry: names, constructors and the task each model solves."""

from collections.abc import Callable

from flax import nnx

from models import charlm
from models import cnn
from models import mlp
from models import resnet
from models import transformer

# Name -> constructor taking keyword arguments and ``rngs``.
MODELS: dict[str, Callable[..., nnx.Module]] = {
    "mlp": mlp.MLP,
    "cnn": cnn.CNN,
    "resnet20": resnet.resnet20,
    "charlm": charlm.CharLM,
    "transformer": transformer.TransformerLM,
}

# Name -> ``partition_specs(params, mesh_axes)``: the models with logical
# axes, which a mesh of model axes can split (train.py --mesh).
PARTITION_SPECS: dict[str, Callable] = {
    "transformer": transformer.partition_specs,
}

CLASSIFY = "classify"
LANGUAGE_MODEL = "language_model"

# Name -> task, which decides the loss and the batch keys (see _functional).
TASKS: dict[str, str] = {
    "mlp": CLASSIFY,
    "cnn": CLASSIFY,
    "resnet20": CLASSIFY,
    "charlm": LANGUAGE_MODEL,
    "transformer": LANGUAGE_MODEL,
}


def check_name(name: str) -> None:
  """Raises ValueError naming the valid choices if ``name`` is unknown."""
  if name not in MODELS:
    raise ValueError(
        f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")


def create(name: str, *, rngs: nnx.Rngs | int = 0, **kwargs) -> nnx.Module:
  """Builds the registered model ``name``.

  Args:
    name: one of ``MODELS`` (``mlp``, ``cnn``, ``resnet20``, ``charlm``).
    rngs: an ``nnx.Rngs`` or an integer seed for parameter initialisation.
    **kwargs: passed to the model's constructor (e.g. ``hidden_sizes`` for
      ``mlp``, ``vocab_size`` for ``charlm``).

  Returns:
    The initialised ``nnx.Module``.

  Raises:
    ValueError: ``name`` is not registered; the message lists valid names.

  Example:
    >>> import models
    >>> model = models.create("mlp", hidden_sizes=(32,), rngs=0)
  """
  check_name(name)
  if not isinstance(rngs, nnx.Rngs):
    rngs = nnx.Rngs(rngs)
  return MODELS[name](rngs=rngs, **kwargs)
