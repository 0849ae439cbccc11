"""What a compressor is: a codec (its local math and exchange), the context
it runs in, and the static :class:`Spec` of a built compressor (its codec,
leaf policy and axis), which wire accounting reads."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import typing
from typing import Any
from typing import ClassVar
from typing import NamedTuple
from typing import Protocol

import jax
import numpy as np

from jaxcomm import _buckets
from jaxcomm import _policy

Shape = tuple[int, ...]
# A collective the codec issues: (HLO kind, payload bytes per device).
Collective = tuple[str, int]

# Inside parallel.update_on_shards: per leaf of the tree tx.update gets,
# how the whole leaf is split into the device's block (Layout.splits).
_SPLITS: contextvars.ContextVar = contextvars.ContextVar(
  "jaxcomm_block_splits", default=None)


@contextlib.contextmanager
def block_splits(splits):
  """Within: compressors see, per leaf of the tree they update, how the
  whole leaf is split into this device's block (set at trace time by
  :func:`jaxcomm.parallel.update_on_shards` around ``tx.update`` and
  ``tx.init``)."""
  token = _SPLITS.set(None if splits is None else tuple(splits))
  try:
    yield
  finally:
    _SPLITS.reset(token)


def current_splits(num_leaves: int):
  """The splits :func:`block_splits` set, if they are for ``num_leaves``
  leaves (a transform before the compressor that changed the tree gets
  block semantics), else None."""
  splits = _SPLITS.get()
  if splits is None or len(splits) != num_leaves:
    return None
  return splits


class Context(NamedTuple):
  """What a codec knows about the step it runs in.

  Attributes:
    axis_name: the data axis (or None: one device, no collectives).
    num_devices: static number of devices along ``axis_name``.
    device_index: this device's index (int32 array).
    step: the step counter before this step (int32 array).
    key: a PRNG key for this step, identical on every device (a shared key
      for random-k; fold in ``device_index`` for independent noise).
    layout: the bucket's static ``Layout`` (``jaxcomm._buckets``).
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


@typing.runtime_checkable
class Codec(Protocol):
  """What :func:`compressed` takes: a compressor's math and exchange.

  :func:`compressed` lays the compressed leaves into flat float32 buckets
  (``jaxcomm._buckets``) and calls the codec once per bucket, on the
  bucket itself: ``init(layout)``, ``apply(x, state, ctx)`` with ``x`` the
  ``[layout.size]`` buffer and ``ctx.layout`` its layout, ``wire(layout,
  n)``. Per-leaf semantics go through the layout's group views, one op per
  group of equal shapes, so the program does not grow with the number of
  leaves.

  Every codec in jaxcomm is a frozen dataclass deriving :class:`CodecBase`:
  its hyperparameters are its fields, so it prints, compares and hashes by
  value. ``apply`` is one method (encode, exchange, decode) because several
  codecs exchange more than once (PowerSGD's two all-reduces, the
  two-phase quantized sums); the one-message codecs that can gossip split
  it into :class:`GossipCodec`'s ``message`` and ``decode``.

  Attributes:
    name: the public name, used in messages.
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

  @property
  def name(self) -> str:
    """The public name, used in messages."""

  @property
  def mean_of_sent(self) -> bool:
    """Whether ``mean`` is exactly the device mean of ``sent``."""

  @property
  def unbiased(self) -> bool:
    """Whether ``sent`` is an unbiased estimate of ``x``."""

  @property
  def wants_gradient(self) -> bool:
    """Whether ``apply`` reads this step's gradient as ``ctx.grad``."""

  def init(self, layout) -> Any:
    """The codec's state for one bucket.

    Args:
      layout: the bucket's static ``Layout`` (``jaxcomm._buckets``).

    Returns:
      A pytree of arrays (``()`` for a stateless codec), the same on
      every device when the step starts.
    """

  def apply(self, x, state, ctx: Context) -> CodecResult:
    """One step on one bucket ``x`` (error feedback already added).

    Args:
      x: this device's flat ``float32[layout.size]`` bucket to send.
      state: the codec's state for this bucket, as :meth:`init` made it
        (or the previous step returned it).
      ctx: the step's :class:`Context` (axis, device index, step, key,
        layout).

    Returns:
      A :class:`CodecResult` with the decoded device mean, what this
      device's message decodes to, and the new state.
    """

  def wire(self, layout, n: int) -> list[Collective]:
    """The collectives ``apply`` issues on ``n`` devices, in HLO terms.

    Checked against the compiled HLO in tests.

    Args:
      layout: the bucket's static ``Layout`` (``jaxcomm._buckets``).
      n: the number of devices along the data axis.

    Returns:
      A list of ``(kind, payload_bytes)`` pairs, ``kind`` one of
      ``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter``,
      ``collective-permute`` and the payload in bytes per device
      (:mod:`jaxcomm.wire`'s convention).
    """

  def accepts(self, shape) -> bool:
    """The codec's own leaf rule (beside the policy's).

    Args:
      shape: a leaf's shape (a tuple of ints).

    Returns:
      Whether the codec can compress a leaf of this shape; a leaf it
      refuses goes through the dense psum.
    """


