"""Which compressor pays where: predicted step communication on a pod.

A pod has fast links inside a host or slice (ICI, NVLink) and slow ones
between (DCN, Ethernet). The recipe compresses only over the slow axis::

  optax.chain(jaxcomm.mean_gradients(axis_name="ici"),
              jaxcomm.powersgd(4, axis_name="dcn"), optax.sgd(0.1))

:func:`advise` predicts, for given params and a mesh of axes with their
links (:class:`jaxcomm.wire.CostModel`), the communication seconds per
step of each candidate: the dense mean over the fast axes (on their link)
plus the candidate's own collectives over the slow axis (what it claims to
send, ``jaxcomm.wire.claimed``, which the test battery checks against the
compiled HLO), plus its compute overhead where the caller gives one, and
names the fastest whose measured accuracy gap fits a budget. A flat
candidate (``dense, flat``: one mean over all axes) is one ring over every
device instead. A local
method syncing every ``H`` steps costs one dense all-reduce of the params
over the slow axis divided by ``H``. The model is alpha-beta (latency plus
bytes over bandwidth per collective); it ignores overlap with compute and
congestion, so it ranks methods rather than promising seconds
(``docs/benchmarks/advisor.md`` compares it with measured steps).

With ``fsdp=Axis(...)`` it prices the sharded-model step
(``DataParallel(..., auto_axes=("fsdp",))``): the params are split over
that model axis, the plain step's own weight all-gather and gradient
reduce-scatter cross its link on every step whatever the method, and each
device's compressor works on its ``1/size`` share of the gradient, so
what crosses the slow axis is the claim on the device's shards.

  >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
  >>> axes = [Axis("dcn", 8, wire.CostModel.link(10)),
  ...         Axis("ici", 8, wire.CostModel.link(400, 1))]
  >>> rows = advise(params, axes, budget=0.05)   # fastest first
  >>> [r.name for r in rows][:2]
  ['DiLoCo H=50', 'topk 0.1%']
  >>> best = recommend(rows, 0.05)
  >>> print(best.name, f"{best.total_s * 1e3:.2f} ms")
  DiLoCo H=50 1.94 ms
  >>> text = table(rows, 0.05)                   # a markdown table
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any
from typing import Callable
from typing import Mapping
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import parallel
from jaxcomm import transforms
from jaxcomm import wire

__all__ = [
  "Axis",
  "Candidate",
  "Row",
  "advise",
  "default_candidates",
  "fsdp_shards",
  "recommend",
  "table",
]


@dataclasses.dataclass(frozen=True)
class Axis:
  """One mesh axis: its name, its size and the link between its devices.

  Attributes:
    name: the mesh axis name.
    size: devices along it.
    link: the link each exchange along it crosses.
    shared: devices that send over one such link at the same time, e.g. the
      devices of a host that share its one network card (each runs its own
      exchange over the slow axis); each gets ``1 / shared`` of its
      bandwidth. 1 (the default) is a link per device, as on GPU nodes with
      a network card per GPU.

  Raises:
    ValueError: naming the field, when ``size`` or ``shared`` is not a
      positive int or ``link`` is not a :class:`jaxcomm.wire.CostModel`.
  """

  name: str
  size: int
  link: wire.CostModel
  shared: int = 1

  def __post_init__(self):
    _checks.integer("size", self.size, 1)
    _checks.integer("shared", self.shared, 1)
    if not isinstance(self.link, wire.CostModel):
      raise ValueError(f"Axis {self.name!r}: link must be a "
                       f"jaxcomm.wire.CostModel, got {self.link!r}")

  @property
  def effective_link(self) -> wire.CostModel:
    """The link as one of its ``shared`` senders sees it."""
    return dataclasses.replace(self.link, beta=self.link.beta * self.shared)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A method the advisor prices.

  Attributes:
    name: its label in the table.
    make: ``make(axis_name) -> compressor`` (a jaxcomm factory call), or
      None for a local method (``period`` set).
    period: for a local method (local SGD, DiLoCo), the steps between its
      dense syncs of the params.
    loss_gap: its measured eval-loss gap to dense (docs/benchmarks/
      convergence.md, char-LM at 8 workers), None where not measured.
    flat: the method runs once over all the axes together (``make`` gets
      the tuple of their names), not after a mean over the fast ones. It
      is priced as one ring over every device, numbered host by host: its
      pace is set by the edges between hosts, one per host, so a link
      shared by a host's devices still carries a single stream.
    sharded: the method runs between hosts once per host
      (:func:`jaxcomm.parallel.sharded_exchange` over the first fast
      axis): each device exchanges its ``1/d`` share of the values, after
      a reduce-scatter inside the host and before an all-gather (priced
      together as the dense mean over the fast axes).
  """

  name: str
  make: Callable | None = None
  period: int | None = None
  loss_gap: float | None = None
  flat: bool = False
  sharded: bool = False


