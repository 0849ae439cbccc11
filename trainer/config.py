"""The command line of ``train.py``: flags, :class:`Config`, and building the
compressor and optimizers a run names.

The choices come from the library's one list of methods
(:mod:`jaxcomm.registry`): a method registered there is selectable here
without changing this file.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import optax

import jaxcomm
import models

DESCRIPTION = "Data-parallel training with jaxcomm's gradient compressors."

AXIS = "data"
# The pod mesh of --slices: between slices, inside a slice.
SLOW, FAST = "dcn", "ici"

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


# What ``make bench-lr`` measured per compressor: the optimizer chained after
# it and the learning rate of the lowest held-out loss.
MEASURED_LR_PATH = os.path.join(os.path.dirname(os.path.dirname(
  os.path.abspath(__file__))), "docs", "benchmarks", "lr.json")


def measured_lr() -> dict[str, dict[str, Any]]:
  """``{method: {"optimizer": ..., "lr": ...}}`` from
  ``docs/benchmarks/lr.json`` (``lr`` None where the sweep did not run)."""
  with open(MEASURED_LR_PATH, encoding="utf-8") as f:
    data = json.load(f)
  return {k: v for k, v in data.items() if not k.startswith("_")}


def compressors() -> dict[str, tuple[str, dict[str, Any]]]:
  """``{name: (factory name, defaults)}`` of every registered compressor,
  read from ``jaxcomm.registry`` when called (a compressor registered after
  this module was imported is a choice too)."""
  return {m.name: (m.attr, {k: _cli_value(v) for k, v in m.defaults.items()})
          for m in jaxcomm.registry.methods("compressor")}


def aliases() -> dict[str, str]:
  """``{alias: name}`` of every registered method."""
  return {a: m.name for m in jaxcomm.registry.methods() for a in m.aliases}


# The registry as this module found it at import (for readers of tables).
COMPRESSORS = compressors()
ALIASES = aliases()
DEFAULT_COMPRESSOR = "powersgd"
DEFAULT_COMPRESSOR_ARGS = "rank=4"
# Used by the default job when jaxcomm has no powersgd.
FALLBACK = ("cast", "dtype=bfloat16,error_feedback=True")

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
           "float16": jnp.float16, "fp16": jnp.float16,
           "float8_e4m3fn": jnp.float8_e4m3fn,
           "float8_e5m2": jnp.float8_e5m2,
           "float32": jnp.float32}


def available_compressors() -> list[str]:
  """The registered compressors' names, in table order."""
  return jaxcomm.registry.names("compressor")


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
    if key in out:
      raise ValueError(f"argument {key!r} is given twice in {text!r}")
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
  key = aliases().get(name.lower(), name.lower())
  avail = available_compressors()
  if key in avail:
    return key
  raise ValueError(
    f"unknown compressor: {name!r}; valid choices: {', '.join(avail)}")


def build_compressor(name: str, args: dict[str, Any] | str | None = None, *,
                     axis_name=AXIS):
  """``(tx, canonical_name, kwargs)`` for compressor ``name``.

  The factory is looked up in ``jaxcomm.registry`` when called, so a
  registered compressor is selectable without changing this file. Its
  registry defaults fill the parameters the user did not give; ``dtype``
  strings become JAX dtypes.
  """
  key = resolve_compressor(name)
  _, defaults = compressors()[key]
  factory = jaxcomm.registry.get(key, "compressor").factory
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
  delay: str = "none"          # none | pipe_sgd | stale_sgd
  delay_args: str = ""         # e.g. width=2 (pipe_sgd), tau=1 (stale_sgd)
  lr: float = 3e-3
  momentum: float = 0.9
  weight_decay: float = 0.0
  schedule: str = "cosine"     # constant | cosine | warmup_cosine | step
  warmup_steps: int = 50
  num_devices: int = 8
  slices: int = 1              # > 1: a ("dcn", "ici") pod mesh
  sharded_exchange: bool = False  # with slices: one exchange per slice
  mesh: str | None = None      # e.g. dcn=2,fsdp=4: a sharded model
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
                 "batch_size", "steps", "seed", "slices",
                 "sharded_exchange")


