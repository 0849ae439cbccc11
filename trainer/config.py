"""The command line of ``train.py``: its flags, which fill in a
:class:`~trainer.settings.Config` (importable from here too).

The choices come from the library's one list of methods
(:mod:`jaxcomm.registry`): a method registered there is selectable here
without changing this file. Building the compressor and optimizers a run
names is :mod:`trainer.optimizers`; its names are importable from here too.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import jaxcomm
import models
from trainer.optimizers import ALIASES  # noqa: F401
from trainer.optimizers import AXIS  # noqa: F401
from trainer.optimizers import COMM_OPTIMIZERS
from trainer.optimizers import COMPRESSED_LOCAL  # noqa: F401
from trainer.optimizers import COMPRESSORS  # noqa: F401
from trainer.optimizers import DELAY_METHODS
from trainer.optimizers import GOSSIP_METHODS  # noqa: F401
from trainer.optimizers import HIERARCHICAL_LOCAL  # noqa: F401
from trainer.optimizers import LOCAL_METHODS
from trainer.optimizers import OPTIMIZERS
from trainer.optimizers import aliases
from trainer.optimizers import available_compressors
from trainer.optimizers import build_compressor  # noqa: F401
from trainer.optimizers import compressors  # noqa: F401
from trainer.optimizers import make_comm_optimizer  # noqa: F401
from trainer.optimizers import make_delay  # noqa: F401
from trainer.optimizers import make_local_optimizer  # noqa: F401
from trainer.optimizers import make_optimizer  # noqa: F401
from trainer.optimizers import make_schedule  # noqa: F401
from trainer.optimizers import method_defaults
from trainer.optimizers import parse_kwargs  # noqa: F401
from trainer.optimizers import resolve_compressor  # noqa: F401
from trainer.settings import DEFAULT_COMPRESSOR  # noqa: F401
from trainer.settings import DEFAULT_COMPRESSOR_ARGS  # noqa: F401
from trainer.settings import Config

DESCRIPTION = "Data-parallel training with jaxcomm's gradient compressors."

# The pod mesh of --slices: between slices, inside a slice.
SLOW, FAST = "dcn", "ici"  # (AXIS, the data axis: trainer.optimizers)

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


# Used by the default job when jaxcomm has no powersgd.
FALLBACK = ("cast", "dtype=bfloat16,error_feedback=True")


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
      defaults = (method_defaults(family, m.name)
                  if family in ("local", "delay") else m.defaults)
      args = ",".join(f"{k}={getattr(v, '__name__', v)}"
                      for k, v in defaults.items())
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
                 "overlap_local_sgd: alpha; diloco: outer_lr, "
                 "outer_momentum, fragments, overlap_steps, alpha; "
                 "dpsgd: topology=ring|torus|hypercube|exponential, no "
                 "period; choco: topology=ring|torus, gamma, "
                 "compressing with --compressor; sgp: "
                 "topology=exponential; hierarchical_sgd: global_period, "
                 "with --slices S: groups are slices); what is left out "
                 "takes the default the method list below gives")
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
                 "between slices (the pod recipe); with --local "
                 "hierarchical_sgd, the groups it averages within")
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