def default_candidates() -> list[Candidate]:
  """The candidates :func:`advise` prices by default.

  Dense, cast, PowerSGD ranks, top-k, onebit, DiLoCo and local SGD, with
  the eval-loss gaps measured on the char-LM at 8 workers
  (docs/benchmarks/convergence.md: PowerSGD r4 and onebit before Adam,
  top-k with error feedback before momentum SGD, DiLoCo with AdamW).

  Returns:
    A list of :class:`Candidate`.
  """
  tr = transforms
  return [
    Candidate("dense", lambda a: tr.mean_gradients(axis_name=a), None, 0.0),
    Candidate("dense, flat", lambda a: tr.mean_gradients(axis_name=a), None,
              0.0, flat=True),
    Candidate("dense, sharded", lambda a: tr.mean_gradients(axis_name=a),
              None, 0.0, sharded=True),
    Candidate("bf16 cast", lambda a: tr.cast(jnp.bfloat16, axis_name=a)),
    Candidate("powersgd r1", lambda a: tr.powersgd(1, axis_name=a)),
    Candidate("powersgd r4", lambda a: tr.powersgd(4, axis_name=a),
              None, 0.032),
    Candidate("topk 1%", lambda a: tr.topk(0.01, axis_name=a), None, 0.075),
    Candidate("topk 0.1%", lambda a: tr.topk(0.001, axis_name=a), None,
              0.367),
    Candidate("onebit", lambda a: tr.onebit(axis_name=a), None, 0.557),
    Candidate("local SGD H=8", None, 8, 0.037),
    Candidate("DiLoCo H=50", None, 50, 0.025),
  ]


@dataclasses.dataclass(frozen=True)
class Row:
  """One candidate's prediction (seconds per step).

  Attributes:
    name: the candidate's label.
    fast_s: seconds on the fast axes (their dense mean, and an FSDP
      axis's own traffic).
    slow_s: seconds on the slow axis (what the candidate sends).
    overhead_s: compute seconds the caller gave for it (0 where absent).
    slow_bytes: bytes each device sends over the slow link per step.
    loss_gap: its measured eval-loss gap to dense, or None.
  """

  name: str
  fast_s: float
  slow_s: float
  overhead_s: float
  slow_bytes: float
  loss_gap: float | None

  @property
  def total_s(self) -> float:
    """``fast_s + slow_s + overhead_s``: the predicted seconds per step."""
    return self.fast_s + self.slow_s + self.overhead_s


def _dense_time(params, axis: Axis) -> float:
  return axis.effective_link.predict(
    [("all-reduce", wire.dense_payload(params))], axis.size)


