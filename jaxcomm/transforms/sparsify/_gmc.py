"""Global momentum compression (GMC, Zhao et al. 2019): top-k of each
device's update corrected by the *global* momentum, with a memory.

Momentum SGD in data parallel keeps its momentum either per device (DGC's
local momentum, :func:`jaxcomm.dgc`) or as the model's own last step, the
global momentum ``(w_{t-1} - w_t) / eta``, which every device knows
because the params are replicated. GMC (Algorithm 1 of the paper) adds the
global momentum to each device's gradient and its memory, sparsifies the
sum and keeps what was not sent::

  z_i = u_i + g_i + beta d           u_i: device i's memory, d: the global
  s_i = top_k(z_i)                   momentum, the last aggregated step
  u_i' = z_i - s_i                   (gradient units: w_t = w_{t-1} - eta d)
  d' = (1 / n) sum_i s_i             the update, and the next global momentum

With a dense compressor it is heavy-ball momentum SGD (``d' = mean_i g_i +
beta d``); chain a plain SGD after it, without momentum of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import ClassVar
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _sparse
from jaxcomm.transforms.sparsify import _sparsification as _sp


class GmcState(NamedTuple):
  """GMC's state, one per bucket (in ``CompressState.codec``).

  Attributes:
    momentum: float32 ``[size]``, the global momentum ``d``: the last
      aggregated update (the same on every device).
  """

  momentum: jax.Array


@dataclasses.dataclass(frozen=True)
class GmcCodec(_codec.CodecBase):
  """Top-k of ``z = x + beta d`` (``x = g + u``, ``d`` the last update),
  exchanged as top-k's (index, value) pairs; the memory keeps ``z -
  top_k(z)``.

  Attributes:
    ratio: fraction of each leaf's coordinates sent, in ``(0, 1]``.
    beta: the global momentum's weight, in ``[0, 1)`` (may be traced).
  """

  ratio: float
  beta: Any = 0.9
  granularity: ClassVar[str] = "leaf"
  # The update is the mean of the selected z_i; sent is z_i's selection
  # less beta d, so that the shared memory u' = x - sent is z - top_k(z).
  mean_of_sent: ClassVar[bool] = False

  @property
  def name(self):
    return f"gmc({self.ratio})"

  check_layouts = _sp._check_selects_one("gmc")

  def init(self, layout):
    return GmcState(jnp.zeros([layout.size], jnp.float32))

  def apply(self, x, state, ctx):
    push = jnp.asarray(self.beta, jnp.float32) * state.momentum
    z = x + push
    vals, idx = _sp._local_topk(z, _sp._segments(ctx.layout), self.ratio)
    mean, chosen = _sp._sparse_exchange(vals, idx, ctx)
    return _codec.CodecResult(mean=mean, sent=chosen - push,
                              state=GmcState(mean))

  def wire(self, layout, n):
    return _sparse.sparse_psum_wire(
      _sp._num_pairs(_sp._segments(layout), self.ratio), layout.size, n)


@_registry.method(
    gap=(
      "1% of gradient + memory + global momentum a step; short on the "
      "char-LSTM"),
    paper="Zhao et al. 2019",
    summary="top-k of gradient + memory + global momentum (the last "
    "update), pairs, sparse psum",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def gmc(ratio: float, beta: float = 0.9, *, axis_name="data",
        error_feedback: bool = True, policy=None, seed: int = 0,
        **options):
  """Global momentum compression: top-k with the global momentum added.

  Sparsified momentum SGD whose momentum is the model's last step, not
  each device's own.

  .. math::
    z_i = u_i + g_i + \\beta d, \\quad s_i = \\mathrm{top}_k(z_i), \\quad
    u_i \\leftarrow z_i - s_i, \\quad d \\leftarrow \\frac{1}{n}
    \\sum_i s_i

  ``d``, the global momentum, is the aggregated update of the previous
  step (``(w_{t-1} - w_t) / eta`` of the paper, in gradient units), kept
  in the state and the same on every device; ``u_i`` is device ``i``'s
  memory (the compressor's residual). The update is ``d``: chain
  ``optax.sgd(lr)`` without momentum after it. Top-k per leaf, ``k =
  max(1, ceil(ratio L))``, exchanged as :func:`jaxcomm.topk`'s (index,
  value) pairs: ``n k (4 + b)`` bytes gathered per device.

  Departure: the momentum is in gradient units (``d``, not ``(w_{t-1} -
  w_t) / eta_t``): under a learning-rate schedule the paper's momentum of
  a constant ``eta`` is kept, as ``optax.sgd(momentum=...)`` keeps it.

  Args:
    ratio: fraction of coordinates sent per leaf, in ``(0, 1]`` (static).
    beta: the global momentum's weight, in ``[0, 1)`` (injectable).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: True (the only mode: the memory ``u_i`` is GMC's).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``momentum`` is refused: GMC's momentum
      is ``beta``; so is ``shift_rate``, DIANA's).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (its residual is the memory ``u_i``, its
    ``codec`` the global momentum ``d``).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), a ``beta`` outside ``[0, 1)``, ``error_feedback``
      other than True, a ``momentum`` option, or an ``axis_name``,
      ``policy`` or option that :func:`jaxcomm.compressed` refuses.
      ``tx.init`` raises one when ``ratio`` keeps fewer than one element
      of every compressed leaf.

  Examples:
    ``k = 2`` of 4 values and ``beta = 0.5``: device ``i`` (1 to 8) has
    the gradient ``i * [1, 0.5, 0.25, 0]`` twice. The first update is the
    mean of the top 2, ``d = [4.5, 2.25, 0, 0]``; at the second each
    device adds ``beta d`` before its top-k, so the update is ``1.5 d``
    (heavy ball where nothing is cut), and the memory ``u_i`` has
    gathered ``0.25 i`` twice at the third coordinate:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.gmc(0.5, beta=0.5, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   second, state = tx.update(g[0], state)
    ...   return first, second, state.residual[0][None]
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array([1.0, 0.5, 0.25, 0])
    >>> first, second, memory = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P(), P("data"))))(grads)
    >>> print(np.asarray(first).round(3), np.asarray(second).round(3))
    [4.5  2.25 0.   0.  ] [6.75  3.375 0.    0.   ]
    >>> print(np.asarray(memory[7]).round(3))
    [0. 0. 4. 0.]

    In training, plain SGD follows it:

    >>> opt = optax.chain(jaxcomm.gmc(0.01, beta=0.9), optax.sgd(0.1))

  References:
    Zhao et al, `Global Momentum Compression for Sparse Communication in
    Distributed Learning <https://arxiv.org/abs/1905.12948>`_, 2019.
  """
  ratio = _checks.ratio("ratio", ratio)
  beta = _checks.decay("beta", beta)
  if error_feedback is not True:
    raise ValueError(
      f"error_feedback must be True for gmc (its memory u_i is the "
      f"residual), got {error_feedback!r}")
  if options.get("momentum") is not None:
    raise ValueError(
      "momentum: gmc's momentum is the global one (beta); DGC's local "
      "momentum correction does not apply")
  return _compressor.compressed(GmcCodec(ratio, beta), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["gmc"]
