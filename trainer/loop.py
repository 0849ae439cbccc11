"""The training loop of ``train.py``: :func:`run` trains as a
:class:`~trainer.config.Config` says, evaluates, logs ``metrics.jsonl``,
checkpoints, and reports (:func:`summary_table`, :func:`summary_line`,
:func:`plot_curves`)."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
import models
from jaxcomm import parallel
from jaxcomm import wire
from models import data as mdata
from trainer import progress
from trainer.checkpoints import CheckpointError
from trainer.checkpoints import Checkpoints
from trainer.checkpoints import atomic_write
from trainer.checkpoints import check_compatible
from trainer.checkpoints import resume_path
from trainer.config import AXIS
from trainer.config import COMM_OPTIMIZERS
from trainer.config import FAST
from trainer.config import GOSSIP_METHODS
from trainer.config import SLOW
from trainer.config import Config
from trainer.config import build_compressor
from trainer.config import make_comm_optimizer
from trainer.config import make_local_optimizer
from trainer.config import make_optimizer
from trainer.config import make_schedule
from trainer.config import parse_kwargs
from trainer.config import parse_mesh
from trainer.config import resolve_compressor
from trainer.model import build_model
from trainer.model import load_data


def _identical_across_devices(tree, per_device: bool = False) -> bool:
  """Whether every addressable copy of every replicated leaf (or block of a
  sharded one) is equal (with ``per_device``: every device's row of the
  per-device params)."""
  for x in jax.tree.leaves(tree):
    copies = {}
    for s in x.addressable_shards:
      rows = [np.asarray(s.data)]
      if per_device:
        rows = list(rows[0])
      key = str(s.index[1:] if per_device else s.index)
      copies.setdefault(key, []).extend(rows)
    for same in copies.values():
      if any(not np.array_equal(same[0], c) for c in same[1:]):
        return False
  return True


def _make_eval(loss_fn, mesh, data_axes=AXIS):
  def local(params, batch):
    _, m = loss_fn(params, batch)
    cnt = jnp.sum(batch["mask"].astype(jnp.float32))
    vals = jnp.stack([m["loss"] * cnt, m["accuracy"] * cnt, cnt])
    return jax.lax.psum(vals, data_axes)

  return jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), P(data_axes)),
                               out_specs=P()))


def _make_whole_eval(loss_fn):
  """The held-out sums for a sharded model: the loss on whole arrays in a
  plain jit (the compiler partitions it as in the train step)."""
  def whole(params, batch):
    _, m = loss_fn(params, batch)
    cnt = jnp.sum(batch["mask"].astype(jnp.float32))
    return jnp.stack([m["loss"] * cnt, m["accuracy"] * cnt, cnt])
  return jax.jit(whole)


def evaluate(eval_fn, params, test, cfg: Config, dp) -> dict[str, float]:
  """Held-out loss and accuracy over at most ``eval_examples`` examples."""
  n = min(len(next(iter(test.values()))), cfg.eval_examples)
  part = {k: v[:n] for k, v in test.items()}
  totals = np.zeros(3)
  nproc, pid = jax.process_count(), jax.process_index()
  for batch in mdata.eval_batches(part, cfg.batch_size,
                                  num_shards=dp.num_devices):
    if nproc > 1:
      batch = mdata.local_slice(batch, pid, nproc)
    totals += np.asarray(eval_fn(params, dp.shard_batch(batch)))
  return {"eval_loss": float(totals[0] / max(totals[2], 1)),
          "eval_accuracy": float(totals[1] / max(totals[2], 1))}


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
  if not isinstance(spec.codec, jaxcomm.transforms._lag.LagCodec) or n < 2:
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
  from jaxcomm.transforms import _sparcml  # noqa: PLC0415
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
  if not found or not all(isinstance(st, jaxcomm.transforms._lag.LagState)
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


def default_out_dir(cfg: Config) -> str:
  return os.path.join("runs", f"{cfg.model}-{cfg.compressor}-"
                      f"n{cfg.num_devices}-{time.strftime('%Y%m%d-%H%M%S')}")


def run(cfg: Config, *, devices=None) -> dict[str, Any]:
  """Trains as ``cfg`` says; returns the final figures (see ``summary``).

  Uses the first ``cfg.num_devices`` of ``devices`` (default
  ``jax.devices()``): this function never changes the device count, so it
  can run in a process whose JAX backend is already up.
  """
  t_start = time.time()
  cfg = dataclasses.replace(cfg)
  if cfg.resume_from is not None:
    cfg.resume = True
  canon = resolve_compressor(cfg.compressor)
  cfg.compressor = canon
  if cfg.num_devices < 1:
    raise ValueError(f"--num-devices must be >= 1, got {cfg.num_devices}")
  if cfg.batch_size % cfg.num_devices:
    raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of "
                     f"--num-devices {cfg.num_devices}")
  if cfg.steps < 1:
    raise ValueError(f"--steps must be >= 1, got {cfg.steps}")
  for flag, value, lo in (("--eval-examples", cfg.eval_examples, 1),
                          ("--log-every", cfg.log_every, 1),
                          ("--checkpoint-every", cfg.checkpoint_every, 0),
                          ("--keep-checkpoints", cfg.keep_checkpoints, 1),
                          ("--eval-every", cfg.eval_every, 0)):
    if value < lo:
      raise ValueError(f"{flag} must be >= {lo}, got {value}")
  if cfg.stop_after is not None and cfg.stop_after < 1:
    raise ValueError(f"--stop-after must be >= 1, got {cfg.stop_after}")
  for flag, value in (("--lr", cfg.lr), ("--weight-decay", cfg.weight_decay),
                      ("--momentum", cfg.momentum)):
    if not math.isfinite(value) or value < 0:
      raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
  if cfg.slices < 1 or cfg.num_devices % cfg.slices:
    raise ValueError(f"--slices {cfg.slices} must be >= 1 and divide "
                     f"--num-devices {cfg.num_devices}")
  pod = cfg.slices > 1
  if pod and (cfg.local != "none" or cfg.optimizer in COMM_OPTIMIZERS):
    raise ValueError(
      f"--slices {cfg.slices} runs the pod recipe (a dense mean inside each "
      "slice, --compressor between slices); it does not combine with "
      f"--local {cfg.local} or --optimizer {cfg.optimizer}")
  if cfg.optimizer_args and cfg.optimizer not in COMM_OPTIMIZERS:
    raise ValueError(
      f"--optimizer-args {cfg.optimizer_args!r}: --optimizer "
      f"{cfg.optimizer} takes none (they are for "
      f"{', '.join(COMM_OPTIMIZERS)}; its rate is --lr, --momentum, "
      "--weight-decay)")
  if cfg.local_args and cfg.local == "none":
    raise ValueError(f"--local-args {cfg.local_args!r} without --local: "
                     "name the local-update method they are for")
  mesh_shape = parse_mesh(cfg.mesh) if cfg.mesh is not None else None
  if mesh_shape is not None:
    total = int(np.prod(list(mesh_shape.values())))
    if total != cfg.num_devices:
      raise ValueError(f"--mesh {cfg.mesh} holds {total} devices, "
                       f"--num-devices {cfg.num_devices}: make them agree")
    if pod or cfg.sharded_exchange:
      raise ValueError("--mesh names its own data axis (the first): it does "
                       "not combine with --slices or --sharded-exchange")
    if cfg.model not in models.PARTITION_SPECS:
      raise ValueError(
        f"--mesh splits params by the model's logical axes; --model "
        f"{cfg.model} has none (models with them: "
        f"{', '.join(sorted(models.PARTITION_SPECS))})")
  if cfg.sharded_exchange and not pod:
    raise ValueError("--sharded-exchange splits the exchange between "
                     "slices over a slice's devices: it needs --slices > 1")
  devices = list(devices if devices is not None else jax.devices())
  if cfg.num_devices > len(devices):
    raise ValueError(f"--num-devices {cfg.num_devices} but JAX has "
                     f"{len(devices)} devices ({devices[0].platform})")
  out_dir = cfg.out_dir or default_out_dir(cfg)
  cfg.out_dir = out_dir
  main_proc = jax.process_index() == 0
  if not cfg.resume and Checkpoints(out_dir).steps():
    if not cfg.overwrite:
      raise ValueError(
        f"{out_dir} already holds checkpoints: pass --resume to continue "
        "them, --overwrite to start afresh, or another --out-dir")
    if main_proc:
      shutil.rmtree(os.path.join(out_dir, "checkpoints"))
  ckpts = Checkpoints(out_dir, cfg.keep_checkpoints, writer=True)
  resume_at = resume_path(ckpts, cfg) if cfg.resume else None

  train, test, data_kwargs, dataset = load_data(cfg)
  cfg.dataset = dataset
  fn = build_model(cfg, data_kwargs)
  loss_fn = models.make_loss_fn(cfg.model, fn.apply)
  data_axis = (next(iter(mesh_shape)) if mesh_shape is not None
               else SLOW if pod else AXIS)
  comp, _, comp_kwargs = build_compressor(
    canon, cfg.compressor_args, axis_name=data_axis)
  schedule = make_schedule(cfg)
  local_tx = None
  if cfg.local != "none":
    if cfg.optimizer in COMM_OPTIMIZERS:
      raise ValueError(f"--local {cfg.local} runs --optimizer on each "
                       f"device alone; {cfg.optimizer} exchanges its own "
                       "momentum every step: pick sgd, momentum, nesterov, "
                       "adam, adamw or lamb")
    local_tx = make_local_optimizer(
      cfg, make_optimizer(cfg, schedule),
      None if canon == "dense" else comp, schedule, axis_name=data_axis)
    comp = tx = local_tx
  elif cfg.optimizer in COMM_OPTIMIZERS:
    if canon != "dense":
      raise ValueError(
        f"--optimizer {cfg.optimizer} exchanges its own 1-bit momentum: use "
        f"--compressor dense (got {canon!r})")
    # The optimizer is the exchange: its wire is what a step moves.
    comp = tx = make_comm_optimizer(cfg, schedule, axis_name=data_axis)
    if jaxcomm.local_states(jax.eval_shape(tx.init, fn.params)):
      local_tx = tx   # 0/1 Adam: params per device, bytes per step vary
  elif cfg.sharded_exchange:
    per_slice = cfg.num_devices // cfg.slices
    tx = optax.chain(parallel.sharded_exchange(comp, FAST,
                                               fast_size=per_slice),
                     make_optimizer(cfg, schedule))
  elif pod:
    tx = optax.chain(jaxcomm.mean_gradients(axis_name=FAST), comp,
                     make_optimizer(cfg, schedule))
  else:
    tx = optax.chain(comp, make_optimizer(cfg, schedule))
  init_params, auto = fn.params, ()
  if mesh_shape is not None:
    # A sharded model: manual over the data axis only, the model axes
    # left to the compiler, params split by the model's logical axes.
    mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape),
                         devices=devices[:cfg.num_devices],
                         axis_types=(jax.sharding.AxisType.Auto,)
                         * len(mesh_shape))
    data_axes = data_axis
    auto = tuple(mesh_shape)[1:]
    specs = models.PARTITION_SPECS[cfg.model](fn.params, mesh.axis_names)
    init_params = jax.tree.map(
      lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), fn.params,
      specs, is_leaf=lambda x: isinstance(x, P))
    dp = parallel.DataParallel(
      loss_fn, tx, mesh, data_axes, auto_axes=auto, has_aux=True,
      batch_axes=(data_axis,) + tuple(a for a in auto if a != "tensor"))
  elif pod:
    mesh = parallel.make_pod_mesh(cfg.slices, slow_axis=SLOW,
                                  fast_axis=FAST,
                                  devices=devices[:cfg.num_devices])
    data_axes = (SLOW, FAST)
  else:
    mesh = parallel.make_mesh(cfg.num_devices, AXIS, devices=devices)
    data_axes = AXIS
  if mesh_shape is None:
    dp = parallel.DataParallel(loss_fn, tx, mesh, data_axes, has_aux=True)
  params, opt_state = dp.init(init_params)
  n = cfg.num_devices
  # The bytes counted: each device's exchange over the data axis, or with
  # slices between them (the mean inside a slice stays inside), of the
  # whole gradient or, sharded, of the device's share (with --mesh: its
  # shards of every leaf, across the data axis).
  n_wire = (cfg.slices if pod else mesh_shape[data_axis] if mesh_shape
            else n)
  wire_params = fn.params
  if cfg.sharded_exchange:
    wire_params = parallel.exchange_share(fn.params, n // cfg.slices)
  split_kw = {}
  if mesh_shape is not None:
    wire_params = parallel.shard_shapes(fn.params, dp.param_specs, mesh)
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
  step_bytes_of_state = None
  if local_tx is not None:
    # A local-update step moves bytes only when it syncs: the summary's
    # bytes per step are the average over the run's steps, and each
    # logged step records what it moved.
    lspec = _compressor.spec_of(local_tx)
    sync_bytes = (wire.summarize(lspec.wire(wire_params, n_wire,
                                            **split_kw),
                                 n_wire).total_sent if n_wire > 1 else 0.0)
    if lspec.adaptive:
      bytes_at = None  # read from the state: the period follows the loss
      per_step = float("nan")
    else:
      per_step_cache = {}

      def bytes_at(s):
        if s not in per_step_cache:
          per_step_cache[s] = (wire.summarize(wire.claimed(
            local_tx, wire_params, n_wire, step=s, **split_kw),
            n_wire).total_sent
                               if n_wire > 1 else 0.0)
        return per_step_cache[s]
      per_step = (sum(bytes_at(s) for s in range(cfg.steps)) / cfg.steps)
    start_dense = 0
  else:
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
      bytes_at, step_bytes_of_state = None, lazy
  num_params = sum(int(np.size(x)) for x in jax.tree.leaves(fn.params))

  meta_cfg = {k: v for k, v in dataclasses.asdict(cfg).items()}
  start = 0
  if cfg.resume:
    path = resume_at
    try:
      meta, p_leaves, s_leaves, start = ckpts.read(path)
    except CheckpointError as e:
      raise CheckpointError(f"{e}{ckpts.fallback_hint(path)}") from None
    old_data, old_model = _check_mesh_resume(meta, mesh_shape, path)
    new_model = ({a: mesh_shape[a] for a in auto} if mesh_shape is not None
                 else {})
    recut = tuple(a for a in new_model if old_model.get(a) != new_model[a])
    check_compatible(meta, cfg, params, opt_state, dp.layout, path,
                     per_device_params=dp.per_device_params,
                     model_axes=recut)
    treedef_p = jax.tree.structure(params)
    treedef_s = jax.tree.structure(opt_state)
    host_state = jax.tree.unflatten(treedef_s, s_leaves)
    old_n, new_n = int(meta["num_devices"]), n
    resize = {}
    if mesh_shape is not None:
      old_n, new_n = old_data, mesh_shape[data_axis]
      resize = {"axis_name": data_axis, "data_size": old_n,
                "model_axes": {a: mesh_shape[a] for a in auto}}
    if recut:
      host_state = _recut_state(host_state, dp, opt_state, comp, local_tx,
                                fn.params, data_axis, old_n, old_model,
                                new_model, main_proc)
    if old_n != new_n:
      host_state = parallel.resize_state(host_state, dp.layout, new_n,
                                         **resize)
      if main_proc:
        what = "slices" if mesh_shape is not None else "devices"
        print(f"resumed a checkpoint of {old_n} {what} on {new_n} "
              "(per-device state averaged or copied: what it owes the "
              "averaged update is kept)")
    host_params = jax.tree.unflatten(treedef_p, p_leaves)
    if dp.per_device_params and old_n != new_n:
      host_params = parallel.resize_params(host_params, new_n)
    params = dp.place_params(host_params)
    opt_state = _place_state(host_state, dp.layout, mesh, data_axes)
    if main_proc:
      print(f"resumed from {path} at step {start}")
    moved = ckpts.set_aside_after(start)
    if main_proc and moved:
      print(f"moved the checkpoints after step {start} aside (kept, no "
            f"longer the latest): {', '.join(moved)}")

  os.makedirs(out_dir, exist_ok=True)
  metrics_path = os.path.join(out_dir, "metrics.jsonl")
  history = []
  if main_proc:
    atomic_write(os.path.join(out_dir, "config.json"),
                  json.dumps(meta_cfg, indent=1))
    if cfg.resume and os.path.exists(metrics_path):
      history = read_history(metrics_path)
      history = [h for h in history if h.get("step", 0) <= start]
      atomic_write(metrics_path, "".join(json.dumps(h) + "\n"
                                          for h in history))
    elif os.path.exists(metrics_path):
      os.remove(metrics_path)
  log = open(metrics_path, "a") if main_proc else None

  stop = min(cfg.stop_after if cfg.stop_after is not None else cfg.steps,
             cfg.steps)
  if start >= stop:  # a resumed run with nothing left to train
    if main_proc:
      why = (f"run already complete at step {start}" if start >= cfg.steps
             else f"checkpoint at step {start}, --stop-after "
             f"{cfg.stop_after}")
      print(f"{why}: nothing to train; evaluating the restored parameters")
    stop = start
  it = mdata.batches(train, cfg.batch_size, seed=cfg.seed, num_shards=n,
                     start_step=start)
  eval_fn = (_make_eval(loss_fn, mesh, data_axes) if not auto
             else _make_whole_eval(loss_fn))
  nproc, pid = jax.process_count(), jax.process_index()
  bar = None
  if cfg.progress and main_proc and stop > start:
    # A bar on a terminal, a plain line every few steps in a log file.
    bar = progress.Progress(stop, start, f"{canon} n={n}", sys.stderr)
  if bytes_at is not None:
    cum_bytes = sum(bytes_at(s) for s in range(start))
  else:  # adacomm: what the run logged so far
    cum_bytes = float(history[-1].get("bytes_total", 0.0)) if history else 0.0

  def step_bytes(step, opt_state):
    if bytes_at is not None:
      return bytes_at(step)
    if step_bytes_of_state is not None:
      return step_bytes_of_state(opt_state)
    synced = jax.tree.leaves(jaxcomm.local_states(opt_state)[0].synced)[0]
    return sync_bytes if _scalar(synced) else 0.0
  t_loop = time.time()
  t_last, steps_since, rate = time.time(), 0, 0.0
  last = {}
  meta_base = {"config": meta_cfg, "num_devices": n}
  try:
    for step in range(start, stop):
      batch = next(it)
      if nproc > 1:
        batch = mdata.local_slice(batch, pid, nproc)
      params, opt_state, m = dp.step(params, opt_state, dp.shard_batch(batch))
      done = step + 1
      moved = step_bytes(step, opt_state)
      cum_bytes += moved
      steps_since += 1
      if done % cfg.log_every == 0 or done == stop:
        now = time.time()
        rate = steps_since / max(now - t_last, 1e-9)
        t_last, steps_since = now, 0
        last = {"step": done, "loss": _scalar(m["loss"]),
                "accuracy": _scalar(m["aux"]["accuracy"]),
                "lr": float(schedule(step)),
                "bytes_per_step": moved, "bytes_total": cum_bytes,
                "steps_per_s": rate, "time": now - t_start}
        last.update(_stats(opt_state))
        if cfg.local in GOSSIP_METHODS:
          last["consensus_distance"] = _scalar(
            parallel.consensus_distance(params))
        if cfg.eval_every and done % cfg.eval_every == 0 and done != stop:
          last.update(evaluate(eval_fn, dp.synchronized(params), test, cfg,
                               dp))
        if log is not None:
          log.write(json.dumps(last) + "\n")
          log.flush()
        history.append(last)
        if bar is not None:
          bar.set_postfix(
            f"loss={last['loss']:.3f} {rate:.1f} steps/s "
            f"{_fmt_bytes(last['bytes_per_step'])}/step")
      if bar is not None:
        bar.update(1)
      if not math.isfinite(last.get("loss", 0.0)):
        raise FloatingPointError(f"loss is {last['loss']} at step {done}")
      if done == stop or (cfg.checkpoint_every
                          and done % cfg.checkpoint_every == 0):
        ckpts.save(done, params, opt_state, dp.layout, meta_base)
  finally:
    ckpts.close()
    if bar is not None:
      bar.close()
    if log is not None:
      log.close()
  train_time = time.time() - t_loop
  steps_run = stop - start
  # Nothing trained (a finished run resumed): the train figures are the last
  # ones recorded, and the speed is the one the run reported when it ran.
  before = {}
  if not last:
    last = next((h for h in reversed(history) if "loss" in h), {})
    before = _previous_result(out_dir, stop) if main_proc else {}

  final = evaluate(eval_fn, dp.synchronized(params), test, cfg, dp)
  if bytes_at is None:  # adacomm, LAG: the average of what steps moved
    per_step = cum_bytes / max(stop, 1)
  result = {
    "model": cfg.model, "dataset": dataset,
    "compressor": (cfg.local + ("" if canon == "dense" else f"+{canon}")
                   if cfg.local != "none"
                   else cfg.optimizer if cfg.optimizer in COMM_OPTIMIZERS
                   else canon),
    "compressor_args": (parse_kwargs(cfg.optimizer_args)
                        if cfg.optimizer in COMM_OPTIMIZERS else comp_kwargs),
    "optimizer": cfg.optimizer, "num_devices": n, "steps": stop,
    "num_params": num_params,
    "train_loss": last.get("loss", float("nan")),
    "train_accuracy": last.get("accuracy", float("nan")),
    **final,
    "bytes_per_step": per_step,
    "dense_bytes_per_step": dense_rep.total_sent,
    "slices": cfg.slices,
    "compression_ratio": (dense_rep.total_sent / per_step
                          if per_step else math.inf),
    "bytes_total": cum_bytes,
    "steps_per_s": (steps_run / train_time if steps_run
                    else before.get("steps_per_s", 0.0)),
    "train_time_s": train_time if steps_run else before.get("train_time_s",
                                                            0.0),
    "wall_time_s": time.time() - t_start,
    "identical_params": _identical_across_devices(params,
                                                  dp.per_device_params),
    "out_dir": out_dir,
  }
  sent = lag_sent_fraction(opt_state)
  if sent is not None:
    result["sent_fraction"] = sent
  result.update(_stats(opt_state))
  summary_path = os.path.join(out_dir, "summary.md")
  if (main_proc and not math.isfinite(result["train_loss"])
      and os.path.exists(summary_path)):
    print(f"note: {metrics_path} records no train loss at step {stop}: "
          f"{summary_path} and result.json are left as they were")
  elif main_proc:
    table = summary_table([result])
    atomic_write(summary_path, table + "\n")
    with open(os.path.join(out_dir, "result.json"), "w") as f:
      json.dump(result, f, indent=1)
    if cfg.plot and history:
      plot_curves({f"{canon}": history}, os.path.join(out_dir,
                                                      "curves.png"))
  result["params"] = params
  result["opt_state"] = opt_state
  result["layout"] = dp.layout
  result["history"] = history
  return result


def os_error_text(e: OSError) -> str:
  """One line for an ``OSError`` that ends a run: what happened, to which
  file, and what to do (complete checkpoints are never lost by it)."""
  where = e.filename or "?"
  if e.errno == errno.ENOSPC:
    return (f"no space left on the device while writing {where}; free "
            "space, then run again with --resume (the complete "
            "checkpoints already written are kept)")
  if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
    return (f"cannot write {where} ({e.strerror}); give an --out-dir this "
            "process can write to")
  if e.errno in (errno.ENOTDIR, errno.EEXIST):
    return (f"{where} is not a directory ({e.strerror}); --out-dir must "
            "name a directory (or a path that does not exist yet)")
  return f"{e.strerror or e} ({where})"


def read_history(path: str) -> list[dict[str, Any]]:
  """The records of a ``metrics.jsonl``, without a torn last line.

  A kill or a full disk can leave the last line half written: it is
  dropped, and said so. A damaged line before the last is not what a kill
  leaves, so it is refused by file and line number.

  Raises:
    ValueError: naming the file and the line that does not parse.
  """
  with open(path) as f:
    lines = f.read().split("\n")
  records = []
  numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
  for k, (lineno, line) in enumerate(numbered):
    try:
      records.append(json.loads(line))
    except ValueError as e:
      if k == len(numbered) - 1:
        print(f"{path}: dropped a torn last line ({lineno}: "
              f"{line[:40]!r}...), as a stopped run leaves it")
        break
      raise ValueError(f"{path}: line {lineno} is not a JSON record "
                       f"({e}); restore the file or resume into a new "
                       "--out-dir") from None
  return records


def _previous_result(out_dir: str, step: int) -> dict[str, Any]:
  """``result.json`` of an earlier run in ``out_dir`` that ended at ``step``."""
  try:
    with open(os.path.join(out_dir, "result.json")) as f:
      before = json.load(f)
  except (OSError, ValueError):
    return {}
  if not isinstance(before, dict) or before.get("steps") != step:
    return {}
  return before


def _recut_state(host_state, dp, fresh, comp, local_tx, params, data_axis,
                 old_n, old_model, new_model, main_proc):
  """A checkpoint's state written on other model-axis sizes (another
  --mesh fsdp=...), re-cut for this run's blocks at the checkpoint's
  number of slices (:func:`jaxcomm.parallel.reshard_state`)."""
  from jaxcomm import _compressor
  from jaxcomm import _states
  template = jax.device_get(fresh)
  # The compressor whose CompressState the state holds (at most one here):
  # the local method's compressor on its pseudo-gradient, or --compressor.
  held = (getattr(_compressor.spec_of(local_tx), "compressor", None)
          if local_tx is not None else comp)
  comps = [held] if held is not None and _states.compress_states(
    template) else []
  if old_n != dp.mesh.shape[data_axis]:
    template = parallel.resize_state(template, dp.layout, old_n,
                                     axis_name=data_axis,
                                     model_axes=new_model,
                                     data_size=dp.mesh.shape[data_axis])
  try:
    state, restarted = parallel.reshard_state(
      host_state, dp.layout, template, dp.layout, params=params,
      specs=dp.param_specs, axis_name=data_axis, data_size=old_n,
      old_axes=old_model, new_axes=new_model, compressors=comps)
  except ValueError as e:
    raise CheckpointError(
      f"cannot move the checkpoint's state from the model axes "
      f"{old_model} to {new_model}: {e}") from None
  if main_proc:
    print(f"resumed a checkpoint of model axes {old_model} on {new_model} "
          "(each device's state re-cut for its new blocks: residuals, "
          "moments and server errors kept element by element"
          + (f"; restarted as at init: {', '.join(restarted)}"
             if restarted else "") + ")")
  return state


def _check_mesh_resume(meta, mesh_shape, path) -> tuple:
  """``(data-axis size, {model axis: size})`` of the checkpoint under
  ``--mesh`` (``(None, {})`` without); :class:`CheckpointError` naming
  what cannot move: a mesh run resumed without one or the reverse, another
  data axis, or other model axes. The number of slices (the data axis's
  size) and the model axes' sizes may change (the state is re-cut for the
  new blocks)."""
  saved = meta.get("config", {}).get("mesh")
  if saved is None and mesh_shape is None:
    return None, {}
  if saved is None or mesh_shape is None:
    now = (None if mesh_shape is None
           else ",".join(f"{k}={v}" for k, v in mesh_shape.items()))
    raise CheckpointError(
      f"{path}: the checkpoint was written with --mesh {saved}, this run "
      f"has --mesh {now}: resume with the checkpoint's --mesh")
  old = parse_mesh(saved)
  (d_old, n_old), (d_new, _) = (next(iter(old.items())),
                                next(iter(mesh_shape.items())))
  model_old = {k: v for k, v in old.items() if k != d_old}
  model_new = {k: v for k, v in mesh_shape.items() if k != d_new}
  if d_old != d_new or list(model_old) != list(model_new):
    raise CheckpointError(
      f"{path}: the checkpoint's --mesh is {saved}; this run may change "
      f"the sizes of its data axis {d_old!r} (the number of slices) and "
      f"of its model axes, but must keep their names and order "
      f"({d_old}, {', '.join(model_old)})")
  return n_old, model_old


def _place_state(host_state, layout, mesh, data_axes=AXIS):
  from jax.sharding import NamedSharding
  specs = parallel.state_specs(layout, data_axes)
  return jax.tree.map(
    lambda x, sp: parallel._global(x, NamedSharding(mesh, sp)), host_state,
    specs, is_leaf=lambda x: isinstance(x, P))


# ------------------------------------------------------------ reporting --

def _ratio_text(r: dict[str, Any]) -> str:
  """The compression ratio, or why there is none (one device: nothing
  crosses the wire, compressed or not)."""
  if not r["dense_bytes_per_step"]:
    return "- (one device: no traffic)"
  return f"{r['compression_ratio']:,.1f}x"


def summary_table(results: list[dict[str, Any]]) -> str:
  """A markdown table: final figures next to wire bytes/step vs dense."""
  rows = ["| model | compressor | args | devices | steps | train loss | "
          "eval loss | eval acc | bytes/step/device | dense bytes/step | "
          "ratio | steps/s |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    args = ",".join(f"{k}={v}" for k, v in r["compressor_args"].items())
    rows.append(
      f"| {r['model']} | {r['compressor']} | {args or '-'} | "
      f"{r['num_devices']} | {r['steps']} | {r['train_loss']:.4f} | "
      f"{r['eval_loss']:.4f} | {r['eval_accuracy']:.4f} | "
      f"{r['bytes_per_step']:,.0f} | {r['dense_bytes_per_step']:,.0f} | "
      f"{_ratio_text(r)} | {r['steps_per_s']:.1f} |")
  return "\n".join(rows)


def plot_curves(histories: dict[str, list[dict]], path: str,
                title: str | None = None) -> None:
  """Loss against step and against bytes sent per device (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for label, hist in histories.items():
    steps = [h["step"] for h in hist]
    loss = [h["loss"] for h in hist]
    mb = [h["bytes_total"] / 2**20 for h in hist]
    a.plot(steps, loss, label=label, lw=1)
    b.plot(mb, loss, label=label, lw=1)
  a.set_xlabel("step")
  b.set_xlabel("MiB sent per device (cumulative)")
  b.set_xscale("log")
  for ax in (a, b):
    ax.set_ylabel("train loss")
    ax.grid(alpha=0.3)
  a.legend(fontsize=7)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summary_line(r: dict[str, Any]) -> str:
  """The run's last printed line: figures and what crossed the wire (on one
  device nothing does, so there is no ratio to give)."""
  if r["dense_bytes_per_step"]:
    where = (f" between {r['slices']} slices" if r.get("slices", 1) > 1
             else "")
    wire = (f"{_fmt_bytes(r['bytes_per_step'])} sent per device per step"
            f"{where} vs "
            f"{_fmt_bytes(r['dense_bytes_per_step'])} dense "
            f"({r['compression_ratio']:.1f}x less)")
  else:
    wire = "one device: nothing crosses the wire"
  if r.get("sent_fraction") is not None:
    wire += (f"; a device sent on {100 * r['sent_fraction']:.1f}% of "
             "steps")
  return (f"{r['model']} on {r['dataset']}, {r['num_devices']} devices, "
          f"{r['steps']} steps in {r['train_time_s']:.0f}s "
          f"({r['wall_time_s']:.0f}s with set-up): held-out loss "
          f"{r['eval_loss']:.4f}, accuracy {r['eval_accuracy']:.4f}; "
          f"{wire}. Outputs: {r['out_dir']}")