def fsdp_shards(params, size: int, specs=None, axis: str = "fsdp"):
  """One device's shards of ``params`` split ``size`` ways over an FSDP axis.

  What the compressor of a sharded step sees.

  Args:
    params: the model's params (arrays or ShapeDtypeStructs).
    size: devices along the FSDP axis.
    specs: each leaf's ``PartitionSpec`` (the model's sharding rules), of
      which only ``axis`` counts; default: each leaf split along its
      largest dimension that ``size`` divides (the first of equals), and
      kept whole (replicated, as biases and norm scales are) when none
      does.
    axis: the FSDP axis's name in ``specs``.

  Returns:
    ``params``' structure with ``jax.ShapeDtypeStruct`` leaves of the
    shards' shapes.

  Raises:
    ValueError: when ``size`` is not a positive int, or ``specs`` split a
      dimension ``size`` does not divide.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jaxcomm.advise import fsdp_shards
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 512), jnp.float32),
    ...           "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    >>> shards = fsdp_shards(params, 4)
    >>> shards["w"].shape, shards["b"].shape
    ((256, 512), (3,))
  """
  size = _checks.integer("size", size, 1)

  def dims_of(x, spec):
    shape = tuple(x.shape)
    if spec is None:
      fits = [i for i, d in enumerate(shape) if d % size == 0]
      return [max(fits, key=lambda i: (shape[i], -i))] if fits else []
    out = []
    for i, e in enumerate(tuple(spec)):
      names = e if isinstance(e, tuple) else (e,)
      if axis in names:
        if i >= len(shape) or shape[i] % size:
          raise ValueError(
            f"specs: a leaf of shape {shape} splits dimension {i} over "
            f"{axis!r} ({size} devices), which does not divide it")
        out.append(i)
    return out

  def shard(x, spec=None):
    shape = list(x.shape)
    for i in dims_of(x, spec):
      shape[i] //= size
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

  if specs is None:
    return jax.tree.map(shard, params)
  return jax.tree.map(shard, params, specs, is_leaf=lambda s: s is None
                      or isinstance(s, jax.sharding.PartitionSpec))


def _fsdp_splits(params, size: int, specs, axis: str) -> list:
  """Per leaf, how :func:`fsdp_shards` splits it (``Layout.splits``): a
  compressor of whole matrices (PowerSGD) claims by it."""
  out = []
  leaves = jax.tree.leaves(params)
  spec_leaves = ([None] * len(leaves) if specs is None else jax.tree.leaves(
    specs, is_leaf=lambda s: s is None
    or isinstance(s, jax.sharding.PartitionSpec)))
  for x, sp in zip(leaves, spec_leaves):
    shape = tuple(x.shape)
    if sp is None:
      fits = [i for i, d in enumerate(shape) if d % size == 0]
      dims = [max(fits, key=lambda i: (shape[i], -i))] if fits else []
    else:
      dims = [i for i, e in enumerate(tuple(sp))
              if axis in (e if isinstance(e, tuple) else (e,))]
    out.append(tuple((i, (axis,), size) for i in dims))
  return out


