"""Lazy aggregation: a device sends only when its gradient moved enough
(LAG, Chen et al. 2018, in the three-point-compressor form of Richtárik et
al. 2022)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm import _vma
from jaxcomm.collectives import _core


class LagState(NamedTuple):
  """LAG's state, one per bucket (in ``CompressState.codec``).

  Attributes:
    previous: float32 ``[size]``, this device's gradient at the last step
      (the trigger's reference ``y``).
    sent_steps: int32, steps at which this device sent.
    senders: int32, devices that sent at the last step (the same on every
      device): ``1 - senders / n`` is the step's skip rate.
  """

  previous: jax.Array
  sent_steps: jax.Array
  senders: jax.Array


@dataclasses.dataclass(frozen=True)
class LagCodec(_codec.CodecBase):
  """LAG's trigger on EF21's input: a device sends ``x = g - h`` only when
  ``|x|^2 > zeta |g - g_prev|^2`` (or at the first step taken: a skipped
  non-finite step does not count).

  Attributes:
    zeta: the trigger constant, ``>= 0``.
  """

  zeta: float
  name = "lag"
  wants_gradient = True

  def init(self, layout):
    return LagState(jnp.zeros([layout.size], jnp.float32),
                    jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

  def apply(self, x, state, ctx):
    # EF21's input: x = g - h (h the device's last sent gradient).
    g = ctx.grad
    moved = jnp.sum(jnp.square(g - state.previous))
    # Every device sends at its first *taken* step: sent_steps is 0 until
    # then (a skipped non-finite step leaves the state as it was), where
    # ctx.step also counts skipped steps and would leave the trigger
    # comparing |g|^2 with zeta |g|^2 for good.
    send = ((jnp.sum(jnp.square(x)) > self.zeta * moved)
            | (state.sent_steps == 0))
    senders = _core.psum(send.astype(jnp.int32), ctx.axis_name)
    sent = jnp.where(send, x, jnp.zeros_like(x))

    # Laid out for the sum outside the cond: the branch holds only the
    # collective (see _core.psum_layout).
    rows, restore = _core.psum_layout(sent)

    def exchange(r):
      return _core.psum_laid_out(r, ctx.axis_name)

    # Typed as the psum's result: varying over the axes x varies over
    # except the data axes (the model's own axes under a sharded model).
    data = set(_core._names(ctx.axis_name)) if ctx.axis_name else set()
    others = _vma.varying_axes(x) - data

    def skip(r):
      return _vma.mark_varying(jnp.zeros(r.shape, jnp.float32), others)

    # No device sends: the step moves the 4-byte count only.
    mean = restore(jax.lax.cond(senders > 0, exchange, skip, rows)
                   ) / ctx.num_devices
    return _codec.CodecResult(
      mean=mean, sent=sent,
      state=LagState(g.astype(jnp.float32),
                     state.sent_steps + send.astype(jnp.int32), senders))

  wire_condition = "on a step where any device sends"

  def wire(self, layout, n):
    # Both collectives the compiled step holds; the second runs only on
    # steps where some device sends (LagState.senders > 0).
    return [("all-reduce", 4), ("all-reduce", 4 * layout.size)]


@_registry.method(
    gap=(
      "lazy aggregation reuses stale gradients on the char-LSTM; at "
      "dense's rate it reached 87.5 on the conv net"),
    paper="Chen et al. 2018 (LAG); Richtárik et al. 2022 (3PC)",
    summary="a device sends only when its gradient moved enough (lazy "
    "aggregation, EF21's estimates)",
    defaults={"zeta": 1.0})
@_compressor.shared_options
def lag(zeta: float = 1.0, *, axis_name="data", error_feedback="ef21",
        policy=None, seed: int = 0, **options):
  """Lazy aggregation (LAG): a device sends only when its gradient moved.

  Each device re-sends its gradient only when it has moved enough since
  the one it last sent; the others' last ones are reused.

  .. math::
    h_i \\leftarrow \\begin{cases} g_i & \\|g_i - h_i\\|^2 >
    \\zeta \\, \\|g_i - g_i^{\\mathrm{prev}}\\|^2 \\\\ h_i &
    \\text{otherwise} \\end{cases}, \\qquad u = \\frac{1}{n}\\sum_i h_i

  The three-point compressor of Richtárik et al. (2022, "LAG" with trigger
  ``zeta``), which they show to be Chen et al.'s (2018) worker-side rule
  with the step-size history folded into one constant. It runs on EF21's
  estimates (``error_feedback="ef21"``, the only mode offered): ``h_i``
  per device, ``h = mean_i h_i`` everywhere, and a device that sends adds
  ``g_i - h_i`` to both. Every device sends at the first step taken (a
  non-finite step skipped before it does not count).

  What moves: one 4-byte all-reduce of the number of senders, then, only
  if some device sends, one float32 all-reduce of the bucket (a device that
  does not send contributes zeros to it: in a collective, the others'
  bytes move anyway). A step where no device sends moves 4 bytes;
  ``LagState.senders`` counts the senders of the last step and
  ``sent_steps`` each device's sends, from which the skip rate and the
  bytes of a run follow. The trigger is taken per bucket (the whole
  compressed model with the default one bucket); leaves the policy keeps
  dense travel every step.

  Args:
    zeta: the trigger constant, ``>= 0`` (0: every device sends every
      step, the exact mean).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: ``"ef21"`` (the only mode: LAG is a rule for EF21's
      estimates).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (with EF21, ``lr_schedule``,
      ``residual_decay`` and ``shift_rate`` are refused; ``momentum`` is
      EF21-SGDM's).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState`: EF21's estimates ``h_i`` and ``h``,
    and a ``LagState`` per bucket in its ``codec``.

  Raises:
    ValueError: naming the argument, for a ``zeta`` that is not a finite
      number ``>= 0``, an ``error_feedback`` other than ``"ef21"``, or an
      ``axis_name``, ``policy`` or option that :func:`jaxcomm.compressed`
      refuses.

  Examples:
    Device ``i`` (1 to 8) has the gradient ``i * [1, -2, 0.5, 0]`` at two
    steps. At the first every device sends and the update is the exact
    mean; at the second no gradient has moved, so no device sends (the
    state counts the senders) and the same mean is reused:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.lag(1.0, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   senders = state.codec[0].senders
    ...   second, state = tx.update(g[0], state)
    ...   return first, second, senders, state.codec[0].senders
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array([1.0, -2, 0.5, 0])
    >>> first, second, n1, n2 = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(first).round(3), np.asarray(second).round(3))
    [ 4.5  -9.    2.25  0.  ] [ 4.5  -9.    2.25  0.  ]
    >>> print(int(n1), int(n2))
    8 0

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.lag(zeta=1.0), optax.sgd(0.1))

  References:
    Chen et al, `LAG: Lazily Aggregated Gradient for Communication-Efficient
    Distributed Learning <https://arxiv.org/abs/1805.09965>`_, 2018.
    Richtárik et al, `3PC: Three Point Compressors for
    Communication-Efficient Distributed Training and a Better Theory for
    Lazy Aggregation <https://arxiv.org/abs/2202.00998>`_, 2022.
  """
  zeta = _checks.number("zeta", zeta, 0.0, None, finite=True)
  if error_feedback != _checks.EF21:
    raise ValueError(
      f"error_feedback must be 'ef21' for lag (its rule keeps EF21's "
      f"estimates: a device reuses its last sent gradient), got "
      f"{error_feedback!r}")
  return _compressor.compressed(LagCodec(zeta), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["lag"]
