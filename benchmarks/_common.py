"""What every benchmark shares: a timer and the ResNet-18 gradient shapes."""

import statistics
import time

import jax


def time_ms(fn, *args, reps: int, warmup: int = 1) -> float:
  """Median wall time of ``fn(*args)`` in ms, after ``warmup`` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def resnet18_shapes(num_classes: int = 10, stem: str = "cifar") -> dict:
  """Parameter shapes of a ResNet-18, by name, in Flax layout.

  Conv kernels are ``(kh, kw, in, out)``, the classifier ``(in, out)``, and
  every normalization has a scale and a bias (running statistics are not
  parameters). ``stem="cifar"`` (3x3 first conv, 10 classes: 11,173,962
  parameters) is the shape set every benchmark uses unless it says
  otherwise; ``stem="imagenet"`` with ``num_classes=1000`` gives the
  ImageNet model (7x7 first conv, 11,689,512 parameters).
  """
  if stem not in ("cifar", "imagenet"):
    raise ValueError(f"stem must be 'cifar' or 'imagenet', got {stem!r}")
  k = 3 if stem == "cifar" else 7
  shapes = {"stem/conv": (k, k, 3, 64), "stem/bn_scale": (64,),
            "stem/bn_bias": (64,)}
  cin = 64
  for stage, (cout, stride) in enumerate(
      [(64, 1), (128, 2), (256, 2), (512, 2)], start=1):
    for block in range(2):
      pre = f"layer{stage}/block{block}"
      c_in = cin if block == 0 else cout
      shapes[f"{pre}/conv1"] = (3, 3, c_in, cout)
      shapes[f"{pre}/conv2"] = (3, 3, cout, cout)
      for bn in ("bn1", "bn2"):
        shapes[f"{pre}/{bn}_scale"] = (cout,)
        shapes[f"{pre}/{bn}_bias"] = (cout,)
      if block == 0 and (stride != 1 or c_in != cout):
        shapes[f"{pre}/down_conv"] = (1, 1, c_in, cout)
        shapes[f"{pre}/down_bn_scale"] = (cout,)
        shapes[f"{pre}/down_bn_bias"] = (cout,)
    cin = cout
  shapes["fc/kernel"] = (512, num_classes)
  shapes["fc/bias"] = (num_classes,)
  return shapes
