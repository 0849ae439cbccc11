"""Checkpoints of a training run: orbax's ``CheckpointManager`` plus digests.

The manager (``orbax.checkpoint.CheckpointManager``) owns the step
directories under ``<out_dir>/checkpoints``: it writes each step to a
temporary directory and renames it when complete (so the last good
checkpoint is never overwritten), keeps the newest ``--keep-checkpoints``
of them and names the latest. A step directory holds two items written
together: ``arrays`` (params and the whole optimizer state as host arrays,
and the step) and ``meta/meta.json`` (leaf paths, shapes, dtypes, a SHA-256
digest per array, the config, the device count). What this module adds on
top: every read checks the digests, a corrupt step is refused with the
older steps that still read cleanly named, and a run resumed from an older
step sets the newer ones aside (``checkpoints/abandoned/``, never deleted)
so that the manager's latest step is again the newest one saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import warnings

import jax
import numpy as np

from trainer.config import Config

_log = logging.getLogger(__name__)

# What meta.json's "format" says; 1 was the layout before the
# CheckpointManager (meta.json beside the arrays, a LATEST file).
FORMAT = 2
ARRAYS, META = "arrays", "meta"  # the items of a step
META_FILE = "meta.json"
ABANDONED = "abandoned"  # steps newer than a resumed one, set aside


class CheckpointError(ValueError):
  """A checkpoint is missing, corrupt, or does not fit the current run."""


def _keystrs(tree) -> list[str]:
  return [jax.tree_util.keystr(k)
          for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _digest(x: np.ndarray) -> str:
  x = np.ascontiguousarray(x)
  h = hashlib.sha256(str((x.shape, x.dtype.str)).encode())
  h.update(x.tobytes())
  return h.hexdigest()[:16]


def _host(tree):
  """Full host copies of (possibly multi-process) global arrays."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    return jax.tree.map(
      lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
      tree)
  return jax.tree.map(np.asarray, jax.device_get(tree))