def parse_mesh(text: str) -> dict[str, int]:
  """``"dcn=2,fsdp=4"`` -> ``{"dcn": 2, "fsdp": 4}`` (ordered); ValueError
  naming ``--mesh`` and what is wrong."""
  out = {}
  for part in str(text).split(","):
    name, eq, size = part.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
      raise ValueError(f"--mesh {text!r}: expected AXIS=SIZE,... (e.g. "
                       "dcn=2,fsdp=4), got the part {part!r}")
    try:
      k = int(size)
    except ValueError:
      k = 0
    if k < 1:
      raise ValueError(f"--mesh {text!r}: the size of {name!r} must be an "
                       f"integer >= 1, got {size!r}")
    if name in out:
      raise ValueError(f"--mesh {text!r}: axis {name!r} is named twice")
    out[name] = k
  if len(out) < 2:
    raise ValueError(f"--mesh {text!r}: name the data axis and at least one "
                     "model axis (e.g. dcn=2,fsdp=4); a data axis alone is "
                     "--num-devices")
  return out


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
            "local": "--local (around --optimizer, run per device)",
            "delay": "--delay (around --compressor)"}
  lines = []
  lrs = measured_lr()
  for family, title in titles.items():
    lines.append(f"{title}:")
    for m in jaxcomm.registry.methods(family):
      tail = ""
      lr = lrs.get(m.name, {})
      if lr.get("lr") is not None:
        tail = f"  [{lr['optimizer']}, lr {lr['lr']:g}]"
      args = ",".join(f"{k}={getattr(v, '__name__', v)}"
                      for k, v in m.defaults.items())
      lines.append(f"  {m.name:<18} {m.paper}"
                   + (f" (default {args})" if args else "") + tail)
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  """The command line: every flag with a help text and its default."""
  d = Config()
  p = argparse.ArgumentParser(
    prog="train.py", description=DESCRIPTION,
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
                 help=f"one of {', '.join(available_compressors())} "
                 "(those in this "
                 f"build of jaxcomm; default {d.compressor}, or "
                 f"{FALLBACK[0]} where jaxcomm has no {d.compressor})")
  g.add_argument("--compressor-args", default=None,
                 help="factory arguments, e.g. rank=4,start_step=10 "
                 f"(default for {d.compressor}: {d.compressor_args})")
  g.add_argument("--optimizer", default=d.optimizer,
                 choices=OPTIMIZERS,
                 help="applied to the compressed mean; onebit_adam, "
                 "onebit_lamb, zero_one_adam and demo are whole optimizers "
                 "that exchange their own compressed momentum (use them "
                 "with --compressor dense, the default for them)")
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
  g.add_argument("--delay", default=d.delay, choices=("none",)
                 + DELAY_METHODS,
                 help="apply the compressor's average late: pipe_sgd "
                 "(width - 1 steps), stale_sgd (each device's gradient "
                 "tau_i steps old); around --compressor, before "
                 "--optimizer")
  g.add_argument("--delay-args", default=d.delay_args,
                 help="arguments of --delay, e.g. width=3 (pipe_sgd) or "
                 "tau=2 / tau_max=4 (stale_sgd; no tau: random up to "
                 "tau_max)")
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
  g.add_argument("--slices", type=int, default=d.slices,
                 help="> 1: cut the devices, in order, into this many "
                 "slices (hosts) on a ('dcn', 'ici') mesh; gradients are "
                 "averaged densely inside a slice and --compressor runs "
                 "between slices (the pod recipe)")
  _add_bool(g, "sharded-exchange", d.sharded_exchange,
            "with --slices: run --compressor between slices once per "
            "slice, each device on its share of the values "
            "(jaxcomm.parallel.sharded_exchange; not PowerSGD)")
  g.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                 help="a sharded model, e.g. dcn=2,fsdp=4 or "
                 "dcn=2,fsdp=2,tensor=2: the first axis is the data axis "
                 "(--compressor runs over it), the others are left to the "
                 "compiler (params split by the model's logical axes: "
                 "embed over fsdp, mlp and heads over tensor; the batch over "
                 "every axis but tensor); --model transformer")
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
                 "corrupt) instead of the latest; the newer steps are moved "
                 "to checkpoints/abandoned/; implies --resume")
  _add_bool(g, "overwrite", d.overwrite,
            "start afresh in an --out-dir that has checkpoints")
  g.add_argument("--eval-every", type=int, default=d.eval_every,
                 help="held-out evaluation every this many steps (0: only "
                 "at the end)")
  g.add_argument("--eval-examples", type=int, default=d.eval_examples,
                 help="held-out examples per evaluation")
  g.add_argument("--log-every", type=int, default=d.log_every,
                 help="a metrics.jsonl line every this many steps")
  _add_bool(g, "progress", d.progress, "tqdm progress bar on a terminal; "
            "off one, a plain line every few steps")
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
    same = aliases().get(values["compressor"].lower(),
                       values["compressor"].lower())
    values["compressor_args"] = (d.compressor_args
                                 if same == d.compressor else "")
  if values["resume_from"] is not None:
    values["resume"] = True
  return Config(**values)


