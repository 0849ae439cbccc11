"""Ahead of time: a step compiled for any mesh, a TPU pod's included, and
what the compiled program says about it.

``libtpu`` (``pip install "jax[tpu]==<jax version>"``) compiles for TPU
topologies on a machine without a TPU (``jax.experimental.topologies``):
nothing is allocated or run, so a 1B-parameter model costs compile time
only. With :meth:`jaxcomm.parallel.DataParallel.init` of abstract params
(``jax.ShapeDtypeStruct`` leaves with shardings) the step lowers for such
a mesh, and :func:`analyze` reads from the compiled program:

* memory per chip (the TPU compiler's buffer assignment: arguments,
  outputs, temporaries) and whether it fits the chip's HBM;
* what each chip hands the cross-slice (megascale) runtime: the ``send``
  ops with ``is_host_transfer=true``, their shapes and transfer types;
* the bytes that cross slices per chip, by :mod:`jaxcomm.wire`'s
  convention (ring algorithms: an all-reduce sends ``2 (n-1)/n`` of its
  operand, an all-gather ``(n-1)`` times the chip's piece, an all-to-all
  or reduce-scatter ``(n-1)/n`` of its operand, a one-to-one send all of
  it); an all-to-all's handed operand holds the chip's own chunk, which
  does not cross;
* the compiler's estimated step time (``cost_analysis()["optimal_seconds"]``)
  and that estimate plus the crossing bytes over a DCN bandwidth;
* the Mosaic kernels in it (``tpu_custom_call``).

Command line (from the repository root, for its models)::

  python -m jaxcomm.aot --topology v5p:2x2x1 --slices 4 \\
      --model transformer --size 1b --compressor int8

Every flag is checked before the first compile: a bad one ends the
command with one ``error:`` line naming it (exit status 2). A step that
does not fit the chip's HBM is reported in one line, the compiler's
per-chip need beside the capacity (exit status 1).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from typing import Any
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import _hlo
from jaxcomm._aot_models import SIZES  # noqa: F401  (re-exported)
from jaxcomm._aot_models import mlp  # noqa: F401
from jaxcomm._aot_models import transformer  # noqa: F401

__all__ = [
  "HBM",
  "SIZES",
  "TRANSFER_KINDS",
  "Figures",
  "Padded",
  "Transfer",
  "analyze",
  "backward_after_first_send",
  "collective_dependence",
  "compile_lowered",
  "compile_method",
  "generation",
  "memory_per_chip",
  "mlp",
  "optimizer_state",
  "padded_buffers",
  "plain_step",
  "slice_mesh",
  "state_bytes_per_chip",
  "topology_devices",
  "transfers",
  "transformer",
]

#: HBM per chip in bytes, by TPU generation (public TPU documentation).
HBM = {"v4": 32 << 30, "v5e": 16 << 30, "v5litepod": 16 << 30,
       "v5p": 95 << 30, "v6e": 32 << 30}
#: Megascale transfer type -> :mod:`jaxcomm.wire`'s collective kind.
TRANSFER_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                  "ALL_TO_ALL": "all-to-all",
                  "REDUCE_SCATTER": "reduce-scatter",
                  "ONE_TO_ONE": "collective-permute"}
_TRANSFER_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


def topology_devices(topology: str, slices: int = 1) -> np.ndarray:
  """The compile-only devices of ``slices`` slices of a TPU topology.

  Args:
    topology: one slice, e.g. ``"v5e:2x2"``, ``"v5p:2x2x1"``,
      ``"v6e:2x2"``.
    slices: the number of slices (a positive int).

  Returns:
    A numpy array of the devices, slice-major.

  Raises:
    ValueError: naming the argument when libtpu is missing or the
      topology is unknown.
  """
  if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
    raise ValueError(f"slices must be a positive int, got {slices!r}")
  if not isinstance(topology, str) or ":" not in topology:
    raise ValueError(
      f"topology must name a TPU generation and its chips, e.g. 'v5e:2x2' "
      f"or 'v5p:2x2x1', got {topology!r}")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  try:
    desc = topologies.get_topology_desc(
      topology_name=topology, platform="tpu", num_slices=slices)
  except Exception as e:  # libtpu absent, or a name it does not know
    import importlib.util
    why = (f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
           if str(e) else type(e).__name__)
    if importlib.util.find_spec("libtpu") is not None:
      raise ValueError(
        f"topology {topology!r} x {slices} slices is not one libtpu "
        f"compiles for ({why}); e.g. 'v5e:2x2', 'v5p:2x2x1', 'v6e:2x2'"
      ) from e
    raise ValueError(
      f"topology {topology!r} x {slices} slices cannot be compiled for "
      f"here ({why}); it needs libtpu: pip install \"jax[tpu]=="
      + jax.__version__ + "\"") from e
  return np.array(desc.devices)


def slice_mesh(topology: str, slices: int, axes: Sequence[str] = (
    "dcn", "fsdp")) -> Mesh:
  """A mesh of ``slices`` compile-only TPU slices.

  Args:
    topology: one slice (see :func:`topology_devices`).
    slices: the number of slices.
    axes: the mesh's axis names, at least two: the first across slices,
      the second over each slice's chips, further axes of size 1.

  Returns:
    A ``jax.sharding.Mesh``, every axis Auto.

  Raises:
    ValueError: when ``axes`` is a string, names fewer than two axes,
      an axis twice or one that is not a non-empty string, or
      :func:`topology_devices` refuses ``topology`` or ``slices``.
  """
  if isinstance(axes, str):
    raise ValueError(f"axes must be a sequence of axis names, not the one "
                     f"string {axes!r}")
  axes = tuple(axes)
  if len(axes) < 2:
    raise ValueError(f"axes must name at least two axes, got {axes!r}")
  bad = [a for a in axes if not isinstance(a, str) or not a]
  if bad:
    raise ValueError(f"axes must be non-empty strings, got {bad[0]!r} in "
                     f"{axes!r}")
  twice = sorted({a for a in axes if axes.count(a) > 1})
  if twice:
    raise ValueError(f"axes must name each axis once, got {twice[0]!r} "
                     f"more than once in {axes!r}")
  devs = topology_devices(topology, slices)
  shape = (slices, devs.size // slices) + (1,) * (len(axes) - 2)
  return Mesh(devs.reshape(shape), axes,
              axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def generation(mesh: Mesh) -> str:
  """The TPU generation of ``mesh``.

  Args:
    mesh: a mesh of TPU devices (compile-only ones included).

  Returns:
    A key of :data:`HBM` (``"v5e"``, ``"v5p"``, ...), or the device kind
    (lower case) when it is none of them.
  """
  kind = mesh.devices.flat[0].device_kind.lower()
  # device_kind: "TPU v5 lite" (v5e), "TPU v5" (v5p), "TPU v6 lite"...
  for name, key in (("v6", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"),
                    ("v5", "v5p"), ("v4", "v4")):
    if name in kind:
      return key
  return kind


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One cross-slice send of the compiled program.

  Attributes:
    kind: ``jaxcomm.wire`` kind (``all-reduce``, ``all-gather``, ...).
    handed: bytes the chip hands the cross-slice runtime.
    shape: the send's shape and dtype as the HLO prints them.
  """
  kind: str
  handed: float
  shape: str

  def crossing(self, slices: int) -> float:
    """Bytes that leave the chip's slice for this transfer.

    Args:
      slices: the number of slices.

    Returns:
      The bytes, a float, by the module docstring's convention (0 for one
      slice).
    """
    n = slices
    if n <= 1:
      return 0.0
    if self.kind == "all-reduce":
      return 2 * (n - 1) / n * self.handed
    if self.kind == "all-gather":
      return (n - 1) * self.handed
    if self.kind in ("all-to-all", "reduce-scatter"):
      return (n - 1) / n * self.handed
    return float(self.handed)


