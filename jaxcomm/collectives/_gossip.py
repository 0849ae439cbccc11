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
import jax.numpy as jnp
import numpy as np

from jaxcomm import _buckets
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
    topology: ``"ring"``: each device averages itself and both ring
      neighbours (weights 1/3; 1/2 with one neighbour when n == 2);
      ``"hypercube"``: in round ``r`` device ``i`` averages with ``i XOR
      2^(r mod log2 n)`` (n a power of two), so ``log2 n`` rounds give
      the exact mean.
    rounds: mixing rounds (each one ppermute per neighbour).

  Returns:
    The mixed values, typed as varying over ``axis_name``.

  Raises:
    ValueError: when ``rounds`` is not a non-negative int, ``topology`` is
      unknown, or the hypercube's device count is not a power of two.

  Examples:
    Three hypercube rounds on 8 devices give every device the exact mean
    of the values 0 to 7:

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> f = jax.shard_map(
    ...   lambda x: jaxcomm.collectives.gossip_average(
    ...     x, "data", topology="hypercube", rounds=3),
    ...   mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> f(jnp.arange(8.0)).tolist()
    [3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5]

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


# ------------------------------------------------ mixing for D-PSGD ----

MIXING_TOPOLOGIES = ("ring", "torus", "hypercube", "exponential")


def _torus_shape(n: int) -> tuple[int, int]:
  r = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
  return r, n // r


def mixing_phases(topology: str, n: int) -> list[list[tuple]]:
  """The mixing of each phase (the step count modulo the number of phases
  picks one): a list of ``(sources, weight)``, ``sources[i]`` being the
  device whose value device ``i`` receives with that weight (``i`` itself
  for the self weight). Every phase's matrix is doubly stochastic.

  * ``ring``: ``1/3`` each of self and both neighbours (``1/2`` when n=2).
  * ``torus``: the most square ``r x c`` grid; ``1/5`` each of self and
    the four grid neighbours (wrapping; coinciding ones add up).
  * ``hypercube`` (n a power of two): phase ``k`` averages with
    ``i XOR 2^k``, ``log2 n`` phases (their product is the exact mean).
  * ``exponential`` (one-peer exponential graph, Ying et al. 2021): phase
    ``k`` averages with the value of ``i + 2^k mod n``,
    ``ceil(log2 n)`` phases (directed; doubly stochastic).
  """
  if topology not in MIXING_TOPOLOGIES:
    raise ValueError(
      f"topology must be one of {MIXING_TOPOLOGIES}, got {topology!r}")
  ident = list(range(n))
  if n == 1:
    return [[(ident, 1.0)]]
  if topology == "ring":
    if n == 2:
      return [[(ident, 0.5), ([1, 0], 0.5)]]
    third = 1.0 / 3.0
    return [[(ident, third), ([(i + 1) % n for i in ident], third),
             ([(i - 1) % n for i in ident], third)]]
  if topology == "torus":
    r, c = _torus_shape(n)
    at = lambda a, b: (a % r) * c + (b % c)
    nbrs = [[at(i // c + da, i % c + db) for i in ident]
            for da, db in ((1, 0), (-1, 0), (0, 1), (0, -1))]
    merged = {}
    for s in [ident] + nbrs:     # coinciding neighbours (r or c <= 2) add up
      merged[tuple(s)] = merged.get(tuple(s), 0.0) + 0.2
    return [[(list(s), w) for s, w in merged.items()]]
  if topology == "hypercube":
    if n & (n - 1):
      raise ValueError("the hypercube topology needs a power-of-two device "
                       f"count, got n={n}")
    return [[(ident, 0.5), ([i ^ (1 << k) for i in ident], 0.5)]
            for k in range(n.bit_length() - 1)]
  phases = max(1, (n - 1).bit_length())
  return [[(ident, 0.5), ([(i + (1 << k)) % n for i in ident], 0.5)]
          for k in range(phases)]


def mixing_matrix(topology: str, n: int, phase: int = 0):
  """The ``n x n`` mixing matrix ``W`` of a phase (``x <- W x``).

  Args:
    topology: ``"ring"`` (1/3 each of self and both neighbours; 1/2 when
      n = 2), ``"torus"`` (the most square grid, 1/5 each of self and four
      neighbours), ``"hypercube"`` (n a power of two; phase ``k`` averages
      with ``i XOR 2^k``) or ``"exponential"`` (phase ``k`` averages with
      ``i + 2^k mod n``).
    n: the number of devices.
    phase: the phase (taken modulo the topology's number of phases).

  Returns:
    A doubly stochastic ``float64`` numpy array of shape ``(n, n)``.

  Raises:
    ValueError: when ``topology`` is unknown, or the hypercube's ``n`` is
      not a power of two.

  Examples:
    >>> from jaxcomm import collectives
    >>> collectives.mixing_matrix("ring", 4).round(3)
    array([[0.333, 0.333, 0.   , 0.333],
           [0.333, 0.333, 0.333, 0.   ],
           [0.   , 0.333, 0.333, 0.333],
           [0.333, 0.   , 0.333, 0.333]])
  """
  w = np.zeros((n, n))
  phases = mixing_phases(topology, n)
  for sources, weight in phases[phase % len(phases)]:
    for i, j in enumerate(sources):
      w[i, j] += weight
  return w


def gossip_mix(leaves, axis_name, topology: str, step):
  """One mixing step ``x_i <- sum_j W_ij x_j`` of ``leaves``.

  All leaves travel as one float32 buffer, one collective-permute per
  neighbour; time-varying topologies pick their phase with
  ``lax.switch``.

  Args:
    leaves: a list of arrays (this device's values).
    axis_name: the axis to mix over, or None (the leaves unchanged).
    topology: a topology of :func:`mixing_matrix`.
    step: the step counter (a traced int); the phase is ``step`` modulo
      the topology's number of phases.

  Returns:
    The mixed leaves, a list in their shapes and dtypes, typed varying
    over ``axis_name``.
  """
  if axis_name is None or not leaves:
    return list(leaves)
  n = _core.axis_size(axis_name)
  flat = _core.pvary(_buckets.flatten_real(list(leaves)), axis_name)
  phases = mixing_phases(topology, n)

  def run(phase):
    def f(x):
      out = None
      for sources, weight in phase:
        if sources == list(range(n)):
          y = x
        else:
          # Device i receives from sources[i].
          y = _core.ppermute(x, axis_name, [(s, i) for i, s in
                                            enumerate(sources)])
        out = weight * y if out is None else out + weight * y
      return out
    return f

  if len(phases) == 1:
    mixed = run(phases[0])(flat)
  else:
    mixed = jax.lax.switch(jnp.asarray(step, jnp.int32) % len(phases),
                           [run(p) for p in phases], flat)
  return _buckets.unflatten_like(mixed, leaves)


def gossip_messages(words, own, decode, axis_name, topology: str):
  """``sum_j W_ij decode(message_j)`` over a fixed topology's neighbours.

  Used by CHOCO-SGD, where messages are compressed: only they travel,
  once per neighbour as one collective-permute.

  Args:
    words: this device's message, a ``uint32`` array.
    own: what ``words`` decodes to (the self term), a list of arrays.
    decode: ``decode(words) -> like own``, for a received message.
    axis_name: the axis to mix over, or None (``own`` unchanged).
    topology: a fixed (single-phase) topology of :func:`mixing_matrix`.

  Returns:
    The mixed values, a list like ``own``.

  Raises:
    ValueError: when ``topology`` is time-varying (several phases).
  """
  if axis_name is None:
    return list(own)
  n = _core.axis_size(axis_name)
  phases = mixing_phases(topology, n)
  if len(phases) != 1:
    raise ValueError(f"topology {topology!r} is time-varying; compressed "
                     "gossip needs a fixed graph")
  ident = list(range(n))
  out = None
  for sources, weight in phases[0]:
    if sources == ident:
      y = list(own)
    else:
      y = decode(_core.ppermute(words, axis_name,
                                [(s, i) for i, s in enumerate(sources)]))
    out = [weight * a for a in y] if out is None else [
      o + weight * a for o, a in zip(out, y)]
  return out


def gossip_wire(topology: str, n: int, size: int, step=None) -> list:
  """Collectives of :func:`gossip_mix` of ``size`` elements: one
  collective-permute of ``4 size`` bytes per neighbour, for the phase of
  ``step`` (None: every phase, as the compiled step holds them)."""
  if n == 1:
    return []
  phases = mixing_phases(topology, n)
  chosen = phases if step is None else [phases[step % len(phases)]]
  ident = list(range(n))
  return [("collective-permute", 4 * size) for ph in chosen
          for sources, _ in ph if sources != ident]


# ------------------------------------------- push-sum (directed graphs) --

def push_sum_phases(topology, n: int) -> list[list[list[int]]]:
  """Per phase, each device's out-neighbours (the devices it sends to).

  * ``"exponential"``: the directed one-peer exponential graph of SGP
    (Assran et al. 2019): in phase ``k`` device ``i`` sends to
    ``i + 2^k mod n``, ``ceil(log2 n)`` phases.
  * a list of ``n`` lists: a fixed directed graph, ``topology[i]`` the
    devices ``i`` sends to (not itself, no repeats); in-degrees may differ,
    which is what push-sum's weights correct for.
  """
  if isinstance(topology, str):
    if topology != "exponential":
      raise ValueError("topology must be 'exponential' or a list of each "
                       f"device's out-neighbours, got {topology!r}")
    if n == 1:
      return [[[]]]
    return [[[(i + (1 << k)) % n] for i in range(n)]
            for k in range(max(1, (n - 1).bit_length()))]
  out = check_directed_graph(topology)
  if len(out) != n:
    raise ValueError(f"topology lists out-neighbours of {len(out)} devices "
                     f"but the axis has {n}")
  if any(j >= n for o in out for j in o):
    raise ValueError(f"topology names a device outside [0, {n})")
  return [[list(o) for o in out]]


def _reach(edges, start: int) -> set:
  seen, todo = {start}, [start]
  while todo:
    for j in edges[todo.pop()]:
      if j not in seen:
        seen.add(j)
        todo.append(j)
  return seen


def _check_strongly_connected(out) -> None:
  """Push-sum averages only over a strongly connected graph: a device no
  path reaches (or that reaches no other) keeps its own values and its
  weight decays towards 0, until ``x / w`` overflows."""
  n = len(out)
  back = [[] for _ in range(n)]
  for i, o in enumerate(out):
    for j in o:
      back[j].append(i)
  for edges, what in ((out, "reached from"), (back, "able to reach")):
    missed = sorted(set(range(n)) - _reach(edges, 0))
    if missed:
      raise ValueError(
        f"topology is not strongly connected: devices {missed} are not "
        f"{what} device 0 (push-sum needs a path between every pair, or "
        "their weights vanish and params become non-finite)")


def check_directed_graph(topology) -> tuple[tuple[int, ...], ...]:
  """A directed graph as a tuple of out-neighbour tuples, checked."""
  try:
    bad = any(isinstance(j, bool) or not isinstance(j, (int, np.integer))
              for o in topology for j in o)
  except TypeError:
    bad = True
  out = () if bad else tuple(tuple(int(j) for j in o) for o in topology)
  if bad or not out:
    raise ValueError("topology must be 'exponential' or a non-empty list of "
                     f"lists of device indices, got {topology!r}")
  for i, o in enumerate(out):
    if i in o or len(set(o)) != len(o) or any(j < 0 for j in o):
      raise ValueError(
        f"topology[{i}] = {list(o)}: out-neighbours must be other devices, "
        "each once, non-negative")
  if all(j < len(out) for o in out for j in o):
    _check_strongly_connected(out)
  return out


def _matchings(out_lists) -> list[list[tuple[int, int]]]:
  """The edges ``(i, j)`` cut into classes in which every device sends at
  most once and receives at most once (one collective-permute each)."""
  classes: list[list[tuple[int, int]]] = []
  used: list[tuple[set, set]] = []
  for i, outs in enumerate(out_lists):
    for j in outs:
      for c, (src, dst) in enumerate(used):
        if i not in src and j not in dst:
          classes[c].append((i, j))
          src.add(i)
          dst.add(j)
          break
      else:
        classes.append([(i, j)])
        used.append(({i}, {j}))
  return classes


def push_sum_mix(flat, axis_name, topology, step):
  """One push-sum round over a directed graph.

  Device ``i`` keeps ``1 / (1 + d_i)`` of its buffer and sends that share
  to each of its ``d_i`` out-neighbours; it receives the shares sent to
  it. The mixing is column stochastic (mass is conserved), not row
  stochastic, so the de-biased ratio ``x / w``, not ``x``, converges to
  the average. The edges travel in classes where each device sends and
  receives at most once, one collective-permute per class; time-varying
  graphs pick their phase with ``lax.switch``.

  Args:
    flat: this device's ``float32[m]`` buffer; push-sum's weight ``w`` is
      its last element.
    axis_name: the axis to mix over, or None (``flat`` unchanged).
    topology: ``"exponential"`` (SGP's one-peer exponential graph: in
      phase ``k`` device ``i`` sends to ``i + 2^k mod n``) or a list of
      ``n`` lists, ``topology[i]`` the devices ``i`` sends to (a strongly
      connected graph, no self loops or repeats).
    step: the step counter (a traced int), choosing the phase.

  Returns:
    The mixed ``float32[m]`` buffer, typed varying over ``axis_name``.

  Raises:
    ValueError: when ``topology`` is neither, names devices outside the
      axis, or is not strongly connected.

  Examples:
    Device ``i`` starts with ``[i, 1]`` (value, weight); after rounds on
    the exponential graph the ratio is the mean 3.5 everywhere:

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> def rounds(x):
    ...   for t in range(3):
    ...     x = jaxcomm.collectives.push_sum_mix(
    ...       x, "data", "exponential", t)
    ...   return x[None]
    >>> x = jnp.stack([jnp.arange(8.0), jnp.ones(8)], axis=1)
    >>> out = jax.shard_map(lambda v: rounds(v[0]), mesh=mesh,
    ...                     in_specs=P("data"), out_specs=P("data"))(x)
    >>> import numpy as np
    >>> np.asarray(out[:, 0] / out[:, 1], np.float64).round(3).tolist()
    [3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5]
  """
  if axis_name is None:
    return flat
  n = _core.axis_size(axis_name)
  flat = _core.pvary(flat, axis_name)
  phases = push_sum_phases(topology, n)
  index = _core.axis_index(axis_name)

  def run(outs):
    share = jnp.asarray([1.0 / (1 + len(o)) for o in outs], jnp.float32)
    def f(x):
      send = x * share[index]
      total = send
      for pairs in _matchings(outs):
        total = total + _core.ppermute(send, axis_name, pairs)
      return total
    return f

  if len(phases) == 1:
    return run(phases[0])(flat)
  return jax.lax.switch(jnp.asarray(step, jnp.int32) % len(phases),
                        [run(p) for p in phases], flat)


def push_sum_wire(topology, n: int, size: int, step=None) -> list:
  """Collectives of :func:`push_sum_mix` of ``size`` elements: one
  collective-permute of ``4 size`` bytes per matching class of the step's
  phase (None: every phase's, as the compiled step holds them)."""
  if n == 1:
    return []
  phases = push_sum_phases(topology, n)
  chosen = phases if step is None else [phases[step % len(phases)]]
  return [("collective-permute", 4 * size) for ph in chosen
          for _ in _matchings(ph)]
