"""What a compressor is: a codec (its local math and exchange), the context
it runs in, and the static :class:`Spec` of a built compressor (its codec,
leaf policy and axis), which wire accounting reads."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax

from jaxcomm import _buckets
from jaxcomm import _policy

Shape = tuple[int, ...]
# A collective the codec issues: (HLO kind, payload bytes per device).
Collective = tuple[str, int]


class Context(NamedTuple):
  """What a codec knows about the step it runs in.

  Attributes:
    axis_name: the data axis (or None: one device, no collectives).
    num_devices: static number of devices along ``axis_name``.
    device_index: this device's index (int32 array).
    step: the step counter before this step (int32 array).
    key: a PRNG key for this step, identical on every device (a shared key
      for random-k; fold in ``device_index`` for independent noise).
    layout: the bucket's static :class:`jaxcomm._buckets.Layout`.
    grad: for a codec with ``wants_gradient`` only (else None): this
      step's fresh contribution to ``x`` as the bucket's flat buffer: the
      (clipped) gradient ``g``, or DGC's momentum ``u`` with ``momentum``.
  """

  axis_name: Any
  num_devices: int
  device_index: jax.Array
  step: jax.Array
  key: jax.Array
  layout: Any = None
  grad: Any = None


class CodecResult(NamedTuple):
  """What a codec returns for one step.

  Attributes:
    mean: the decoded average over devices; identical (and typed invariant)
      on every device, as the bucket's flat ``[size]`` buffer.
    sent: what this device's own message decodes to (same form as
      ``mean``); the error-feedback residual is ``x - sent``.
    state: the codec's new state.
  """

  mean: Any
  sent: Any
  state: Any


@dataclasses.dataclass(frozen=True)
class Codec:
  """A compressor's math and exchange, in the form :func:`compressed` takes.

  :func:`compressed` lays the compressed leaves into flat float32 buckets
  (:mod:`jaxcomm._buckets`) and calls the codec once per bucket, on the
  bucket itself: ``init(layout)``, ``apply(x, state, ctx)`` with ``x`` the
  ``[layout.size]`` buffer and ``ctx.layout`` its layout, ``wire(layout,
  n)``. Per-leaf semantics go through the layout's group views, one op per
  group of equal shapes, so the program does not grow with the number of
  leaves.

  Attributes:
    name: the public name, used in messages.
    init: ``init(layout) -> state``.
    apply: ``apply(x, state, ctx) -> CodecResult`` (error feedback
      already added to the input).
    wire: ``wire(layout, n) -> [(kind, payload_bytes), ...]``, the
      collectives ``apply`` issues on ``n`` devices, in HLO terms
      (``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter``,
      ``collective-permute``). Checked against the compiled HLO in tests.
    accepts: ``accepts(shape) -> bool``, the codec's own leaf rule.
    message: for gossip (:func:`jaxcomm.choco`), stateless codecs only:
      ``message(x, ctx) -> (words, sent)``, this device's compressed
      message as one ``uint32`` array (what travels to a neighbour) and
      what it decodes to; no collective. None: the codec cannot gossip.
    decode: ``decode(words, ctx) -> float32[layout.size]``, a received
      message decoded (``decode(message(x)[0]) == message(x)[1]``).
    wire_at: for a codec whose exchange changes with the step (DGC's
      warm-up stages, behind a ``lax.switch``): ``wire_at(layout, n,
      step)``, what that step moves. None: ``wire``, every step.
    mean_of_sent: whether ``mean`` is exactly the device mean of ``sent``
      (linear aggregation). EF21 keeps ``h = mean_i h_i`` only then, so
      ``compressed(error_feedback="ef21")`` refuses a codec that says False
      (a majority vote, a server stage that re-compresses, an owner that
      re-rounds the average).
    unbiased: whether ``sent`` is an unbiased estimate of ``x`` over the
      codec's own randomness, ``E[sent] = x`` for every input (stochastic
      rounding: QSGD, TernGrad without clipping, natural compression).
      DIANA needs it (its shifts learn ``g_i`` only through unbiased
      differences), so ``compressed(error_feedback="diana")`` refuses a
      codec that says False, and one that says ``mean_of_sent=False``.
      Deterministic codecs (top-k, signs, int8 rounding, low rank) and
      random-k without its ``L / k`` rescaling are biased. The tests check
      every codec that says True statistically.
    wants_gradient: whether ``apply`` reads ``ctx.grad``, this step's
      gradient beside ``x = g + e`` (AdaComp's ``H = x + g`` counts the
      latest gradient twice). False (every other codec): ``ctx.grad`` is
      None.
  """

  name: str
  init: Callable[[Any], Any]
  apply: Callable[[Any, Any, Context], CodecResult]
  wire: Callable[[Any, int], list[Collective]]
  accepts: Callable[[Shape], bool] = lambda shape: True
  message: Callable[[Any, Context], tuple[Any, Any]] | None = None
  decode: Callable[[Any, Context], Any] | None = None
  wire_at: Callable[[Any, int, int], list[Collective]] | None = None
  mean_of_sent: bool = True
  unbiased: bool = False
  wants_gradient: bool = False


class _Init:
  """The ``init`` of a compressor; also carries what wire accounting needs."""

  def __init__(self, fn, spec):
    self._fn = fn
    self.jaxcomm_spec = spec

  def __call__(self, params):
    return self._fn(params)


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static description of a built compressor (for wire accounting)."""

  codec: Codec
  policy: _policy.LeafPolicy
  axis_name: Any
  start_step: int

  def paths(self, params) -> list[str]:
    return self.policy.plan(params, self.codec.accepts)

  def layouts(self, params) -> tuple[_buckets.Layout, ...]:
    """The buckets of the compressed leaves of ``params``."""
    leaves = jax.tree.leaves(params)
    comp = _policy.select(leaves, self.paths(params), _policy.COMPRESS)
    return _buckets.plan([tuple(l.shape) for l in comp],
                         self.policy.bucket_bytes)

  def leaves_of(self, buffers, params) -> list:
    """Per-bucket buffers (a state's ``residual`` or ``momentum``) back as
    one array per compressed leaf, in ``jax.tree.leaves`` order. Leading
    axes (e.g. the device axis of a stored state) are kept."""
    layouts = self.layouts(params)
    out = {}
    for lay, buf in zip(layouts, buffers):
      for j, leaf in zip(lay.leaves, lay.split(buf)):
        out[j] = leaf
    return [out[j] for j in sorted(out)]

  def wire(self, params, n: int, step: int | None = None
           ) -> list[Collective]:
    """Collectives a step issues on ``n`` devices.

    Args:
      params: the parameters (or gradients, or their shapes).
      n: the number of devices along the data axis.
      step: the step counter: the collectives that step moves (the dense
        phase's psums before ``start_step``, the codec's after). None: every
        collective the compiled step holds (with ``start_step > 0``, both
        phases' behind a ``lax.cond``), as the compiled HLO lists them.
    """
    leaves = jax.tree.leaves(params)
    paths = self.paths(params)
    out = []
    dense_phase = self.start_step > 0 and (step is None
                                           or step < self.start_step)
    codec_phase = step is None or step >= self.start_step
    for lay in self.layouts(params):
      if dense_phase:
        out.append(("all-reduce", 4 * lay.size))
      if codec_phase:
        if step is not None and self.codec.wire_at is not None:
          out.extend(self.codec.wire_at(lay, n, step))
        else:
          out.extend(self.codec.wire(lay, n))
    dense = sum(_policy.real_size(l) for l in _policy.select(leaves, paths,
                                                    _policy.DENSE))
    # The fused dense psum always carries one extra float32: the flag that
    # tells every device whether some device saw a non-finite value.
    out.append(("all-reduce", 4 * (dense + 1)))
    return [(k, b) for k, b in out if b > 0]