def transfers(compiled_or_text: Any) -> list[Transfer]:
  """The cross-slice sends of a compiled step.

  Args:
    compiled_or_text: a compiled step or its HLO text.

  Returns:
    A list of :class:`Transfer`, one per ``send`` with
    ``is_host_transfer=true``.

  Raises:
    ValueError: when such a send's line cannot be read (its shape, or a
      transfer type not in :data:`TRANSFER_KINDS`); the message names the
      send and the jax, jaxlib and libtpu versions.
  """
  text = (compiled_or_text if isinstance(compiled_or_text, str)
          else compiled_or_text.as_text())
  out = []
  for line in text.splitlines():
    if "send(" not in line or "is_host_transfer=true" not in line:
      continue
    ins = _hlo.instruction(line, where="aot.transfers")
    if ins is None or ins.opcode != "send":
      continue
    # A send's result: (data, u32[] context, token[]); the data is what
    # the chip hands the cross-slice runtime.
    shape = ins.shape
    if not isinstance(shape, _hlo.Tuple) or not shape.elements:
      raise _hlo.Unreadable(
        f"aot.transfers: send %{ins.name} has the shape {shape}, not a "
        f"tuple (data, context, token); printed by {_hlo.versions()}")
    data = shape.elements[0]
    t = _TRANSFER_TYPE.search(ins.rest)
    # No transfer type: a one-to-one host transfer.
    kind = TRANSFER_KINDS.get(t.group(1) if t else "ONE_TO_ONE")
    if kind is None:
      raise _hlo.Unreadable(
        f"aot.transfers: send %{ins.name} has the transfer type "
        f"{t.group(1)!r}, not one of {sorted(TRANSFER_KINDS)}; printed by "
        f"{_hlo.versions()}")
    out.append(Transfer(kind, float(data.nbytes), str(data)))
  return out


