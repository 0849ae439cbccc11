"""What a training run's steps move over the wire, and the state's figures.

:func:`wire_bytes` prices a run's exchange once, before the first step:
the bytes per device per step the compressor (or the local-update method,
or the communicating optimizer) claims, checked against the compiled HLO by
the test battery, and the dense psum they replace. Where the bytes of a step
depend on what it did (LAG's skipped all-reduces, SparCML's switch, an
adaptive local period), they are read from the step's optimizer state.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import jax
import numpy as np

import jaxcomm
from jaxcomm import parallel
from jaxcomm import wire
from jaxcomm.transforms.sparsify import _lag
from trainer.config import AXIS
from trainer.config import Config


def _scalar(x) -> float:
  """A metric as a float: a replicated scalar, or the mean of a per-device
  one (local-update steps) over this process's devices."""
  if not isinstance(x, jax.Array):
    return float(x)
  vals = [np.asarray(s.data, np.float64).reshape(-1)
          for s in x.addressable_shards]
  if x.ndim == 0:
    return float(vals[0][0])
  return float(np.mean(np.concatenate(vals)))


def _stats(opt_state) -> dict[str, float]:
  out = {}
  found = jaxcomm.stats(opt_state)
  if found:
    st = found[0]
    norms = [np.asarray(s.data) for s in st.residual_norm.addressable_shards]
    out["residual_norm"] = float(np.sqrt(np.mean(np.concatenate(
      [np.reshape(x, -1) for x in norms]) ** 2)))
    out["nonfinite_steps"] = int(np.max(np.concatenate(
      [np.reshape(np.asarray(s.data), -1)
       for s in st.nonfinite_steps.addressable_shards])))
  return out


def _lazy_bytes(spec, params, n: int, full: float):
  """For LAG (:func:`jaxcomm.lag`): ``fn(opt_state)``, the bytes the step
  that made ``opt_state`` moved (``full``, less each bucket's all-reduce
  on a step where no device sent it); None for any other compressor."""
  if not isinstance(spec.codec, _lag.LagCodec) or n < 2:
    return None
  skipped = [wire.summarize([("all-reduce", 4 * lay.size)], n).total_sent
             for lay in spec.layouts(params)]

  def moved(opt_state):
    codec = jaxcomm.compress_states(opt_state)[0].codec
    return full - sum(b for b, st in zip(skipped, codec)
                      if _scalar(st.senders) == 0)
  return moved


def _sparcml_bytes(spec, params, n: int, full: float):
  """For SparCML (:func:`jaxcomm.sparcml`): ``fn(opt_state)``, the bytes
  the step that made ``opt_state`` moved (``full`` lists both all-gathers
  of a bucket whose switch the compiled step holds; the one not taken, by
  the union the state recorded, is taken off); None for any other
  compressor."""
  from jaxcomm.transforms.sparsify import _sparcml  # noqa: PLC0415
  if not isinstance(spec.codec, _sparcml.SparcmlCodec) or n < 2:
    return None
  buckets = []
  for lay in spec.layouts(params):
    p = _sparcml.plan(lay, n, spec.codec.ratio)
    if p.gather != _sparcml.SWITCH:
      buckets.append(None)
      continue
    sparse = wire.summarize([("all-gather", 4 * n * _sparcml._sparse
                              .message_words(p.c2, p.m))], n).total_sent
    dense = wire.summarize([("all-gather", 4 * n * p.m)], n).total_sent
    buckets.append((p.c2, sparse, dense))

  def moved(opt_state):
    codec = jaxcomm.compress_states(opt_state)[0].codec
    out = full
    for b, st in zip(buckets, codec):
      if b is not None:
        c2, sparse, dense = b
        out -= sparse if _scalar(st.union) > c2 else dense
    return out
  return moved


def lag_sent_fraction(opt_state) -> float | None:
  """The fraction of device-steps on which a LAG device sent its gradient
  (``sent_steps`` over steps, averaged over devices and buckets); None
  without LAG."""
  found = jaxcomm.compress_states(opt_state)
  if not found or not all(isinstance(st, _lag.LagState)
                          for st in found[0].codec) or not found[0].codec:
    return None
  steps = max(_scalar(found[0].count), 1.0)
  return float(np.mean([_scalar(st.sent_steps) for st in found[0].codec])
               / steps)


def _fmt_bytes(b: float) -> str:
  for unit in ("B", "KB", "MB", "GB"):
    if abs(b) < 1024 or unit == "GB":
      return f"{b:,.1f} {unit}" if unit != "B" else f"{b:,.0f} B"
    b /= 1024
  return str(b)  # pragma: no cover