def advise(params, axes: Sequence[Axis], candidates=None, *,
           overhead_s: Mapping[str, float] | None = None,
           budget: float | None = None, fsdp: Axis | None = None,
           specs=None) -> list[Row]:
  """Predicted communication per step of each candidate on ``axes``.

  Args:
    params: the model's params (arrays or ``jax.ShapeDtypeStruct``).
    axes: the data axes, slowest first: ``axes[0]`` is the one compressed
      (between hosts or slices), the rest are averaged densely on their own
      links first (inside a host or slice). One axis: no fast stage.
    candidates: :class:`Candidate` list (default :func:`default_candidates`).
    overhead_s: per-candidate compute seconds per step (e.g. from
      ``benchmarks/bench_overhead.py`` on your accelerator); 0 where absent.
    budget: the largest eval-loss gap to dense accepted; candidates with a
      larger or unmeasured gap are still priced but not recommended.
    fsdp: a model axis the params are sharded over (FSDP inside a host or
      slice; :class:`jaxcomm.parallel.DataParallel` with ``auto_axes``).
      Every candidate then pays the plain FSDP step's traffic on its link
      (one all-gather of the weights and one reduce-scatter of the
      gradient per step, local methods included: their inner steps are
      FSDP steps), averages and compresses only its device's shards
      (:func:`fsdp_shards`), and a local method syncs its shards. Flat and
      host-sharded candidates do not apply and are left out of the
      defaults (refused when given).
    specs: the params' PartitionSpecs naming ``fsdp``'s axis, for
      :func:`fsdp_shards` (default: each leaf split along its largest
      dimension ``fsdp.size`` divides).

  Returns:
    A list of :class:`Row` sorted by predicted total seconds, fastest
    first; with ``budget`` the first row within it is :func:`recommend`'s
    answer.

  Raises:
    ValueError: naming the argument: no axes, an axis that is not an
      :class:`Axis`, a negative ``budget``, ``overhead_s`` naming no
      candidate or out of range, an ``fsdp`` axis that is also a data
      axis or whose size divides no dimension, ``specs`` without
      ``fsdp``, flat or host-sharded candidates with ``fsdp``, a
      candidate's ``period`` that is not a positive int.
  """
  if not axes:
    raise ValueError("axes must name at least one data axis (the slow one "
                     "first), got none")
  for a in axes:
    if not isinstance(a, Axis):
      raise ValueError(f"axes must be jaxcomm.advise.Axis values, got {a!r}")
  if budget is not None:
    _checks.number("budget", budget, 0.0)
  slow, fast = axes[0], list(axes[1:])
  overhead_s = dict(overhead_s or {})
  candidates_given = candidates is not None
  candidates = (default_candidates() if candidates is None
                else list(candidates))
  unknown = sorted(set(overhead_s) - {c.name for c in candidates})
  if unknown:
    raise ValueError(
      f"overhead_s names no candidate: {unknown}; candidates are "
      + ", ".join(repr(c.name) for c in candidates))
  for name, sec in overhead_s.items():
    _checks.number(f"overhead_s[{name!r}]", sec, 0.0, 1e9)
  fsdp_s = 0.0
  if fsdp is not None:
    if not isinstance(fsdp, Axis):
      raise ValueError(f"fsdp must be a jaxcomm.advise.Axis, got {fsdp!r}")
    if fsdp.name in {a.name for a in axes}:
      raise ValueError(f"fsdp: {fsdp.name!r} is also a data axis in axes; "
                       "the FSDP axis is a model axis of its own")
    dims = [int(d) for x in jax.tree.leaves(params) for d in x.shape]
    if specs is None and not any(d % fsdp.size == 0 for d in dims):
      # Every leaf would stay whole on every device: no FSDP to price.
      raise ValueError(
        f"fsdp: size {fsdp.size} (--fsdp) divides no dimension of any leaf "
        f"(the largest is {max(dims, default=0)}): every leaf would be "
        "priced unsplit; give a size that divides the weights' dimensions,"
        " or specs naming the axis")
    whole = wire.dense_payload(params)
    # The plain FSDP step's own traffic: weights gathered, gradient
    # reduce-scattered, over the FSDP axis, every step.
    fsdp_s = fsdp.effective_link.predict(
      [("all-gather", whole), ("reduce-scatter", whole)], fsdp.size)
    splits = _fsdp_splits(params, fsdp.size, specs, fsdp.name)
    params = fsdp_shards(params, fsdp.size, specs, fsdp.name)
    off = [c.name for c in candidates if c.flat or c.sharded]
    if off and candidates_given:
      raise ValueError(
        f"candidates {off} are flat or host-sharded, which a sharded model "
        "(fsdp=) does not run: each device already exchanges its own "
        "shards over the slow axis")
    candidates = [c for c in candidates if not (c.flat or c.sharded)]
  else:
    splits = None
  if fsdp is None and specs is not None:
    raise ValueError("specs is given without fsdp: name the FSDP axis "
                     "(fsdp=Axis(name, size, link)) they split the params "
                     "over")
  fast_s = sum(_dense_time(params, a) for a in fast)
  rows = []
  for c in candidates:
    if c.period is not None:
      _checks.integer("period", c.period, 1)
      # Params averaged every `period` steps: one dense all-reduce over
      # every axis, its cost spread over the period; no per-step gradient
      # exchange at all.
      slow_bytes = (wire.sent_bytes("all-reduce", wire.dense_payload(params),
                                    slow.size) / c.period)
      rows.append(Row(c.name, fsdp_s + fast_s / c.period,
                      _dense_time(params, slow) / c.period,
                      overhead_s.get(c.name, 0.0), slow_bytes, c.loss_gap))
      continue
    if c.flat:
      n = math.prod(a.size for a in axes)
      ops = wire.claimed(c.make(tuple(a.name for a in axes)), params, n)
      rows.append(Row(c.name, 0.0, slow.link.predict(ops, n),
                      overhead_s.get(c.name, 0.0),
                      sum(wire.sent_bytes(k, p, n) for k, p in ops),
                      c.loss_gap))
      continue
    exchanged = params
    if c.sharded and fast:
      # One flat float32 share per device of the first fast axis.
      exchanged = parallel.exchange_share(params, fast[0].size)
    ops = (wire.claimed(c.make(slow.name), exchanged, slow.size)
           if splits is None else
           wire.claimed(c.make(slow.name), exchanged, slow.size,
                        splits=splits))
    slow_bytes = sum(wire.sent_bytes(k, p, slow.size) for k, p in ops)
    rows.append(Row(c.name, fsdp_s + fast_s,
                    slow.effective_link.predict(ops, slow.size),
                    overhead_s.get(c.name, 0.0), slow_bytes, c.loss_gap))
  rows.sort(key=lambda r: r.total_s)
  return rows


