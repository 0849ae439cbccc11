"""Bytes on the wire, read from compiled HLO, and an alpha-beta cost model.

:func:`collectives` reads every collective out of a lowered or compiled step
(``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter``,
``collective-permute``) with its payload and group size. :func:`report` turns
those into bytes sent per device per step, split by operation, next to the
dense-psum baseline of the same parameters. Compressors state what they send
(:func:`claimed`), and the tests check the claim against the HLO.

Accounting convention (one for everything in jaxcomm). The *payload* of an
operation is the size of the buffer it is defined on: the operand of an
all-reduce, all-to-all, reduce-scatter or collective-permute, and the
*gathered result* of an all-gather. Bytes *sent per device* assume the
bandwidth-optimal ring algorithms:

=================== ===========================
all-reduce          2 (n - 1) / n * payload
all-gather          (n - 1) / n * payload
reduce-scatter      (n - 1) / n * payload
all-to-all          (n - 1) / n * payload
collective-permute  payload (each sender)
=================== ===========================

The :class:`CostModel` turns payloads into predicted time for a link with
latency ``alpha`` (seconds) and inverse bandwidth ``beta`` (seconds per byte)
for ring, tree and recursive-doubling algorithms.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any
from typing import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _codec
from jaxcomm import _hlo

__all__ = [
  "KINDS",
  "CostModel",
  "Op",
  "Report",
  "claimed",
  "collectives",
  "dense_payload",
  "report",
  "sent_bytes",
  "summarize",
]

#: The collective kinds jaxcomm accounts for, as the HLO names them.
KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
         "collective-permute")

# A line that may define a collective (read in full by jaxcomm._hlo); the
# opcode the reader finds decides.
_MAYBE_OP_RE = re.compile(
  r"(?:all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
  r"(?:-start)?\(")


class Op(NamedTuple):
  """One collective in a compiled step.

  Attributes:
    kind: one of :data:`KINDS`.
    payload: bytes of the buffer it is defined on (see the module doc).
    group: devices in each replica group.
    senders: fraction of devices that send (collective-permute), else 1.
  """

  kind: str
  payload: int
  group: int
  senders: float = 1.0


def _payload(ins: _hlo.Instruction, kind: str, start: bool) -> int:
  """Payload bytes of one collective instruction by the module's
  convention, from its result shape: an async start's is a tuple
  (``all-gather-start``: operands then gathered results;
  ``collective-permute-start``: operand, result, then contexts), an
  ``all-reduce-start``'s the summed operands."""
  shape = ins.shape
  if start and kind in ("all-gather", "collective-permute"):
    if not isinstance(shape, _hlo.Tuple) or len(shape.elements) < 2:
      raise _hlo.Unreadable(
        f"wire.collectives: {ins.opcode} %{ins.name} has the shape "
        f"{shape}, not a tuple (operand, result, ...); printed by "
        f"{_hlo.versions()}")
    shape = shape.elements[1 if kind == "all-gather" else 0]
  return shape.nbytes


# The three forms XLA prints replica groups in (see _group_size).
_IOTA_GROUPS_RE = re.compile(
  r"replica_groups=\[(\d+),(\d+)\]<=\[[\d,]*\](?:T\([\d,]*\))?")
_LIST_GROUPS_RE = re.compile(r"replica_groups=\{(\{[^}]*\}(?:,\{[^}]*\})*)\}")
_MESH_GROUPS_RE = re.compile(
  r"replica_groups=mesh\[(?P<mesh>[^\]]*)\]"
  r"(?:,\s*device_ids=\(.*?\))?\s*\{(?P<axes>[^}]*)\}")
_MESH_AXIS_RE = re.compile(r"""^\s*['"]?([^'"=]+?)['"]?\s*=\s*(\d+)\s*$""")
_GROUP_AXIS_RE = re.compile(
  r"""^\s*['"]?([^'":]+?)['"]?\s*(?::\((\d+)\)(\d+))?\s*$""")


def _mesh_group_size(mesh: str, axes: str) -> int | None:
  """Devices per group of ``mesh['a'=2,'b'=4] {'b'}`` (None: unreadable)."""
  sizes = {}
  for part in mesh.split(","):
    m = _MESH_AXIS_RE.match(part)
    if not m:
      return None
    sizes[m.group(1)] = int(m.group(2))
  size = 1
  for part in axes.split(","):
    if not part.strip():
      continue
    m = _GROUP_AXIS_RE.match(part)
    if not m:
      return None
    if m.group(3) is not None:          # a sub-axis name:(pre_size)size
      size *= int(m.group(3))
    elif m.group(1) in sizes:
      size *= sizes[m.group(1)]
    else:
      return None
  return size