def _entry_lines(text: str) -> list[str]:
  """The scheduled instructions of the HLO module's entry computation, in
  schedule order (a compiled module prints them in the order they run)."""
  lines, inside = [], False
  for line in text.splitlines():
    if line.startswith("ENTRY "):
      inside = True
      continue
    if inside:
      if line.startswith("}"):
        break
      lines.append(line)
  return lines


_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')


def backward_after_first_send(compiled_or_text: Any) -> float | None:
  """The fraction of the backward pass scheduled after the first send.

  The backward pass is the entry computation's ops whose ``op_name`` is
  JAX's ``transpose(...)`` of the loss, weighted by the compiler's
  ``estimated_cycles`` where it gives them; the fraction after the first
  cross-slice send starts is how much of the exchange can overlap the
  backward pass (WFBP).

  Args:
    compiled_or_text: a compiled step or its HLO text.

  Returns:
    A float in ``[0, 1]``, or None when nothing crosses or there is no
    backward op in the entry computation.
  """
  text = (compiled_or_text if isinstance(compiled_or_text, str)
          else compiled_or_text.as_text())
  first, total, after = None, 0.0, 0.0
  for i, line in enumerate(_entry_lines(text)):
    if first is None and " send(" in line and "is_host_transfer=true" in line:
      ins = _hlo.instruction(line, where="aot.backward_after_first_send")
      if ins is not None and ins.opcode == "send":
        first = i
    if "transpose(" not in line or "op_name=" not in line:
      continue
    m = _CYCLES.search(line)
    w = float(m.group(1)) if m else 1.0
    total += w
    if first is not None:
      after += w
  if first is None or not total:
    return None
  return after / total


# Opcodes that move data between devices (their -start/-done halves,
# send/recv and host transfers included, by prefix).
_COLLECTIVE_OPS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
                   "collective-permute", "collective-broadcast", "send",
                   "recv", "ragged-all-to-all")