def recommend(rows: Sequence[Row], budget: float) -> Row | None:
  """The fastest row whose measured gap is at most ``budget``.

  Args:
    rows: :func:`advise`'s rows, fastest first.
    budget: the largest eval-loss gap to dense accepted.

  Returns:
    The first :class:`Row` with a measured ``loss_gap <= budget``, or None
    when there is none.
  """
  for r in rows:
    if r.loss_gap is not None and r.loss_gap <= budget:
      return r
  return None


def table(rows: Sequence[Row], budget: float | None = None) -> str:
  """A markdown table of :func:`advise`'s rows (milliseconds).

  Args:
    rows: :func:`advise`'s rows.
    budget: if given, :func:`recommend`'s row is set in bold.

  Returns:
    The table as one str.
  """
  best = recommend(rows, budget) if budget is not None else None
  out = ["| method | fast axes ms | slow axis ms | overhead ms | total ms "
         "| MB over the slow link | loss gap |",
         "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    gap = "—" if r.loss_gap is None else f"{r.loss_gap:+.3f}"
    name = f"**{r.name}**" if r is best else r.name
    out.append(f"| {name} | {r.fast_s * 1e3:.2f} | {r.slow_s * 1e3:.2f} | "
               f"{r.overhead_s * 1e3:.2f} | {r.total_s * 1e3:.2f} | "
               f"{r.slow_bytes / 1e6:.2f} | {gap} |")
  return "\n".join(out)


def _params_from_args(model: str | None, shapes: str | None,
                      model_params: Callable[[str], Any] | None):
  """Abstract params: a named model's (through ``model_params``) or given
  shapes."""
  if (model is None) == (shapes is None):
    raise ValueError("give one of --model (a model name) or --shapes (e.g. "
                     "'1024x1024,1024')")
  if shapes is not None:
    out = {}
    for i, text in enumerate(t for t in shapes.split(",") if t.strip()):
      try:
        dims = tuple(int(d) for d in text.strip().split("x"))
      except ValueError:
        raise ValueError(f"--shapes: {text!r} is not dims joined by 'x' "
                         "(e.g. 1024x1024)") from None
      if not dims or min(dims) < 1:
        raise ValueError(f"--shapes: {text!r} needs positive dims")
      out[f"p{i}"] = jax.ShapeDtypeStruct(dims, jnp.float32)
    if not out:
      raise ValueError("--shapes gave no shapes")
    return out
  if model_params is None:
    raise ValueError("--model needs a model catalogue, which the library "
                     "does not have: give --shapes, or run `python -m "
                     "benchmarks.advise --model NAME ...` from the "
                     "repository root")
  return model_params(model)


def _overheads(text: str | None) -> dict:
  out = {}
  for item in (t for t in (text or "").split(",") if t.strip()):
    name, sep, ms = item.rpartition("=")
    try:
      out[name.strip()] = float(ms) / 1e3
    except ValueError:
      sep = ""
    if not sep or not name.strip():
      raise ValueError(f"--overhead-ms: {item!r} is not NAME=MS")
  return out


def main(argv=None, *, model_params: Callable[[str], Any] | None = None
         ) -> int:
  """Internal: the ``python -m jaxcomm.advise`` command.

  Prints the table for a model on a two-level mesh.

  Args:
    argv: the command line (default ``sys.argv[1:]``).
    model_params: ``model_params(name) -> params`` (abstract is enough)
      for ``--model``; the repository's ``benchmarks/advise.py`` passes its
      models' (raising ``ValueError`` for an unknown name).
  """
  p = argparse.ArgumentParser(
    prog="python -m jaxcomm.advise",
    description="Predicted communication per step of dense, bf16, "
    "PowerSGD, top-k, onebit, local SGD and DiLoCo on a mesh of hosts, "
    "and the fastest within a loss budget.")
  p.add_argument("--model", help="a model name (with `python -m "
                 "benchmarks.advise`: charlm, resnet20, ...)")
  p.add_argument("--shapes", help="parameter shapes instead, e.g. "
                 "'1024x1024,1024' (float32)")
  p.add_argument("--hosts", type=int, required=True,
                 help="devices along the slow axis (hosts or slices)")
  p.add_argument("--per-host", type=int, default=1,
                 help="devices along the fast axis, inside a host")
  p.add_argument("--slow-gbit", type=float, required=True,
                 help="link between hosts, Gbit/s")
  p.add_argument("--slow-latency-us", type=float, default=50.0)
  p.add_argument("--fast-gbit", type=float, default=800.0,
                 help="link inside a host, Gbit/s")
  p.add_argument("--fast-latency-us", type=float, default=5.0)
  p.add_argument("--fsdp", type=int, default=1,
                 help="devices a host's (slice's) params are sharded over "
                 "(FSDP on the fast link, the compressor on each device's "
                 "shards); --per-host then counts the data-parallel "
                 "devices beside them")
  p.add_argument("--shared", type=int, default=1,
                 help="devices of a host sharing one link between hosts")
  p.add_argument("--budget", type=float, default=0.05,
                 help="largest eval-loss gap to dense accepted")
  p.add_argument("--overhead-ms", default=None,
                 help="measured compute per method, e.g. "
                 "'powersgd r4=2.7,topk 1%%=2.0'")
  a = p.parse_args(argv)
  try:
    for flag, value in (("--hosts", a.hosts), ("--per-host", a.per_host),
                        ("--shared", a.shared), ("--fsdp", a.fsdp)):
      _checks.integer(flag, value, 1)
    params = _params_from_args(a.model, a.shapes, model_params)
    axes = [Axis("dcn", a.hosts, wire.CostModel.link(a.slow_gbit,
                                                     a.slow_latency_us),
                 shared=a.shared)]
    if a.per_host > 1:
      axes.append(Axis("ici", a.per_host, wire.CostModel.link(
        a.fast_gbit, a.fast_latency_us)))
    fsdp = (Axis("fsdp", a.fsdp, wire.CostModel.link(
      a.fast_gbit, a.fast_latency_us)) if a.fsdp > 1 else None)
    rows = advise(params, axes, overhead_s=_overheads(a.overhead_ms),
                  budget=a.budget, fsdp=fsdp)
  except ValueError as e:
    p.error(str(e))
  print(table(rows, a.budget))
  best = recommend(rows, a.budget)
  print(f"\nWithin a loss gap of {a.budget:g}: "
        + (f"{best.name} ({best.total_s * 1e3:.2f} ms per step)" if best
           else "none of the measured methods"))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