def _group_size(line: str, num_devices: int) -> int:
  """Devices per replica group of one collective's HLO line.

  XLA prints replica groups three ways: as explicit lists,
  ``replica_groups={{0,1,2,3},{4,5,6,7}}``; in the iota form,
  ``replica_groups=[G,S]<=[dims]`` or ``[G,S]<=[dims]T(perm)`` (``G`` groups
  of ``S`` devices, from an iota reshaped to ``dims`` and transposed by
  ``perm``); and, from JAX 0.11, in the mesh-axes form,
  ``replica_groups=mesh['a'=2,'data'=4] {'data'}`` (one group per
  combination of the other axes; its size the product of the named axes'
  sizes, ``name:(pre)size`` naming a sub-axis of ``size``). No groups, or
  ``{}``, means every device.
  """
  m = _IOTA_GROUPS_RE.search(line)
  if m:
    return int(m.group(2))
  m = _MESH_GROUPS_RE.search(line)
  if m:
    size = _mesh_group_size(m.group("mesh"), m.group("axes"))
    if size is not None:
      return size
  m = _LIST_GROUPS_RE.search(line)
  if m:
    first = m.group(1).split("}")[0].strip("{")
    return len([t for t in first.split(",") if t.strip()])
  return num_devices


def _num_devices(text: str) -> int:
  m = re.search(r"num_partitions=(\d+)", text)
  parts = int(m.group(1)) if m else 1
  m = re.search(r"replica_count=(\d+)", text)
  reps = int(m.group(1)) if m else 1
  return max(parts * reps, 1)


def _as_text(step: Any) -> str:
  if isinstance(step, str):
    return step
  # A lowering (jax.jit(f).lower(...), flax's nnx.jit(f).lower(...), ...)
  # holds the program before XLA's passes: its text names no HLO
  # collectives, so it is compiled first.
  if callable(getattr(step, "compile", None)):
    step = step.compile()
  if hasattr(step, "as_text"):
    text = step.as_text()
    if isinstance(text, str):
      return text
  raise ValueError(
    "step must be HLO text, a lowered step (jax.jit(f).lower(...), "
    "nnx.jit(f).lower(...)) or its .compile(), got "
    f"{type(step).__name__}")


_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_BRANCH_RE = re.compile(
  r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)"
  r"|false_computation=%?([\w.\-]+))")
_CALL_RE = re.compile(
  r"(?:calls|to_apply|body|condition|called_computations)=\{?%?([\w.\-]+)")


