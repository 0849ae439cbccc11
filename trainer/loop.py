"""The training loop of ``train.py``: :func:`run` trains as a
:class:`~trainer.config.Config` says, evaluates, logs ``metrics.jsonl``,
checkpoints, and reports.

:func:`run` is a sequence of phases: the set-up (:func:`_set_up`: the
config checked, the out dir, data, model, optimizer and mesh), the pricing
of the exchange (:func:`trainer.accounting.wire_bytes`), a resume
(:func:`trainer.resume.restore`), the step loop (:func:`_train_steps`) and
the final evaluation and reports (:func:`_finish`). The reports
(:func:`summary_table`, :func:`summary_line`, :func:`plot_curves`) are in
:mod:`trainer.reporting`, resuming in :mod:`trainer.resume`, the byte
accounting in :mod:`trainer.accounting`; their public names are importable
from here as well.
"""

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
from models import data as mdata
from trainer import progress
from trainer.accounting import WireBytes
from trainer.accounting import _fmt_bytes
from trainer.accounting import _scalar
from trainer.accounting import _stats
from trainer.accounting import lag_sent_fraction
from trainer.accounting import wire_bytes
from trainer.checkpoints import Checkpoints
from trainer.checkpoints import resume_path
from trainer.config import AXIS
from trainer.config import COMM_OPTIMIZERS
from trainer.config import FAST
from trainer.config import GOSSIP_METHODS
from trainer.config import HIERARCHICAL_LOCAL
from trainer.config import SLOW
from trainer.config import Config
from trainer.config import build_compressor
from trainer.config import make_comm_optimizer
from trainer.config import make_delay
from trainer.config import make_local_optimizer
from trainer.config import make_optimizer
from trainer.config import make_schedule
from trainer.config import parse_kwargs
from trainer.config import parse_mesh
from trainer.config import resolve_compressor
from trainer.model import build_model
from trainer.model import load_data
from trainer.reporting import plot_curves  # noqa: F401
from trainer.reporting import summary_line  # noqa: F401
from trainer.reporting import summary_table  # noqa: F401
from trainer.reporting import write_outputs
from trainer.resume import _previous_result
from trainer.resume import open_metrics
from trainer.resume import read_history  # noqa: F401
from trainer.resume import restore


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


def default_out_dir(cfg: Config) -> str:
  return os.path.join("runs", f"{cfg.model}-{cfg.compressor}-"
                      f"n{cfg.num_devices}-{time.strftime('%Y%m%d-%H%M%S')}")


def _validate(cfg: Config) -> dict[str, int] | None:
  """Refuses a config whose flags do not fit together (a ``ValueError``
  naming them); returns ``--mesh`` as ``{axis: size}``, or None."""
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
  hier = cfg.local in HIERARCHICAL_LOCAL
  if pod and ((cfg.local != "none" and not hier)
              or cfg.optimizer in COMM_OPTIMIZERS):
    raise ValueError(
      f"--slices {cfg.slices} runs the pod recipe (a dense mean inside each "
      "slice, --compressor between slices); it does not combine with "
      f"--local {cfg.local} or --optimizer {cfg.optimizer}")
  if hier and not pod:
    raise ValueError(
      f"--local {cfg.local} averages within groups of devices and across "
      "them: give --slices S (S > 1 dividing --num-devices; the groups are "
      "the slices, e.g. --slices 2)")
  if hier and cfg.sharded_exchange:
    raise ValueError(f"--local {cfg.local} runs its own exchange between "
                     "slices: it does not combine with --sharded-exchange")
  if cfg.optimizer_args and cfg.optimizer not in COMM_OPTIMIZERS:
    raise ValueError(
      f"--optimizer-args {cfg.optimizer_args!r}: --optimizer "
      f"{cfg.optimizer} takes none (they are for "
      f"{', '.join(COMM_OPTIMIZERS)}; its rate is --lr, --momentum, "
      "--weight-decay)")
  if cfg.local_args and cfg.local == "none":
    raise ValueError(f"--local-args {cfg.local_args!r} without --local: "
                     "name the local-update method they are for")
  if cfg.delay_args and cfg.delay == "none":
    raise ValueError(f"--delay-args {cfg.delay_args!r} without --delay: "
                     "name the delay method they are for")
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
  return mesh_shape


