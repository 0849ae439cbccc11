"""Data-parallel training with jaxcomm's gradient compressors.

One command line selects the model, dataset, compressor and its
hyperparameters, optimizer, learning-rate schedule, number of devices
(simulated CPU devices by default), steps, seed and output directory::

  python train.py                                  # the default job
  python train.py --compressor topk --compressor-args ratio=0.01
  python train.py --model cnn --dataset digits --compressor powersgd \\
      --compressor-args rank=2,start_step=10 --num-devices 4 --steps 300
  python train.py --out-dir runs/a --resume        # continue runs/a
  python train.py --local diloco --local-args period=50 --optimizer adamw \
      --compressor topk --compressor-args ratio=0.02,value_bits=2

``--local local_sgd|adacomm|overlap_local_sgd|diloco`` trains with a
local-update optimizer around ``--optimizer`` (each device alone between
syncs; ``--compressor`` compresses DiLoCo's pseudo-gradients): params are
kept per device, checkpointed per device, evaluated as their device
average, and the bytes of a step are those of its sync (none between).

With no arguments it trains the character-level LSTM on Python's own help
text (``pydoc_data``) on 8 simulated CPU devices with PowerSGD rank 4 (or,
when this build of jaxcomm has no ``powersgd``, bfloat16 casting with error
feedback) and prints the held-out loss and accuracy next to the bytes each
device sends per step and the dense all-reduce it replaces.

What a run writes to ``--out-dir``: ``metrics.jsonl`` (one JSON object per
step), ``curves.png`` (loss against step and against bytes communicated),
``summary.md`` (the final table), ``config.json`` and ``checkpoints/``.

Checkpoints (orbax) hold the parameters, the full optimizer state as host
arrays (every device's error-feedback residual: per-device leaves keep their
leading device axis; PowerSGD's Q, the compressor's PRNG key and step
counters), and the step, which is also the data position because batches
are a pure function of ``(seed, step)``. Each checkpoint is written to a new
``step_<N>`` directory and only then does ``checkpoints/LATEST`` switch to
it, so the last good checkpoint is never overwritten. ``--resume`` continues
bit-identically; a checkpoint from ``n`` devices restores on ``m`` (``n`` and
``m`` dividing one another) with the error-feedback mass preserved
(:func:`jaxcomm.parallel.resize_state`). When the latest checkpoint is
corrupt, the error names the older ones that read cleanly, and
``--resume-from checkpoints/step_<N>`` continues from one of them. Resuming a
run that is already complete trains nothing: it re-evaluates and reports the
train loss recorded in ``metrics.jsonl``.

Multi-process: pass ``--coordinator host:port --num-processes P
--process-id i`` to every process (``--num-devices`` is the global count).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  # Before JAX starts: CPU collectives over many simulated devices on few
  # cores can wait longer than XLA's default timeouts.
  _FLAGS = ("--xla_cpu_collective_timeout_seconds=900",
            "--xla_cpu_collective_call_terminate_timeout_seconds=900")
  _old = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join(
    [_old] + [f for f in _FLAGS if f.split("=")[0] not in _old]).strip()

import argparse  # noqa: E402
import ast  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import typing  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
import models  # noqa: E402
from jaxcomm import parallel  # noqa: E402
from jaxcomm import wire  # noqa: E402
from models import data as mdata  # noqa: E402

AXIS = "data"

# ------------------------------------------------------------ compressors --

# Name on the command line -> (attribute of ``jaxcomm``, default keyword
# arguments used when the factory takes them and the user gives none), read
# from the library's one list of methods (jaxcomm.registry).
def _cli_value(v):
  """A registry default as the command line writes it (dtypes by name, so
  configs and results stay plain JSON)."""
  if isinstance(v, type) or isinstance(v, jnp.dtype):
    return jnp.dtype(v).name
  return v


COMPRESSORS: dict[str, tuple[str, dict[str, Any]]] = {
  m.name: (m.attr, {k: _cli_value(v) for k, v in m.defaults.items()})
  for m in jaxcomm.registry.methods("compressor")}
ALIASES = {a: m.name for m in jaxcomm.registry.methods() for a in m.aliases}
DEFAULT_COMPRESSOR = "powersgd"
DEFAULT_COMPRESSOR_ARGS = "rank=4"
# Used by the default job when jaxcomm has no powersgd.
FALLBACK = ("cast", "dtype=bfloat16,error_feedback=True")

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
           "float16": jnp.float16, "fp16": jnp.float16,
           "float32": jnp.float32}


def available_compressors() -> list[str]:
  """Compressor names whose factory exists in this build of jaxcomm."""
  return [k for k, (attr, _) in COMPRESSORS.items()
          if callable(getattr(jaxcomm, attr, None))]


def parse_kwargs(text: str | None) -> dict[str, Any]:
  """Parses ``"rank=4,ratio=0.01,error_feedback=false,dtype=bfloat16"``.

  Values are Python literals (ints, floats, tuples, ``None``), ``true`` /
  ``false`` in any case, or else plain strings.
  """
  out: dict[str, Any] = {}
  if not text:
    return out
  depth, part, parts = 0, "", []
  for ch in text:  # split on commas outside brackets
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append(part)
      part = ""
    else:
      part += ch
  parts.append(part)
  for item in parts:
    item = item.strip()
    if not item:
      continue
    if "=" not in item:
      raise ValueError(f"expected key=value, got {item!r} in {text!r}")
    key, value = (s.strip() for s in item.split("=", 1))
    if not key.isidentifier():
      raise ValueError(f"bad argument name {key!r} in {text!r}")
    low = value.lower()
    if low in ("true", "false"):
      out[key] = low == "true"
    elif low == "none":
      out[key] = None
    else:
      try:
        out[key] = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        out[key] = value
  return out


def resolve_compressor(name: str) -> str:
  """The canonical name of ``name``; ValueError listing the choices."""
  key = ALIASES.get(name.lower(), name.lower())
  avail = available_compressors()
  if key in COMPRESSORS and key in avail:
    return key
  missing = sorted(set(COMPRESSORS) - set(avail))
  why = ("not in this build of jaxcomm" if key in COMPRESSORS
         else "unknown compressor")
  raise ValueError(
    f"{why}: {name!r}; valid choices: {', '.join(avail)}"
    + (f" (known but not available here: {', '.join(missing)})"
       if missing else ""))


def build_compressor(name: str, args: dict[str, Any] | str | None = None, *,
                     axis_name=AXIS):
  """``(tx, canonical_name, kwargs)`` for compressor ``name``.

  The factory is looked up on ``jaxcomm`` when called, so compressors added
  to the package are selectable without changing this file (add a row to
  :data:`COMPRESSORS`). Defaults in the table fill the factory's parameters
  that the user did not give; ``dtype`` strings become JAX dtypes.
  """
  key = resolve_compressor(name)
  attr, defaults = COMPRESSORS[key]
  factory = getattr(jaxcomm, attr)
  given = parse_kwargs(args) if isinstance(args, str) else dict(args or {})
  try:
    sig = inspect.signature(factory)
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
  except (TypeError, ValueError):  # pragma: no cover
    params, takes_any = {}, True
  unknown = [k for k in given if k not in params and not takes_any]
  if unknown:
    valid = [p for p in params if p != "axis_name"]
    raise ValueError(
      f"compressor {key!r} takes no argument(s) {', '.join(unknown)}; "
      f"valid: {', '.join(valid)}")
  kwargs = {k: v for k, v in defaults.items()
            if (k in params or takes_any) and k not in given}
  kwargs.update(given)
  needed = [p.name for p in params.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                   p.KEYWORD_ONLY)
            and p.name not in kwargs]
  if needed:
    raise ValueError(
      f"compressor {key!r} needs {', '.join(needed)}: pass e.g. "
      f"--compressor-args {needed[0]}=...")
  call = dict(kwargs)
  if isinstance(call.get("dtype"), str):
    if call["dtype"] not in _DTYPES:
      raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got "
                       f"{call['dtype']!r}")
    call["dtype"] = _DTYPES[call["dtype"]]
  if "axis_name" in params or takes_any:
    call["axis_name"] = axis_name
  tx = factory(**call)
  return tx, key, kwargs


# ----------------------------------------------------------------- config --

@dataclasses.dataclass
class Config:
  """Everything a run depends on (all settable from the command line).

  The defaults are the default job: a compressed char-LSTM run on 8
  simulated CPU devices, about 3 minutes on 2 cores.
  """

  model: str = "charlm"
  model_args: str = "embed_dim=32,hidden_size=128,num_layers=1"
  dataset: str = "auto"        # auto | text | digits | cifar10
  data_dir: str | None = None  # CIFAR-10 batches
  text_file: str | None = None  # UTF-8 text (default: pydoc_data)
  seq_len: int = 64
  compressor: str = DEFAULT_COMPRESSOR
  compressor_args: str = DEFAULT_COMPRESSOR_ARGS
  optimizer: str = "adam"      # sgd | momentum | nesterov | adam | adamw
  #                              | lamb | onebit_adam | onebit_lamb
  #                              | zero_one_adam
  optimizer_args: str = ""     # e.g. freeze_step=200 (jaxcomm optimizers)
  local: str = "none"          # none | local_sgd | adacomm |
  #                              overlap_local_sgd | diloco
  local_args: str = ""         # e.g. period=50,outer_lr=0.7 (see --local)
  lr: float = 3e-3
  momentum: float = 0.9
  weight_decay: float = 0.0
  schedule: str = "cosine"     # constant | cosine | warmup_cosine | step
  warmup_steps: int = 50
  num_devices: int = 8
  batch_size: int = 64         # global; a multiple of num_devices
  steps: int = 1500
  stop_after: int | None = None  # stop (and checkpoint) at this step
  seed: int = 0
  out_dir: str | None = None   # default runs/<model>-<compressor>-<time>
  checkpoint_every: int = 500
  keep_checkpoints: int = 2
  resume: bool = False
  resume_from: str | None = None  # a checkpoint directory; implies resume
  overwrite: bool = False
  eval_every: int = 0          # 0: only at the end
  eval_examples: int = 512
  log_every: int = 1
  progress: bool = True
  plot: bool = True
  platform: str = "cpu"        # cpu | default (whatever JAX finds)
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None

  # Fields that must agree between a checkpoint and the run resuming it.
  RESUME_KEYS = ("model", "model_args", "dataset", "text_file", "seq_len",
                 "compressor", "compressor_args", "optimizer",
                 "optimizer_args", "local", "local_args", "lr",
                 "momentum", "weight_decay", "schedule", "warmup_steps",
                 "batch_size", "steps", "seed")


def _add_bool(parser, name, default, help_):
  parser.add_argument(f"--{name}", dest=name.replace("-", "_"),
                      action=argparse.BooleanOptionalAction, default=default,
                      help=help_)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
  """Appends "(default: ...)" to every flag's help except where the default
  is None: those flags say in their help what leaving them out does."""

  def _get_help_string(self, action):
    if action.default is None:
      return action.help
    if action.default == "":
      return action.help + " (default: none)"
    return super()._get_help_string(action)


def methods_epilog() -> str:
  """The methods ``--compressor``, ``--optimizer`` and ``--local`` take,
  one line each, from ``jaxcomm.registry``."""
  titles = {"compressor": "--compressor (chained before --optimizer)",
            "optimizer": "--optimizer (whole jaxcomm optimizers)",
            "local": "--local (around --optimizer, run per device)"}
  lines = []
  for family, title in titles.items():
    lines.append(f"{title}:")
    for m in jaxcomm.registry.methods(family):
      tail = ""
      if m.lr is not None:
        tail = f"  [{m.optimizer}, lr {m.lr:g}]"
      args = ",".join(f"{k}={getattr(v, '__name__', v)}"
                      for k, v in m.defaults.items())
      lines.append(f"  {m.name:<18} {m.paper}"
                   + (f" (default {args})" if args else "") + tail)
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  """The command line: every flag with a help text and its default."""
  d = Config()
  p = argparse.ArgumentParser(
    prog="train.py", description=__doc__.split("\n\n")[0],
    epilog=methods_epilog(), formatter_class=_HelpFormatter)
  g = p.add_argument_group("model and data")
  g.add_argument("--model", default=d.model,
                 help=f"one of {', '.join(models.MODELS)}")
  g.add_argument("--model-args", default=None,
                 help="constructor arguments, k=v,... (default for charlm: "
                 f"{d.model_args})")
  g.add_argument("--dataset", default=d.dataset,
                 choices=("auto", "text", "digits", "cifar10"),
                 help="auto: the model's own (text for charlm, digits for "
                 "mlp and cnn, cifar10 for resnet20)")
  g.add_argument("--data-dir", default=None,
                 help="directory of the CIFAR-10 python batches")
  g.add_argument("--text-file", default=None,
                 help="UTF-8 text for charlm (default: pydoc_data topics)")
  g.add_argument("--seq-len", type=int, default=d.seq_len,
                 help="characters per training sequence (charlm)")
  g = p.add_argument_group("compression and optimization")
  g.add_argument("--compressor", default=None,
                 help=f"one of {', '.join(COMPRESSORS)} (those in this "
                 f"build of jaxcomm; default {d.compressor}, or "
                 f"{FALLBACK[0]} where jaxcomm has no {d.compressor})")
  g.add_argument("--compressor-args", default=None,
                 help="factory arguments, e.g. rank=4,start_step=10 "
                 f"(default for {d.compressor}: {d.compressor_args})")
  g.add_argument("--optimizer", default=d.optimizer,
                 choices=OPTIMIZERS,
                 help="applied to the compressed mean; onebit_adam, "
                 "onebit_lamb and zero_one_adam are whole optimizers that "
                 "exchange their own 1-bit momentum (use them with "
                 "--compressor dense, the default for them)")
  g.add_argument("--optimizer-args", default=d.optimizer_args,
                 help="arguments of a jaxcomm optimizer, e.g. "
                 "freeze_step=200")
  g.add_argument("--local", default=d.local, choices=("none",)
                 + LOCAL_METHODS,
                 help="local-update training: each device runs --optimizer "
                 "alone and the devices sync every `period` steps (diloco: "
                 "an outer Nesterov SGD on the averaged pseudo-gradient, "
                 "compressed by --compressor when it is not dense)")
  g.add_argument("--local-args", default=d.local_args,
                 help="arguments of --local, e.g. period=8 (local_sgd: "
                 "start_step; adacomm: interval, max_period; "
                 "overlap_local_sgd: alpha; diloco: outer_lr=0.7, "
                 "outer_momentum=0.9, fragments, overlap_steps, alpha; "
                 "dpsgd: topology=ring|torus|hypercube|exponential, no "
                 "period; choco: topology=ring|torus, gamma=0.5, "
                 "compressing with --compressor; sgp: "
                 "topology=exponential)")
  g.add_argument("--lr", type=float, default=d.lr,
                 help="peak learning rate of --optimizer (of the inner "
                 "optimizer with --local)")
  g.add_argument("--momentum", type=float, default=d.momentum,
                 help="momentum of --optimizer momentum and nesterov")
  g.add_argument("--weight-decay", type=float, default=d.weight_decay,
                 help="decoupled weight decay (adamw, lamb and the jaxcomm "
                 "optimizers)")
  g.add_argument("--schedule", default=d.schedule,
                 choices=("constant", "cosine", "warmup_cosine", "step"),
                 help="learning-rate schedule over --steps (step: x0.1 "
                 "at 50%% and again at 75%% of them)")
  g.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                 help="linear warm-up steps of --schedule warmup_cosine")
  g = p.add_argument_group("run")
  g.add_argument("--num-devices", type=int, default=d.num_devices,
                 help="data-parallel devices (global)")
  g.add_argument("--batch-size", type=int, default=d.batch_size,
                 help="global batch size")
  g.add_argument("--steps", type=int, default=d.steps,
                 help="training steps (the schedule's length)")
  g.add_argument("--stop-after", type=int, default=None,
                 help="stop early at this step (checkpointed); the "
                 "schedule still spans --steps")
  g.add_argument("--seed", type=int, default=d.seed,
                 help="seed of the initial params, the data split and the "
                 "batch order")
  g.add_argument("--out-dir", default=None,
                 help="where metrics, plots and checkpoints go (default: "
                 "runs/<model>-<compressor>-<time>)")
  g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                 help="save a checkpoint every this many steps (0: only "
                 "at the end)")
  g.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                 help="checkpoints kept (the newest ones)")
  _add_bool(g, "resume", d.resume, "continue from --out-dir's checkpoint")
  g.add_argument("--resume-from", default=None, metavar="PATH",
                 help="continue from this checkpoint directory (e.g. "
                 "checkpoints/step_<N>, an older one when the latest is "
                 "corrupt) instead of the one LATEST names; implies --resume")
  _add_bool(g, "overwrite", d.overwrite,
            "start afresh in an --out-dir that has checkpoints")
  g.add_argument("--eval-every", type=int, default=d.eval_every,
                 help="held-out evaluation every this many steps (0: only "
                 "at the end)")
  g.add_argument("--eval-examples", type=int, default=d.eval_examples,
                 help="held-out examples per evaluation")
  g.add_argument("--log-every", type=int, default=d.log_every,
                 help="a metrics.jsonl line every this many steps")
  _add_bool(g, "progress", d.progress, "tqdm progress bar")
  _add_bool(g, "plot", d.plot, "write curves.png")
  g.add_argument("--platform", default=d.platform,
                 choices=("cpu", "default"),
                 help="cpu: simulated CPU devices; default: JAX's choice")
  g = p.add_argument_group("multi-process")
  g.add_argument("--coordinator", default=None,
                 help="host:port of process 0 of a multi-process job "
                 "(jax.distributed); default: a single process")
  g.add_argument("--num-processes", type=int, default=None,
                 help="processes in the job (with --coordinator)")
  g.add_argument("--process-id", type=int, default=None,
                 help="this process's index, 0 .. --num-processes - 1")
  return p


def parse_args(argv=None) -> Config:
  """Builds a :class:`Config` from command-line arguments."""
  d = Config()
  ns = build_parser().parse_args(argv)
  values = vars(ns)
  if values["model_args"] is None:
    values["model_args"] = d.model_args if ns.model == "charlm" else ""
  if values["compressor"] is None and (ns.optimizer in COMM_OPTIMIZERS
                                      or ns.local != "none"):
    values["compressor"] = "dense"
  if values["compressor"] is None:
    values["compressor"] = d.compressor
    if d.compressor not in available_compressors():
      print(f"note: this build of jaxcomm has no {d.compressor}; using "
            f"{FALLBACK[0]}({FALLBACK[1]}) instead")
      values["compressor"] = FALLBACK[0]
      if values["compressor_args"] is None:
        values["compressor_args"] = FALLBACK[1]
  if values["compressor_args"] is None:
    same = ALIASES.get(values["compressor"].lower(),
                       values["compressor"].lower())
    values["compressor_args"] = (d.compressor_args
                                 if same == d.compressor else "")
  if values["resume_from"] is not None:
    values["resume"] = True
  return Config(**values)


# ------------------------------------------------------------ model, data --

def load_data(cfg: Config):
  """``(train, test, model_kwargs, dataset)``: arrays and size arguments."""
  models._registry.check_name(cfg.model)
  task = models.TASKS[cfg.model]
  dataset = cfg.dataset
  if dataset == "auto":
    dataset = {"charlm": "text", "resnet20": "cifar10"}.get(cfg.model,
                                                            "digits")
  if task == models._registry.LANGUAGE_MODEL:
    if dataset != "text":
      raise ValueError(f"model {cfg.model!r} trains on --dataset text, got "
                       f"{dataset!r}")
    ids, vocab = mdata.text_corpus(cfg.text_file)
    cut = int(len(ids) * 0.9)
    train = mdata.char_sequences(ids[:cut], cfg.seq_len)
    test = mdata.char_sequences(ids[cut:], cfg.seq_len)
    return train, test, {"vocab_size": len(vocab)}, dataset
  if dataset == "text":
    raise ValueError(f"model {cfg.model!r} is a classifier: use --dataset "
                     "digits or cifar10")
  if dataset == "digits":
    train, test = mdata.digits(seed=cfg.seed)
    kwargs = {"cnn": {"in_channels": 1, "image_size": 8},
              "resnet20": {"in_channels": 1}}.get(cfg.model, {})
  elif dataset == "cifar10":
    if not cfg.data_dir:
      raise ValueError(
        "--dataset cifar10 needs --data-dir: a directory holding "
        f"{', '.join(mdata.CIFAR10_TRAIN_FILES)} and "
        f"{mdata.CIFAR10_TEST_FILE}")
    train, test = mdata.cifar10(cfg.data_dir, normalize=True)
    kwargs = {"cnn": {"in_channels": 3, "image_size": 32},
              "mlp": {"in_features": 32 * 32 * 3}}.get(cfg.model, {})
  else:
    raise ValueError(f"unknown dataset {dataset!r}; valid: text, digits, "
                     "cifar10")
  if cfg.model == "mlp":
    flat = lambda s: {"image": s["image"].reshape(len(s["image"]), -1),
                      "label": s["label"]}
    train, test = flat(train), flat(test)
    kwargs = {"in_features": train["image"].shape[1]}
  kwargs["num_classes"] = int(max(np.max(train["label"]),
                                  np.max(test["label"]))) + 1
  return train, test, kwargs, dataset


def model_arguments(name: str) -> dict[str, Any]:
  """``{argument: default}`` of model ``name``'s constructor.

  ``rngs`` is left out. A constructor taking ``**kwargs`` (``resnet20``)
  also lists the arguments of the class it returns. Defaults without a
  value are ``inspect.Parameter.empty``; ``{}`` means the arguments cannot
  be told from the signature.
  """
  models._registry.check_name(name)
  out: dict[str, Any] = {}
  targets = [models.MODELS[name]]
  while targets:
    fn = targets.pop(0)
    # A class's own signature can be its metaclass's (*args, **kwargs), as
    # for flax.nnx modules: read __init__ instead.
    init = fn.__init__ if inspect.isclass(fn) else fn
    try:
      params = list(inspect.signature(init).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover
      return {}
    if inspect.isclass(fn):
      params = params[1:]  # self
    for p in params:
      if p.kind is p.VAR_KEYWORD:
        try:
          ret = typing.get_type_hints(fn).get("return")
        except Exception:  # pylint: disable=broad-except  # pragma: no cover
          ret = None
        if not inspect.isclass(ret):
          return {}  # pragma: no cover  # open-ended: nothing to check
        targets.append(ret)
      elif p.kind is not p.VAR_POSITIONAL and p.name != "rngs":
        out.setdefault(p.name, p.default)
  return out


def _expected(default: Any) -> str | None:
  """What a model argument with this default must be; None: anything."""
  if isinstance(default, bool):
    return "true or false"
  if isinstance(default, int):
    return "a positive integer"
  if isinstance(default, float):
    return "a finite number"
  if (isinstance(default, (tuple, list))
      and all(isinstance(v, int) and not isinstance(v, bool)
              for v in default)):
    return "a tuple of positive integers"
  return None


def _fits(value: Any, expected: str | None) -> bool:
  is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
  if expected == "true or false":
    return isinstance(value, bool)
  if expected == "a positive integer":
    return is_int(value) and value > 0
  if expected == "a finite number":
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
  if expected == "a tuple of positive integers":
    return (isinstance(value, (tuple, list))
            and all(is_int(v) and v > 0 for v in value))
  return True


def check_model_args(name: str, given: dict[str, Any],
                     data_kwargs: dict[str, Any]) -> None:
  """Refuses ``--model-args`` that model ``name`` cannot take.

  Unknown keys (the message lists the accepted ones), values of the wrong
  kind (sizes must be positive integers, stage widths tuples of them), and
  sizes the dataset fixes (``vocab_size``, ``in_features``, ``in_channels``,
  ``image_size``, ``num_classes``) given another value.
  """
  accepted = model_arguments(name)
  if not accepted:  # pragma: no cover  # a signature inspect cannot read
    return
  unknown = [k for k in given if k not in accepted]
  if unknown:
    raise ValueError(
      f"--model-args: model {name!r} takes no argument(s) "
      f"{', '.join(unknown)}; accepted: {', '.join(accepted)}")
  for key, value in given.items():
    if key in data_kwargs and value != data_kwargs[key]:
      raise ValueError(
        f"--model-args {key}={value!r}: the dataset fixes {key} to "
        f"{data_kwargs[key]!r} for model {name!r}; leave {key} out")
    expected = _expected(accepted[key])
    if not _fits(value, expected):
      example = ("e.g. (64,) or (32, 64)"
                 if expected == "a tuple of positive integers"
                 else f"default {accepted[key]!r}")
      raise ValueError(
        f"--model-args {key}={value!r}: model {name!r} expects {expected} "
        f"for {key} ({example})")


def build_model(cfg: Config, data_kwargs: dict[str, Any]):
  """The model's :class:`models.Functional` (parameters seeded by seed).

  ``--model-args`` is checked first (:func:`check_model_args`); what the
  constructor itself refuses is reported under the flag's name too.
  """
  try:
    given = parse_kwargs(cfg.model_args)
  except ValueError as e:
    raise ValueError(f"--model-args: {e}") from None
  check_model_args(cfg.model, given, data_kwargs)
  kwargs = dict(data_kwargs)
  kwargs.update(given)
  try:
    model = models.create(cfg.model, rngs=cfg.seed, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"--model-args {cfg.model_args!r} for model "
                     f"{cfg.model!r}: {e}") from e
  return models.functional(model)


def make_schedule(cfg: Config):
  """The learning-rate schedule as an optax schedule."""
  if cfg.schedule == "constant":
    return optax.constant_schedule(cfg.lr)
  if cfg.schedule == "cosine":
    return optax.cosine_decay_schedule(cfg.lr, max(cfg.steps, 1))
  if cfg.schedule == "warmup_cosine":
    return optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, min(cfg.warmup_steps, max(cfg.steps - 1, 0)),
      max(cfg.steps, 1))
  if cfg.schedule == "step":
    return optax.piecewise_constant_schedule(
      cfg.lr, {int(cfg.steps * 0.5): 0.1, int(cfg.steps * 0.75): 0.1})
  raise ValueError(f"unknown schedule {cfg.schedule!r}; valid: constant, "
                   "cosine, warmup_cosine, step")


# Whole optimizers that exchange their own (1-bit) momentum.
COMM_OPTIMIZERS = tuple(jaxcomm.registry.names("optimizer"))
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw",
              "lamb") + COMM_OPTIMIZERS


def make_comm_optimizer(cfg: Config, schedule):
  """A jaxcomm optimizer (``--optimizer onebit_adam|onebit_lamb``) with
  ``--optimizer-args`` (``freeze_step`` defaults to 20% of the steps)."""
  factory = getattr(jaxcomm, cfg.optimizer)
  kwargs = parse_kwargs(cfg.optimizer_args)
  params = inspect.signature(factory).parameters
  unknown = [k for k in kwargs if k not in params
             or k in ("learning_rate", "axis_name")]
  if unknown:
    valid = [k for k in params if k not in ("learning_rate", "axis_name")]
    raise ValueError(f"--optimizer {cfg.optimizer} takes no argument(s) "
                     f"{', '.join(unknown)}; valid: {', '.join(valid)}")
  kwargs.setdefault("var_freeze_step" if cfg.optimizer == "zero_one_adam"
                    else "freeze_step", max(cfg.steps // 5, 1))
  kwargs.setdefault("weight_decay", cfg.weight_decay)
  return factory(schedule, axis_name=AXIS, **kwargs)


LOCAL_METHODS = tuple(jaxcomm.registry.names("local"))
# Decentralized methods: no sync period, params never agree exactly.
GOSSIP_METHODS = tuple(m.name for m in jaxcomm.registry.methods("local")
                       if m.gossip)


def make_local_optimizer(cfg: Config, inner, compressor, schedule):
  """``--local METHOD --local-args ...`` around the inner optimizer;
  diloco's outer optimizer is SGD with ``outer_lr`` (0.7),
  ``outer_momentum`` (0.9) and ``outer_nesterov`` (True), as in the paper;
  ``compressor`` (None for dense) compresses its pseudo-gradients."""
  kwargs = parse_kwargs(cfg.local_args)
  factory = getattr(jaxcomm, cfg.local)
  if "period" not in kwargs and cfg.local not in GOSSIP_METHODS:
    raise ValueError(f"--local {cfg.local} needs --local-args period=H "
                     "(steps between syncs)")
  if cfg.local == "choco" and compressor is None:
    raise ValueError(
      "--local choco gossips compressed model differences: give "
      "--compressor topk, randomk or ef_signsgd (e.g. --compressor topk "
      "--compressor-args ratio=0.1)")
  if compressor is not None and cfg.local not in ("diloco", "choco"):
    raise ValueError(
      f"--local {cfg.local} averages params with a dense all-reduce; "
      "--compressor applies to diloco's pseudo-gradients only (use "
      "--compressor dense)")
  extra = {}
  if cfg.local == "diloco":
    lr = kwargs.pop("outer_lr", 0.7)
    mom = kwargs.pop("outer_momentum", 0.9)
    nesterov = kwargs.pop("outer_nesterov", True)
    extra["outer"] = optax.sgd(lr, momentum=mom or None,
                               nesterov=bool(nesterov and mom))
    extra["compressor"] = compressor
  if cfg.local == "choco":
    extra["compressor"] = compressor
    kwargs.setdefault("gamma", 0.5)
  if cfg.local == "adacomm":
    kwargs.setdefault("learning_rate", schedule)
  params = inspect.signature(factory).parameters
  unknown = [k for k in kwargs if k not in params
             or k in ("inner", "outer", "compressor", "axis_name")]
  if unknown:
    valid = [k for k in params if k not in ("inner", "outer", "compressor",
                                            "axis_name")]
    if cfg.local == "diloco":
      valid += ["outer_lr", "outer_momentum", "outer_nesterov"]
    raise ValueError(f"--local {cfg.local} takes no argument(s) "
                     f"{', '.join(unknown)}; valid: {', '.join(valid)}")
  return factory(inner, axis_name=AXIS, **extra, **kwargs)


def make_optimizer(cfg: Config, schedule):
  """The optimizer applied to the compressed mean gradient."""
  if cfg.optimizer == "sgd":
    return optax.sgd(schedule)
  if cfg.optimizer == "momentum":
    return optax.sgd(schedule, momentum=cfg.momentum)
  if cfg.optimizer == "nesterov":
    return optax.sgd(schedule, momentum=cfg.momentum, nesterov=True)
  if cfg.optimizer == "adam":
    return optax.adam(schedule)
  if cfg.optimizer == "adamw":
    return optax.adamw(schedule, weight_decay=cfg.weight_decay)
  if cfg.optimizer == "lamb":
    return optax.lamb(schedule, weight_decay=cfg.weight_decay)
  raise ValueError(f"unknown optimizer {cfg.optimizer!r}; valid: "
                   f"{', '.join(OPTIMIZERS)}")


# ------------------------------------------------------------- checkpoints --

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


def _atomic_write(path: str, text: str) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


class _DrainingEventLoop(asyncio.SelectorEventLoop):
  """An event loop that lets its unfinished tasks end before it closes."""

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


def _step_of(name: str) -> tuple[int, int] | None:
  """``(step, k)`` of a ``step_<N>`` or ``step_<N>.<k>`` directory name."""
  if not name.startswith("step_"):
    return None
  head, _, k = name[len("step_"):].partition(".")
  if not head.isdigit() or (k and not k.isdigit()):
    return None
  return int(head), int(k or 0)


class Checkpoints:
  """Step directories under ``<out_dir>/checkpoints`` and a LATEST pointer.

  ``save`` writes ``step_<N>`` with orbax (which itself writes to a
  temporary directory and renames when complete), adds ``meta.json`` (leaf
  paths, shapes, dtypes, SHA-256 digests, the config), and only then
  rewrites ``LATEST``; older directories beyond ``keep`` are removed, never
  the one ``LATEST`` names.
  """

  def __init__(self, out_dir: str, keep: int = 2):
    self.root = os.path.join(out_dir, "checkpoints")
    self.keep = max(int(keep), 1)
    self._ckpt = None

  @property
  def ckpt(self):
    if self._ckpt is None:
      import orbax.checkpoint as ocp
      self._ckpt = ocp.StandardCheckpointer()
    return self._ckpt

  def latest(self) -> str | None:
    """The directory LATEST names, or None when there is no checkpoint."""
    pointer = os.path.join(self.root, "LATEST")
    if not os.path.exists(pointer):
      return None
    with open(pointer) as f:
      name = f.read().strip()
    path = os.path.join(self.root, name)
    if not name or not os.path.isdir(path):
      raise CheckpointError(
        f"{pointer} names {name!r}, which is not a checkpoint directory "
        f"under {self.root}")
    return path

  def step_dirs(self) -> list[str]:
    """Every ``step_<N>`` directory, newest (highest step) first."""
    if not os.path.isdir(self.root):
      return []
    found = [(_step_of(n), n) for n in os.listdir(self.root)
             if os.path.isdir(os.path.join(self.root, n))]
    return [os.path.join(self.root, n)
            for key, n in sorted(found, reverse=True) if key is not None]

  def resolve(self, path: str) -> str:
    """The checkpoint directory ``--resume-from path`` names.

    ``path`` is a directory (absolute, or relative to the working directory)
    or the name of one under ``<out_dir>/checkpoints``.
    """
    for p in (path, os.path.join(self.root, path)):
      if os.path.isfile(os.path.join(p, "meta.json")):
        return p
    have = self.step_dirs()
    raise CheckpointError(
      f"--resume-from {path}: not a checkpoint directory (absolute, relative "
      f"to here, or under {self.root}); expected a step_<N> directory "
      "holding meta.json" + (f", e.g. {', '.join(have)}" if have else ""))

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
            "(the next checkpoint saved becomes LATEST)")

  def save(self, step: int, params, opt_state, layout, meta: dict) -> str:
    """Writes a checkpoint of ``(params, opt_state)`` at ``step``."""
    host_params = _host(params)
    host_state = _host(opt_state)
    p_leaves = jax.tree.leaves(host_params)
    s_leaves = jax.tree.leaves(host_state)
    tree = {"params": {f"{i:04d}": x for i, x in enumerate(p_leaves)},
            "opt_state": {f"{i:04d}": x for i, x in enumerate(s_leaves)},
            "step": np.asarray(step, np.int64)}
    name = f"step_{step:08d}"
    path = os.path.join(self.root, name)
    k = 0
    while os.path.exists(path):  # never write into an existing directory
      k += 1
      path = os.path.join(self.root, f"{name}.{k}")
    os.makedirs(self.root, exist_ok=True)
    self.ckpt.save(os.path.abspath(path), tree)
    self.ckpt.wait_until_finished()
    meta = dict(meta)
    meta.update(
      format=1, step=int(step),
      params=[[k_, list(x.shape), x.dtype.name, _digest(x)]
              for k_, x in zip(_keystrs(host_params), p_leaves)],
      opt_state=[[k_, list(x.shape), x.dtype.name, _digest(x), bool(b)]
                 for k_, x, b in zip(_keystrs(host_state), s_leaves,
                                     jax.tree.leaves(layout))])
    if jax.process_index() == 0:
      _atomic_write(os.path.join(path, "meta.json"),
                    json.dumps(meta, indent=1))
      _atomic_write(os.path.join(self.root, "LATEST"),
                    os.path.basename(path))
      self._prune(os.path.basename(path))
    return path

  def _prune(self, current: str) -> None:
    names = sorted(n for n in os.listdir(self.root)
                   if n.startswith("step_") and n != current
                   and os.path.isdir(os.path.join(self.root, n)))
    for n in names[:max(len(names) - (self.keep - 1), 0)]:
      shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)

  def read(self, path: str | None = None):
    """``(meta, params_leaves, state_leaves, step)`` as host arrays."""
    path = path or self.latest()
    if path is None:
      raise CheckpointError(f"no checkpoint in {self.root} (no LATEST)")
    meta_path = os.path.join(path, "meta.json")
    try:
      with open(meta_path) as f:
        meta = json.load(f)
      assert meta["format"] == 1
      p_meta, s_meta = meta["params"], meta["opt_state"]
    except FileNotFoundError:
      raise CheckpointError(f"checkpoint {path} has no meta.json") from None
    except (ValueError, KeyError, TypeError, AssertionError) as e:
      raise CheckpointError(
        f"checkpoint {path}: meta.json is corrupt ({e!r})") from None
    try:
      with _drained_event_loops():
        tree = self.ckpt.restore(os.path.abspath(path))
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
        f"checkpoint {path}: arrays do not match meta.json (missing {e})"
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


def check_compatible(meta: dict, cfg: Config, params, state, layout,
                     path: str, *, per_device_params: bool = False) -> None:
  """Raises :class:`CheckpointError` naming every mismatch (per-device
  params, of local-update runs, are compared without their device axis)."""
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
      if dev != m[4] or (shape[1:] if dev else shape) != saved:
        problems.append(f"opt_state{k}: checkpoint {m[1]} (per-device="
                        f"{m[4]}), this run {shape} (per-device={dev})")
  if problems:
    raise CheckpointError(
      f"checkpoint {path} does not fit this run:\n  "
      + "\n  ".join(problems[:20])
      + "\n(resume with the checkpoint's settings; --num-devices, "
      "--stop-after, --checkpoint-every, --eval-* and logging may change)")


# ------------------------------------------------------------------- run --

def _identical_across_devices(tree, per_device: bool = False) -> bool:
  """Whether every addressable copy of every replicated leaf is equal (with
  ``per_device``: every device's row of the per-device params)."""
  for x in jax.tree.leaves(tree):
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    if per_device:
      shards = [row for s in shards for row in s]
    if any(not np.array_equal(shards[0], s) for s in shards[1:]):
      return False
  return True


def _make_eval(loss_fn, mesh):
  def local(params, batch):
    _, m = loss_fn(params, batch)
    cnt = jnp.sum(batch["mask"].astype(jnp.float32))
    vals = jnp.stack([m["loss"] * cnt, m["accuracy"] * cnt, cnt])
    return jax.lax.psum(vals, AXIS)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS)),
                               out_specs=P()))


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
                          ("--checkpoint-every", cfg.checkpoint_every, 0)):
    if value < lo:
      raise ValueError(f"{flag} must be >= {lo}, got {value}")
  if cfg.stop_after is not None and cfg.stop_after < 1:
    raise ValueError(f"--stop-after must be >= 1, got {cfg.stop_after}")
  if not math.isfinite(cfg.lr) or cfg.lr < 0:
    raise ValueError(f"--lr must be a finite number >= 0, got {cfg.lr}")
  devices = list(devices if devices is not None else jax.devices())
  if cfg.num_devices > len(devices):
    raise ValueError(f"--num-devices {cfg.num_devices} but JAX has "
                     f"{len(devices)} devices ({devices[0].platform})")
  out_dir = cfg.out_dir or default_out_dir(cfg)
  cfg.out_dir = out_dir
  main_proc = jax.process_index() == 0
  ckpts = Checkpoints(out_dir, cfg.keep_checkpoints)
  if not cfg.resume and os.path.exists(os.path.join(ckpts.root, "LATEST")):
    if not cfg.overwrite:
      raise ValueError(
        f"{out_dir} already holds checkpoints: pass --resume to continue "
        "them, --overwrite to start afresh, or another --out-dir")
    if main_proc:
      shutil.rmtree(ckpts.root)
  resume_path = _resume_path(ckpts, cfg) if cfg.resume else None

  train, test, data_kwargs, dataset = load_data(cfg)
  cfg.dataset = dataset
  fn = build_model(cfg, data_kwargs)
  loss_fn = models.make_loss_fn(cfg.model, fn.apply)
  comp, _, comp_kwargs = build_compressor(canon, cfg.compressor_args)
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
      None if canon == "dense" else comp, schedule)
    comp = tx = local_tx
  elif cfg.optimizer in COMM_OPTIMIZERS:
    if canon != "dense":
      raise ValueError(
        f"--optimizer {cfg.optimizer} exchanges its own 1-bit momentum: use "
        f"--compressor dense (got {canon!r})")
    # The optimizer is the exchange: its wire is what a step moves.
    comp = tx = make_comm_optimizer(cfg, schedule)
    if jaxcomm.local_states(jax.eval_shape(tx.init, fn.params)):
      local_tx = tx   # 0/1 Adam: params per device, bytes per step vary
  else:
    tx = optax.chain(comp, make_optimizer(cfg, schedule))
  mesh = parallel.make_mesh(cfg.num_devices, AXIS, devices=devices)
  dp = parallel.DataParallel(loss_fn, tx, mesh, AXIS, has_aux=True)
  params, opt_state = dp.init(fn.params)
  n = cfg.num_devices

  # Bytes per device per step, as the compressor claims (checked against the
  # compiled HLO by the test battery), and the dense psum it replaces.
  # Before a start_step (freeze_step) a step moves the dense phase's psum.
  from jaxcomm import _compressor
  dense_rep = wire.summarize(wire.claimed(jaxcomm.mean_gradients(AXIS),
                                          fn.params, n), n, fn.params)
  if local_tx is not None:
    # A local-update step moves bytes only when it syncs: the summary's
    # bytes per step are the average over the run's steps, and each
    # logged step records what it moved.
    lspec = _compressor.spec_of(local_tx)
    sync_bytes = (wire.summarize(lspec.wire(fn.params, n), n).total_sent
                  if n > 1 else 0.0)
    if lspec.adaptive:
      bytes_at = None  # read from the state: the period follows the loss
      per_step = float("nan")
    else:
      per_step_cache = {}

      def bytes_at(s):
        if s not in per_step_cache:
          per_step_cache[s] = (wire.summarize(wire.claimed(local_tx,
                               fn.params, n, step=s), n).total_sent
                               if n > 1 else 0.0)
        return per_step_cache[s]
      per_step = (sum(bytes_at(s) for s in range(cfg.steps)) / cfg.steps)
    start_dense = 0
  else:
    start_dense = _compressor.spec_of(comp).start_step
    rep = wire.summarize(wire.claimed(comp, fn.params, n, step=start_dense),
                         n, fn.params)
    warm_rep = (wire.summarize(wire.claimed(comp, fn.params, n, step=0), n,
                               fn.params) if start_dense else rep)
    bytes_at = lambda s: (warm_rep.total_sent if s < start_dense
                          else rep.total_sent)
    per_step = rep.total_sent
  num_params = sum(int(np.size(x)) for x in jax.tree.leaves(fn.params))

  meta_cfg = {k: v for k, v in dataclasses.asdict(cfg).items()}
  start = 0
  if cfg.resume:
    path = resume_path
    try:
      meta, p_leaves, s_leaves, start = ckpts.read(path)
    except CheckpointError as e:
      raise CheckpointError(f"{e}{ckpts.fallback_hint(path)}") from None
    check_compatible(meta, cfg, params, opt_state, dp.layout, path,
                     per_device_params=dp.per_device_params)
    treedef_p = jax.tree.structure(params)
    treedef_s = jax.tree.structure(opt_state)
    host_state = jax.tree.unflatten(treedef_s, s_leaves)
    old_n = int(meta["num_devices"])
    if old_n != n:
      host_state = parallel.resize_state(host_state, dp.layout, n)
      if main_proc:
        print(f"resumed a {old_n}-device checkpoint on {n} devices "
              "(residuals resized, total preserved)")
    host_params = jax.tree.unflatten(treedef_p, p_leaves)
    if dp.per_device_params and old_n != n:
      host_params = parallel.resize_params(host_params, n)
    params = dp.place_params(host_params)
    opt_state = _place_state(host_state, dp.layout, mesh)
    if main_proc:
      print(f"resumed from {path} at step {start}")

  os.makedirs(out_dir, exist_ok=True)
  metrics_path = os.path.join(out_dir, "metrics.jsonl")
  history = []
  if main_proc:
    _atomic_write(os.path.join(out_dir, "config.json"),
                  json.dumps(meta_cfg, indent=1))
    if cfg.resume and os.path.exists(metrics_path):
      with open(metrics_path) as f:
        history = [json.loads(line) for line in f if line.strip()]
      history = [h for h in history if h.get("step", 0) <= start]
      _atomic_write(metrics_path, "".join(json.dumps(h) + "\n"
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
  eval_fn = _make_eval(loss_fn, mesh)
  nproc, pid = jax.process_count(), jax.process_index()
  bar = None
  if cfg.progress and main_proc and stop > start:
    from tqdm import tqdm
    bar = tqdm(total=stop, initial=start, desc=f"{canon} n={n}",
               dynamic_ncols=True, file=sys.stderr)
  if bytes_at is not None:
    cum_bytes = sum(bytes_at(s) for s in range(start))
  else:  # adacomm: what the run logged so far
    cum_bytes = float(history[-1].get("bytes_total", 0.0)) if history else 0.0

  def step_bytes(step, opt_state):
    if bytes_at is not None:
      return bytes_at(step)
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
          bar.set_postfix_str(
            f"loss={last['loss']:.3f} {rate:.1f} steps/s "
            f"{_fmt_bytes(last['bytes_per_step'])}/step", refresh=False)
      if bar is not None:
        bar.update(1)
      if not math.isfinite(last.get("loss", 0.0)):
        raise FloatingPointError(f"loss is {last['loss']} at step {done}")
      if done == stop or (cfg.checkpoint_every
                          and done % cfg.checkpoint_every == 0):
        ckpts.save(done, params, opt_state, dp.layout, meta_base)
  finally:
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
  if bytes_at is None:  # adacomm: the average of what the steps moved
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
  result.update(_stats(opt_state))
  summary_path = os.path.join(out_dir, "summary.md")
  if (main_proc and not math.isfinite(result["train_loss"])
      and os.path.exists(summary_path)):
    print(f"note: {metrics_path} records no train loss at step {stop}: "
          f"{summary_path} and result.json are left as they were")
  elif main_proc:
    table = summary_table([result])
    _atomic_write(summary_path, table + "\n")
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


def _resume_path(ckpts: Checkpoints, cfg: Config) -> str:
  """The checkpoint a resumed run starts from (``--resume-from`` or LATEST)."""
  if cfg.resume_from is not None:
    return ckpts.resolve(cfg.resume_from)
  try:
    path = ckpts.latest()
  except CheckpointError as e:
    raise CheckpointError(f"{e}{ckpts.fallback_hint(None)}") from None
  if path is None:
    raise CheckpointError(f"--resume: no checkpoint in {ckpts.root}")
  return path


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


def _place_state(host_state, layout, mesh):
  from jax.sharding import NamedSharding
  rep = NamedSharding(mesh, P())
  dev = NamedSharding(mesh, P(AXIS))
  return jax.tree.map(
    lambda x, b: parallel._global(x, dev if b else rep), host_state, layout)


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


# ------------------------------------------------------------------ main --

def configure_devices(cfg: Config) -> None:
  """Sets up JAX's devices for a script run (before the backend starts)."""
  if cfg.platform == "cpu":
    jax.config.update("jax_platforms", "cpu")
  if cfg.coordinator is not None or cfg.num_processes is not None:
    procs = cfg.num_processes or 1
    if cfg.num_devices % procs:
      raise ValueError(f"--num-devices {cfg.num_devices} must be a multiple "
                       f"of --num-processes {procs}")
    parallel.initialize(
      cfg.coordinator, cfg.num_processes, cfg.process_id,
      local_device_count=(cfg.num_devices // procs
                          if cfg.platform == "cpu" else None))
  elif cfg.platform == "cpu":
    jax.config.update("jax_num_cpu_devices", cfg.num_devices)


def main(argv=None, *, set_devices: bool = False) -> dict[str, Any]:
  """Parses ``argv``, trains, prints the summary table; returns the result.

  ``set_devices=True`` (the script) makes ``--num-devices`` simulated CPU
  devices and joins a multi-process job; in a process where JAX already
  runs, leave it False and the first ``--num-devices`` devices are used.
  """
  cfg = parse_args(argv)
  if set_devices:
    configure_devices(cfg)
  result = run(cfg)
  if jax.process_index() == 0:
    r = result
    print()
    print(summary_table([r]))
    print("\n" + summary_line(r))
  return result


def summary_line(r: dict[str, Any]) -> str:
  """The run's last printed line: figures and what crossed the wire (on one
  device nothing does, so there is no ratio to give)."""
  if r["dense_bytes_per_step"]:
    wire = (f"{_fmt_bytes(r['bytes_per_step'])} sent per device per step vs "
            f"{_fmt_bytes(r['dense_bytes_per_step'])} dense "
            f"({r['compression_ratio']:.1f}x less)")
  else:
    wire = "one device: nothing crosses the wire"
  return (f"{r['model']} on {r['dataset']}, {r['num_devices']} devices, "
          f"{r['steps']} steps in {r['train_time_s']:.0f}s "
          f"({r['wall_time_s']:.0f}s with set-up): held-out loss "
          f"{r['eval_loss']:.4f}, accuracy {r['eval_accuracy']:.4f}; "
          f"{wire}. Outputs: {r['out_dir']}")


if __name__ == "__main__":
  try:
    main(sys.argv[1:], set_devices=True)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