def spec_of(tx) -> Spec:
  """The :class:`Spec` of a compressor built by :func:`compressed`."""
  spec = getattr(getattr(tx, "init", None), "jaxcomm_spec", None)
  if spec is None:
    raise ValueError(
      "tx must be a jaxcomm compressor (built by jaxcomm.compressed or one of "
      f"its factories), got {type(tx).__name__}; wrap only the compressor, "
      "not an optax.chain around it")
  return spec


class CompressStats(NamedTuple):
  """Per-step statistics kept in the state.

  Attributes:
    residual_norm: L2 norm of this device's error-feedback residual after the
      step (0 without error feedback).
    nonfinite_steps: steps skipped because some device's gradient, or what
      the compressor made of it (the average, the residual), held a NaN or
      Inf (residuals and codec state were left unchanged).
  """

  residual_norm: jax.Array
  nonfinite_steps: jax.Array


class CompressState(NamedTuple):
  """State of a compressor built by :func:`compressed`.

  Attributes:
    count: steps taken (int32).
    residual: error-feedback residual per bucket (flat float32, per
      device); empty without error feedback. ``Spec.leaves_of`` (through
      :func:`spec_of`) gives it back per leaf.
    momentum: momentum-correction buffer ``u`` per bucket (per device);
      empty unless ``momentum`` is set.
    codec: the codec's own state, one per bucket (a tuple).
    key: PRNG key data (uint32[2]), split every step, identical everywhere.
    stats: :class:`CompressStats`.
    estimate: EF21's gradient estimate (DIANA's shift) ``h_i`` per bucket
      (per device); empty unless ``error_feedback`` is ``"ef21"`` or
      ``"diana"``.
    estimate_mean: their aggregate ``h = mean_i h_i`` per bucket
      (replicated): EF21's update every step; DIANA returns ``h + mean_i
      C(g_i - h_i)`` before moving it. Empty unless EF21 or DIANA.
  """

  count: jax.Array
  residual: tuple
  momentum: tuple
  codec: tuple
  key: jax.Array
  stats: CompressStats
  estimate: tuple = ()
  estimate_mean: tuple = ()
