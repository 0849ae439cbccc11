"""Resuming a training run: its checkpoint restored onto this run's devices
and mesh, and its ``metrics.jsonl`` cut back to the step it resumes at.

A checkpoint written on another number of devices (or slices) is resized
(:func:`jaxcomm.parallel.resize_state`); one written on other model-axis
sizes (another ``--mesh fsdp=...``) is re-cut for the new blocks
(:func:`jaxcomm.parallel.reshard_state`). What cannot move is refused with a
:class:`~trainer.checkpoints.CheckpointError` naming it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxcomm import parallel
from jaxcomm.parallel._resize import check_like
from trainer.checkpoints import MOVABLE as _MOVABLE
from trainer.checkpoints import CheckpointError
from trainer.checkpoints import Checkpoints
from trainer.checkpoints import atomic_write
from trainer.checkpoints import check_compatible
from trainer.config import AXIS
from trainer.config import Config
from trainer.config import parse_mesh


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
  except (ValueError, IndexError) as e:
    raise CheckpointError(
      f"cannot move the checkpoint's state from the model axes "
      f"{old_model} to {new_model}: {e}; {_MOVABLE}") from None
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


def restore(ckpts: Checkpoints, path: str, cfg: Config, dp, params,
            opt_state, *, comp, local_tx, host_params, mesh, mesh_shape,
            auto, data_axis, data_axes, main_proc: bool
            ) -> tuple[Any, Any, int]:
  """``(params, opt_state, step)`` of the checkpoint at ``path``, placed on
  this run's devices; the checkpoints after it are set aside.

  Args:
    ckpts: the run's checkpoints.
    path: the checkpoint to resume from.
    cfg: the run's config.
    dp: the run's ``DataParallel``.
    params: the run's freshly initialized params (the structure to fit).
    opt_state: its freshly initialized optimizer state.
    comp: the run's compressor.
    local_tx: its local-update optimizer, or None.
    host_params: the model's host params (before placement).
    mesh: the run's mesh.
    mesh_shape: ``--mesh`` as ``{axis: size}``, or None.
    auto: the mesh's model axes (left to the compiler).
    data_axis: the axis the exchange runs over.
    data_axes: the step's data axes.
    main_proc: whether this is process 0 (the one that prints).

  Raises:
    CheckpointError: the checkpoint is corrupt or does not fit this run.
  """
  n = cfg.num_devices
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
                              host_params, data_axis, old_n, old_model,
                              new_model, main_proc)
  if old_n != new_n:
    what = "slices" if mesh_shape is not None else "devices"
    try:
      host_state = parallel.resize_state(host_state, dp.layout, new_n,
                                         **resize)
    except ValueError as e:
      raise CheckpointError(
        f"{path}: cannot move the checkpoint's state from {old_n} to "
        f"{new_n} {what}: {e}; {_MOVABLE}") from None
    if main_proc:
      print(f"resumed a checkpoint of {old_n} {what} on {new_n} "
            "(per-device state averaged or copied: what it owes the "
            "averaged update is kept)")
  try:
    # Before anything is placed: every leaf as this run's step built it.
    check_like(host_state, opt_state, "the moved state")
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}; {_MOVABLE}") from None
  saved_params = jax.tree.unflatten(treedef_p, p_leaves)
  if dp.per_device_params and old_n != new_n:
    saved_params = parallel.resize_params(saved_params, new_n)
  params = dp.place_params(saved_params)
  opt_state = _place_state(host_state, dp.layout, mesh, data_axes)
  if main_proc:
    print(f"resumed from {path} at step {start}")
  moved = ckpts.set_aside_after(start)
  if main_proc and moved:
    print(f"moved the checkpoints after step {start} aside (kept, no "
          f"longer the latest): {', '.join(moved)}")
  return params, opt_state, start


def open_metrics(cfg: Config, out_dir: str, meta_cfg: dict[str, Any],
                 start: int, main_proc: bool):
  """``(metrics_path, history, log)``: writes ``config.json``; on a resumed
  run, the records of ``metrics.jsonl`` up to ``start`` (the file cut back
  to them), else none (the file removed); ``log``, the file opened for
  appending (None off process 0)."""
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
  return metrics_path, history, log