def _hlo_graph(text: str):
  """``(entry, {computation: {instruction: (opcode, refs, line)}})`` of an
  HLO module's text; ``refs``: every ``%name`` the instruction mentions
  (operands and called computations)."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
    if head:
      cur = head.group(2)
      comps[cur] = {}
      if head.group(1):
        entry = cur
      continue
    ins = _hlo.instruction(line, where="aot.collective_dependence")
    if ins is not None and cur is not None:
      comps[cur][ins.name] = (ins.opcode,
                              re.findall(r"%([\w.\-]+)", ins.rest), line)
  return entry, comps


def collective_dependence(compiled_or_text: Any, *,
                          cross_slice: bool = False) -> list[bool]:
  """Whether each output of a compiled program depends on a collective.

  Outputs are the entry's ROOT tuple, in order (the flattened outputs);
  an output depends on a collective directly or through a computation
  that issues one (a fusion, an async wrapper, a loop body, a conditional
  branch). An output that depends on none can be computed before any exchange of
  the step completes: Pipe-SGD's new params (``jaxcomm.pipe_sgd``) read
  only the previous step's average.

  Args:
    compiled_or_text: a compiled program or its HLO text.
    cross_slice: count only what crosses slices (TPU: ``send``/``recv``
      with ``is_host_transfer=true``), not collectives inside a slice
      (the sharded step's mean of a replicated leaf over its copies).

  Returns:
    A list of bool, one per output.

  Raises:
    ValueError: when the HLO text has no ENTRY computation.
  """
  def moves(op, line):
    if cross_slice:
      return op.startswith(("send", "recv")) and (
        "is_host_transfer=true" in line)
    return op.startswith(_COLLECTIVE_OPS)

  text = (compiled_or_text if isinstance(compiled_or_text, str)
          else compiled_or_text.as_text())
  entry, comps = _hlo_graph(text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  issues: dict[str, bool] = {}

  def issues_collective(comp, seen=()):
    if comp not in issues:
      issues[comp] = any(
        moves(op, line) or any(
          r in comps and r not in seen
          and issues_collective(r, seen + (comp,)) for r in refs)
        for op, refs, line in comps[comp].values())
    return issues[comp]

  body = comps[entry]
  memo: dict[str, bool] = {}

  def depends(name):
    if name not in memo:
      memo[name] = False
      op, refs, line = body[name]
      memo[name] = moves(op, line) or any(
        (r in comps and issues_collective(r)) or (r in body and depends(r))
        for r in refs)
    return memo[name]

  root = [line for _, _, line in body.values() if "ROOT" in line][0]
  if " tuple(" not in root:
    return [depends(re.match(r"^\s+ROOT %([\w.\-]+)", root).group(1))]
  args = root[root.index(" tuple(") + len(" tuple("):].split(")")[0]
  return [depends(o) for o in re.findall(r"%([\w.\-]+)", args)]


class Padded(NamedTuple):
  """A buffer whose tiled layout stores much more than its data.

  Attributes:
    instruction: the instruction that defines it (without ``%``).
    opcode: its opcode.
    shape: its shape and layout as the compiler printed them.
    data_bytes: the bytes of its elements.
    tiled_bytes: the bytes it takes, its tiles' padding included.
    op_name: the JAX operation it comes from (``op_name`` metadata; empty
      when the compiler kept none).
    source: ``file:line`` of the Python that traced it (empty when none).
  """
  instruction: str
  opcode: str
  shape: str
  data_bytes: int
  tiled_bytes: int
  op_name: str
  source: str

  def __str__(self) -> str:
    where = f" at {self.source}" if self.source else ""
    return (f"%{self.instruction} = {self.opcode} {self.shape}: "
            f"{self.tiled_bytes / 2**20:.2f} MiB tiled for "
            f"{self.data_bytes / 2**20:.2f} MiB of data "
            f"({self.tiled_bytes / max(self.data_bytes, 1):.0f}x), from "
            f"{self.op_name or '(no op_name)'}{where}")


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_LAYOUT_TEXT = re.compile(r"\w+\[[^\]]*\]\{[^}]*\}")


def padded_buffers(compiled_or_text: Any, *, min_bytes: int,
                   ratio: float = 2.0) -> list[Padded]:
  """The buffers of a compiled step padded by their tiles (a layout lint).

  The buffers whose tiles store more than ``ratio`` times their data and
  that take more than ``min_bytes``. A TPU array is stored in tiles
  (``T(8,128)``: the two most minor dimensions rounded up to 8 rows of
  128 lanes): an index array of shape ``[n, 2]`` takes 64 times its
  data. Such a layout is invisible on CPU and in the test's model until a
  shape reaches it; this reads every buffer's layout from the compiled
  program instead. Fusion bodies are left out (their values are not
  stored), and so are buffers in another memory space than the chip's
  HBM (``S(1)``...: outside the compiler's memory analysis; onebit's step
  once held 47 MiB of them beside 1.2 MiB of temporaries). Each buffer is
  named once by its shape and source.

  Args:
    compiled_or_text: a compiled program or its HLO text.
    min_bytes: report only buffers that take more than this, tiled.
    ratio: report only buffers whose tiled size is more than this times
      their data.

  Returns:
    A list of :class:`Padded`, largest first.

  Examples:
    >>> from jaxcomm import aot
    >>> hlo = "\\n".join([
    ...   "ENTRY %main (p: s32[4096,2]) -> s32[4096,2] {",
    ...   '  ROOT %g = s32[4096,2]{1,0:T(8,128)} gather(%p), '
    ...   'metadata={op_name="jit(step)/gather" source_file="m.py" '
    ...   'source_line=7}', "}"])
    >>> [p.tiled_bytes // p.data_bytes for p in
    ...  aot.padded_buffers(hlo, min_bytes=1 << 20)]
    [64]
  """
  text = (compiled_or_text if isinstance(compiled_or_text, str)
          else compiled_or_text.as_text())
  fused = set(re.findall(r"\bfusion\(.*?calls=%([\w.\-]+)", text))
  out, seen, skip = [], set(), False
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
    if head:
      skip = head.group(1) in fused
      continue
    if skip:
      continue
    ins = _hlo.instruction(line, where="aot.padded_buffers")
    if ins is None:
      continue
    shape = ins.shape
    arrays = shape.elements if isinstance(shape, _hlo.Tuple) else (shape,)
    texts = _LAYOUT_TEXT.findall(line.split(ins.opcode + "(", 1)[0])
    for i, a in enumerate(arrays):
      if not isinstance(a, _hlo.Array) or not a.tile or a.memory_space:
        continue
      tiled = a.tiled_nbytes
      if tiled <= min_bytes or tiled <= ratio * a.nbytes:
        continue
      name = _OP_NAME.search(ins.rest)
      src = _SOURCE.search(ins.rest)
      shown = texts[i] if i < len(texts) else str(a)
      key = (shown, name and name.group(1), src and src.group(0))
      if key in seen:
        continue
      seen.add(key)
      out.append(Padded(
        ins.name, ins.opcode, shown, a.nbytes, tiled,
        name.group(1) if name else "",
        f"{src.group(1)}:{src.group(2)}" if src else ""))
  return sorted(out, key=lambda p: -p.tiled_bytes)


@dataclasses.dataclass(frozen=True)
class Figures:
  """What a compiled step says, per chip (bytes unless named).

  Attributes:
    compile_seconds: wall time of ``.compile()``.
    argument: argument bytes (the compiler's buffer assignment).
    output: output bytes.
    alias: output bytes aliased to arguments (donated buffers).
    temp: temporary bytes.
    hbm: the chip's HBM (0 when unknown).
    transfers: the cross-slice sends.
    slices: the number of slices.
    optimal_seconds: the compiler's estimated step time (None if absent).
    mosaic: Pallas kernels compiled by Mosaic (``tpu_custom_call``).
    unknown_cost_ops: ops the compiler's estimate leaves out (it reports
      each as -1 s; ``optimal_seconds`` is the estimate of the rest).
  """
  compile_seconds: float
  argument: int
  output: int
  alias: int
  temp: int
  hbm: int
  transfers: tuple
  slices: int
  optimal_seconds: float | None
  mosaic: int
  unknown_cost_ops: int = 0

  @property
  def peak(self) -> int:
    """Arguments, outputs not aliased to them, and temporaries."""
    return self.argument + self.output - self.alias + self.temp

  @property
  def fits(self) -> bool | None:
    """Whether :attr:`peak` fits the chip's HBM (None when unknown)."""
    return None if not self.hbm else self.peak <= self.hbm

  @property
  def handed(self) -> float:
    """Bytes the chip hands the cross-slice runtime, over all sends."""
    return sum(t.handed for t in self.transfers)

  @property
  def crossing(self) -> float:
    """Bytes that leave the chip's slice, over all sends."""
    return sum(t.crossing(self.slices) for t in self.transfers)

  def step_seconds(self, dcn_gbit_per_s: float) -> float | None:
    """The compiler's estimate plus the crossing bytes over a DCN link.

    No overlap of the exchange with compute is assumed.

    Args:
      dcn_gbit_per_s: the DCN bandwidth per chip, Gbit/s.

    Returns:
      Seconds, or None when the compiler gave no estimate.
    """
    if self.optimal_seconds is None:
      return None
    return self.optimal_seconds + self.crossing * 8 / (dcn_gbit_per_s * 1e9)


def analyze(compiled, compile_seconds: float = 0.0, *, slices: int,
            hbm: int = 0) -> Figures:
  """What a compiled step says, per chip.

  Args:
    compiled: the compiled step (``lowered.compile()``).
    compile_seconds: the wall time its compile took (see
      :func:`compile_lowered`).
    slices: the number of slices of its mesh.
    hbm: the chip's HBM in bytes (:data:`HBM`), 0 when unknown.

  Returns:
    The step's :class:`Figures`.
  """
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  text = compiled.as_text()
  optimal = (cost or {}).get("optimal_seconds")
  unknown = 0
  if optimal is not None and optimal < 0:
    # The TPU compiler counts an op it cannot cost (some custom calls) as
    # -1 s: 2 such calls in the plain MLP step at dim 512 gave -0.99991,
    # one at dim 256 gave +2.4e-5. The estimate is the rest.
    unknown = -math.floor(optimal)
    optimal = optimal + unknown
  return Figures(
    unknown_cost_ops=int(unknown),
    compile_seconds=float(compile_seconds),
    argument=int(m.argument_size_in_bytes),
    output=int(m.output_size_in_bytes),
    alias=int(m.alias_size_in_bytes), temp=int(m.temp_size_in_bytes),
    hbm=int(hbm), transfers=tuple(transfers(text)), slices=int(slices),
    optimal_seconds=None if optimal is None else float(optimal),
    mosaic=len(re.findall(r'custom_call_target="tpu_custom_call"', text)))


def compile_lowered(lowered) -> tuple[Any, float]:
  """Compiles a lowered step and times it.

  Args:
    lowered: a lowered step (``jax.jit(f).lower(...)``, or
      :meth:`jaxcomm.parallel.DataParallel.lower`).

  Returns:
    ``(compiled, seconds)``: ``lowered.compile()`` and its wall time.
  """
  t = time.perf_counter()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t


def plain_step(loss_fn, learning_rate: float = 0.1, optimizer=None):
  """The plain jit step a sharded trainer writes.

  The gradient of the loss on whole arrays, SGD, XLA's own reductions:
  the baseline every compiled jaxcomm step is compared with.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``.
    learning_rate: the SGD step size (without ``optimizer``).
    optimizer: an optax optimizer to apply instead of SGD (the one a whole
      optimizer such as 1-bit Adam replaces: Adam), or None.

  Returns:
    The jitted step ``step(params, batch) -> params``, or with
    ``optimizer`` ``step(params, opt_state, batch) -> (params,
    opt_state)``, its state laid out by :func:`optimizer_state`; params
    (and state) are donated.
  """
  if optimizer is None:
    def step(params, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    return jax.jit(step, donate_argnums=0)

  def opt_step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(opt_step, donate_argnums=(0, 1))


def optimizer_state(optimizer, params):
  """An optimizer's state for abstract params, abstract.

  Args:
    optimizer: an optax optimizer.
    params: ``jax.ShapeDtypeStruct`` leaves with ``NamedSharding`` (as
      :func:`mlp` and :func:`transformer` give).

  Returns:
    The state as ``jax.ShapeDtypeStruct`` leaves. Each leaf that mirrors
    a param (Adam's moments) is sharded as that param, the rest (step
    counts) replicated on the params' mesh.

  Raises:
    ValueError: when ``params`` are not all abstract with a
      ``NamedSharding``.
  """
  leaves = jax.tree.leaves(params)
  if not leaves or not all(isinstance(getattr(p, "sharding", None),
                                      NamedSharding) for p in leaves):
    raise ValueError("params must be jax.ShapeDtypeStruct leaves with "
                     "NamedShardings (as aot.mlp / aot.transformer give)")
  state = jax.eval_shape(optimizer.init, params)
  mesh = leaves[0].sharding.mesh
  whole = NamedSharding(mesh, P())
  like = lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                           sharding=p.sharding)
  return optax.tree_map_params(
    optimizer, like, state, params,
    transform_non_params=lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=whole))