def _unconditional_lines(text: str) -> list[str]:
  """The instruction lines of the computations every run executes: ENTRY
  and what it calls, except through a conditional's branches."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    m = _COMP_RE.match(line)
    if m and not line.startswith(" "):
      cur = m.group(2)
      comps[cur] = []
      if m.group(1):
        entry = cur
      continue
    if cur is not None:
      comps[cur].append(line)
  if entry is None:
    return text.splitlines()
  seen, todo = set(), [entry]
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      branch = set()
      for b in _BRANCH_RE.finditer(line):
        for g in b.groups():
          if g:
            branch |= {x.strip().lstrip("%") for x in g.split(",")}
      for call in _CALL_RE.finditer(line):
        if call.group(1) not in branch:
          todo.append(call.group(1))
  return [l for c in seen for l in comps[c]]


def collectives(step: Any, *, outside_branches: bool = False) -> list[Op]:
  """The collectives of a lowered/compiled step (or its HLO text).

  Args:
    step: ``jax.jit(f).lower(*args)`` (compiled here), its ``.compile()``,
      or HLO text.
    outside_branches: only those every execution runs: not inside a
      conditional's branches (``lax.cond``/``lax.switch``), such as the
      sync of a local-update step or a dense warm-up phase.

  Returns:
    One :class:`Op` per collective instruction in the optimized module.

  Raises:
    ValueError: ``step`` is none of those, or a collective's line cannot
      be read (an element type or shape syntax this reader does not know):
      the message names the instruction and the jax, jaxlib and libtpu
      versions; it is never counted as 0 bytes.

  Examples:
    One psum of 1,024 float32 per device, on 8 devices:

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"),
    ...                           mesh=mesh, in_specs=P("data"),
    ...                           out_specs=P()))
    >>> jaxcomm.wire.collectives(f.lower(jnp.zeros((8, 1024))))
    [Op(kind='all-reduce', payload=4096, group=8, senders=1.0)]
  """
  text = _as_text(step)
  n_dev = _num_devices(text)
  ops = []
  lines = (_unconditional_lines(text) if outside_branches
           else text.splitlines())
  for line in lines:
    if not _MAYBE_OP_RE.search(line):
      continue
    ins = _hlo.instruction(line, where="wire.collectives")
    if ins is None:
      continue
    kind = ins.opcode.removesuffix("-start")
    start = kind != ins.opcode
    if kind not in KINDS:
      continue
    # The result's bytes: for all-to-all equal to the operand's; for
    # reduce-scatter the operand is the result times the group (below).
    payload = _payload(ins, kind, start)
    group = _group_size(line, n_dev)
    senders = 1.0
    if kind == "reduce-scatter":
      payload *= group
    if kind == "collective-permute":
      pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
      if pairs:
        n_pairs = len(re.findall(r"\{\d+,\d+\}", pairs.group(0) + "}"))
        senders = n_pairs / n_dev
      group = n_dev
    ops.append(Op(kind, int(payload), int(group), senders))
  return ops


def sent_bytes(kind: str, payload: float, n: int) -> float:
  """Bytes one device sends for one collective under ring algorithms.

  Args:
    kind: the collective, one of :data:`KINDS`.
    payload: its payload in bytes (the module's convention).
    n: the number of devices in its group.

  Returns:
    The bytes each device sends, a float (0 for one device).

  Raises:
    ValueError: when ``kind`` is not one of :data:`KINDS`.

  Examples:
    >>> import jaxcomm
    >>> jaxcomm.wire.sent_bytes("all-reduce", 4096, 8)   # 2 (n-1)/n
    7168.0
    >>> jaxcomm.wire.sent_bytes("all-gather", 4096, 8)   # (n-1)/n
    3584.0
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if n <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2.0 * (n - 1) / n * payload
  if kind == "collective-permute":
    return float(payload)
  return (n - 1) / n * payload


@dataclasses.dataclass(frozen=True)
class Report:
  """Bytes per device per step of a compiled step, next to the dense psum.

  Attributes:
    ops: the collectives found.
    payload: payload bytes by kind.
    sent: bytes sent per device by kind (ring algorithms).
    total_sent: sum of ``sent``.
    dense_sent: what one float32 all-reduce of the parameters would send.
    ratio: ``dense_sent / total_sent`` (inf when nothing is sent).
  """

  ops: tuple
  payload: dict
  sent: dict
  total_sent: float
  dense_sent: float
  ratio: float

  def __str__(self) -> str:
    return self.table()

  def table(self) -> str:
    """The report as a markdown table.

    Returns:
      The table as one str (also what ``str`` and ``print`` give), with a
      row per collective kind, the total, the dense baseline and the
      ratio.
    """
    rows = ["| op | payload bytes | sent bytes/device |", "|---|---:|---:|"]
    for k in KINDS:
      if k in self.payload:
        rows.append(f"| {k} | {self.payload[k]:,} | {self.sent[k]:,.0f} |")
    rows.append(f"| total | | {self.total_sent:,.0f} |")
    rows.append(f"| dense f32 psum | | {self.dense_sent:,.0f} |")
    rows.append(f"| ratio | | {self.ratio:,.1f}x |")
    return "\n".join(rows)


def dense_payload(params) -> int:
  """Bytes of one float32 all-reduce over every floating leaf of params.

  Args:
    params: a pytree of arrays (or of anything with ``shape`` and
      ``dtype``).

  Returns:
    The payload in bytes, an int (4 per floating element).
  """
  total = 0
  for leaf in jax.tree.leaves(params):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
      total += int(np.prod(leaf.shape)) * 4
  return total


def summarize(ops: Iterable[Op] | Iterable[tuple], n: int | None = None,
              params=None) -> Report:
  """Bytes per device by kind for ``ops`` (:class:`Op` or (kind, payload)).

  Args:
    ops: collectives, e.g. from :func:`collectives` or :func:`claimed`.
    n: group size for (kind, payload) pairs; Ops carry their own.
    params: if given, the dense baseline is a float32 all-reduce of them.

  Returns:
    A :class:`Report`.

  Examples:
    What top-k claims to send on 8 devices, against a dense psum of the
    same params:

    >>> import jax.numpy as jnp, jaxcomm
    >>> params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros(256)}
    >>> ops = jaxcomm.wire.claimed(jaxcomm.topk(0.01), params, n=8)
    >>> r = jaxcomm.wire.summarize(ops, n=8, params=params)
    >>> r.total_sent, r.dense_sent, round(r.ratio, 1)
    (36911.0, 460544.0, 12.5)
  """
  ops = tuple(o if isinstance(o, Op) else Op(o[0], int(o[1]), int(n or 1))
              for o in ops)
  payload, sent = {}, {}
  for o in ops:
    payload[o.kind] = payload.get(o.kind, 0) + o.payload
    sent[o.kind] = sent.get(o.kind, 0.0) + sent_bytes(
      o.kind, o.payload, o.group) * o.senders
  total = sum(sent.values())
  group = n or max((o.group for o in ops), default=1)
  dense = sent_bytes("all-reduce", dense_payload(params), group) \
    if params is not None else 0.0
  ratio = dense / total if total > 0 else math.inf
  return Report(ops, payload, sent, total, dense, ratio)


def report(step: Any, params=None) -> Report:
  """Bytes per device per step of a compiled step, next to the dense psum.

  ``print(report(...))`` prints it as a table.

  Args:
    step: a lowered step (``jax.jit(f).lower(*args)``,
      ``nnx.jit(f).lower(*args)``: compiled here), its ``.compile()``, or
      optimized HLO text.
    params: if given, the dense baseline is a float32 all-reduce of them.

  Returns:
    :func:`summarize` of the step's collectives.

  Raises:
    ValueError: the step holds no collective at all (a step compiled for
      one device, outside ``shard_map``/``pmap``, or one whose gradients
      were never exchanged): there would be nothing to compare.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"),
    ...                           mesh=mesh, in_specs=P("data"),
    ...                           out_specs=P()))
    >>> r = jaxcomm.wire.report(f.lower(jnp.zeros((8, 1024))),
    ...                         params={"w": jnp.zeros(1024)})
    >>> print(r)
    | op | payload bytes | sent bytes/device |
    |---|---:|---:|
    | all-reduce | 4,096 | 7,168 |
    | total | | 7,168 |
    | dense f32 psum | | 7,168 |
    | ratio | | 1.0x |
  """
  ops = collectives(step)
  if not ops:
    raise ValueError(
      "report found no collective (all-reduce, all-gather, all-to-all, "
      "reduce-scatter, collective-permute) in the compiled step: pass the "
      "lowered or compiled step that runs inside jax.shard_map/pmap over "
      "more than one device")
  return summarize(ops, params=params)


def claimed(tx, params, n: int, step: int | None = None, *, splits=None
            ) -> list[tuple[str, int]]:
  """The collectives a jaxcomm compressor says one step issues on n devices.

  Args:
    tx: a compressor from a jaxcomm factory (not a chain around it), or a
      jaxcomm optimizer (``onebit_adam``, ``onebit_lamb``).
    params: the parameters (or gradients, or their shapes) it is applied to.
    n: the number of devices along its data axis.
    step: the step counter, for what that step moves (a dense phase before
      ``start_step`` / ``freeze_step``); None for every collective the
      compiled step holds (what the compiled HLO lists).
    splits: when ``params`` are one device's blocks in a sharded step
      (``parallel.shard_shapes``), how each leaf is split
      (``parallel.shard_splits(specs, mesh)``): a compressor that exchanges
      whole leaves (PowerSGD's ``sharded="whole"``) claims by them.

  Returns:
    A list of ``(kind, payload_bytes)`` pairs, one per collective (empty
    for ``n == 1``); :func:`summarize` turns them into bytes sent.

  Raises:
    ValueError: when ``n < 1``, or ``tx`` is not a jaxcomm compressor (an
      ``optax.chain`` around one, say).
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  if n == 1:
    return []
  spec = _codec.spec_of(tx)
  if splits is None:
    return spec.wire(params, n, step)
  return spec.wire(params, n, step, splits=splits)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Alpha-beta model of a link: ``t = hops * alpha + bytes * beta``.

  Attributes:
    alpha: latency per message, seconds.
    beta: seconds per byte (1 / bandwidth).
    algorithm: ``"ring"``, ``"tree"`` or ``"recursive_doubling"``.

  Raises:
    ValueError: naming the field, when ``alpha`` or ``beta`` is negative or
      ``algorithm`` is not one of the three.

  Examples:
    A 10 Gbit/s link with 50 us latency; a ring all-reduce of 1 MB on 8
    devices:

    >>> import jaxcomm
    >>> link = jaxcomm.wire.CostModel.link(10)
    >>> print(f"{link.time('all-reduce', 1e6, 8) * 1e3:.2f} ms")
    2.10 ms
  """

  alpha: float
  beta: float
  algorithm: str = "ring"

  def __post_init__(self):
    if self.alpha < 0:
      raise ValueError(f"alpha must be >= 0, got {self.alpha}")
    if self.beta < 0:
      raise ValueError(f"beta must be >= 0, got {self.beta}")
    if self.algorithm not in ("ring", "tree", "recursive_doubling"):
      raise ValueError(
        "algorithm must be 'ring', 'tree' or 'recursive_doubling', got "
        f"{self.algorithm!r}")

  @classmethod
  def link(cls, gbit_per_s: float, latency_us: float = 50.0,
           algorithm: str = "ring") -> "CostModel":
    """A link of ``gbit_per_s`` Gbit/s and ``latency_us`` microseconds.

    Args:
      gbit_per_s: the bandwidth, Gbit/s (finite, > 0).
      latency_us: the latency per message, microseconds (finite, >= 0).
      algorithm: ``"ring"``, ``"tree"`` or ``"recursive_doubling"``.

    Returns:
      A :class:`CostModel`.

    Raises:
      ValueError: naming the argument when it is out of range.
    """
    if not (isinstance(gbit_per_s, (int, float))
            and math.isfinite(gbit_per_s) and gbit_per_s > 0):
      raise ValueError(f"gbit_per_s must be a finite number > 0, got "
                       f"{gbit_per_s!r}")
    if not (isinstance(latency_us, (int, float))
            and math.isfinite(latency_us) and latency_us >= 0):
      raise ValueError(f"latency_us must be a finite number >= 0, got "
                       f"{latency_us!r}")
    return cls(alpha=latency_us * 1e-6, beta=8.0 / (gbit_per_s * 1e9),
               algorithm=algorithm)

  def time(self, kind: str, payload: float, n: int) -> float:
    """Predicted seconds for one collective of ``payload`` bytes on n.

    Args:
      kind: the collective, one of :data:`KINDS`.
      payload: its payload in bytes.
      n: the number of devices in its group.

    Returns:
      The predicted seconds, a float (0 for one device).

    Raises:
      ValueError: when ``kind`` is not one of :data:`KINDS`.
    """
    if kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if n <= 1:
      return 0.0
    a, b, s = self.alpha, self.beta, float(payload)
    lg = math.ceil(math.log2(n))
    frac = (n - 1) / n
    if kind == "collective-permute":
      return a + s * b
    if self.algorithm == "ring":
      if kind == "all-reduce":
        return 2 * (n - 1) * a + 2 * frac * s * b
      return (n - 1) * a + frac * s * b
    if self.algorithm == "tree":
      if kind == "all-reduce":   # reduce to the root, broadcast back
        return 2 * lg * (a + s * b)
      if kind == "all-gather":   # gather to the root, broadcast the result
        return lg * a + frac * s * b + lg * (a + s * b)
      return lg * a + frac * s * b * lg
    # recursive doubling / halving
    if kind == "all-reduce":
      return lg * (a + s * b)
    if kind == "all-to-all":
      return lg * (a + 0.5 * s * b)
    return lg * a + frac * s * b

  def predict(self, ops: Iterable, n: int | None = None) -> float:
    """Predicted seconds for a step's collectives, run one after another.

    Args:
      ops: :class:`Op` (from :func:`collectives`) or ``(kind, payload)``
        pairs (from :func:`claimed`).
      n: the group size for pairs; an :class:`Op` carries its own.

    Returns:
      The predicted seconds, a float.
    """
    total = 0.0
    for o in ops:
      if isinstance(o, Op):
        # Permutes run concurrently on all senders: one message's time.
        if o.senders > 0:
          total += self.time(o.kind, o.payload, o.group)
      else:
        total += self.time(o[0], o[1], n or 1)
    return total