@typing.runtime_checkable
class GossipCodec(Codec, Protocol):
  """A codec whose message travels whole to a neighbour.

  Used by the gossip methods (:func:`jaxcomm.choco`): no collective
  inside the codec, and no state.
  """

  def message(self, x, ctx: Context) -> tuple[Any, Any]:
    """This device's message and what it decodes to.

    Args:
      x: this device's flat ``float32[layout.size]`` bucket.
      ctx: the step's :class:`Context`.

    Returns:
      ``(words, sent)``: the message as one ``uint32`` array (what
      travels) and its decoded value, ``float32[layout.size]``.
    """

  def decode(self, words, ctx: Context) -> Any:
    """A received message decoded.

    Args:
      words: a message :meth:`message` made (on another device).
      ctx: the step's :class:`Context`.

    Returns:
      ``float32[layout.size]``: ``decode(message(x)[0]) ==
      message(x)[1]``.
    """


@typing.runtime_checkable
class SteppedCodec(Codec, Protocol):
  """A codec whose exchange changes with the step.

  DGC's warm-up stages, behind a ``lax.switch``: ``wire`` lists every
  stage, as the compiled program holds them, and :meth:`wire_at` the one
  a given step runs.
  """

  def wire_at(self, layout, n: int, step: int) -> list[Collective]:
    """What step ``step`` moves.

    Args:
      layout: the bucket's static ``Layout`` (``jaxcomm._buckets``).
      n: the number of devices along the data axis.
      step: the step counter.

    Returns:
      ``(kind, payload_bytes)`` pairs as :meth:`Codec.wire` gives them,
      for that step's stage only.
    """