# ------------------------------------------------------------- optimizers --

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
              "lamb", "muon") + COMM_OPTIMIZERS


def make_comm_optimizer(cfg: Config, schedule, axis_name=AXIS):
  """A jaxcomm optimizer (``--optimizer onebit_adam|onebit_lamb|demo``)
  with ``--optimizer-args`` (``freeze_step``, where the optimizer takes
  one, defaults to 20% of the steps)."""
  factory = getattr(jaxcomm, cfg.optimizer)
  kwargs = parse_kwargs(cfg.optimizer_args)
  params = inspect.signature(factory).parameters
  unknown = [k for k in kwargs if k not in params
             or k in ("learning_rate", "axis_name")]
  if unknown:
    valid = [k for k in params if k not in ("learning_rate", "axis_name")]
    raise ValueError(f"--optimizer {cfg.optimizer} takes no argument(s) "
                     f"{', '.join(unknown)}; valid: {', '.join(valid)}")
  freeze = ("var_freeze_step" if cfg.optimizer == "zero_one_adam"
            else "freeze_step")
  if freeze in params:   # the Adam family's warm-up (not DeMo's)
    kwargs.setdefault(freeze, max(cfg.steps // 5, 1))
  if kwargs.get(freeze) == 0 and not cfg.resume:
    # A frozen variance comes from the warm-up: a fresh state's is zero,
    # and the first step would divide by eps.
    raise ValueError(
      f"--optimizer-args {freeze}=0 freezes a variance that no warm-up "
      f"step estimated (a new run's is 0): give {freeze} >= 1, or 0 only "
      "with --resume, to continue a run whose warm-up is done")
  kwargs.setdefault("weight_decay", cfg.weight_decay)
  return factory(schedule, axis_name=axis_name, **kwargs)


LOCAL_METHODS = tuple(jaxcomm.registry.names("local"))
DELAY_METHODS = tuple(jaxcomm.registry.names("delay"))


def make_delay(cfg: Config, comp):
  """``--delay METHOD --delay-args ...`` around the compressor ``comp``
  (``comp`` itself with ``--delay none``)."""
  if cfg.delay == "none":
    return comp
  if cfg.local != "none":
    raise ValueError(f"--delay {cfg.delay} delays the averaged gradient; "
                     f"--local {cfg.local} averages params: use one")
  kwargs = parse_kwargs(cfg.delay_args)
  factory = getattr(jaxcomm, cfg.delay)
  params = inspect.signature(factory).parameters
  unknown = [k for k in kwargs if k not in params
             or k in ("exchange", "axis_name")]
  if unknown:
    valid = [k for k in params if k not in ("exchange", "axis_name")]
    raise ValueError(f"--delay {cfg.delay} takes no argument(s) "
                     f"{', '.join(unknown)}; valid: {', '.join(valid)}")
  if "tau" in kwargs and isinstance(kwargs["tau"], str) and (
      kwargs["tau"] == "none"):
    kwargs["tau"] = None
  return factory(comp, **kwargs)
# Decentralized methods: no sync period, params never agree exactly.
GOSSIP_METHODS = tuple(m.name for m in jaxcomm.registry.methods("local")
                       if m.gossip)


# Local methods that take a compressor (``--compressor``): DiLoCo on its
# pseudo-gradients, the compressed gossip methods on model differences,
# FedCOM on model deltas, hierarchical averaging across groups.
COMPRESSED_LOCAL = ("diloco", "choco", "dcd_psgd", "ecd_psgd", "squarm",
                    "fedcom", "fedcomgate")


def make_local_optimizer(cfg: Config, inner, compressor, schedule,
                         axis_name=AXIS):
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
  if cfg.local == "muloco" and compressor is not None:
    raise ValueError(
      "--local muloco quantizes its pseudo-gradients itself (--local-args "
      "bits=2|4|8): use --compressor dense")
  if compressor is not None and cfg.local not in COMPRESSED_LOCAL:
    raise ValueError(
      f"--local {cfg.local} averages params with a dense all-reduce; "
      f"--compressor applies to {', '.join(COMPRESSED_LOCAL)} only (use "
      "--compressor dense)")
  extra = {}
  if cfg.local in ("diloco", "muloco"):
    lr = kwargs.pop("outer_lr", 0.7)
    mom = kwargs.pop("outer_momentum", 0.9)
    for name, v in (("outer_lr", lr), ("outer_momentum", mom)):
      if (isinstance(v, bool) or not isinstance(v, (int, float))
          or not math.isfinite(v) or v < 0):
        raise ValueError(f"--local-args {name}={v!r}: expected a finite "
                         "number >= 0")
    nesterov = kwargs.pop("outer_nesterov", True)
    extra["outer"] = optax.sgd(lr, momentum=mom or None,
                               nesterov=bool(nesterov and mom))
    if cfg.local == "diloco":
      extra["compressor"] = compressor
  if cfg.local in COMPRESSED_LOCAL and cfg.local not in ("diloco",
                                                          "muloco"):
    extra["compressor"] = compressor
  if cfg.local in ("choco", "squarm"):
    kwargs.setdefault("gamma", 0.5)
  if cfg.local == "adacomm":
    kwargs.setdefault("learning_rate", schedule)
  params = inspect.signature(factory).parameters
  unknown = [k for k in kwargs if k not in params
             or k in ("inner", "outer", "compressor", "axis_name")]
  if unknown:
    valid = [k for k in params if k not in ("inner", "outer", "compressor",
                                            "axis_name")]
    if cfg.local in ("diloco", "muloco"):
      valid += ["outer_lr", "outer_momentum", "outer_nesterov"]
    raise ValueError(f"--local {cfg.local} takes no argument(s) "
                     f"{', '.join(unknown)}; valid: {', '.join(valid)}")
  return factory(inner, axis_name=axis_name, **extra, **kwargs)


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
  if cfg.optimizer == "muon":
    # Muon on the matrices, AdamW (at the same rate) on the other leaves.
    return optax.contrib.muon(schedule, weight_decay=cfg.weight_decay)
  raise ValueError(f"unknown optimizer {cfg.optimizer!r}; valid: "
                   f"{', '.join(OPTIMIZERS)}")

