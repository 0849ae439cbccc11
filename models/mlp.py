"""A multilayer perceptron classifier (Flax NNX)."""

from collections.abc import Sequence

import jax
from flax import nnx


class MLP(nnx.Module):
  """Fully connected ReLU network over flattened inputs.

  Every input is flattened (all axes but the first), so the same model takes
  ``(N, 8, 8, 1)`` digit images or ``(N, 64)`` vectors.

  Args:
    in_features: size of one flattened input (64 for 8x8x1 digits).
    hidden_sizes: width of each hidden layer, in order; ``()`` gives a linear
      (softmax-regression) model.
    num_classes: number of output logits.
    rngs: parameter initialisation RNGs.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = MLP(64, (32,), 10, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8, 8, 1))).shape
    (2, 10)
  """

  def __init__(
      self,
      in_features: int = 64,
      hidden_sizes: Sequence[int] = (128, 128),
      num_classes: int = 10,
      *,
      rngs: nnx.Rngs,
  ):
    sizes = (in_features, *hidden_sizes)
    self.num_hidden = len(hidden_sizes)
    # Named attributes (not an nnx.List) keep every key of the parameter
    # pytree a string, e.g. ``hidden_0/kernel``.
    for i in range(len(hidden_sizes)):
      setattr(self, f"hidden_{i}",
              nnx.Linear(sizes[i], sizes[i + 1], rngs=rngs))
    self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape((x.shape[0], -1))
    for i in range(self.num_hidden):
      x = nnx.relu(getattr(self, f"hidden_{i}")(x))
    return self.head(x)