@dataclasses.dataclass(frozen=True)
class CodecBase:
  """The defaults of a :class:`Codec`.

  Stateless, every leaf shape, linear aggregation, biased, no fresh
  gradient. Derive a frozen dataclass from it, the hyperparameters as
  fields, and define ``name``, ``apply`` and ``wire`` (and override the
  rest where the method differs).

  Examples:
    A codec that sends half of each value; :func:`jaxcomm.compressed`
    makes it a transform, run here on 8 devices, each with its own
    gradient (1 to 8): the update is half their mean, the residual keeps
    the other half.

    >>> import dataclasses
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> @dataclasses.dataclass(frozen=True)
    ... class Halve(jaxcomm.CodecBase):
    ...   scale: float = 0.5
    ...   name = "halve"
    ...
    ...   def apply(self, x, state, ctx):
    ...     mean = jax.lax.pmean(self.scale * x, ctx.axis_name)
    ...     return jaxcomm.CodecResult(mean=mean, sent=self.scale * x,
    ...                                state=state)
    ...
    ...   def wire(self, layout, n):
    ...     return [("all-reduce", 4 * layout.size)]
    >>> tx = jaxcomm.compressed(Halve(), axis_name="data",
    ...                         policy=jaxcomm.LeafPolicy(min_size=1))
    >>> mesh = jaxcomm.parallel.make_mesh()
    >>> def step(g):
    ...   u, s = tx.update(g, tx.init(jnp.zeros(4)))
    ...   return u, s.residual[0][None, :4]
    >>> grads = jnp.repeat(jnp.arange(1.0, 9.0), 4)
    >>> u, res = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"),
    ...                                out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(u, np.float64).round(3))
    [2.25 2.25 2.25 2.25]
    >>> print(np.asarray(res[:, 0], np.float64).round(3))
    [0.5 1.  1.5 2.  2.5 3.  3.5 4. ]
  """

  mean_of_sent: ClassVar[bool] = True
  unbiased: ClassVar[bool] = False
  wants_gradient: ClassVar[bool] = False
  # When the bytes on the wire depend on the data (a collective that runs
  # only on some steps, decided by the values), what ``wire`` assumes, for
  # tables; "" when they do not.
  wire_condition: ClassVar[str] = ""

  def init(self, layout) -> Any:
    """No state: ``()`` for every bucket.

    Args:
      layout: the bucket's layout (unused).

    Returns:
      ``()``.
    """
    del layout
    return ()

  def accepts(self, shape) -> bool:
    """Every leaf shape.

    Args:
      shape: a leaf's shape (unused).

    Returns:
      True.
    """
    del shape
    return True

  def check_layouts(self, layouts) -> None:
    """Refuses a configuration that cannot work on these buckets.

    Called once by the compressor's ``init`` with every bucket at once;
    an override raises a ValueError naming the hyperparameter. The
    default accepts every layout.

    Args:
      layouts: the buckets' ``Layout`` (``jaxcomm._buckets``) objects.
    """
    del layouts


def can_gossip(codec) -> bool:
  """Whether ``codec`` has a gossip message (:class:`GossipCodec`)."""
  return callable(getattr(codec, "message", None)) and callable(
    getattr(codec, "decode", None))


def is_stepped(codec) -> bool:
  """Whether ``codec``'s exchange changes with the step
  (:class:`SteppedCodec`)."""
  return callable(getattr(codec, "wire_at", None))


