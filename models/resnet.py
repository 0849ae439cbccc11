"""CIFAR ResNets (He et al. 2016, Sec. 4.2), ResNet-20 by default (Flax NNX).

Normalization: GroupNorm, not BatchNorm. BatchNorm's batch statistics differ
on every device in data-parallel training (syncing them is one more collective
per layer, which is exactly the traffic this project tries to cut) and its
running averages are mutable non-parameter state that a pure
``loss_fn(params, batch)`` would have to thread through. GroupNorm normalizes
each example on its own, so the model is a pure function of its parameters,
gives the same output on any number of devices, and behaves identically in
training and evaluation. This departs from the paper, which uses BatchNorm;
Hsieh et al. 2020 make the same substitution in decentralized training, where
BatchNorm breaks down when the devices' local batches differ. The default of
2 groups per layer is this module's choice (``num_groups``), not the paper's.

References:
  He et al, `Deep Residual Learning for Image Recognition
  <https://arxiv.org/abs/1512.03385>`_, 2016.
  Wu and He, `Group Normalization <https://arxiv.org/abs/1803.08494>`_, 2018.
  Hsieh et al, `The Non-IID Data Quagmire of Decentralized Machine Learning
  <https://arxiv.org/abs/1910.00189>`_, 2020.
"""

import jax
import jax.numpy as jnp
from flax import nnx

_PAD_1 = ((1, 1), (1, 1))


def _conv3x3(in_ch: int, out_ch: int, stride: int, rngs: nnx.Rngs):
  # Symmetric padding of 1, as in the paper's (and PyTorch's) CIFAR nets;
  # 'SAME' would pad (0, 1) for stride 2.
  return nnx.Conv(in_ch, out_ch, (3, 3), strides=stride, padding=_PAD_1,
                  use_bias=False,
                  kernel_init=nnx.initializers.he_normal(), rngs=rngs)


class BasicBlock(nnx.Module):
  """Two 3x3 convolutions with a parameter-free shortcut (the paper's option A).

  When the block downsamples, the shortcut takes every ``stride``-th pixel and
  pads the new channels with zeros, so ResNet-20 keeps the paper's 0.27M
  parameters.
  """

  def __init__(self, in_ch: int, out_ch: int, stride: int, num_groups: int,
               *, rngs: nnx.Rngs):
    self.conv1 = _conv3x3(in_ch, out_ch, stride, rngs)
    self.norm1 = nnx.GroupNorm(out_ch, num_groups=num_groups, epsilon=1e-5,
                               rngs=rngs)
    self.conv2 = _conv3x3(out_ch, out_ch, 1, rngs)
    self.norm2 = nnx.GroupNorm(out_ch, num_groups=num_groups, epsilon=1e-5,
                               rngs=rngs)
    self.stride = stride
    self.extra_channels = out_ch - in_ch

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(self.norm1(self.conv1(x)))
    y = self.norm2(self.conv2(y))
    shortcut = x[:, ::self.stride, ::self.stride, :]
    if self.extra_channels:
      shortcut = jnp.pad(
          shortcut, ((0, 0), (0, 0), (0, 0), (0, self.extra_channels)))
    return nnx.relu(y + shortcut)


class ResNet(nnx.Module):
  """CIFAR ResNet of depth ``6n + 2``: 3 stages of ``n`` basic blocks.

  A 3x3 stem convolution, stages of 16/32/64 channels (the 2nd and 3rd halve
  the resolution), global average pooling and a linear classifier. Depth 20
  (n = 3) is ResNet-20; depth 8 (n = 1) is handy for quick tests.

  Args:
    num_classes: number of output logits.
    in_channels: channels of the input images.
    depth: total number of weighted layers, ``6n + 2``.
    widths: channels of the three stages.
    num_groups: GroupNorm groups per normalization layer; must divide every
      width. 1 normalizes over all channels of an example (LayerNorm-like).
    rngs: parameter initialisation RNGs.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> model = ResNet(depth=8, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 32, 32, 3))).shape
    (2, 10)
  """

  def __init__(
      self,
      num_classes: int = 10,
      in_channels: int = 3,
      depth: int = 20,
      widths: tuple[int, int, int] = (16, 32, 64),
      num_groups: int = 2,
      *,
      rngs: nnx.Rngs,
  ):
    if depth < 8 or (depth - 2) % 6:
      raise ValueError(f"depth must be 6n + 2 with n >= 1, got {depth}")
    if len(widths) != 3 or any(w % num_groups for w in widths):
      raise ValueError(f"widths={widths} must be 3 stage widths, each "
                       f"divisible by num_groups={num_groups}")
    self.blocks_per_stage = (depth - 2) // 6
    self.stem = _conv3x3(in_channels, widths[0], 1, rngs)
    self.stem_norm = nnx.GroupNorm(widths[0], num_groups=num_groups,
                                   epsilon=1e-5, rngs=rngs)
    in_ch = widths[0]
    for s, width in enumerate(widths):
      for b in range(self.blocks_per_stage):
        stride = 2 if s > 0 and b == 0 else 1
        setattr(self, f"stage{s + 1}_block{b}",
                BasicBlock(in_ch, width, stride, num_groups, rngs=rngs))
        in_ch = width
    self.head = nnx.Linear(in_ch, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.stem_norm(self.stem(x)))
    for s in range(3):
      for b in range(self.blocks_per_stage):
        x = getattr(self, f"stage{s + 1}_block{b}")(x)
    return self.head(x.mean(axis=(1, 2)))


def resnet20(num_classes: int = 10, in_channels: int = 3, *,
             rngs: nnx.Rngs, **kwargs) -> ResNet:
  """ResNet-20 (3 stages x 3 basic blocks, 16/32/64 channels, 0.27M params)."""
  return ResNet(num_classes, in_channels, depth=20, rngs=rngs, **kwargs)
