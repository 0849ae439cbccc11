"""ScaleCom (Chen et al., NeurIPS 2020): cyclic local top-k (CLT-k) with a
low-pass filter on the error-feedback memory.

At step ``t`` the leader is device ``t mod n``. Per leaf, the leader's ``k``
largest ``|x|`` (``x = g + e``) pick the coordinates; their indices reach
every device through one psum (the leader's ``k`` int32 per leaf, the
others' zeros), and every device's own values at them are summed with a
second psum of ``k`` float32. Bytes per device are ``8 k`` per leaf,
independent of the number of devices (top-k's all-gather grows with it).

The paper's memory update (Algorithm 1) is a low-pass filter of the
residual, ``m_t = (1 - beta) m_{t-1} + beta (x_t - C(x_t))`` with ``x_t =
m_{t-1} + g_t``; ``beta = 1`` is classic error feedback. The shared error
feedback of :func:`jaxcomm.compressed` keeps ``e' = x - sent``, so for
``beta < 1`` the codec keeps its own copy of ``m`` (per device) and returns
``sent = x - m_t`` (then ``e' = m_t`` exactly); the update is still the
mean of the selected values, so ``mean`` is then not the mean of ``sent``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.transforms.sparsify._sparsification import _local_topk
from jaxcomm.transforms.sparsify._sparsification import _num_pairs
from jaxcomm.transforms.sparsify._sparsification import _segments


def leader(step, n: int):
  """The device whose top-k picks the coordinates at ``step``."""
  return step % n


@dataclasses.dataclass(frozen=True)
class ScaleComCodec(_codec.CodecBase):
  """Cyclic local top-k: the leader's indices, every device's values,
  two psums; with ``beta != 1`` a low-pass filtered memory (per device, the
  codec's state).

  Attributes:
    ratio: fraction of coordinates sent per leaf.
    beta: the filter's weight on the new residual (1: classic error
      feedback, no filter; may be a traced value, which filters).
  """

  ratio: float
  beta: Any = 1.0

  @property
  def name(self):
    return f"scalecom({self.ratio})"

  @property
  def filtered(self) -> bool:
    """Whether the memory is low-pass filtered (``beta`` is not 1)."""
    return isinstance(self.beta, jax.core.Tracer) or float(self.beta) != 1.0

  @property
  def mean_of_sent(self):
    return not self.filtered

  def check_layouts(self, layouts):
    # Like top-k's: the floor k = 1 would hide a ratio that keeps nothing.
    _checks.selects_one("ratio", self.ratio,
                        [s for lay in layouts for s in lay.sizes],
                        "scalecom")

  def init(self, layout):
    if self.filtered:
      return jnp.zeros((layout.size,), jnp.float32)
    return ()

  def apply(self, x, state, ctx):
    segs = _segments(ctx.layout)
    _, idx = _local_topk(x, segs, self.ratio)
    idx = idx.astype(jnp.int32)
    lead = ctx.device_index == leader(ctx.step, ctx.num_devices)
    # The leader's indices on every device: a psum where only it adds.
    idx = _core.psum(jnp.where(lead, idx, 0), ctx.axis_name)
    vals = x[idx]
    summed = _core.psum(vals, ctx.axis_name)
    mean = _core.zeros_after(ctx.layout.size, idx).at[idx].set(
      summed / ctx.num_devices)
    chosen = _core.zeros_after(ctx.layout.size, idx).at[idx].set(vals)
    if not self.filtered:
      return _codec.CodecResult(mean=mean, sent=chosen, state=state)
    # Low-pass filter: m_t = (1 - beta) m_{t-1} + beta (x - C(x)); sent is
    # what leaves exactly m_t as the residual x - sent.
    beta = self.beta
    memory = (1.0 - beta) * state + beta * (x - chosen)
    sent = x - memory
    return _codec.CodecResult(mean=mean, sent=sent, state=x - sent)

  def wire(self, layout, n):
    del n
    k = _num_pairs(_segments(layout), self.ratio)
    return [("all-reduce", 4 * k), ("all-reduce", 4 * k)]


@_registry.method(
    gap=(
      "the leader's top-k indices serve every device; the paper's memory "
      "similarity needs larger per-device batches than 16 examples"),
    paper="Chen et al. 2020 (ScaleCom)",
    summary="leader's top-k indices (cyclic), values psummed, EF",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def scalecom(ratio: float, *, beta: float | None = None, axis_name="data",
             error_feedback: bool = True, policy=None, seed: int = 0,
             **options):
  """ScaleCom: cyclic local top-k with a low-pass filtered memory.

  .. math::
    x_i = g_i + m_i, \\quad I = \\text{top}_k(|x_\\ell|),\\ \\ell = t
    \\bmod n, \\quad u = \\frac{1}{n}\\sum_i (x_i)_I, \\quad
    m_i \\leftarrow (1 - \\beta) m_i + \\beta (x_i - (x_i)_I)

  At step ``t`` device ``t mod n`` (the leader) selects the ``k = max(1,
  ceil(ratio * L))`` entries of largest ``|x|`` of each leaf (ties: lower
  index first); the indices reach every device through one psum of ``k``
  int32 per leaf, and every device's own values there are averaged with one
  psum of ``k`` float32: ``8 k`` bytes per device per leaf, independent of
  ``n``. ``beta = 1`` (the default) is classic error feedback; ``beta < 1``
  is the paper's low-pass filter of the memory, kept by the codec as a
  second per-device buffer (the shared residual then equals it). The
  filter needs ``error_feedback=True`` and takes no ``momentum`` or
  ``lr_schedule`` (both rewrite the residual behind the filter's copy).

  Args:
    ratio: fraction of coordinates sent, in ``(0, 1]`` (static).
    beta: the filter's weight on the new residual, in ``(0, 1]`` (default
      1: classic error feedback).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased; with ``beta < 1``, so are ``momentum`` and
      ``lr_schedule``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet; with
    ``beta < 1`` the codec part keeps its filtered copy).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), a ``beta`` outside ``(0, 1]``, ``beta < 1`` with
      ``error_feedback`` other than True or with ``momentum`` or
      ``lr_schedule``, or an ``axis_name``, ``error_feedback``,
      ``policy`` or option that :func:`jaxcomm.compressed` refuses.
      ``tx.init`` raises one when ``ratio`` keeps fewer than one element
      of every compressed leaf.

  Examples:
    ``k = 2`` of 8 values; device ``d`` (0 to 7) has the gradient ``[d,
    -d, 1, -1, 0, ...]``. At step 0 the leader is device 0, whose largest
    are ``1, -1``: every device sends its values there, whose mean is the
    update, though most devices' largest are elsewhere. At step 1 device 1
    leads: its ``x = g + e`` is largest at the first two coordinates,
    where every device sends what two steps have put there, ``2d`` and
    ``-2d``:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.scalecom(0.25, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   second, state = tx.update(g[0], state)
    ...   return first, second
    >>> d = np.arange(8.0)                         # device d = 0 .. 7
    >>> grads = np.zeros((8, 8))
    >>> grads[:, 0], grads[:, 1], grads[:, 2], grads[:, 3] = d, -d, 1, -1
    >>> first, second = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    >>> print(np.asarray(first).round(3))
    [ 0.  0.  1. -1.  0.  0.  0.  0.]
    >>> print(np.asarray(second).round(3))
    [ 7. -7.  0.  0.  0.  0.  0.  0.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.scalecom(0.01), optax.sgd(0.1))

  References:
    Chen et al, `ScaleCom: Scalable Sparsified Gradient Compression for
    Communication-Efficient Distributed Training
    <https://arxiv.org/abs/2104.11125>`_, NeurIPS 2020.
  """
  # Static arguments default to None: optax.inject_hyperparams then keeps
  # them out of the traced hyperparameters unless the caller passes them.
  ratio = _checks.ratio("ratio", ratio)
  beta = _checks.number("beta", 1.0 if beta is None else beta, 0.0, 1.0,
                        lo_open=True)
  filtered = isinstance(beta, jax.core.Tracer) or float(beta) != 1.0
  if filtered:
    clash = [name for name in ("momentum", "lr_schedule")
             if options.get(name) is not None]
    if error_feedback is not True:
      clash.append(f"error_feedback={error_feedback!r}")
    if clash:
      raise ValueError(
        f"beta={beta!r} low-pass filters the error-feedback memory, which "
        f"needs error_feedback=True and no momentum or lr_schedule; got "
        f"{', '.join(clash)}")
    beta = beta if isinstance(beta, jax.core.Tracer) else float(beta)
  return _compressor.compressed(
    ScaleComCodec(ratio, beta), axis_name=axis_name,
    error_feedback=error_feedback, policy=policy, seed=seed, **options)


__all__ = ["scalecom"]
