"""dist-EF-SGDM (Zheng, Huang, Kwok 2019): blockwise momentum SGD whose
momentum is compressed to scaled signs, with error feedback on the workers
and on the server.

Each worker keeps a momentum and an error, the server an error of its own
(Algorithm 2 of the paper, dist-EF-BlockSGDM; blocks ``G_b``)::

  m_i = mu m_i + g_i                  worker i's momentum
  p_i = m_i + e_i                     (the paper: eta m_i + e_i)
  D_i = C(p_i),  e_i = p_i - D_i      C(v)_G = ||v_G||_1 / |G| sign(v_G)
  p = (1 / n) sum_i D_i + e           the server
  D = C(p),      e = p - D            the update: x -= eta D

The exchange is the two-phase compressed allreduce of
:mod:`jaxcomm.collectives._signs` with ``norm="l1"``: every device is the
server of one chunk of the bucket, which it receives from every device as
packed signs and per-leaf scales (an all-to-all), compresses again with
its server error and sends back (an all-gather).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _per_device
from jaxcomm import _registry
from jaxcomm.collectives import _signs


class DistEfSgdmState(NamedTuple):
  """Codec state of :func:`jaxcomm.dist_ef_sgdm`.

  Attributes:
    server_error: ``float32[S]`` per device (``S`` the bucket's stored
      size, :attr:`jaxcomm._buckets.Layout.stored_size`);
      device ``k`` is the server of chunk ``[k C, (k + 1) C)`` and keeps
      its error there, in gradient-sum units (``n`` times the paper's
      ``e``); zero elsewhere.
  """

  server_error: jax.Array


# Device k holds the whole server error of its chunk: resizing re-cuts
# the total into the new devices' chunks (as onebit's).
_per_device.register(DistEfSgdmState, server_error=_per_device.OWNED)


@dataclasses.dataclass(frozen=True)
class DistEfSgdmCodec(_codec.CodecBase):
  """Blockwise ``||v||_1 / d`` scaled signs of ``p_i = m_i + e_i`` (one
  block per leaf), averaged and compressed again by each chunk's server
  with its error (:func:`jaxcomm.dist_ef_sgdm`). No fields: the momentum is
  :func:`jaxcomm.compressed`'s."""

  name = "dist_ef_sgdm"
  mean_of_sent = False

  def init(self, layout):
    return DistEfSgdmState(jnp.zeros([layout.stored_size], jnp.float32))

  def apply(self, x, state, ctx):
    mean, sent, err = _signs.compressed_allreduce(
      x, ctx.layout.sizes, state.server_error, ctx.axis_name, norm="l1")
    return _codec.CodecResult(mean=mean, sent=sent,
                              state=DistEfSgdmState(err))

  def wire(self, layout, n):
    return _signs.compressed_allreduce_wire(layout.sizes, n,
                                            layout.stored_size)


@_registry.method(
    gap=(
      "signs of the momentum, worker and server error: short on the "
      "char-LSTM in 300 steps"),
    paper="Zheng, Huang, Kwok 2019",
    summary="blockwise l1-scaled signs of the momentum, worker and server "
    "EF (2-phase)")
