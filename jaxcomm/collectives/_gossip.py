"""Gossip averaging: each device mixes with its neighbours only.

Decentralized data parallelism (D-PSGD) replaces the global average by a
few neighbour exchanges per step: device ``i`` holds its own copy ``x_i``
and moves it towards its neighbours' copies with a doubly stochastic mixing
matrix ``W``, ``x_i <- sum_j W_ij x_j``. Each device sends its buffer once
per neighbour per round, whatever the number of devices, and repeated rounds
converge to the global mean at a rate set by ``W``'s spectral gap.

The result differs per device (it is typed as varying): gossip is for
decentralized training, where params are per device, not for the replicated
updates jaxcomm's compressors produce.
"""

from __future__ import annotations

import jax

from jaxcomm.collectives import _core

TOPOLOGIES = ("ring", "hypercube")


def gossip_weights(topology: str, n: int, rnd: int = 0) -> list[tuple]:
  """The round's ``(offset, weight)`` pairs: ``x_i += w * x_{(i+offset)%n}``.

  ``ring``: each device averages itself and both ring neighbours (weights
  1/3; 1/2 with one neighbour when n == 2). ``hypercube``: in round ``r``,
  device ``i`` averages with ``i XOR 2^(r mod log2 n)`` (n a power of two);
  ``log2 n`` rounds give the exact mean.
  """
  if topology not in TOPOLOGIES:
    raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
  if n == 1:
    return []
  if topology == "ring":
    if n == 2:
      return [(1, 0.5)]
    return [(1, 1.0 / 3.0), (-1, 1.0 / 3.0)]
  if n & (n - 1):
    raise ValueError(
      f"the hypercube topology needs a power-of-two device count, got n={n}")
  return [("xor", 1 << (rnd % (n.bit_length() - 1)))]


def gossip_average(x, axis_name, *, topology: str = "ring",
                   rounds: int = 1):
  """``rounds`` of gossip averaging of ``x`` (any pytree) over the axis.

  Args:
    x: this device's values.
    axis_name: the axis to gossip over (None: identity).
    topology: ``"ring"`` or ``"hypercube"`` (see :func:`gossip_weights`).
    rounds: mixing rounds (each one ppermute per neighbour).

  Returns:
    The mixed values, typed as varying over ``axis_name``.

  References:
    Lian et al, `Can Decentralized Algorithms Outperform Centralized
    Algorithms? <https://arxiv.org/abs/1705.09056>`_, 2017.
  """
  if not isinstance(rounds, int) or rounds < 0:
    raise ValueError(f"rounds must be a non-negative int, got {rounds!r}")
  if topology not in TOPOLOGIES:
    raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
  if axis_name is None:
    return x
  n = _core.axis_size(axis_name)
  x = _core.pvary(x, axis_name)
  for r in range(rounds):
    pairs = gossip_weights(topology, n, r)
    if not pairs:
      break
    if pairs[0][0] == "xor":
      bit = pairs[0][1]
      perm = [(i, i ^ bit) for i in range(n)]
      x = jax.tree.map(
        lambda a, perm=perm: 0.5 * (a + _core.ppermute(a, axis_name, perm)), x)
      continue
    self_w = 1.0 - sum(w for _, w in pairs)

    def mix(a, pairs=pairs, self_w=self_w):
      out = self_w * a
      for off, w in pairs:
        # Device i receives from (i + off) % n.
        perm = [((i + off) % n, i) for i in range(n)]
        out = out + w * _core.ppermute(a, axis_name, perm)
      return out

    x = jax.tree.map(mix, x)
  return x
