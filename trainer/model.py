"""The model and data a :class:`~trainer.config.Config` names: the dataset
split, the model's constructor arguments (``--model-args``, checked) and its
functional form."""

from __future__ import annotations

import inspect
import math
import typing
from typing import Any

import numpy as np

import models
from models import data as mdata
from trainer.config import Config
from trainer.config import parse_kwargs


def load_data(cfg: Config):
  """``(train, test, model_kwargs, dataset)``: arrays and size arguments."""
  models._registry.check_name(cfg.model)
  task = models.TASKS[cfg.model]
  dataset = cfg.dataset
  if dataset == "auto":
    dataset = {"charlm": "text", "transformer": "text",
               "resnet20": "cifar10"}.get(cfg.model, "digits")
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

