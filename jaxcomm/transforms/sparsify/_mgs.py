"""MGS, merged gradient sparsification (Shi et al. 2020): top-k over
groups of consecutive layers, the groups chosen by the alpha-beta model
of the link.

Layer-wise top-k sends each layer's pairs in a message of its own as soon
as the backward pass has made them (wait-free backpropagation), so every
layer pays the link's startup time; top-k over the whole model pays it
once but waits for the whole backward pass. MGS merges a layer into the
group of the layers after it when the merge saves more communication
(``tc(G) + tc(l) - tc(G + l)``, mostly one startup) than it delays the
group's message (the layer's backward time, the larger top-k's extra
time, less the time the message would have waited for the link anyway):
the greedy rule of the paper, over the layers in backward order, with the
timeline recomputed after each merge. :func:`merge_plan` makes the plan,
:func:`timeline` predicts a plan's times.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import wire as _wire
from jaxcomm.collectives import _sparse
from jaxcomm.transforms.sparsify import _sparsification as _sp

DEFAULT_LINK = _wire.CostModel.link(10.0, 50.0)


@dataclasses.dataclass(frozen=True)
class Times:
  """A plan's predicted times (seconds, from the start of the backward
  pass).

  Attributes:
    compute: when the last group's top-k ends (backward and top-k are
      serial on the device, as in the paper).
    comm: when the last group's message has arrived.
    exposed: ``comm - compute``: communication not hidden behind the
      backward pass.
  """

  compute: float
  comm: float

  @property
  def exposed(self) -> float:
    return self.comm - self.compute


def _costs(sizes, n, ratio, link, backward_seconds, topk_per_element):
  total = float(sum(sizes)) or 1.0
  tb = [backward_seconds * s / total for s in sizes]

  def ts(p):
    return topk_per_element * p

  def tc(p):
    k = _sp.num_selected(ratio, p)
    return sum(link.time(kind, b, n)
               for kind, b in _sparse.sparse_psum_wire(k, p, n))
  return tb, ts, tc


def timeline(sizes: Sequence[int], groups: Sequence[tuple[int, int]],
             n: int, ratio: float, link: _wire.CostModel = DEFAULT_LINK,
             backward_seconds: float = 0.1,
             topk_seconds_per_element: float = 0.0) -> Times:
  """Predicted times of sparsifying and sending ``groups`` (``(start,
  stop)`` ranges of layers in forward order, together covering
  ``sizes``) while the backward pass runs from the last layer to the
  first: each layer's backward time is its share of ``backward_seconds``
  by size, a group's top-k starts after its first layer's (in forward
  order) backward and takes ``topk_seconds_per_element`` per element, and
  its all-gather of ``k = max(1, ceil(ratio size))`` pairs starts when
  both its top-k and the previous message are done (``link.time``)."""
  tb, ts, tc = _costs(sizes, n, ratio, link, backward_seconds,
                      topk_seconds_per_element)
  t = free = 0.0
  for start, stop in sorted(groups, reverse=True):
    p = sum(sizes[start:stop])
    t += sum(tb[start:stop]) + ts(p)
    free = max(t, free) + tc(p)
  return Times(compute=t, comm=max(free, t))


def merge_plan(sizes: Sequence[int], n: int, ratio: float,
               link: _wire.CostModel = DEFAULT_LINK,
               backward_seconds: float = 0.1,
               topk_seconds_per_element: float = 0.0
               ) -> tuple[tuple[int, int], ...]:
  """The paper's merge of layers (forward order ``sizes``) into groups:
  ``(start, stop)`` ranges in forward order.

  From the last layer back: the open group ``G`` takes layer ``l`` when

  .. math::
    t_b(l) + t_s(G + l) - t_s(G) - t_s(l) - w_G < t_c(G) + t_c(l) -
    t_c(G + l)

  with ``w_G`` the time ``G``'s message would wait for the link after
  its top-k; else ``G`` is closed and ``l`` opens the next group. Times
  as :func:`timeline`'s.
  """
  sizes = [int(s) for s in sizes]
  if not sizes:
    return ()
  tb, ts, tc = _costs(sizes, n, ratio, link, backward_seconds,
                      topk_seconds_per_element)
  last = len(sizes) - 1
  lo, hi, p = last, last + 1, sizes[last]
  t = tb[last] + ts(p)          # the open group's top-k ends
  free = 0.0                    # the link is free from
  groups = []
  for l in range(last - 1, -1, -1):
    start = max(t, free)
    delay = tb[l] + ts(p + sizes[l]) - ts(p) - ts(sizes[l]) - (start - t)
    saved = tc(p) + tc(sizes[l]) - tc(p + sizes[l])
    if delay < saved:
      t += tb[l] + ts(p + sizes[l]) - ts(p)
      lo, p = l, p + sizes[l]
    else:
      free = start + tc(p)
      groups.append((lo, hi))
      t += tb[l] + ts(sizes[l])
      lo, hi, p = l, lo, sizes[l]
  groups.append((lo, hi))
  return tuple(sorted(groups))


@dataclasses.dataclass(frozen=True)
class MgsCodec(_codec.CodecBase):
  """Top-k over each merged group of consecutive leaves of the bucket
  (:func:`merge_plan`), exchanged as top-k's (index, value) pairs.

  Attributes:
    ratio: fraction of each group's coordinates sent, in ``(0, 1]``.
    link: the :class:`jaxcomm.wire.CostModel` the plan prices.
    backward_seconds: the backward pass's time, spread over the leaves
      by size.
    topk_seconds_per_element: the top-k's time per element.
  """

  ratio: float
  link: _wire.CostModel = DEFAULT_LINK
  backward_seconds: float = 0.1
  topk_seconds_per_element: float = 0.0

  @property
  def name(self):
    return f"mgs({self.ratio})"

  def check_layouts(self, layouts):
    _checks.selects_one("ratio", self.ratio,
                        [lay.size for lay in layouts], "mgs", "bucket")

  def groups(self, layout, n: int) -> tuple[tuple[int, int], ...]:
    """The bucket's merged groups (ranges of its segments)."""
    return merge_plan(layout.sizes, n, self.ratio, self.link,
                      self.backward_seconds, self.topk_seconds_per_element)

  def segments(self, layout, n: int) -> list:
    """The groups as top-k segments, runs of equal sizes batched."""
    offsets, sizes = layout.offsets, layout.sizes
    segs = []
    for start, stop in self.groups(layout, n):
      size = sum(sizes[start:stop])
      row = (min(layout.leaves[start:stop]),)
      last = segs[-1] if segs else None
      if last is not None and last.size == size and \
          last.offset + last.count * last.size == offsets[start]:
        segs[-1] = _sp._Segs(last.offset, last.count + 1, size,
                             last.ids + row)
      else:
        segs.append(_sp._Segs(offsets[start], 1, size, row))
    return segs

  def apply(self, x, state, ctx):
    segs = self.segments(ctx.layout, ctx.num_devices)
    vals, idx = _sp._local_topk(x, segs, self.ratio)
    mean, sent = _sp._sparse_exchange(vals, idx, ctx)
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    return _sparse.sparse_psum_wire(
      _sp._num_pairs(self.segments(layout, n), self.ratio), layout.size, n)