def _build_optimizer(cfg: Config, canon: str, params, data_axis: str,
                     pod: bool):
  """``(comp, tx, local_tx, comp_kwargs, schedule)``: the exchange (the
  compressor, the local-update method or the communicating optimizer), the
  step's whole optimizer, the local-update optimizer (or None) and the
  compressor's arguments."""
  comp, _, comp_kwargs = build_compressor(
    canon, cfg.compressor_args, axis_name=data_axis)
  if cfg.delay != "none":
    if cfg.optimizer in COMM_OPTIMIZERS or cfg.sharded_exchange:
      raise ValueError(
        f"--delay {cfg.delay} wraps --compressor; it does not combine with "
        + ("--optimizer " + cfg.optimizer if cfg.optimizer in
           COMM_OPTIMIZERS else "--sharded-exchange"))
    comp = make_delay(cfg, comp)
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
      None if canon == "dense" else comp, schedule,
      axis_name=(SLOW, FAST) if pod else data_axis)
    comp = tx = local_tx
  elif cfg.optimizer in COMM_OPTIMIZERS:
    if canon != "dense":
      raise ValueError(
        f"--optimizer {cfg.optimizer} exchanges its own 1-bit momentum: use "
        f"--compressor dense (got {canon!r})")
    # The optimizer is the exchange: its wire is what a step moves.
    comp = tx = make_comm_optimizer(cfg, schedule, axis_name=data_axis)
    if jaxcomm.local_states(jax.eval_shape(tx.init, params)):
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
  return comp, tx, local_tx, comp_kwargs, schedule


def _build_step(cfg: Config, mesh_shape, pod: bool, devices, loss_fn, tx,
                params, data_axis: str):
  """``(mesh, data_axes, auto, dp, init_params)``: the run's mesh, its data
  axes and model axes (left to the compiler; ``()`` without ``--mesh``),
  the ``DataParallel`` step, and the params to initialize it with (placed
  by the model's logical axes under ``--mesh``)."""
  init_params, auto = params, ()
  if mesh_shape is not None:
    # A sharded model: manual over the data axis only, the model axes
    # left to the compiler, params split by the model's logical axes.
    mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape),
                         devices=devices[:cfg.num_devices],
                         axis_types=(jax.sharding.AxisType.Auto,)
                         * len(mesh_shape))
    data_axes = data_axis
    auto = tuple(mesh_shape)[1:]
    specs = models.PARTITION_SPECS[cfg.model](params, mesh.axis_names)
    init_params = jax.tree.map(
      lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), params,
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
  return mesh, data_axes, auto, dp, init_params


@dataclasses.dataclass
class _Setup:
  """What :func:`_set_up` builds for a run."""
  canon: str
  mesh_shape: dict[str, int] | None
  pod: bool
  main_proc: bool
  out_dir: str
  ckpts: Checkpoints
  resume_at: str | None
  train: Any
  test: Any
  dataset: str
  fn: Any
  loss_fn: Any
  data_axis: str
  comp: Any
  tx: Any
  local_tx: Any
  comp_kwargs: dict[str, Any]
  schedule: Any
  mesh: Any
  data_axes: Any
  auto: tuple
  dp: Any
  init_params: Any


