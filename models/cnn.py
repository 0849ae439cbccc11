"""A small convolutional classifier for 8x8 or 32x32 images (Flax NNX)."""

from collections.abc import Sequence

import jax
from flax import nnx


class CNN(nnx.Module):
  """Conv-ReLU-max-pool stages, then one hidden dense layer and the logits.

  Each stage is a 3x3 'SAME' convolution, a ReLU and a 2x2 max-pool, so
  ``image_size`` must be divisible by ``2 ** len(channels)``: with the
  default two stages, 8x8 digits end at 2x2 and 32x32 CIFAR images at 8x8.

  Args:
    in_channels: channels of the input images (1 for digits, 3 for CIFAR).
    num_classes: number of output logits.
    image_size: height (= width) of the input images.
    channels: output channels of each convolutional stage.
    hidden: width of the dense layer before the logits.
    rngs: parameter initialisation RNGs.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = CNN(1, 10, image_size=8, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8, 8, 1))).shape
    (2, 10)
  """

  def __init__(
      self,
      in_channels: int = 1,
      num_classes: int = 10,
      image_size: int = 8,
      channels: Sequence[int] = (32, 64),
      hidden: int = 128,
      *,
      rngs: nnx.Rngs,
  ):
    channels = tuple(channels)
    if not channels or image_size % (2 ** len(channels)):
      raise ValueError(
          f"image_size={image_size} must be divisible by "
          f"2 ** len(channels) = {2 ** len(channels)} (channels={channels})")
    self.num_stages = len(channels)
    fan_in = in_channels
    for i, width in enumerate(channels):
      setattr(self, f"conv_{i}",
              nnx.Conv(fan_in, width, (3, 3), padding="SAME", rngs=rngs))
      fan_in = width
    side = image_size // 2 ** len(channels)
    self.dense = nnx.Linear(side * side * channels[-1], hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.num_stages):
      x = nnx.relu(getattr(self, f"conv_{i}")(x))
      x = nnx.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    return self.head(nnx.relu(self.dense(x)))