def _finite(name, value, lo_open=False):
  if isinstance(value, jax.core.Tracer):
    raise ValueError(f"{name} sets the merge and must be static")
  v = _checks.number(name, value, 0.0, None, lo_open=lo_open, finite=True)
  return float(v)


@_registry.method(
    gap=(
      "as top-k (1% of merged groups' coordinates a step, the rest "
      "delayed in the residual)"),
    paper="Shi et al. 2020 (MGS)",
    summary="top-k over groups of layers merged by the alpha-beta model, "
    "pairs, sparse psum",
    defaults={"ratio": 0.01},
    static=("ratio", "backward_seconds", "topk_seconds_per_element"))
@_compressor.shared_options
def mgs(ratio: float, link: _wire.CostModel | None = None,
        backward_seconds: float | None = None,
        topk_seconds_per_element: float | None = None, *, axis_name="data",
        error_feedback: bool = True, policy=None, seed: int = 0,
        **options):
  """Merged gradient sparsification: top-k over merged groups of layers.

  Groups of consecutive layers are merged where the link's startup time
  costs more than waiting. Layers (compressed leaves, in the bucket's
  order) are merged by ``merge_plan`` (in
  ``jaxcomm/transforms/sparsify/_mgs.py``), the paper's greedy rule on the
  alpha-beta model ``link`` (backward pass from the last layer to the
  first, one all-gather of pairs per group); each group ``G`` sends its ``k_G =
  max(1, ceil(ratio |G|))`` largest ``|x|`` as (index, value) pairs, with
  error feedback (the paper's residuals):

  .. math::
    s_i = \\sum_G \\mathrm{top}_{k_G}(x_{i,G}), \\quad e_i \\leftarrow
    x_i - s_i, \\quad u = \\frac{1}{n} \\sum_i s_i

  One group per layer is layer-wise top-k (:func:`jaxcomm.topk`), one
  group for the model is ``topk(granularity="model")``; ``timeline``
  (beside ``merge_plan``) predicts the three (``python -m
  benchmarks.mgs``).

  Departures: a jitted JAX step runs the update after the whole backward
  pass, so there is no wait-free pipeline to overlap: the groups'
  pairs travel in one all-gather (``n sum_G k_G (4 + b)`` bytes
  gathered), and the plan decides what each top-k selects over, as the
  paper's groups would. Layers are the bucket's leaves in its order (tree
  order with equal shapes side by side); each layer's backward time is
  its share of ``backward_seconds`` by size and the top-k's is linear
  (the paper measures both per layer on its GPUs). The greedy rule is
  the one of the authors' code (written from it, not copied).

  Args:
    ratio: fraction of each group's coordinates sent, in ``(0, 1]``
      (static).
    link: the :class:`jaxcomm.wire.CostModel` of the data axis (default
      10 Gbit/s, 50 us).
    backward_seconds: the backward pass's time, ``>= 0``, or None: 0.1
      (static).
    topk_seconds_per_element: the top-k's time per element, ``>= 0``, or
      None: 0 (static).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent (default True, as the paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), a ``link`` that is not a finite
      :class:`jaxcomm.wire.CostModel`, a ``backward_seconds`` or
      ``topk_seconds_per_element`` that is not a finite number ``>= 0``
      (or is traced), or an ``axis_name``, ``error_feedback``, ``policy``
      or option that :func:`jaxcomm.compressed` refuses. ``tx.init``
      raises one when ``ratio`` keeps fewer than one element of every
      bucket.

  Examples:
    Two layers of 8 values, ``k = max(1, ceil(ratio |G|))`` per group.
    With no backward time to hide the messages behind
    (``backward_seconds=0``), a second startup of the link buys nothing,
    so the layers merge into one group of 16 and its top 4 all fall in
    ``a``; layer-wise top-k would send 2 of ``b``. Device ``i`` (1 to 8)
    has ``i`` times the values below:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.mgs(0.25, backward_seconds=0.0,
    ...                  policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's grads
    ...   g = jax.tree.map(lambda x: x[0], g)
    ...   update, state = tx.update(g, tx.init(g))
    ...   return update
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = {"a": i * np.array([4.0, 3, 2, 1, 0, 0, 0, 0]),
    ...          "b": i * np.array([0.5, 0.25, 0, 0, 0, 0, 0, 0])}
    >>> update = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(update["a"]).round(3))
    [18.  13.5  9.   4.5  0.   0.   0.   0. ]
    >>> print(np.asarray(update["b"]).round(3))
    [0. 0. 0. 0. 0. 0. 0. 0.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(
    ...   jaxcomm.mgs(0.01, jaxcomm.wire.CostModel.link(1.0)), optax.sgd(0.1))

  References:
    Shi et al, `Communication-Efficient Distributed Deep Learning with
    Merged Gradient Sparsification on GPUs <https://ieeexplore.ieee.org/
    document/9155269>`_, 2020.
  """
  ratio = _checks.ratio("ratio", ratio)
  link = DEFAULT_LINK if link is None else link
  if not isinstance(link, _wire.CostModel):
    raise ValueError(f"link must be a jaxcomm.wire.CostModel, got {link!r}")
  if not (math.isfinite(link.alpha) and math.isfinite(link.beta)):
    raise ValueError(f"link must be finite, got {link!r}")
  backward_seconds = _finite(
    "backward_seconds", 0.1 if backward_seconds is None else backward_seconds)
  topk_seconds_per_element = _finite(
    "topk_seconds_per_element",
    0.0 if topk_seconds_per_element is None else topk_seconds_per_element)
  _checks.error_feedback(error_feedback)
  codec = MgsCodec(ratio, link, backward_seconds, topk_seconds_per_element)
  return _compressor.compressed(codec, axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["mgs"]