def _set_up(cfg: Config, devices) -> _Setup:
  """Checks ``cfg`` (filling in the canonical compressor, the out dir and
  the dataset), clears or keeps the out dir's checkpoints, and builds the
  data, model, optimizer, mesh and step."""
  if cfg.resume_from is not None:
    cfg.resume = True
  canon = resolve_compressor(cfg.compressor)
  cfg.compressor = canon
  mesh_shape = _validate(cfg)
  pod = cfg.slices > 1
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
  comp, tx, local_tx, comp_kwargs, schedule = _build_optimizer(
    cfg, canon, fn.params, data_axis, pod)
  mesh, data_axes, auto, dp, init_params = _build_step(
    cfg, mesh_shape, pod, devices, loss_fn, tx, fn.params, data_axis)
  return _Setup(canon, mesh_shape, pod, main_proc, out_dir, ckpts, resume_at,
                train, test, dataset, fn, loss_fn, data_axis, comp, tx,
                local_tx, comp_kwargs, schedule, mesh, data_axes, auto, dp,
                init_params)


def _stop_step(cfg: Config, start: int, main_proc: bool) -> int:
  """The step this run stops at (``start`` for a resumed run with nothing
  left to train, which says so)."""
  stop = min(cfg.stop_after if cfg.stop_after is not None else cfg.steps,
             cfg.steps)
  if start >= stop:  # a resumed run with nothing left to train
    if main_proc:
      why = (f"run already complete at step {start}" if start >= cfg.steps
             else f"checkpoint at step {start}, --stop-after "
             f"{cfg.stop_after}")
      print(f"{why}: nothing to train; evaluating the restored parameters")
    stop = start
  return stop