@_compressor.shared_options
def dist_ef_sgdm(momentum: float = 0.9, *, axis_name="data",
                 error_feedback: bool = True, policy=None,
                 momentum_masking: bool = False, **options):
  """dist-EF-BlockSGDM: momentum SGD, scaled signs, worker and server EF.

  Blockwise momentum SGD with error feedback on workers and server, about
  1 bit per element each way.

  .. math::
    m_i \\leftarrow \\mu m_i + g_i, \\quad p_i = m_i + e_i, \\quad
    \\Delta_i = C(p_i), \\quad e_i \\leftarrow p_i - \\Delta_i

  .. math::
    \\tilde p = \\frac{1}{n} \\sum_i \\Delta_i + \\tilde e, \\quad
    \\tilde\\Delta = C(\\tilde p), \\quad \\tilde e \\leftarrow \\tilde p -
    \\tilde\\Delta, \\quad
    C(v)_{G} = \\frac{\\|v_G\\|_1}{|G|} \\operatorname{sign}(v_G)

  per block ``G``; the update is ``tilde Delta``: chain ``optax.sgd(lr)``
  without momentum (the paper's step ``x -= eta tilde Delta``). Each
  device sends its signs (1 bit per element) and one float32 scale per
  block in an all-to-all, and its chunk of the server's signs and scales
  in an all-gather: about 2 bits per element per device whatever ``n``
  (the paper's 1 bit up and 1 bit down).

  Departures: the paper compresses ``p_i = eta m_i + e_i`` (errors in
  parameter units); here ``p_i = m_i + e_i / eta``, the same steps for a
  constant ``eta`` (``C`` is positively homogeneous); under a schedule
  pass ``lr_schedule`` (the workers' errors are rescaled by ``eta_{t-1}
  / eta_t``; the server's are not). The workers' blocks are the leaves
  (the paper's experiments use layers as blocks; written from memory of
  the paper). There is no parameter server: each device serves one chunk
  of ``ceil(L / n)`` elements (rounded up to 32) and its blocks are the
  leaves' segments in that chunk, one scale each. sign(0) = +1.

  Args:
    momentum: ``mu`` in ``[0, 1)`` (injectable; 0: dist-EF-SGD).
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: True (the workers' error ``e_i``; the only mode).
    policy: a :class:`jaxcomm.LeafPolicy`.
    momentum_masking: False (the momentum is never masked; True is
      refused).
    **options: ``start_step``, ``clip_norm``, ``lr_schedule``,
      ``residual_decay`` and ``shift_rate``, the options every compressor
      takes, forwarded to :func:`jaxcomm.compressed` (``shift_rate``,
      DIANA's, is refused).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (the workers' momenta and errors, and
    a :class:`jaxcomm.DistEfSgdmState` per bucket).

  Raises:
    ValueError: naming the argument, for a ``momentum`` outside ``[0,
      1)``, an ``error_feedback`` other than True, a ``momentum_masking``
      other than False, or an ``axis_name``, ``policy`` or option that
      :func:`jaxcomm.compressed` refuses; the update raises one when it
      is called outside a context that binds ``axis_name``.

  Examples:
    Two steps on the 8 devices with the same gradient ``g_i = [i, -i /
    2, 1.5, 8 - i]`` on device ``i`` (1 to 8), with a leaf policy that
    compresses even a 4-value leaf: the second step compresses the
    momentum ``m_i = 0.9 g_i + g_i = 1.9 g_i``. Each update is one scale
    times a sign per element, and nothing is lost: ``n`` times the
    updates, plus the workers' and the server's errors, is the sum of
    the momenta, ``2.9 sum_i g_i``:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.dist_ef_sgdm(0.9, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 4]
    ...   state = tx.init(g[0])
    ...   first, state = tx.update(g[0], state)
    ...   second, state = tx.update(g[0], state)
    ...   return (first + second, state.momentum[0][None],
    ...           state.residual[0][None], state.codec[0].server_error[None])
    >>> i = np.arange(1.0, 9.0)[:, None]          # device i = 1 .. 8
    >>> grads = np.concatenate([i, -i / 2, 0 * i + 1.5, 8 - i], axis=1)
    >>> updates, momentum, residual, server = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"), P("data"), P("data"))))(grads)
    >>> print(np.asarray(momentum[0], np.float64).round(3))     # device 1's
    [ 1.9  -0.95  2.85 13.3 ]
    >>> kept = np.sum(residual, 0) + np.sum(server, 0)
    >>> print(np.allclose(8 * updates + kept, 2.9 * grads.sum(0), atol=1e-4))
    True

    In training, an optimizer without momentum follows it:

    >>> opt = optax.chain(jaxcomm.dist_ef_sgdm(0.9), optax.sgd(0.01))

  References:
    Zheng, Huang, Kwok, `Communication-Efficient Distributed Blockwise
    Momentum SGD with Error-Feedback <https://arxiv.org/abs/1905.10936>`_,
    2019.
  """
  momentum = _checks.decay("momentum", momentum)
  if error_feedback is not True:
    raise ValueError(
      f"error_feedback must be True for dist_ef_sgdm (the workers' error "
      f"e_i is the residual), got {error_feedback!r}")
  if momentum_masking is not False:
    raise ValueError(
      f"momentum_masking must be False for dist_ef_sgdm (its momentum is "
      f"never masked), got {momentum_masking!r}")
  return _compressor.compressed(DistEfSgdmCodec(), axis_name=axis_name,
                                error_feedback=True, policy=policy,
                                momentum=momentum, momentum_masking=False,
                                **options)


__all__ = ["dist_ef_sgdm", "DistEfSgdmState"]