def check_codec(codec) -> None:
  """Refuses what is not a :class:`Codec`, naming what is missing."""
  missing = [a for a in ("name", "init", "apply", "wire", "accepts",
                         "mean_of_sent", "unbiased", "wants_gradient")
             if not hasattr(codec, a)]
  if missing:
    raise TypeError(
      f"codec must be a jaxcomm.Codec (derive a frozen dataclass from "
      f"jaxcomm.CodecBase), got {type(codec).__name__} without "
      f"{', '.join(missing)}")


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

  def paths(self, params, splits=None) -> list[str]:
    """Per leaf of ``params``: compressed, dense or skipped. Inside a
    sharded step (``splits``, default :func:`block_splits`'s) a codec
    with ``decision_shape`` (PowerSGD of whole matrices) decides on the
    whole leaf a block belongs to, so that every model-axis size
    compresses the same leaves."""
    leaves = jax.tree.leaves(params)
    if splits is None:
      splits = current_splits(len(leaves))
    decide = getattr(self.codec, "decision_shape", None)
    shapes = None
    if splits is not None and decide is not None and \
        len(splits) == len(leaves):
      shapes = [decide(tuple(np.shape(x)), tuple(sp))
                for x, sp in zip(leaves, splits)]
    return self.policy.plan(params, self.codec.accepts, shapes)

  def layouts(self, params, splits=None) -> tuple[_buckets.Layout, ...]:
    """The buckets of the compressed leaves of ``params``.

    ``splits``: per leaf of ``params`` (``jax.tree.leaves`` order), how the
    whole leaf is split into the block ``params`` holds (see
    :attr:`jaxcomm._buckets.Layout.splits`), or None (default: the one
    :func:`block_splits` sets inside a sharded step, if any).
    """
    leaves = jax.tree.leaves(params)
    if splits is None:
      splits = current_splits(len(leaves))
    paths = self.paths(params, splits)
    comp = _policy.select(leaves, paths, _policy.COMPRESS)
    out = _buckets.plan([tuple(l.shape) for l in comp],
                        self.policy.bucket_bytes)
    if splits is None:
      return out
    if len(splits) != len(leaves):
      raise ValueError(f"splits has {len(splits)} entries for "
                       f"{len(leaves)} leaves")
    per_comp = _policy.select(list(splits), paths, _policy.COMPRESS)
    return tuple(dataclasses.replace(
      lay, splits=tuple(tuple(per_comp[j]) for j in lay.leaves))
      for lay in out)

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

  def wire(self, params, n: int, step: int | None = None, splits=None
           ) -> list[Collective]:
    """Collectives a step issues on ``n`` devices.

    Args:
      params: the parameters (or gradients, or their shapes).
      n: the number of devices along the data axis.
      step: the step counter: the collectives that step moves (the dense
        phase's psums before ``start_step``, the codec's after). None: every
        collective the compiled step holds (with ``start_step > 0``, both
        phases' behind a ``lax.cond``), as the compiled HLO lists them.
      splits: for ``params`` that are a device's blocks in a sharded step,
        how each leaf is split (see :meth:`layouts`).
    """
    leaves = jax.tree.leaves(params)
    paths = self.paths(params, splits)
    out = []
    dense_phase = self.start_step > 0 and (step is None
                                           or step < self.start_step)
    codec_phase = step is None or step >= self.start_step
    for lay in self.layouts(params, splits):
      if dense_phase:
        out.append(("all-reduce", 4 * lay.size))
      if codec_phase:
        if step is not None and is_stepped(self.codec):
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
  """The static description of a compressor built by :func:`compressed`.

  Args:
    tx: the compressor itself (not an ``optax.chain`` around it).

  Returns:
    Its ``Spec`` (codec, leaf policy, axis name and ``start_step``), which
    :func:`jaxcomm.wire.claimed` reads.

  Raises:
    ValueError: when ``tx`` was not built by :func:`compressed` (or one of
      the factories that call it).
  """
  spec = getattr(getattr(tx, "init", None), "jaxcomm_spec", None)
  if spec is None:
    raise ValueError(
      "tx must be a jaxcomm compressor (built by jaxcomm.compressed or one of "
      f"its factories), got {type(tx).__name__}; wrap only the compressor, "
      "not an optax.chain around it")
  return spec


class CompressStats(NamedTuple):
  """Per-step statistics kept in a compressor's state.

  Attributes:
    residual_norm: L2 norm of this device's error-feedback residual after the
      step (0 without error feedback).
    nonfinite_steps: steps skipped because some device's gradient, or what
      the compressor made of it (the average, the residual), held a NaN or
      Inf (residuals and codec state were left unchanged).
  """

  residual_norm: jax.Array
  nonfinite_steps: jax.Array


# CompressState's bucket buffers: flat per bucket, stored in whole tiles
# (``Layout.stored_size``), re-cut by leaves when model axes change.
BUFFER_FIELDS = ("residual", "momentum", "estimate", "estimate_mean")


class CompressState(NamedTuple):
  """State of a compressor built by :func:`compressed`.

  Attributes:
    count: steps taken (int32).
    residual: error-feedback residual per bucket (flat float32, per
      device); empty without error feedback. ``Spec.leaves_of`` (through
      :func:`spec_of`) gives it back per leaf. Each bucket buffer here
      (``residual``, ``momentum``, ``estimate``, ``estimate_mean``) is
      ``Layout.stored_size`` long: a long bucket's size rounded up to
      whole 1,024-value tiles (the tail zeros; see ``_buckets``).
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
