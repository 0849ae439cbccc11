"""The leaf policy: which gradient leaves are compressed, decided in one place.

Every compressor routes each leaf of the gradient pytree to one of three
paths:

* ``COMPRESS`` — floating leaves the policy and the compressor accept;
* ``DENSE``    — other floating leaves, and complex ones (as their real and
  imaginary parts): all of them travel in one fused dense
  psum (tensor fusion), never one collective each;
* ``SKIP``     — non-floating leaves (ints, bools, float0): passed through
  untouched and never communicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxcomm import _buckets
from jaxcomm import _checks

COMPRESS = "compress"
DENSE = "dense"
SKIP = "skip"


def is_float(x) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if dtype == jax.dtypes.float0:
    return False
  return bool(jnp.issubdtype(dtype, jnp.floating))


def is_complex(x) -> bool:
  """Complex leaves are averaged densely (as their real and imaginary
  parts), never compressed."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and bool(jnp.issubdtype(dtype,
                                                   jnp.complexfloating))


def real_size(x) -> int:
  """Float32 elements a dense leaf takes in the fused psum (complex: 2)."""
  return int(x.size) * (2 if is_complex(x) else 1)


@dataclasses.dataclass(frozen=True)
class LeafPolicy:
  """Which leaves a compressor compresses.

  A floating leaf is compressed when all of these hold: its size is at least
  ``min_size`` elements; its rank is at least ``min_ndim``; ``mask`` (a
  pytree of bools with the gradients' structure, or a callable from the
  gradients to such a pytree) is True for it or absent; and the compressor
  accepts its shape (PowerSGD, for instance, only takes matrices for which
  ``(n + m) * r * min_compression_rate < n * m``). All other floating leaves
  go through one fused dense psum.

  Compressed leaves are laid out in flat float32 buckets
  (``jaxcomm._buckets``) and the compressor runs once per bucket:
  ``bucket_bytes`` caps a bucket's size (as DDP's ``bucket_cap_mb``; a leaf
  larger than the cap gets a bucket of its own); ``None`` puts every
  compressed leaf in one bucket, the smallest program.

  Attributes:
    min_size: smallest number of elements worth compressing.
    min_ndim: smallest rank worth compressing (2 keeps biases dense).
    mask: optional pytree of bools or callable returning one.
    bucket_bytes: largest bucket in bytes (float32), or None for one bucket.

  Raises:
    ValueError: naming the field, when ``min_size`` or ``min_ndim`` is not
      a non-negative int, or ``bucket_bytes`` is not None or a positive
      int.

  Examples:
    Matrices of at least 256 values compressed, the rest (biases, small
    leaves) through the dense psum:

    >>> import jax.numpy as jnp, jaxcomm
    >>> policy = jaxcomm.LeafPolicy(min_size=256, min_ndim=2)
    >>> grads = {"b": jnp.zeros(512), "w": jnp.zeros((64, 64)),
    ...          "w_small": jnp.zeros((4, 4)), "step": jnp.zeros((), int)}
    >>> policy.plan(grads, accepts=lambda shape: True)
    ['dense', 'skip', 'compress', 'dense']
    >>> tx = jaxcomm.topk(0.01, policy=policy)
  """

  min_size: int = 256
  min_ndim: int = 1
  mask: Any = None
  bucket_bytes: int | None = None

  def __post_init__(self):
    _checks.integer("min_size", self.min_size, 0)
    _checks.integer("min_ndim", self.min_ndim, 0)
    _buckets.check_bucket_bytes(self.bucket_bytes)

  def plan(self, grads, accepts: Callable[[tuple[int, ...]], bool],
           shapes=None) -> list[str]:
    """The path of each leaf of ``grads`` in ``jax.tree.leaves`` order.

    Args:
      grads: the gradients (or params, or their shapes).
      accepts: the compressor's own rule, ``accepts(shape) -> bool``.
      shapes: per leaf, the shape to decide on instead of the leaf's own
        (None: its own); a compressor of whole matrices decides on the
        whole leaf a sharded step's block belongs to.

    Returns:
      A list of ``"compress"``, ``"dense"`` or ``"skip"``, one per leaf.

    Raises:
      ValueError: when ``mask`` does not have the gradients' tree
        structure, naming the paths they do not share.
    """
    leaves, treedef = jax.tree.flatten(grads)
    if shapes is None:
      shapes = [None] * len(leaves)
    if self.mask is None:
      mask = [True] * len(leaves)
    else:
      m = self.mask(grads) if callable(self.mask) else self.mask
      mask = _mask_by_path(m, grads)
    out = []
    for leaf, keep, shape in zip(leaves, mask, shapes):
      shape = tuple(leaf.shape) if shape is None else tuple(shape)
      size = 1
      for d in shape:
        size *= int(d)
      if is_complex(leaf):
        out.append(DENSE)
      elif not is_float(leaf):
        out.append(SKIP)
      elif (keep and size >= max(self.min_size, 1)
            and len(shape) >= self.min_ndim and accepts(shape)):
        out.append(COMPRESS)
      else:
        out.append(DENSE)
    return out


def _path_names(path) -> tuple:
  """A key path as plain names (dict keys, attribute names, indices), so
  that a mask written as a dict matches an ``nnx.State`` or a dataclass of
  the same names."""
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(getattr(k, attr))
        break
    else:
      out.append(str(k))
  return tuple(out)


def _mask_by_path(mask, grads) -> list[bool]:
  """``mask``'s bools in ``grads``' leaf order, matched by key path.

  Raises:
    ValueError: naming the paths the two trees do not share.
  """
  got = {_path_names(p): bool(b)
         for p, b in jax.tree_util.tree_flatten_with_path(mask)[0]}
  want = [_path_names(p)
          for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
  missing = [p for p in want if p not in got]
  extra = sorted(set(got) - set(want), key=str)
  if missing or extra:
    show = lambda ps: ", ".join("/".join(map(str, p)) or "<root>"
                                for p in ps[:4]) + (" ..." if len(ps) > 4
                                                    else "")
    raise ValueError(
      "mask must have the gradients' tree structure (one bool per leaf, "
      "matched by path): "
      + (f"no mask entry for {show(missing)}" if missing else "")
      + ("; " if missing and extra else "")
      + (f"mask entries {show(extra)} match no gradient leaf" if extra
         else ""))
  return [got[p] for p in want]


def as_policy(policy: LeafPolicy | None) -> LeafPolicy:
  if policy is None:
    return LeafPolicy()
  if not isinstance(policy, LeafPolicy):
    raise ValueError(
      f"policy must be a jaxcomm.LeafPolicy or None, got {type(policy)}")
  return policy


def select(items: Sequence, paths: Sequence[str], which: str) -> list:
  return [x for x, p in zip(items, paths) if p == which]