@dataclasses.dataclass
class WireBytes:
  """A run's bytes per device per step (see :func:`wire_bytes`).

  Attributes:
    dense_rep: the dense psum's ``wire.summarize`` report (what a step
      would move uncompressed).
    per_step: the summary's bytes per step as claimed (NaN where only the
      run can tell: an adaptive local period).
    bytes_at: ``fn(step)``, the bytes of a step known before it runs; None
      where they are read from the state.
    of_state: ``fn(opt_state)``, the bytes of the step that made
      ``opt_state`` (LAG, SparCML); None otherwise.
    sync_bytes: what a local-update sync moves (read off the state's
      ``synced`` flag where neither of the above applies).
  """
  dense_rep: Any
  per_step: float
  bytes_at: Callable[[int], float] | None
  of_state: Callable[[Any], float] | None = None
  sync_bytes: float = 0.0

  def before(self, start: int, history: list[dict[str, Any]]) -> float:
    """The bytes moved by the steps before ``start`` (a resumed run)."""
    if self.bytes_at is not None:
      return sum(self.bytes_at(s) for s in range(start))
    # adacomm: what the run logged so far
    return float(history[-1].get("bytes_total", 0.0)) if history else 0.0

  def step(self, step: int, opt_state) -> float:
    """The bytes step ``step`` moved, ``opt_state`` being its result."""
    if self.bytes_at is not None:
      return self.bytes_at(step)
    if self.of_state is not None:
      return self.of_state(opt_state)
    synced = jax.tree.leaves(jaxcomm.local_states(opt_state)[0].synced)[0]
    return self.sync_bytes if _scalar(synced) else 0.0


def wire_bytes(cfg: Config, comp, local_tx, params, dp, mesh,
               mesh_shape: dict[str, int] | None, data_axis: str,
               pod: bool) -> WireBytes:
  """Prices a run's exchange: see :class:`WireBytes`.

  Args:
    cfg: the run's config.
    comp: the compressor (or the communicating optimizer) of the step.
    local_tx: the local-update optimizer, or None.
    params: the model's (host) params.
    dp: the run's ``DataParallel``.
    mesh: its mesh.
    mesh_shape: ``--mesh`` as ``{axis: size}``, or None.
    data_axis: the axis the exchange runs over.
    pod: whether the run has ``--slices`` > 1.
  """
  n = cfg.num_devices
  # The bytes counted: each device's exchange over the data axis, or with
  # slices between them (the mean inside a slice stays inside), of the
  # whole gradient or, sharded, of the device's share (with --mesh: its
  # shards of every leaf, across the data axis).
  n_wire = (cfg.slices if pod else mesh_shape[data_axis] if mesh_shape
            else n)
  wire_params = params
  if cfg.sharded_exchange:
    wire_params = parallel.exchange_share(params, n // cfg.slices)
  split_kw = {}
  if mesh_shape is not None:
    wire_params = parallel.shard_shapes(params, dp.param_specs, mesh)
    # How each leaf is split into those shards: a compressor of whole
    # matrices (PowerSGD) claims by it.
    split_kw = {"splits": parallel.shard_splits(dp.param_specs, mesh)}

  # Bytes per device per step, as the compressor claims (checked against the
  # compiled HLO by the test battery), and the dense psum it replaces.
  # Before a start_step (freeze_step) a step moves the dense phase's psum.
  from jaxcomm import _compressor
  dense_rep = wire.summarize(wire.claimed(jaxcomm.mean_gradients(AXIS),
                                          wire_params, n_wire), n_wire,
                             wire_params)
  if local_tx is not None:
    # A local-update step moves bytes only when it syncs: the summary's
    # bytes per step are the average over the run's steps, and each
    # logged step records what it moved.
    lspec = _compressor.spec_of(local_tx)
    sync_bytes = (wire.summarize(lspec.wire(wire_params, n_wire,
                                            **split_kw),
                                 n_wire).total_sent if n_wire > 1 else 0.0)
    if lspec.adaptive:
      # read from the state: the period follows the loss
      return WireBytes(dense_rep, float("nan"), None, None, sync_bytes)
    per_step_cache = {}

    def bytes_at(s):
      if s not in per_step_cache:
        per_step_cache[s] = (wire.summarize(wire.claimed(
          local_tx, wire_params, n_wire, step=s, **split_kw),
          n_wire).total_sent
                             if n_wire > 1 else 0.0)
      return per_step_cache[s]
    per_step = (sum(bytes_at(s) for s in range(cfg.steps)) / cfg.steps)
    return WireBytes(dense_rep, per_step, bytes_at, None, sync_bytes)

  start_dense = _compressor.spec_of(comp).start_step
  rep = wire.summarize(wire.claimed(comp, wire_params, n_wire, **split_kw,
                                    step=start_dense), n_wire)
  warm_rep = (wire.summarize(wire.claimed(comp, wire_params, n_wire,
                                          **split_kw,
                                          step=0), n_wire)
              if start_dense else rep)
  bytes_at = lambda s: (warm_rep.total_sent if s < start_dense
                        else rep.total_sent)
  per_step = rep.total_sent
  spec = _compressor.spec_of(comp)
  if isinstance(spec.codec, jaxcomm.SteppedCodec) and n_wire > 1:
    # The exchange changes with the step (DGC's warm-up stages): each
    # step's own claim; the summary's bytes per step are the last
    # step's (after the warm-up).
    at = {}

    def bytes_at(s):  # pylint: disable=function-redefined
      if s not in at:
        at[s] = wire.summarize(wire.claimed(comp, wire_params, n_wire,
                                            **split_kw,
                                            step=s), n_wire).total_sent
      return at[s]
    per_step = bytes_at(cfg.steps - 1)
  lazy = _lazy_bytes(spec, wire_params, n_wire, rep.total_sent) or \
    _sparcml_bytes(spec, wire_params, n_wire, rep.total_sent)
  if lazy is not None:
    # LAG: a bucket's all-reduce runs only on steps where some device
    # sends; SparCML: one of a bucket's two all-gathers runs. Each
    # step's bytes are read from its state.
    return WireBytes(dense_rep, per_step, None, lazy)
  return WireBytes(dense_rep, per_step, bytes_at)
