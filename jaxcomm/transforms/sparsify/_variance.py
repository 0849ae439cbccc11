"""Variance-based gradient sparsification (Tsuzuku, Imachi, Akiba 2018):
an element is sent only once its delayed update is unambiguous, large
against the variance of its estimate, and it is sent as a sign and a power
of two.

Per device and element, with ``g`` this step's gradient (the mean over the
device's batch ``B``) and ``s`` the variance of that mean estimated from
the per-example gradients ``g_z``::

  s  = (1 / |B|^2) sum_z g_z^2
  r  = zeta r + g                  the delayed update (the residual)
  v  = zeta^2 v + s                the variance of r
  send Q(r)  iff  alpha v < r^2    then r -= Q(r), v = 0

``r`` is :func:`jaxcomm.compressed`'s error-feedback residual (its
``residual_decay`` is ``zeta``), ``v`` the codec's state
(:class:`VarianceState`). ``Q(r)`` is ``sign(r) 2^k``, the power of two
nearest ``|r|``; it travels as one 32-bit word holding the sign, the code
``E - k`` in ``exponent_bits`` bits (``E``: the leaf's largest ``k`` on that
device, one more word per leaf) and the position in the bucket. Every
device's words are all-gathered (a static capacity) and added everywhere.

The statistic comes in as an extra argument of the update,
``tx.update(grads, state, params, grad_variance=s)`` (``optax.chain``
forwards it), e.g. from :func:`grad_and_variance` (``jax.vmap`` over
micro-batches); ``DataParallel(..., update_args=...)`` hands it from each
device's own batch. Without it each step's device gradient is its batch's
only sample, ``s = g^2``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Callable
from typing import ClassVar
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _extra_args
from jaxcomm import _policy
from jaxcomm import _prefix
from jaxcomm import _registry
from jaxcomm import _vma
from jaxcomm.collectives import _core
from jaxcomm.kernels.threshold import _select_bit

# float32's layout: the biased exponent is bits 23-30.
_MANTISSA_BITS = 23
_HALF_MANTISSA = 1 << (_MANTISSA_BITS - 1)
_MAX_EXPONENT = 254           # 255 is inf / NaN
DEFAULT_CAPACITY_RATIO = 0.015
DEFAULT_EXPONENT_BITS = 3
MAX_EXPONENT_BITS = 8


def index_bits(exponent_bits: int) -> int:
  """Bits of a word left to the position: ``31 - exponent_bits``."""
  return 31 - int(exponent_bits)


def max_bucket(exponent_bits: int) -> int:
  """The largest bucket a word can address: ``2^index_bits - 2``
  (positions ``0 .. 2^index_bits - 2``; all ones marks an empty slot)."""
  return (1 << index_bits(exponent_bits)) - 2


def capacity(size: int, capacity_ratio: float) -> int:
  """Static words of a bucket's message: ``max(1, ceil(capacity_ratio *
  size))``, at most ``size``."""
  return min(int(size), max(1, math.ceil(capacity_ratio * size
                                         * (1 - 1e-9))))


def rounded_exponent(x: jax.Array) -> jax.Array:
  """int32: the biased float32 exponent of the power of two nearest to
  ``|x|`` (ties up), at most 254; 0 for zeros and subnormals (not sent)."""
  bits = jax.lax.bitcast_convert_type(jnp.abs(x).astype(jnp.float32),
                                      jnp.int32)
  e = bits >> _MANTISSA_BITS
  up = ((bits & ((1 << _MANTISSA_BITS) - 1)) >= _HALF_MANTISSA).astype(
    jnp.int32)
  return jnp.where(e == 0, 0, jnp.minimum(e + up, _MAX_EXPONENT))


def power_of_two(negative: jax.Array, exponent: jax.Array) -> jax.Array:
  """float32 ``(-1)^negative 2^(exponent - 127)`` built from its bits
  (``exponent`` a biased exponent in ``[1, 254]``)."""
  bits = (negative.astype(jnp.uint32) << 31) | (
    exponent.astype(jnp.uint32) << _MANTISSA_BITS)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def pack_mask(mask: jax.Array) -> jax.Array:
  """bool ``[L]`` -> ``uint32[W]``, ``W = ceil(L / 32)``: position ``p`` is
  bit ``p // W`` of word ``p % W`` (:func:`jaxcomm.collectives.
  pack_fields`: packed along the major axis, lane-dense)."""
  size = mask.shape[0]
  words = -(-size // 32)
  u = jnp.pad(mask.astype(jnp.uint32), (0, 32 * words - size))
  return _core.pack_fields(u, 1)


def compact(packed: jax.Array, size: int, cap: int) -> jax.Array:
  """int32 ``[cap]``: the set positions of a :func:`pack_mask` mask, the
  first ``cap`` in word order (``size`` in slots left empty): a prefix sum
  of the words' popcounts, each slot's word and its bit in it. Nothing of
  the bucket's length, no search loop (a ``searchsorted``'s kept its
  buffers through the step), and every buffer made after the mask (the
  slots' zeros and counters hang on the prefix sum, so that XLA does not
  make them early, beside the backward pass's)."""
  words = packed.shape[0]
  popc = jax.lax.population_count(packed).astype(jnp.int32)
  incl = _prefix.prefix_sum(popc, jnp.int32)
  start = incl - popc
  zeros = _core.zeros_after(max(cap, words), incl, jnp.int32)
  slot = zeros[:cap] + jax.lax.iota(jnp.int32, cap)
  # Each word with set bits marks the slot of its first one; a running
  # maximum carries it over the slots after.
  mark = jnp.where((popc > 0) & (start < cap), start, cap)
  word = jax.lax.cummax(zeros[:cap].at[mark].max(
    zeros[:words] + jax.lax.iota(jnp.int32, words), mode="drop"), axis=0)
  rank = slot - start[word]
  pos = _select_bit(packed[word], rank) * words + word
  return jnp.where(slot < incl[-1], pos, size)


def per_element(layout, per_segment: jax.Array) -> jax.Array:
  """``[num_segments]`` values -> ``[size]``, each element its leaf's: a
  gather by the element's leaf, computed from its position group by group
  (elementwise: no concatenated buffer)."""
  return per_segment[segment_of(layout, jax.lax.iota(jnp.int32,
                                                     layout.size))]


def capacity_cut(key: jax.Array, count: jax.Array, cap: int
                 ) -> tuple[jax.Array, jax.Array]:
  """``(level, first)``: the elements kept are those with ``key > level``,
  and those with ``key == level`` at positions before ``first``.

  ``key`` (uint8) is each element's exponent, 0 where it is not a
  candidate; ``count`` the candidates. At most ``cap`` of them: ``(0,
  0)`` (every candidate) when ``count <= cap``, else the largest
  exponents first and, at the last level that fits, the first positions.
  Two bisections of masked counts, unrolled (no loop keeps a buffer of the
  bucket's length), behind a ``lax.cond`` that only an overflowing step
  takes: over the exponent (8 counts), then over the position (``L``'s
  bit length)."""
  size = key.shape[0]

  def cut(_):
    # Compared as uint8 (keys are at most 254), so that no wider copy of
    # the keys is made for the counts.
    lo, hi = jnp.int32(1), jnp.int32(255)
    for _ in range(8):
      # sum(key >= lo) >= cap > sum(key >= hi).
      mid = (lo + hi) // 2
      ok = jnp.sum(key >= mid.astype(jnp.uint8), dtype=jnp.int32) >= cap
      lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    room = cap - jnp.sum(key > lo.astype(jnp.uint8), dtype=jnp.int32)
    ties = key == lo.astype(jnp.uint8)
    where = jax.lax.iota(jnp.int32, size)
    a, b = jnp.int32(0), jnp.int32(size)
    for _ in range(size.bit_length()):
      # sum(ties before a) < room <= sum(ties before b).
      mid = (a + b) // 2
      ok = jnp.sum(ties & (where < mid), dtype=jnp.int32) >= room
      a, b = jnp.where(ok, a, mid), jnp.where(ok, mid, b)
    return (_vma.match_varying(lo, count), _vma.match_varying(b, count))

  def keep_all(_):
    zero = _vma.match_varying(jnp.int32(0), count)
    return zero, zero

  return jax.lax.cond(count > cap, cut, keep_all, None)


def kept(key: jax.Array, level: jax.Array, first: jax.Array) -> jax.Array:
  """The elements :func:`capacity_cut` keeps, elementwise."""
  where = jax.lax.iota(jnp.int32, key.shape[0])
  at = level.astype(jnp.uint8)
  return (key > at) | ((key == at) & (level > 0) & (where < first))


class VarianceState(NamedTuple):
  """The codec's state, one per bucket (in ``CompressState.codec``).

  Attributes:
    variance: float32 ``[size]``, this device's ``v``: the variance of its
      delayed update ``r`` (0 where it was just sent).
    selected: int32, elements that met ``alpha v < r^2`` with a code in
      range at the last step (may exceed the capacity).
    sent: int32, elements this device sent at the last step.
    total_sent: float32, ``sent`` summed over the steps taken (exact up to
      ``2**24``).
  """

  variance: jax.Array
  selected: jax.Array
  sent: jax.Array
  total_sent: jax.Array


def segment_of(layout, idx: jax.Array) -> jax.Array:
  """int32: the leaf (segment, in bucket order) of each position ``idx``
  (0 outside the bucket): arithmetic per group of equal leaves, no
  search."""
  seg = jnp.zeros(idx.shape, jnp.int32)
  for g in layout.groups:
    inside = (idx >= g.offset) & (idx < g.offset + g.size)
    seg = jnp.where(inside, g.first + (idx - g.offset) // g.leaf_size, seg)
  return seg


@dataclasses.dataclass(frozen=True)
class VarianceCodec(_codec.CodecBase):
  """Tsuzuku et al.'s criterion ``alpha v < r^2`` on ``r = x`` with ``v =
  zeta^2 v + s`` in the state, the sent elements as ``(sign, exponent
  code, position)`` words in a static capacity per bucket, all-gathered.
  ``s`` is ``ctx.grad^2`` here (each step's gradient as its batch's only
  sample); the factory hands a per-example statistic in per step
  (:class:`_HandedVarianceCodec`).

  Attributes:
    alpha: the criterion's constant, ``>= 0`` (may be traced).
    zeta: the decay of ``r`` and (squared) of ``v``, in ``[0, 1]``: the
      compressor's ``residual_decay`` (may be traced).
    capacity_ratio: words per bucket element, in ``(0, 1]`` (static).
    exponent_bits: bits of each exponent code, in ``[1, 8]``.
  """

  alpha: Any = 1.0
  zeta: Any = 0.999
  capacity_ratio: float = DEFAULT_CAPACITY_RATIO
  exponent_bits: int = DEFAULT_EXPONENT_BITS
  wants_gradient: ClassVar[bool] = True

  @property
  def name(self):
    return "variance_sparsification"

  def init(self, layout):
    return VarianceState(variance=jnp.zeros((layout.size,), jnp.float32),
                         selected=jnp.zeros([], jnp.int32),
                         sent=jnp.zeros([], jnp.int32),
                         total_sent=jnp.zeros([], jnp.float32))

  def check_layouts(self, layouts):
    top = max_bucket(self.exponent_bits)
    for lay in layouts:
      if lay.size > top:
        raise ValueError(
          f"{self.name}: a bucket of {lay.size} elements does not fit the "
          f"{index_bits(self.exponent_bits)} position bits of a word "
          f"(exponent_bits={self.exponent_bits}: at most {top}); cap the "
          "buckets with jaxcomm.LeafPolicy(bucket_bytes=...) or pass fewer "
          "exponent_bits")

  def statistic(self, x, ctx):
    """``s``, this step's variance of the device's gradient: its square
    (one sample)."""
    del x
    return ctx.grad * ctx.grad

  def apply(self, x, state, ctx):
    layout = ctx.layout
    size = layout.size
    cap = capacity(size, self.capacity_ratio)
    levels = 1 << self.exponent_bits
    ibits = index_bits(self.exponent_bits)
    empty = jnp.uint32((1 << ibits) - 1)

    v = state.variance
    if not (isinstance(self.zeta, (int, float)) and float(self.zeta) == 1.0):
      zeta = jnp.asarray(self.zeta, jnp.float32)
      v = (zeta * zeta) * v
    v = v + self.statistic(x, ctx)
    alpha = jnp.asarray(self.alpha, jnp.float32)
    k = rounded_exponent(x)
    candidate = (alpha * v < x * x) & (k > 0)
    # Exponents in one byte (at most 254), 0 where not a candidate. Each
    # leaf's largest among its candidates, E, is where its codes count
    # down from; a candidate more than levels - 1 below it waits.
    exps = jnp.where(candidate, k, 0).astype(jnp.uint8)
    top = layout.reduce(lambda a: jnp.max(a, axis=-1), exps,
                        pad=jnp.uint8(0))
    floor = jnp.maximum(top.astype(jnp.int32) - levels, 0).astype(jnp.uint8)
    key = jnp.where(exps > per_element(layout, floor), exps,
                    jnp.uint8(0))
    count = jnp.sum(key > 0, dtype=jnp.int32)
    # Over the capacity: the largest powers of two first, then the lower
    # positions.
    level, first = capacity_cut(key, count, cap)
    mask = kept(key, level, first)
    pos = compact(pack_mask(mask), size, cap)
    filled = pos < size
    safe = jnp.minimum(pos, size - 1)
    xv = x[safe]
    kv = rounded_exponent(xv)
    codev = top.astype(jnp.int32)[segment_of(layout, safe)] - kv
    word = ((xv < 0).astype(jnp.uint32) << 31) | (
      codev.astype(jnp.uint32) << ibits) | pos.astype(jnp.uint32)
    word = jnp.where(filled, word, empty)
    message = jnp.concatenate([word, top.astype(jnp.uint32)])

    def decode(words):
      """``[..., cap + leaves]`` words -> (values, positions) of
      ``[..., cap]``; empty slots at position ``2^ibits - 1`` (dropped)."""
      w, tops = words[..., :cap], words[..., cap:].astype(jnp.int32)
      idx = (w & empty).astype(jnp.int32)
      c = ((w >> ibits) & jnp.uint32(levels - 1)).astype(jnp.int32)
      e = jnp.take_along_axis(tops, segment_of(layout, idx), axis=-1)
      exponent = jnp.clip(e - c, 1, _MAX_EXPONENT)
      vals = power_of_two(w >> 31, exponent)
      return jnp.where(idx < size, vals, 0.0), idx

    got, at_ = decode(_core.all_gather(message, ctx.axis_name))
    at_ = at_.reshape(-1)
    total = _core.zeros_after(size, at_).at[at_].add(got.reshape(-1),
                                                     mode="drop")
    # What this device sent, and its v restarted where it sent.
    sent = jnp.where(mask, power_of_two(x < 0, jnp.maximum(k, 1)), 0.0)
    new_v = jnp.where(mask, 0.0, v)
    # A statistic that overflows float32 (|g| > 1.8e19) would leave v = inf
    # and its element never sent again: the step is non-finite instead
    # (skipped on every device, state kept, counted).
    sent = jnp.where(jnp.all(jnp.isfinite(new_v)), sent, jnp.nan)
    n_sent = jnp.minimum(count, cap)
    new = VarianceState(variance=new_v, selected=count, sent=n_sent,
                        total_sent=state.total_sent
                        + n_sent.astype(jnp.float32))
    return _codec.CodecResult(mean=total / ctx.num_devices, sent=sent,
                              state=new)

  def wire(self, layout, n):
    words = capacity(layout.size, self.capacity_ratio) + layout.num_segments
    return [("all-gather", 4 * n * words)]


@dataclasses.dataclass(frozen=True)
class _HandedVarianceCodec(VarianceCodec):
  """:class:`VarianceCodec` for one update, with that step's per-example
  statistic handed in: per bucket, ``(layout.leaves, flat float32
  [size])``."""

  handed: Any = dataclasses.field(default=(), repr=False, compare=False)

  def statistic(self, x, ctx):
    del x
    for leaves, flat in self.handed:
      if leaves == tuple(ctx.layout.leaves):
        return flat
    raise AssertionError("no grad_variance bucket for this layout")


def _handed_buckets(spec, updates, grad_variance) -> tuple:
  """``grad_variance`` (a tree like the gradients) laid into the
  compressor's buckets, as :func:`jaxcomm.compressed` lays the
  gradients."""
  leaves, treedef = jax.tree.flatten(updates)
  var_leaves, var_def = jax.tree.flatten(grad_variance)
  if var_def != treedef:
    raise ValueError(
      "variance_sparsification: grad_variance must have the gradients' "
      f"tree structure ({treedef}), got {var_def}")
  paths = spec.paths(updates)
  comp = _policy.select(list(range(len(leaves))), paths, _policy.COMPRESS)
  out = []
  for lay in spec.layouts(updates):
    parts = []
    for j in lay.leaves:
      g, s = leaves[comp[j]], var_leaves[comp[j]]
      if tuple(jnp.shape(s)) != tuple(jnp.shape(g)):
        raise ValueError(
          "variance_sparsification: a grad_variance leaf has shape "
          f"{tuple(jnp.shape(s))} where its gradient has "
          f"{tuple(jnp.shape(g))}")
      parts.append(s)
    out.append((tuple(lay.leaves), _buckets.flatten(parts)))
  return tuple(out)


def grad_and_variance(loss_fn: Callable, *, micro_batches: int | None = None
                      ) -> Callable:
  """``loss_fn(params, batch, ...) -> loss`` made into ``f(params, batch,
  ...) -> (loss, grads, grad_variance)``: the batch's leading axis cut
  into ``micro_batches`` equal micro-batches (None: one per example), one
  gradient per micro-batch (``jax.vmap``), ``grads`` their mean and
  ``grad_variance`` the paper's ``(1 / M^2) sum_m g_m^2`` over the ``M``
  micro-batches, leaf by leaf, for :func:`variance_sparsification`'s
  ``grad_variance=``. ``loss`` is the micro-batches' mean loss; for a loss
  that is a mean over examples, ``grads`` is the batch's gradient.

  The ``M`` gradients are materialized (``M`` times the params' memory);
  the paper computes the sum alongside backpropagation instead.
  """
  if micro_batches is not None:
    _checks.integer("micro_batches", micro_batches, 1)

  def fn(params, batch, *args, **kwargs):
    sizes = {int(jnp.shape(x)[0]) for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
      raise ValueError(
        "grad_and_variance: every batch leaf needs the same leading "
        f"(example) axis, got sizes {sorted(sizes)}")
    size = sizes.pop()
    m = size if micro_batches is None else micro_batches
    if size % m:
      raise ValueError(
        f"grad_and_variance: micro_batches={m} does not divide the batch "
        f"of {size} examples")
    split = jax.tree.map(
      lambda x: jnp.reshape(x, (m, size // m) + tuple(jnp.shape(x)[1:])),
      batch)
    losses, grads = jax.vmap(
      lambda b: jax.value_and_grad(loss_fn)(params, b, *args, **kwargs))(
        split)
    mean = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
    var = jax.tree.map(lambda g: jnp.sum(g * g, axis=0) / (m * m), grads)
    return jnp.mean(losses), mean, var

  return fn


@_registry.method(
    gap=(
      "coordinates whose variance is small a step, the rest delayed"),
    paper="Tsuzuku et al. 2018",
    summary="alpha var < r^2; sign + 2^-code + index in a 32-bit word, "
    "delayed update (EF)",
    static=("capacity_ratio",))
@_compressor.shared_options
def variance_sparsification(
    alpha: float = 1.0, *, capacity_ratio: float | None = None,
    exponent_bits: int | None = None, residual_decay: float = 0.999,
    axis_name="data", error_feedback: bool = True, policy=None,
    seed: int = 0, **options):
  """Variance-based gradient sparsification (Tsuzuku, Imachi, Akiba 2018).

  An element travels once its delayed update is unambiguous: large against
  the variance of its estimate. Per device and element, with ``g`` this
  step's gradient (the mean over the device's batch ``B``) and ``s`` the
  variance of that mean:

  .. math::
    r \\leftarrow \\zeta r + g, \\quad v \\leftarrow \\zeta^2 v + s, \\quad
    \\text{send } Q(r) \\text{ iff } \\alpha v < r^2, \\text{ then }
    r \\leftarrow r - Q(r), \\; v \\leftarrow 0

  ``r`` is the error-feedback residual (the paper's delayed update;
  ``zeta`` is :func:`jaxcomm.compressed`'s ``residual_decay``, and the
  decayed part is dropped, by design); ``v`` is kept per device in the
  codec state (a ``VarianceState``: a second buffer the size of the
  compressed leaves, beside the residual). ``Q`` rounds ``|r|`` to the
  nearest power of two ``2^k`` (ties up). A sent element is one 32-bit
  word: its sign (bit 31), the code ``E - k`` in ``exponent_bits`` bits,
  ``E`` the largest ``k`` of its leaf's candidates on this device, and its
  position in the bucket in the other ``31 - exponent_bits`` bits; it
  decodes to ``sign(r) 2^(E - code)``. A candidate ``2^exponent_bits`` or
  more octaves below ``E`` has no code and waits in ``r``. ``E`` travels
  as one word per leaf. Every device's words are all-gathered and added on
  every device: ``4 n (c + leaves)`` bytes per device for ``c`` slots.

  **The statistic.** ``s`` is estimated from the per-example gradients
  ``g_z`` of the device's batch as ``(1 / |B|^2) sum_z g_z^2`` (their sum
  of squares: the sample variance of the mean plus ``g^2 / |B|``, which
  needs no second pass), or over ``M`` micro-batches in their place. The
  loss side supplies it and the update takes it as the extra argument
  ``grad_variance``, a tree like the gradients (``optax.chain`` forwards
  extra arguments to every transformation that takes them)::

    tx = optax.chain(jaxcomm.variance_sparsification(1.0),
                     optax.sgd(0.1, momentum=0.9))
    stats = jaxcomm.variance_sparsification.grad_and_variance(
      loss_fn, micro_batches=None)    # a scalar loss; one g_z per example
    # in the shard_map step, local gradients (at varying params):
    loss, grads, var = stats(jaxcomm.collectives.pvary(params, "data"),
                             batch)
    updates, state = tx.update(grads, state, params, grad_variance=var)

  ``grad_and_variance`` vmaps the gradient over the batch's examples (or
  ``micro_batches`` equal parts) and returns their mean and ``(1 / M^2)
  sum_m g_m^2``; it holds ``M`` gradients at once (the paper computes the
  sum alongside backpropagation, at negligible cost).
  :class:`jaxcomm.parallel.DataParallel` hands it with ``update_args=
  lambda p, b: {"grad_variance": grad_and_variance(loss_fn)(p, b)[2]}``
  (block mode). Without it (``train.py``) each step's device gradient is
  its batch's only sample, ``s = g^2`` (with ``momentum``, DGC's ``u``),
  and an element is sent once ``r`` has kept its sign over about
  ``alpha`` steps (``(g_1 + g_2)^2 > alpha (g_1^2 + g_2^2)``; with ``alpha
  < 1`` from the first step). On the char-LSTM that sends the same bytes
  for a worse loss than the per-example statistic
  (``docs/benchmarks/variance.md``).

  **Departures, stated.** The number of elements meeting the criterion
  varies; the message has a static capacity of ``c = max(1,
  ceil(capacity_ratio L))`` words per bucket of ``L`` elements, and when
  more qualify the largest powers of two travel (the exponent they are
  sent with; equal ones first by position), the rest waiting in ``r``
  with their ``v``, as :func:`jaxcomm.adacomp`'s capacity
  (``VarianceState.selected`` against ``sent`` shows how often it binds;
  ``capacity_ratio=1`` never cuts, and moves more than the dense
  all-reduce). The quantization error of a sent element stays in ``r``
  (error feedback) while its ``v`` restarts at 0. ``s`` is used as given
  (not rescaled by ``clip_norm`` or ``lr_schedule``). A statistic that
  overflows float32 (``|g| > 1.8e19``) makes the step non-finite: skipped
  on every device and counted, as a NaN.

  Args:
    alpha: the criterion's constant ``alpha >= 0`` (injectable; default
      1.0).
    capacity_ratio: words per bucket element, in ``(0, 1]`` (static;
      default 0.015: the bytes of top-k 0.01 where its indices take 16
      bits, three quarters of them where they take 32).
    exponent_bits: bits of each exponent code, in ``[1, 8]`` (default 3:
      8 octaves below the leaf's largest; 28 position bits, buckets of up
      to ``2^28 - 2`` elements: larger ones are refused at init).
    residual_decay: ``zeta`` in ``[0, 1]``, the decay of ``r`` and
      (squared) of ``v`` (injectable; default 0.999).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: True (the only mode: ``r`` is the residual).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule`` and ``shift_rate``, the
      options every compressor takes (besides ``residual_decay`` above),
      forwarded to :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is
      refused: the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (its residual is ``r``, its ``codec``
    a ``VarianceState`` per bucket); its update takes the extra keyword
    argument ``grad_variance``.

  Raises:
    ValueError: naming the argument, for an ``alpha`` that is not a
      finite number ``>= 0``, a ``capacity_ratio`` outside ``(0, 1]``
      (or traced), ``exponent_bits`` outside ``[1, 8]``, a
      ``residual_decay`` outside ``[0, 1]``, an ``error_feedback`` other
      than True, or an ``axis_name``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses. ``tx.init`` raises one for a
      bucket larger than the position bits can address; the update, for a
      ``grad_variance`` whose tree or shapes differ from the gradients'.

  Examples:
    ``alpha = 0.5`` sends from the first step (the statistic is ``g^2``
    without ``grad_variance``, and ``0.5 g^2 < g^2``), with room for every
    value. Device ``i`` (1 to 8) has the gradient ``[i, -1.5, 0.3, 0]``;
    each value travels as the power of two nearest it (``3 -> 4``, ``5
    -> 4``, ``6 -> 8``, ``-1.5 -> -2``, ``0.3 -> 0.25``) and the rounding
    error stays in the residual:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.variance_sparsification(
    ...   0.5, capacity_ratio=1.0, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> grads = np.zeros((8, 4))
    >>> grads[:, 0], grads[:, 1], grads[:, 2] = np.arange(1.0, 9.0), -1.5, 0.3
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(update).round(4))
    [ 4.875 -2.     0.25   0.   ]
    >>> print(np.asarray(residual)[:, 0].round(3))
    [ 0.  0. -1.  0.  1. -2. -1.  0.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.variance_sparsification(1.0),
    ...                   optax.sgd(0.1))

  References:
    Tsuzuku, Imachi, Akiba, `Variance-based Gradient Compression for
    Efficient Distributed Deep Learning <https://arxiv.org/abs/
    1802.06058>`_, ICLR 2018 (workshop).
  """
  alpha = _checks.number("alpha", alpha, 0.0, None, finite=True)
  # Static arguments default to None: optax.inject_hyperparams then keeps
  # them out of the traced hyperparameters unless the caller passes them.
  capacity_ratio = _checks.ratio(
    "capacity_ratio",
    DEFAULT_CAPACITY_RATIO if capacity_ratio is None else capacity_ratio)
  exponent_bits = _checks.integer(
    "exponent_bits",
    DEFAULT_EXPONENT_BITS if exponent_bits is None else exponent_bits, 1,
    MAX_EXPONENT_BITS)
  residual_decay = _checks.number("residual_decay", residual_decay, 0.0,
                                  1.0)
  if error_feedback is not True:
    raise ValueError(
      "error_feedback must be True for variance_sparsification (the "
      "residual is the paper's delayed update r), got "
      f"{error_feedback!r}")
  codec = VarianceCodec(alpha=alpha, zeta=residual_decay,
                        capacity_ratio=capacity_ratio,
                        exponent_bits=exponent_bits)
  kwargs = dict(axis_name=axis_name, error_feedback=True, policy=policy,
                seed=seed, residual_decay=residual_decay, **options)
  base = _compressor.compressed(codec, **kwargs)
  spec = _codec.spec_of(base)

  def update_fn(updates, state, params=None, *, grad_variance=None,
                **extra_args):
    if grad_variance is None:
      return base.update(updates, state, params, **extra_args)
    _extra_args.read("grad_variance")
    handed = _HandedVarianceCodec(
      **{f.name: getattr(codec, f.name) for f in dataclasses.fields(codec)},
      handed=_handed_buckets(spec, updates, grad_variance))
    return _compressor.compressed(handed, **kwargs).update(
      updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(base.init, update_fn)


variance_sparsification.grad_and_variance = grad_and_variance
_extra_args.declare("grad_variance", "variance_sparsification")

__all__ = ["variance_sparsification"]
