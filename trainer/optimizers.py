"""Building the compressor and optimizers a run names: the compressor
factories and their defaults read from :mod:`jaxcomm.registry`, the
learning-rate schedule, the optimizer chained after the compressor, the
whole jaxcomm optimizers, ``--local`` and ``--delay``.

:mod:`trainer.config` (the command line) re-exports these names; this
module imports nothing from it (:class:`~trainer.settings.Config` is in
:mod:`trainer.settings`).
"""

from __future__ import annotations

import ast
import inspect
import math
from typing import Any

import jax.numpy as jnp
import optax

import jaxcomm
from trainer.settings import Config

# The mesh axis gradients are averaged over (the run's data axis).
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
  tx = _build("--compressor", key, factory, **call)
  return tx, key, kwargs



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
  params = _check_flag_args("--optimizer", cfg.optimizer, factory, kwargs,
                            ("learning_rate", "axis_name"))
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
  return _build("--optimizer", cfg.optimizer, factory, schedule,
                axis_name=axis_name, **kwargs)


def _check_flag_args(flag: str, name: str, factory, kwargs: dict,
                     reserved: tuple, also_valid: tuple = ()):
  """``flag NAME --...-args`` names only ``factory``'s parameters, none of
  the ``reserved`` ones the trainer passes itself; returns the
  parameters."""
  params = inspect.signature(factory).parameters
  unknown = [k for k in kwargs if k not in params or k in reserved]
  if unknown:
    valid = [k for k in params if k not in reserved] + list(also_valid)
    raise ValueError(f"{flag} {name} takes no argument(s) "
                     f"{', '.join(unknown)}; valid: {', '.join(valid)}")
  return params


LOCAL_METHODS = tuple(jaxcomm.registry.names("local"))
DELAY_METHODS = tuple(jaxcomm.registry.names("delay"))

# What the trainer fills in for a ``--local`` method beyond the registry's
# defaults: arguments of its own (DiLoCo's outer SGD) or ones the registry
# leaves to the caller.
_TRAINER_DEFAULTS = {
  "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9,
             "outer_nesterov": True},
  "muloco": {"outer_lr": 0.7, "outer_momentum": 0.9,
             "outer_nesterov": True},
  "choco": {"gamma": 0.5},
  "squarm": {"gamma": 0.5},
}


def method_defaults(family: str, name: str) -> dict[str, Any]:
  """The arguments ``train.py`` gives method ``name`` of ``family``
  (``"local"``, ``"delay"``, ...) when its ``--*-args`` leave them out:
  the registry's ``defaults`` (:func:`jaxcomm.registry.get`), then the
  trainer's own (DiLoCo's outer SGD, the gossip step ``gamma``). The help
  text lists these and the run applies them: one source for both."""
  out = {k: _cli_value(v)
         for k, v in jaxcomm.registry.get(name, family).defaults.items()}
  if family == "local":
    for k, v in _TRAINER_DEFAULTS.get(name, {}).items():
      out.setdefault(k, v)
  return out


def _build(flag: str, name: str, factory, *args, **kwargs):
  """``factory(*args, **kwargs)``; any error building it becomes a
  one-line ``ValueError`` naming ``flag name``."""
  try:
    return factory(*args, **kwargs)
  except (TypeError, ValueError) as e:
    text = " ".join(str(e).split())
    if text.startswith(flag):
      raise ValueError(text) from e
    raise ValueError(f"{flag} {name}: {text}") from e


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
  _check_flag_args("--delay", cfg.delay, factory, kwargs,
                   ("exchange", "axis_name"))
  for k, v in method_defaults("delay", cfg.delay).items():
    kwargs.setdefault(k, v)
  if "tau" in kwargs and isinstance(kwargs["tau"], str) and (
      kwargs["tau"] == "none"):
    kwargs["tau"] = None
  return _build("--delay", cfg.delay, factory, comp, **kwargs)


# Decentralized methods: no sync period, params never agree exactly.
GOSSIP_METHODS = tuple(m.name for m in jaxcomm.registry.methods("local")
                       if m.gossip)


# Local methods that take a compressor (``--compressor``): DiLoCo on its
# pseudo-gradients, the compressed gossip methods on model differences,
# FedCOM on model deltas, hierarchical averaging across groups.
COMPRESSED_LOCAL = ("diloco", "choco", "dcd_psgd", "ecd_psgd", "squarm",
                    "fedcom", "fedcomgate", "hierarchical_sgd")

# Local methods that average within groups and across them: they run on the
# pod mesh of ``--slices`` (groups are slices), ``axis_name=(slow, fast)``.
HIERARCHICAL_LOCAL = ("hierarchical_sgd",)


def make_local_optimizer(cfg: Config, inner, compressor, schedule,
                         axis_name=AXIS):
  """``--local METHOD --local-args ...`` around the inner optimizer;
  diloco's outer optimizer is SGD with ``outer_lr`` (0.7),
  ``outer_momentum`` (0.9) and ``outer_nesterov`` (True), as in the paper;
  ``compressor`` (None for dense) compresses its pseudo-gradients."""
  kwargs = parse_kwargs(cfg.local_args)
  factory = getattr(jaxcomm, cfg.local)
  params = inspect.signature(factory).parameters
  for k, v in method_defaults("local", cfg.local).items():
    if k in params or k.startswith("outer_"):
      kwargs.setdefault(k, v)
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
    lr = kwargs.pop("outer_lr")
    mom = kwargs.pop("outer_momentum")
    for name, v in (("outer_lr", lr), ("outer_momentum", mom)):
      if (isinstance(v, bool) or not isinstance(v, (int, float))
          or not math.isfinite(v) or v < 0):
        raise ValueError(f"--local-args {name}={v!r}: expected a finite "
                         "number >= 0")
    nesterov = kwargs.pop("outer_nesterov")
    extra["outer"] = optax.sgd(lr, momentum=mom or None,
                               nesterov=bool(nesterov and mom))
    if cfg.local == "diloco":
      extra["compressor"] = compressor
  if cfg.local in COMPRESSED_LOCAL and cfg.local not in ("diloco",
                                                          "muloco"):
    extra["compressor"] = compressor
  if cfg.local == "adacomm":
    kwargs.setdefault("learning_rate", schedule)
  _check_flag_args(
    "--local", cfg.local, factory, kwargs,
    ("inner", "outer", "compressor", "axis_name"),
    ("outer_lr", "outer_momentum", "outer_nesterov")
    if cfg.local in ("diloco", "muloco") else ())
  return _build("--local", cfg.local, factory, inner, axis_name=axis_name,
                **extra, **kwargs)


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