# ----------------------------------------------------------- the command --

def compile_method(loss_fn, params, batch, mesh, tx, *, data_axis="dcn",
                   auto_axes=("fsdp",)):
  """A method's sharded step, compiled ahead of time for ``mesh``.

  The step is :class:`jaxcomm.parallel.DataParallel`'s, manual over
  ``data_axis`` with ``auto_axes`` left to the compiler; nothing is
  allocated.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``.
    params: abstract params (``jax.ShapeDtypeStruct`` with shardings).
    batch: an abstract batch.
    mesh: the mesh to compile for (e.g. :func:`slice_mesh`).
    tx: the optimizer (a chain holding the method).
    data_axis: the data axis (or axes) the method averages over.
    auto_axes: the model axes left to the compiler.

  Returns:
    ``(compiled, seconds, state)``: the compiled step, its compile time
    and the abstract optimizer state.
  """
  from jaxcomm import parallel
  dp = parallel.DataParallel(loss_fn, tx, mesh, axis_name=data_axis,
                             auto_axes=auto_axes)
  p, state = dp.init(params)
  compiled, secs = compile_lowered(dp.lower(p, state, batch))
  return compiled, secs, state


def state_bytes_per_chip(state) -> int:
  """Bytes of an abstract state's shards on one chip.

  Args:
    state: ``jax.ShapeDtypeStruct`` leaves with shardings (the state
      :func:`compile_method` returns).

  Returns:
    The bytes, an int.
  """
  total = 0
  for x in jax.tree.leaves(state):
    shape = x.sharding.shard_shape(x.shape)
    total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
  return total


def memory_per_chip(fig: Figures, state=None) -> int:
  """The memory a step adds per chip, as the TPU tier bounds it.

  Args:
    fig: the step's :class:`Figures`.
    state: an abstract optimizer state whose shards a method keeps by
      design, or None.

  Returns:
    Temporaries and arguments less ``state``'s shards, in bytes.
  """
  held = 0 if state is None else state_bytes_per_chip(state)
  return fig.temp + fig.argument - held


if __name__ == "__main__":
  # The command line lives in jaxcomm/_aot_cli.py (internal).
  from jaxcomm import _aot_cli
  sys.exit(_aot_cli.main())