def _train_steps(cfg: Config, s: _Setup, params, opt_state, *, start: int,
                 stop: int, wb: WireBytes, eval_fn, history: list, log,
                 meta_cfg: dict[str, Any], t_start: float):
  """Steps ``start .. stop - 1``: logs every ``--log-every`` steps (to
  ``log`` and ``history``), evaluates every ``--eval-every``, checkpoints
  every ``--checkpoint-every`` and at ``stop``; closes the checkpoints, the
  progress report and ``log`` however it ends.

  Returns:
    ``(params, opt_state, last, cum_bytes, train_time)``: the last record
    logged (``{}`` if none), the bytes moved by steps ``0 .. stop - 1``,
    and the seconds the loop took.

  Raises:
    FloatingPointError: the logged loss is not finite.
  """
  dp, n = s.dp, cfg.num_devices
  it = mdata.batches(s.train, cfg.batch_size, seed=cfg.seed, num_shards=n,
                     start_step=start)
  nproc, pid = jax.process_count(), jax.process_index()
  bar = None
  if cfg.progress and s.main_proc and stop > start:
    # A bar on a terminal, a plain line every few steps in a log file.
    bar = progress.Progress(stop, start, f"{s.canon} n={n}", sys.stderr)
  cum_bytes = wb.before(start, history)
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
      moved = wb.step(step, opt_state)
      cum_bytes += moved
      steps_since += 1
      if done % cfg.log_every == 0 or done == stop:
        now = time.time()
        rate = steps_since / max(now - t_last, 1e-9)
        t_last, steps_since = now, 0
        last = {"step": done, "loss": _scalar(m["loss"]),
                "accuracy": _scalar(m["aux"]["accuracy"]),
                "lr": float(s.schedule(step)),
                "bytes_per_step": moved, "bytes_total": cum_bytes,
                "steps_per_s": rate, "time": now - t_start}
        last.update(_stats(opt_state))
        if cfg.local in GOSSIP_METHODS:
          last["consensus_distance"] = _scalar(
            parallel.consensus_distance(params))
        if cfg.eval_every and done % cfg.eval_every == 0 and done != stop:
          last.update(evaluate(eval_fn, dp.synchronized(params), s.test, cfg,
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
        s.ckpts.save(done, params, opt_state, dp.layout, meta_base)
  finally:
    s.ckpts.close()
    if bar is not None:
      bar.close()
    if log is not None:
      log.close()
  return params, opt_state, last, cum_bytes, time.time() - t_loop


def _finish(cfg: Config, s: _Setup, params, opt_state, *, start: int,
            stop: int, last: dict[str, Any], history: list, cum_bytes: float,
            train_time: float, wb: WireBytes, eval_fn, num_params: int,
            metrics_path: str, t_start: float) -> dict[str, Any]:
  """The final evaluation and figures; writes the run's reports."""
  dp, canon, n = s.dp, s.canon, cfg.num_devices
  steps_run = stop - start
  # Nothing trained (a finished run resumed): the train figures are the last
  # ones recorded, and the speed is the one the run reported when it ran.
  before = {}
  if not last:
    last = next((h for h in reversed(history) if "loss" in h), {})
    before = _previous_result(s.out_dir, stop) if s.main_proc else {}

  final = evaluate(eval_fn, dp.synchronized(params), s.test, cfg, dp)
  per_step = wb.per_step
  if wb.bytes_at is None:  # adacomm, LAG: the average of what steps moved
    per_step = cum_bytes / max(stop, 1)
  dense_rep = wb.dense_rep
  result = {
    "model": cfg.model, "dataset": s.dataset,
    "compressor": (cfg.local + ("" if canon == "dense" else f"+{canon}")
                   if cfg.local != "none"
                   else cfg.optimizer if cfg.optimizer in COMM_OPTIMIZERS
                   else canon),
    "compressor_args": (parse_kwargs(cfg.optimizer_args)
                        if cfg.optimizer in COMM_OPTIMIZERS
                        else s.comp_kwargs),
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
    "out_dir": s.out_dir,
  }
  sent = lag_sent_fraction(opt_state)
  if sent is not None:
    result["sent_fraction"] = sent
  result.update(_stats(opt_state))
  if s.main_proc:
    write_outputs(result, history, out_dir=s.out_dir,
                  metrics_path=metrics_path, label=f"{canon}", plot=cfg.plot)
  result["params"] = params
  result["opt_state"] = opt_state
  result["layout"] = dp.layout
  result["history"] = history
  return result


def run(cfg: Config, *, devices=None) -> dict[str, Any]:
  """Trains as ``cfg`` says; returns the final figures (see ``summary``).

  Uses the first ``cfg.num_devices`` of ``devices`` (default
  ``jax.devices()``): this function never changes the device count, so it
  can run in a process whose JAX backend is already up.
  """
  t_start = time.time()
  cfg = dataclasses.replace(cfg)
  s = _set_up(cfg, devices)
  params, opt_state = s.dp.init(s.init_params)
  wb = wire_bytes(cfg, s.comp, s.local_tx, s.fn.params, s.dp, s.mesh,
                  s.mesh_shape, s.data_axis, s.pod)
  num_params = sum(int(np.size(x)) for x in jax.tree.leaves(s.fn.params))

  meta_cfg = {k: v for k, v in dataclasses.asdict(cfg).items()}
  start = 0
  if cfg.resume:
    params, opt_state, start = restore(
      s.ckpts, s.resume_at, cfg, s.dp, params, opt_state, comp=s.comp,
      local_tx=s.local_tx, host_params=s.fn.params, mesh=s.mesh,
      mesh_shape=s.mesh_shape, auto=s.auto, data_axis=s.data_axis,
      data_axes=s.data_axes, main_proc=s.main_proc)
  metrics_path, history, log = open_metrics(cfg, s.out_dir, meta_cfg, start,
                                            s.main_proc)
  stop = _stop_step(cfg, start, s.main_proc)
  eval_fn = (_make_eval(s.loss_fn, s.mesh, s.data_axes) if not s.auto
             else _make_whole_eval(s.loss_fn))
  params, opt_state, last, cum_bytes, train_time = _train_steps(
    cfg, s, params, opt_state, start=start, stop=stop, wb=wb,
    eval_fn=eval_fn, history=history, log=log, meta_cfg=meta_cfg,
    t_start=t_start)
  return _finish(cfg, s, params, opt_state, start=start, stop=stop,
                 last=last, history=history, cum_bytes=cum_bytes,
                 train_time=train_time, wb=wb, eval_fn=eval_fn,
                 num_params=num_params, metrics_path=metrics_path,
                 t_start=t_start)


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
