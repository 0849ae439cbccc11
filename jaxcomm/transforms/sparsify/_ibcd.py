"""IBCD, independent block coordinate descent (Mishchenko, Hanzely,
Richtarik 2020): each device sends only a random subset of blocks, drawn
independently of the other devices.

The bucket is partitioned into ``m`` blocks of ``block_size`` elements
(the paper's ``u_1, ..., u_m``); every step, device ``i`` draws a uniform
subset ``U_i`` of ``tau m`` blocks, independently of the others, and the
update is the average of the devices' block-restricted gradients
(Algorithm 1 of the paper, the stepsize ``gamma`` left to the optimizer
chained after)::

  x_i = x - gamma (g_i)_{U_i}              each device, its own blocks
  x' = (1 / n) sum_i x_i = x - gamma (1 / n) sum_i (g_i)_{U_i}

The subsets come from the key every device shares (``fold_in(key,
i)`` for device ``i``), so every device knows every device's blocks and
no index travels: the devices' blocks are all-gathered (``n tau m`` blocks
per device, lane-dense rows of ``block_size``) and added where they
belong, or, when that would move more than the dense all-reduce
(``tau >= 2 / n``), the chosen blocks travel in a dense psum with zeros
elsewhere.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core


def plan(size: int, n: int, ratio, block_size: int
         ) -> tuple[int, int, bool]:
  """``(m, k, gather)`` for a bucket of ``size`` elements on ``n``
  devices: ``m`` blocks of ``block_size`` (the last one padded), ``k =
  max(1, ceil(tau m))`` sent by each device (``tau = ratio``, or ``1 /
  n`` when None), and whether the blocks are all-gathered (fewer bytes
  than the dense ring all-reduce: ``n k B < 2 size``) or psummed dense."""
  m = -(-int(size) // int(block_size))
  tau = 1.0 / n if ratio is None else float(ratio)
  k = max(1, min(m, math.ceil(tau * m - 1e-9)))
  gather = n > 1 and n * k * block_size < 2 * size
  return m, k, gather


def block_choices(key, n: int, m: int, k: int) -> jax.Array:
  """``int32[n, k]``: device ``i``'s ``k`` blocks out of ``m``, a uniform
  subset drawn from ``fold_in(key, i)``: the ``k`` largest of ``m``
  uniform numbers (independent over devices, known to all)."""
  u = jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, j),
                                            (m,)))(jnp.arange(n))
  return jax.lax.top_k(u, k)[1].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class IbcdCodec(_codec.CodecBase):
  """Each device's own random ``tau m`` blocks of the bucket, the devices'
  blocks averaged (:func:`ibcd`).

  Attributes:
    ratio: ``tau``, the fraction of blocks each device sends, in ``(0,
      1]``, or None: ``1 / n`` (the paper's choice).
    block_size: elements per block (the last block of a bucket may be
      shorter).
  """

  ratio: float | None = None
  block_size: int = 1024

  @property
  def name(self):
    return f"ibcd({self.ratio})"

  def apply(self, x, state, ctx):
    n, size, b = ctx.num_devices, x.shape[0], self.block_size
    m, k, gather = plan(size, n, self.ratio, b)
    key = jax.random.fold_in(ctx.key, min(ctx.layout.leaves))
    chosen = block_choices(key, n, m, k)                        # [n, k]
    mine = jnp.take(chosen, ctx.device_index, axis=0)           # [k]
    blocks = jnp.pad(x, (0, m * b - size)).reshape(m, b)
    keep = jnp.zeros((m,), jnp.float32).at[mine].set(1.0)
    sent = (blocks * keep[:, None]).reshape(-1)[:size]
    if not gather:
      mean = _core.psum(sent, ctx.axis_name) / n
      return _codec.CodecResult(mean=mean, sent=sent, state=state)
    rows = jnp.take(blocks, mine, axis=0).reshape(-1)           # [k b]
    every = _core.all_gather(rows, ctx.axis_name).reshape(n * k, b)
    total = _core.zeros_after(m * b, every).reshape(m, b).at[
      chosen.reshape(-1)].add(every)
    mean = total.reshape(-1)[:size] / n
    return _codec.CodecResult(mean=mean, sent=sent, state=state)

  def wire(self, layout, n):
    m, k, gather = plan(layout.size, n, self.ratio, self.block_size)
    if gather:
      return [("all-gather", 4 * n * k * self.block_size)]
    return [("all-reduce", 4 * layout.size)]


@_registry.method(
    gap=(
      "each device sends 1/n of its blocks, unscaled (the paper's E[u] = "
      "tau g): the step is 1/8 of dense's, and the paper's rate is about "
      "n/3 times dense's, not dense's"),
    paper="Mishchenko, Hanzely, Richtarik 2020",
    summary="each device's own random tau m blocks (shared seed, no "
    "indices), all-gathered",
    static=("ratio", "block_size"))
@_compressor.shared_options
def ibcd(ratio: float | None = None, block_size: int | None = None, *,
         axis_name="data", error_feedback: bool = False, policy=None,
         seed: int = 0, **options):
  """Independent block coordinate descent: each device sends random blocks.

  Every device sends a random subset of blocks, drawn independently of the
  other devices.

  .. math::
    u = \\frac{1}{n} \\sum_{i=1}^{n} (g_i)_{U_i}, \\quad U_i \\subset
    \\{u_1, \\dots, u_m\\}, \\; |U_i| = \\tau m

  ``(g)_U`` keeps the blocks in ``U`` and zeros the rest; each ``U_i`` is
  uniform and independent of the others (Algorithm 1 of the paper: each
  worker takes a subspace step on its blocks and the master averages the
  workers' iterates). ``E[u] = tau mean_i g_i``: as in the paper, the
  update is not rescaled by ``1 / tau``; the stepsize makes up for it
  (Theorem 1, for smooth strongly convex ``f_i`` with ``grad f_i(x*) =
  0``: ``gamma = n / (tau n + 2 (1 - tau)) / (2 L)``, about ``n / 3``
  times gradient descent's ``1 / (2 L)`` at ``tau = 1 / n``; Corollary 1:
  then the iteration complexity is gradient descent's, ``O(L / mu log
  1/eps)``). Chain ``optax.sgd`` with that larger rate.

  Blocks are ``block_size`` consecutive elements of each bucket of
  compressed leaves (the paper allows any partition; its Section 3.5
  suggests blocks of about ``d / n``); ``k = max(1, ceil(tau m))`` per
  device. The subsets come from the state's key, shared by every device
  (device ``i`` draws from ``fold_in(key, i)``), so no index travels:
  the ``n k`` blocks are all-gathered, ``4 n k block_size`` bytes
  gathered per device, a ``k / m`` share of what each device would
  gather of everyone's whole gradient; from ``tau >= 2 / n`` a dense
  psum of the chosen blocks (zeros elsewhere) moves fewer bytes and is
  taken instead. At ``tau = 1 / n`` a device sends ``1 / n`` of its
  gradient and the ring all-gather moves about half of the dense ring
  all-reduce's bytes per device (every device still receives every
  device's blocks).

  Departures: none in the update; what the paper does not fix (the block
  partition, how the master learns the blocks) is chosen as above.
  ``error_feedback=True`` keeps the unsent blocks in a residual (not in
  the paper, which drops them).

  Args:
    ratio: ``tau``, the fraction of blocks each device sends, in ``(0,
      1]``, or None (default): ``1 / n`` (static).
    block_size: elements per block, ``>= 1``, or None (default): 1024
      (static; a multiple of 128 keeps TPU rows lane-dense).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep the unsent blocks (default False, as the paper).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the shared key the subsets are drawn from.
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the update is not rescaled).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with ``error_feedback=True``, its
    residual holds the blocks each device has not sent).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), a ``block_size`` that is not an int ``>= 1``, or an
      ``axis_name``, ``error_feedback``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses.

  Examples:
    ``tau = 1/4`` of 4 blocks of 2: every device sends one block of its
    own choosing. With all gradients ones, ``8 u`` counts, per coordinate,
    the devices that sent it: 16 values in all (8 devices times one block
    of 2), in whole blocks:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.ibcd(0.25, 2, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update
    >>> update = np.asarray(jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=P()))(np.ones((8, 8))))
    >>> print(float(8 * update.sum()))
    16.0
    >>> print(bool((update[0::2] == update[1::2]).all()))    # whole blocks
    True

    In training, SGD with the larger rate follows it:

    >>> opt = optax.chain(jaxcomm.ibcd(), optax.sgd(0.1))

  References:
    Mishchenko, Hanzely, Richtarik, `99% of Worker-Master Communication in
    Distributed Optimization Is Not Needed <https://proceedings.mlr.press/
    v124/mishchenko20a.html>`_, 2020.
  """
  if ratio is not None:
    ratio = _checks.ratio("ratio", ratio)
  block_size = (1024 if block_size is None else
                _checks.integer("block_size", block_size, 1))
  _checks.error_feedback(error_feedback)
  return _compressor.compressed(IbcdCodec(ratio, block_size),
                                axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                seed=seed, **options)


__all__ = ["ibcd"]
