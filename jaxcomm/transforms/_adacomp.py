"""AdaComp (Chen et al., AAAI 2018): adaptive residual gradient compression,
a per-bin selection whose count follows the gradient.

Per leaf, with ``G = e + dW`` (the residue plus the latest gradient: what
:func:`jaxcomm.compressed` hands the codec as ``x``) and ``H = G + dW`` (the
latest gradient counted twice), the leaf is cut into bins of ``L_T =
bin_size`` consecutive elements; element ``j`` is sent iff ``|H_j| >=
g_max(bin(j))``, the bin's largest ``|G|``, and it sends ``G_j``. The
residue keeps ``G - sent``.

The maxima are one reduction per group of equal shapes (``[G, bins,
L_T]`` views); the selection is one packed-mask compaction
(:func:`jaxcomm.kernels.threshold.compact_segments`) into a static capacity
per leaf, sent as top-k's ``(index, value)`` pairs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _sparse
from jaxcomm.kernels import threshold as _kthreshold
from jaxcomm.kernels import topk as _topk

# Registered first, as it was before this module: keeps the registry's
# (and the README tables') order.
from jaxcomm.transforms import _dense  # noqa: F401
from jaxcomm.transforms._sparsification import _leaf_rows
from jaxcomm.transforms._sparsification import _sparse_exchange


class AdaCompState(NamedTuple):
  """AdaComp's per-device statistics, one per bucket (in
  ``CompressState.codec``).

  Attributes:
    selected: int32, coordinates the rule chose at the last step (may
      exceed the capacity: the excess stayed in the residual).
    sent: int32, coordinates this device sent at the last step (each a
      nonzero ``(index, value)`` pair; at most the capacity).
    total_sent: float32, ``sent`` summed over the steps taken (exact up
      to ``2**24``).
  """

  selected: jax.Array
  sent: jax.Array
  total_sent: jax.Array


# The default capacity, as a fraction of the bin: the paper's rule, run
# without a capacity on ordinary gradients (digits MLP and CNN, char-LSTM;
# batch 8, 200-300 steps, bins of 50, momentum SGD 0.1), selected 1.5-3.3
# per bin on average and up to 9.5 per bin of a leaf (19%). A quarter of
# the bin (12.5 of 50) holds every selection of those runs; the former 2
# per bin sent about half of it (truncated by index).
DEFAULT_CAPACITY = 0.25


def capacity(size: int, bin_size: int, capacity_factor: float) -> int:
  """Static slots of a leaf's message: ``ceil(capacity_factor * L /
  bin_size)``, at most ``L``."""
  return min(size, max(1, math.ceil(capacity_factor * size / bin_size)))


def selection_mask(x, grad, layout, bin_size):
  """``|H| >= g_max(bin)`` with ``H = x + grad`` and ``g_max`` the bin's
  largest ``|x|``; bins of ``bin_size`` consecutive elements of each leaf
  (a leaf's last bin is shorter where ``bin_size`` does not divide it).
  Zeros of ``x`` are not selected (they carry nothing)."""
  h = x + grad
  parts = []
  for gv, hv, grp in zip(layout.views(x), layout.views(h), layout.groups):
    size = grp.leaf_size
    nb = -(-size // bin_size)
    pad = ((0, 0), (0, nb * bin_size - size))
    # Padding zeros leave each bin's max |G| (>= 0) unchanged.
    g3 = jnp.pad(gv, pad).reshape(grp.count, nb, bin_size)
    h3 = jnp.pad(hv, pad).reshape(grp.count, nb, bin_size)
    gmax = jnp.max(jnp.abs(g3), axis=-1, keepdims=True)
    m = (jnp.abs(h3) >= gmax) & (g3 != 0)
    parts.append(m.reshape(grp.count, nb * bin_size)[:, :size].reshape(-1))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


@dataclasses.dataclass(frozen=True)
class AdaCompCodec(_codec.CodecBase):
  """Per bin, ``|H| >= g_max`` selects exact ``(index, value)`` pairs, at
  most a static capacity per leaf, in :func:`topk`'s all-gather; the state
  is an :class:`AdaCompState` per bucket.

  Attributes:
    bin_size: ``L_T``, elements per bin.
    capacity_factor: message slots per bin.
  """

  bin_size: int = 50
  capacity_factor: float = DEFAULT_CAPACITY * 50
  wants_gradient = True

  @property
  def name(self):
    return f"adacomp({self.bin_size})"

  def _caps_of(self, sizes):
    return tuple(capacity(s, self.bin_size, self.capacity_factor)
                 for s in sizes)

  def init(self, layout):
    bin_size = self.bin_size
    for shape, size in zip(layout.shapes, layout.sizes):
      if size < bin_size:
        raise ValueError(
          f"adacomp: bin_size={bin_size} exceeds a compressed leaf of shape "
          f"{tuple(shape)} ({size} elements); pass a smaller bin_size, or "
          "keep such leaves out of compression with a jaxcomm.LeafPolicy "
          "(min_size or a mask)")
    return AdaCompState(selected=jnp.zeros([], jnp.int32),
                        sent=jnp.zeros([], jnp.int32),
                        total_sent=jnp.zeros([], jnp.float32))

  def apply(self, x, state, ctx):
    layout = ctx.layout
    bounds, sizes = _leaf_rows(layout)
    caps = self._caps_of(sizes)
    mask = selection_mask(x, ctx.grad, layout, self.bin_size)
    vals, gi, counts = _kthreshold.compact_segments(
      x, _topk.pack_mask(mask), bounds, caps)
    vals = jnp.where(gi < layout.size, vals, 0.0)
    mean, sent = _sparse_exchange(vals, gi, ctx)
    n_sent = jnp.sum(jnp.minimum(counts, jnp.asarray(caps, jnp.int32)))
    new = AdaCompState(
      selected=jnp.sum(counts).astype(jnp.int32),
      sent=n_sent.astype(jnp.int32),
      total_sent=state.total_sent + n_sent.astype(jnp.float32))
    return _codec.CodecResult(mean=mean, sent=sent, state=new)

  def wire(self, layout, n):
    _, sizes = _leaf_rows(layout)
    return _sparse.sparse_psum_wire(sum(self._caps_of(sizes)), layout.size,
                                    n)


@_registry.method(
    family="compressor",
    paper="Chen et al. 2018 (AdaComp)",
    summary="per-bin |H| >= bin max of |G| (pairs), EF",
    defaults={"bin_size": 50},
    static=("capacity_factor",))
@_compressor.shared_options
def adacomp(bin_size: int | None = None, *,
            capacity_factor: float | None = None, axis_name="data",
            error_feedback: bool = True, policy=None, seed: int = 0,
            **options):
  """AdaComp: adaptive residual gradient compression.

  Per leaf, ``G = e + g`` (the residue plus the latest gradient, ``x`` of
  :func:`jaxcomm.compressed`) and ``H = G + g`` (the latest gradient
  counted twice) are cut into bins of ``bin_size`` consecutive elements;
  element ``j`` is sent iff ``|H_j| >= g_max``, its bin's largest ``|G|``,
  as an exact ``(index, value = G_j)`` pair, and the residual keeps ``G -
  sent``. The number sent follows the gradient; the message has a static
  capacity of ``ceil(capacity_factor * L / bin_size)`` pairs per leaf of
  ``L`` elements; when more are selected, the first by index travel and
  the rest stays in the residual (nothing is dropped with error feedback).
  The exchange is the all-gather of :func:`topk`, sized by the capacity.

  The default capacity is a quarter of each bin, sized for the rule's
  peaks, so that ordinary gradients are sent as the paper selects them:
  measured without a capacity (digits MLP and CNN, char-LSTM; batch 8,
  bins of 50), the rule selected 1.5-3.3 per bin on average and up to 9.5
  per bin of a leaf. The bytes are the capacity's, not the selection's: at
  8 devices the all-gather moves more than a dense mean. A smaller
  ``capacity_factor`` sends fewer bytes and truncates the peaks (the rest
  waits in the residual; ``AdaCompState.selected`` against ``sent`` shows
  it).

  The achieved message size is kept per bucket and device in the state's
  codec part (an ``AdaCompState``: the last step's ``selected`` and
  ``sent`` counts, int32, and their float32 sum ``total_sent``), e.g.
  ``jaxcomm.compress_states(state)[0].codec[0].sent``.

  Departs from the paper in stated ways: the sent values travel in float32
  (the paper also quantizes them; its quantizer is not reproduced here); a
  leaf whose size ``bin_size`` does not divide ends in a shorter bin;
  coordinates where ``G`` is exactly 0 are not sent (they carry nothing).
  With ``momentum`` (DGC's correction), ``g`` in ``H`` is the momentum
  ``u`` added to the residual.

  Args:
    bin_size: ``L_T``, elements per bin, at least 1 and at most the size of
      every compressed leaf (static; default 50, the paper's for
      convolutions; it uses 500 for fully connected layers). A larger one
      raises at init.
    capacity_factor: message slots per bin, at least 1 (static; default
      ``bin_size / 4``: 12.5 for bins of 50).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent (the paper's residue).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).

  Example::

    tx = optax.chain(jaxcomm.adacomp(50), optax.sgd(0.1, momentum=0.9))

  References:
    Chen et al, `AdaComp: Adaptive Residual Gradient Compression for
    Data-Parallel Distributed Training <https://arxiv.org/abs/1712.02679>`_,
    AAAI 2018.
  """
  # Static arguments default to None: optax.inject_hyperparams then keeps
  # them out of the traced hyperparameters unless the caller passes them.
  bin_size = _checks.integer("bin_size", 50 if bin_size is None else bin_size,
                             1)
  capacity_factor = _checks.static_number(
    "capacity_factor", capacity_factor, max(1.0, DEFAULT_CAPACITY * bin_size),
    1.0)
  return _compressor.compressed(
    AdaCompCodec(bin_size, capacity_factor),
    axis_name=axis_name, error_feedback=error_feedback, policy=policy,
    seed=seed, **options)


__all__ = ["adacomp"]