def atomic_write(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` whole or not at all (a temporary file,
  synced, then renamed over it)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


class _DrainingEventLoop(asyncio.SelectorEventLoop):
  """An event loop that lets its unfinished tasks end before it closes.

  A failed restore raises its first read error; the other reads that
  failed beside it, already finished when the loop closes and so not among
  the tasks drained, would each log "Task exception was never retrieved"
  with a traceback when collected (at interpreter exit, say). They are
  logged at debug level instead: the restore's error already says what
  went wrong.
  """

  def call_exception_handler(self, context):
    if (context.get("message") == "Task exception was never retrieved"
        and isinstance(context.get("exception"), Exception)):
      _log.debug("a checkpoint read that failed beside the one reported: %r",
                 context["exception"])
      return
    super().call_exception_handler(context)

  def close(self):
    if not self.is_closed() and not self.is_running():
      pending = [t for t in asyncio.all_tasks(self) if not t.done()]
      if pending:
        self.run_until_complete(
          asyncio.gather(*pending, return_exceptions=True))
    super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):

  def new_event_loop(self):
    return _DrainingEventLoop()


@contextlib.contextmanager
def _drained_event_loops():
  """Event loops made inside finish their pending tasks before closing.

  orbax runs a restore in a fresh event loop and closes it as soon as the
  first array read fails, while tensorstore still completes the other reads
  and then calls back into the closed loop: "RuntimeError: Event loop is
  closed" tracebacks on stderr, typically at interpreter exit. Letting the
  loop finish those reads first (their errors are collected, not raised)
  ends them cleanly.
  """
  with warnings.catch_warnings():  # the policy API is deprecated in 3.14
    warnings.simplefilter("ignore", DeprecationWarning)
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy())
  try:
    yield
  finally:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      asyncio.set_event_loop_policy(old)


def _name_format():
  """Step directory names: ``step_<N>``, ``N`` in eight digits."""
  import orbax.checkpoint as ocp
  return ocp.path.step.standard_name_format(step_prefix="step",
                                            step_format_fixed_length=8)


def _registry():
  """The handlers of a step's two items: arrays and meta.json."""
  import orbax.checkpoint as ocp
  reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
    reg.add(META, args, ocp.JsonCheckpointHandler(filename=META_FILE))
  for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
    reg.add(ARRAYS, args, ocp.StandardCheckpointHandler)
  return reg


def _sync(name: str) -> None:
  """A barrier across the processes of a multi-process job."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


class Checkpoints:
  """The step directories under ``<out_dir>/checkpoints``.

  ``save`` hands a step to the ``CheckpointManager`` (rotation: the newest
  ``keep`` steps stay); ``latest``, ``steps`` and ``step_dirs`` are the
  manager's view of what is on disk; ``read`` reads any step directory
  (also one outside this run's, for ``--resume-from``) and checks it
  against its digests.

  Args:
    out_dir: the run's output directory.
    keep: how many of the newest steps the manager keeps.
    writer: whether this object belongs to the training job that writes
      here; only the writer removes the temporary directories a killed
      save left behind (a reader must not, they may be in progress).
  """

  def __init__(self, out_dir: str, keep: int = 2, *, writer: bool = False):
    self.root = os.path.join(out_dir, "checkpoints")
    self.keep = max(int(keep), 1)
    self.writer = writer
    self._manager = None
    self._reader = None

  @property
  def manager(self):
    """The ``orbax.checkpoint.CheckpointManager`` over :attr:`root`."""
    if self._manager is None:
      import orbax.checkpoint as ocp
      if self.writer:
        os.makedirs(self.root, exist_ok=True)
      self._manager = ocp.CheckpointManager(
        os.path.abspath(self.root),
        options=ocp.CheckpointManagerOptions(
          step_name_format=_name_format(),
          preservation_policy=ocp.checkpoint_managers.LatestN(self.keep),
          enable_async_checkpointing=False, create=False,
          cleanup_tmp_directories=self.writer,
          # A reader lists steps without reading their metadata, which a
          # writer's rotation may be deleting.
          lightweight_initialize=not self.writer),
        handler_registry=_registry())
    return self._manager

  @property
  def reader(self):
    """An orbax ``Checkpointer`` for one step directory anywhere."""
    if self._reader is None:
      import orbax.checkpoint as ocp
      self._reader = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(handler_registry=_registry()))
    return self._reader

  def _listed(self):
    """The manager, its list of steps read from disk now."""
    if self._manager is None:
      return self.manager  # a new one has just read them
    self._manager.reload()
    return self._manager

  def close(self) -> None:
    """Lets the manager finish (it deletes rotated-out steps) and closes."""
    if self._manager is not None:
      self._manager.close()
      self._manager = None

  def path_of(self, step: int) -> str:
    """The directory of ``step`` under :attr:`root`."""
    return os.path.join(self.root, _name_format().build_name(step))

  def steps(self) -> list[int]:
    """The complete steps on disk, newest first (as the manager reads
    them now)."""
    if not os.path.isdir(self.root):
      return []
    return sorted(self._listed().all_steps(), reverse=True)

  def step_dirs(self) -> list[str]:
    """Every step directory, newest (highest step) first."""
    return [self.path_of(s) for s in self.steps()]

  def latest_step(self) -> int | None:
    """The manager's latest step, or None when there is none."""
    if not os.path.isdir(self.root):
      return None
    return self._listed().latest_step()

  def latest(self) -> str | None:
    """The directory of the latest step, or None when there is none."""
    step = self.latest_step()
    return None if step is None else self.path_of(step)

  def resolve(self, path: str) -> str:
    """The checkpoint directory ``--resume-from path`` names.

    ``path`` is a directory (absolute, or relative to the working directory)
    or the name of one under ``<out_dir>/checkpoints``.
    """
    for p in (path, os.path.join(self.root, path)):
      if (os.path.isfile(os.path.join(p, META, META_FILE))
          or os.path.isfile(os.path.join(p, META_FILE))):  # format 1
        return p
    have = self.step_dirs()
    raise CheckpointError(
      f"--resume-from {path}: not a checkpoint directory (absolute, relative "
      f"to here, or under {self.root}); expected a step_<N> directory "
      f"holding {META}/{META_FILE}"
      + (f", e.g. {', '.join(have)}" if have else ""))

  def fallback_hint(self, bad: str | None) -> str:
    """Names the checkpoints other than ``bad`` that read cleanly.

    Each is read and checked against its digests (as ``read`` does), so a
    suggestion is never another corrupt checkpoint.
    """
    good = []
    for path in self.step_dirs():
      if bad is not None and os.path.realpath(path) == os.path.realpath(bad):
        continue
      try:
        good.append((self.read(path)[3], path))
      except (CheckpointError, OSError):
        continue
    if not good:
      return (f"\nno other checkpoint under {self.root} reads cleanly: "
              "pass --overwrite to start afresh")
    step, path = good[0]
    listed = ", ".join(f"{p} (step {s})" for s, p in good)
    return (f"\ncheckpoints that read cleanly: {listed}\npass --resume-from "
            f"{path} to resume from the older checkpoint at step {step} "
            f"(the newer ones are then moved to {ABANDONED}/ and the next "
            "checkpoint saved is the latest)")

  def set_aside_after(self, step: int) -> list[str]:
    """Moves the steps newer than ``step`` to ``checkpoints/abandoned/``.

    A run resumed from an older step writes its own steps after it; the
    newer ones on disk (a corrupt latest one, or a branch not taken) would
    otherwise stay the manager's latest. They are moved, not deleted, and
    out of the manager's sight: rotation never removes them. Every process
    of a job calls this (process 0 moves; the others wait for it).

    Returns:
      The directories the steps were moved to (on process 0).
    """
    moved = []
    if jax.process_index() == 0:
      for s in self.steps():
        if s <= step:
          continue
        src = self.path_of(s)
        dst = os.path.join(self.root, ABANDONED, os.path.basename(src))
        k, base = 0, dst
        while os.path.exists(dst):
          k += 1
          dst = f"{base}.{k}"
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
        moved.append(dst)
    _sync("jaxcomm-train-set-aside")
    return moved

  def save(self, step: int, params, opt_state, layout, meta: dict) -> str:
    """Writes a checkpoint of ``(params, opt_state)`` at ``step``.

    Every process of a job calls this (the arrays are gathered to each
    host first); the manager then removes the steps beyond ``keep``.
    """
    import orbax.checkpoint as ocp
    host_params = _host(params)
    host_state = _host(opt_state)
    p_leaves = jax.tree.leaves(host_params)
    s_leaves = jax.tree.leaves(host_state)
    tree = {"params": {f"{i:04d}": x for i, x in enumerate(p_leaves)},
            "opt_state": {f"{i:04d}": x for i, x in enumerate(s_leaves)},
            "step": np.asarray(step, np.int64)}
    meta = dict(meta)
    meta.update(
      format=FORMAT, step=int(step),
      params=[[k_, list(x.shape), x.dtype.name, _digest(x)]
              for k_, x in zip(_keystrs(host_params), p_leaves)],
      opt_state=[[k_, list(x.shape), x.dtype.name, _digest(x),
                  _layout_json(b)]
                 for k_, x, b in zip(_keystrs(host_state), s_leaves,
                                     jax.tree.leaves(layout))])
    os.makedirs(self.root, exist_ok=True)
    mngr = self._listed()  # changed since? (set_aside_after, --overwrite)
    mngr.save(step, force=True, args=ocp.args.Composite(
      **{ARRAYS: ocp.args.StandardSave(tree),
         META: ocp.args.JsonSave(meta)}))
    mngr.wait_until_finished()
    return self.path_of(step)

  def read(self, path: str | None = None):
    """``(meta, params_leaves, state_leaves, step)`` as host arrays.

    ``path`` (default: the latest step) is read whole and every array
    checked against the shape, dtype and digest meta.json records.

    Raises:
      CheckpointError: naming what is missing, corrupt or unreadable.
    """
    import orbax.checkpoint as ocp
    path = path or self.latest()
    if path is None:
      raise CheckpointError(f"no checkpoint in {self.root}")
    meta_path = os.path.join(path, META, META_FILE)
    if (not os.path.exists(meta_path)
        and os.path.isfile(os.path.join(path, META_FILE))):
      raise CheckpointError(
        f"checkpoint {path} has the layout of an older train.py (format 1: "
        f"{META_FILE} beside the arrays, a LATEST file); this one reads the "
        f"CheckpointManager's step directories ({ARRAYS}/, "
        f"{META}/{META_FILE}): resume it with the train.py that wrote it")
    try:
      with open(meta_path) as f:
        meta = json.load(f)
      assert meta["format"] == FORMAT
      p_meta, s_meta = meta["params"], meta["opt_state"]
    except FileNotFoundError:
      raise CheckpointError(
        f"checkpoint {path} has no {META}/{META_FILE}") from None
    except (ValueError, KeyError, TypeError, AssertionError) as e:
      raise CheckpointError(
        f"checkpoint {path}: {META_FILE} is corrupt ({e!r})") from None
    try:
      with _drained_event_loops():
        tree = self.reader.restore(
          os.path.abspath(path),
          args=ocp.args.Composite(**{ARRAYS: ocp.args.StandardRestore()}))
      tree = tree[ARRAYS]
    except Exception as e:  # orbax/tensorstore raise many kinds
      raise CheckpointError(
        f"checkpoint {path} is corrupt or unreadable: "
        f"{type(e).__name__}: {str(e)[:300]}") from None
    try:
      p = [np.asarray(tree["params"][f"{i:04d}"]) for i in range(len(p_meta))]
      s = [np.asarray(tree["opt_state"][f"{i:04d}"])
           for i in range(len(s_meta))]
      step = int(np.asarray(tree["step"]))
    except (KeyError, TypeError) as e:
      raise CheckpointError(
        f"checkpoint {path}: arrays do not match {META_FILE} (missing {e})"
      ) from None
    for kind, leaves, metas in (("params", p, p_meta), ("opt_state", s,
                                                        s_meta)):
      for x, m in zip(leaves, metas):
        if list(x.shape) != m[1] or x.dtype.name != m[2] or _digest(x) != m[3]:
          raise CheckpointError(
            f"checkpoint {path} is corrupt: {kind} leaf {m[0]} does not "
            f"match its recorded shape/dtype/digest ({m[1]} {m[2]} "
            f"{m[3]}; read {list(x.shape)} {x.dtype.name} {_digest(x)})")
    if step != meta["step"]:
      raise CheckpointError(
        f"checkpoint {path} is corrupt: step {step} != meta step "
        f"{meta['step']}")
    return meta, p, s, step


def resume_path(ckpts: Checkpoints, cfg: Config) -> str:
  """The checkpoint a resumed run starts from (``--resume-from`` or the
  latest step)."""
  if cfg.resume_from is not None:
    return ckpts.resolve(cfg.resume_from)
  path = ckpts.latest()
  if path is None:
    raise CheckpointError(f"--resume: no checkpoint in {ckpts.root}")
  return path


def _layout_json(b):
  """A state layout leaf as meta.json holds it: False (replicated), True
  (one row per device) or the sorted data axes it varies over (--slices:
  a residual kept after the mean inside a slice varies over "dcn")."""
  return b if isinstance(b, bool) else sorted(b)


# What a resumed run may change and what it may not (one text for every
# refusal of a resume).
MOVABLE = (
  "must match the checkpoint: " + ", ".join(
    "--" + k.replace("_", "-") for k in Config.RESUME_KEYS)
  + ", the model's params and the optimizer state's per-device layout, "
  "and --mesh's axis names and order; may change: --num-devices (and "
  "--mesh's sizes) where the sizes divide one another and the state keeps "
  "its layout, --stop-after, --checkpoint-every, --keep-checkpoints, "
  "--eval-every, --eval-examples, --log-every, --progress, --plot")


def check_compatible(meta: dict, cfg: Config, params, state, layout,
                     path: str, *, per_device_params: bool = False,
                     model_axes: tuple = ()) -> None:
  """Raises :class:`CheckpointError` naming every mismatch (per-device
  params, of local-update runs, are compared without their device axis;
  with ``model_axes`` whose sizes changed, a state leaf laid out over one
  of them is a block's state and is compared by its layout only)."""
  problems = []
  saved_cfg = meta.get("config", {})
  for key in Config.RESUME_KEYS:
    now = getattr(cfg, key)
    if key in saved_cfg and saved_cfg[key] != now:
      problems.append(f"{key}: checkpoint has {saved_cfg[key]!r}, this run "
                      f"{now!r}")
  p_now = list(zip(_keystrs(params), [list(np.shape(x)) for x in
                                      jax.tree.leaves(params)]))
  p_then = [(m[0], m[1]) for m in meta["params"]]
  if [k for k, _ in p_now] != [k for k, _ in p_then]:
    problems.append(
      "params: different parameter names (checkpoint "
      f"{[k for k, _ in p_then][:6]}..., model {[k for k, _ in p_now][:6]}"
      "...)")
  else:
    for (k, a), (_, b) in zip(p_now, p_then):
      if per_device_params:
        a, b = a[1:], b[1:]
      if a != b:
        problems.append(f"params{k}: checkpoint shape {b}, model shape {a}")
  s_now = jax.tree.leaves(state)
  s_keys = _keystrs(state)
  s_lay = jax.tree.leaves(layout)
  if len(s_now) != len(meta["opt_state"]):
    problems.append(f"opt_state: checkpoint has {len(meta['opt_state'])} "
                    f"leaves, this optimizer {len(s_now)}")
  else:
    for k, x, dev, m in zip(s_keys, s_now, s_lay, meta["opt_state"]):
      shape = list(np.shape(x))
      saved = m[1][1:] if m[4] else m[1]
      recut = (not isinstance(dev, bool)
               and any(a in dev for a in model_axes))
      if (_layout_json(dev) != m[4]
          or (not recut and (shape[1:] if dev else shape) != saved)):
        problems.append(f"opt_state{k}: checkpoint {m[1]} (per-device="
                        f"{m[4]}), this run {shape} (per-device={dev})")
  if problems:
    layout = any("per-device=" in p for p in problems)
    raise CheckpointError(
      f"checkpoint {path} does not fit this run:\n  "
      + "\n  ".join(problems[:20])
      + ("\n  (the optimizer state is laid out per device otherwise on "
         "this run's devices or mesh: the compressor keeps other state "
         "there, e.g. int8's server error exists only from 2 slices on; "
         "resume on a device count or --mesh data-axis size whose state "
         "is laid out as the checkpoint's)" if layout else "")
      + f"\n({MOVABLE})")

