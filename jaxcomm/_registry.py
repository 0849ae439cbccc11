"""Registration of public methods, beside their factories.

A family module marks each public factory with :func:`method`::

  @_registry.method(family="compressor", paper="Aji & Heafield 2017",
                    defaults={"ratio": 0.01}, static=("ratio",))
  @_compressor.shared_options
  def topk(ratio: float, *, ...):

This module imports no family module (they import it); the public view,
which first imports every family, is :mod:`jaxcomm.registry`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any
from typing import Callable
from typing import Mapping

import optax

# Keyword arguments every gradient compressor takes and forwards to
# ``jaxcomm.compressed``: the shared mechanism, not the method.
COMMON_KEYWORDS = ("axis_name", "policy", "error_feedback", "start_step",
                   "clip_norm", "momentum", "lr_schedule")

FAMILIES = {
  "compressor": "gradient compressors: chained before the optimizer, "
                "optax.chain(jaxcomm.<name>(...), optax.<opt>(lr))",
  "optimizer": "whole optimizers that exchange their own compressed "
               "momentum: jaxcomm.<name>(lr, ...)",
  "local": "local-update and decentralized methods around an inner "
           "optimizer: jaxcomm.<name>(inner, ...)",
  "delay": "when the averaged gradient is applied, around a compressor "
           "and before the optimizer: optax.chain(jaxcomm.<name>(jaxcomm."
           "<compressor>(...)), optax.<opt>(lr))",
}

# Annotations of hyperparameters optax.inject_hyperparams may trace (after
# dropping "| None"): real numbers and schedules. Every other parameter is
# static: ints and bools (which set shapes, seeds and branches), strings,
# dtypes, policies, inner optimizers, callables.
_TRACEABLE = frozenset({"float", "optax.ScalarOrSchedule", "ScalarOrSchedule",
                        "base.ScalarOrSchedule", "chex.Numeric"})
# The shared options of ``jaxcomm.compressed`` that are real numbers.
_TRACEABLE_SHARED = frozenset({"clip_norm", "momentum", "residual_decay",
                               "shift_rate"})


def _traceable(p: inspect.Parameter) -> bool:
  """Whether optax.inject_hyperparams may trace parameter ``p``."""
  if p.name in _TRACEABLE_SHARED and p.annotation is p.empty:
    return True
  ann = p.annotation
  if ann is p.empty:
    # Unannotated: a float default says it is a real number.
    return isinstance(p.default, float)
  text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
  text = re.sub(r"^Optional\[(.*)\]$", r"\1", text.strip())
  # The first member of a union decides: "float | None" and "float |
  # Callable[...]" (a rate or its schedule) are real numbers.
  return text.split("|")[0].strip() in _TRACEABLE


def derive_static_args(factory: Callable, extra: tuple[str, ...] = ()
                       ) -> tuple[str, ...]:
  """The arguments of ``factory`` that ``optax.inject_hyperparams`` must keep
  static: every parameter whose annotation is not a real number or a
  schedule, plus ``extra`` (real numbers that set a shape, such as top-k's
  ``ratio``)."""
  params = inspect.signature(factory).parameters
  unknown = [a for a in extra if a not in params]
  if unknown:
    raise ValueError(f"static names {unknown}, which {factory.__name__} "
                     "does not take")
  out = [name for name, p in params.items()
         if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
         and (name in extra or not _traceable(p))]
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Method:
  """One public method.

  Attributes:
    name: its name on the command line and in tables.
    factory: the public factory (an attribute of ``jaxcomm``).
    family: a key of :data:`FAMILIES`.
    paper: the paper(s) it follows, as the README's tables cite them.
    summary: what travels (a compressor) or how it syncs, one line for the
      README's table.
    defaults: arguments used when the caller gives none (the required
      ones, e.g. ``ratio``, and the defaults ``train.py`` runs).
    static_args: arguments ``optax.inject_hyperparams`` must keep static,
      derived from the factory's signature (:func:`derive_static_args`).
    aliases: other names ``train.py`` accepts.
    gossip: a decentralized method (no sync: params never agree exactly).
  """

  name: str
  factory: Callable[..., Any]
  family: str
  paper: str
  summary: str = ""
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  static_args: tuple[str, ...] = ()
  aliases: tuple[str, ...] = ()
  gossip: bool = False

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"Method {self.name!r}: family must be one of "
                       f"{sorted(FAMILIES)}, got {self.family!r}")

  @property
  def attr(self) -> str:
    """The factory's name on ``jaxcomm``."""
    return self.factory.__name__

  def parameters(self) -> Mapping[str, inspect.Parameter]:
    """The factory's parameters."""
    return inspect.signature(self.factory).parameters

  def required(self) -> dict[str, Any]:
    """The :attr:`defaults` of the parameters that have no default (what
    a call must pass)."""
    return {k: self.defaults[k] for k, p in self.parameters().items()
            if p.default is p.empty and k in self.defaults}

  def make(self, *args, **kwargs):
    """The factory called with :attr:`defaults` under ``kwargs``."""
    return self.factory(*args, **{**self.defaults, **kwargs})


class Built(optax.GradientTransformationExtraArgs):
  """What a registered factory returns: an
  ``optax.GradientTransformationExtraArgs`` that knows how it was built.

  ``repr`` names the method and the arguments that differ from the
  factory's defaults; two equal configurations compare equal (and hash
  alike), e.g. ``jaxcomm.topk(0.01) == jaxcomm.topk(ratio=0.01)``. It
  unpacks, chains and wraps as any Optax transformation.

  Attributes:
    method: the registered name.
    arguments: every argument of the call, defaults applied.
    changed: the arguments that differ from the defaults.
    spec: the compressor's static :class:`jaxcomm._codec.Spec` (codec,
      leaf policy, axis), or None for methods built otherwise.
  """

  def __new__(cls, tx, method_name: str, arguments: Mapping[str, Any],
              changed: Mapping[str, Any]):
    self = super().__new__(cls, tx.init, tx.update)
    self.method = method_name
    self.arguments = dict(arguments)
    self.changed = dict(changed)
    return self

  def __getnewargs__(self):
    # copy.copy / copy.deepcopy rebuild through __new__.
    return (optax.GradientTransformationExtraArgs(self.init, self.update),
            self.method, self.arguments, self.changed)

  @property
  def spec(self):
    return getattr(self.init, "jaxcomm_spec", None)

  def _key(self):
    return (self.method, tuple((k, repr(v))
                               for k, v in sorted(self.arguments.items())))

  def __eq__(self, other):
    return isinstance(other, Built) and self._key() == other._key()

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    args = ", ".join(f"{k}={_show(v)}" for k, v in self.changed.items())
    return f"jaxcomm.{self.method}({args})"


def _show(v) -> str:
  name = getattr(v, "__name__", None)
  if isinstance(v, type) and name:
    return f"jnp.{name}"
  return repr(v)


def _recording(factory: Callable, name: str) -> Callable:
  """``factory`` whose result is a :class:`Built` recording the call."""
  sig = inspect.signature(factory)

  @functools.wraps(factory)
  def build(*args, **kwargs):
    tx = factory(*args, **kwargs)
    bound = sig.bind(*args, **kwargs)
    changed = dict(bound.arguments)
    for k, p in sig.parameters.items():
      if p.kind is p.VAR_KEYWORD and k in changed:
        changed.update(changed.pop(k))
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for k, p in sig.parameters.items():
      if p.kind is p.VAR_KEYWORD and k in arguments:
        arguments.update(arguments.pop(k))
    changed = {k: v for k, v in changed.items()
               if k not in sig.parameters
               or sig.parameters[k].default is inspect.Parameter.empty
               or not _same(v, sig.parameters[k].default)}
    return Built(tx, name, arguments, changed)

  build.__signature__ = sig
  return build


def _same(a, b) -> bool:
  try:
    return bool(a is b or (type(a) is type(b) and a == b))
  except Exception:  # pylint: disable=broad-except
    return False


# Registration order within a family is table order.
_REGISTERED: list[Method] = []


def method(*, family: str, paper: str, summary: str = "",
           name: str | None = None, defaults: Mapping[str, Any] | None = None,
           static: tuple[str, ...] = (), aliases: tuple[str, ...] = (),
           gossip: bool = False) -> Callable:
  """Registers the decorated factory as a public method.

  Returns the factory wrapped so that what it builds is a :class:`Built`
  (the same transformation, with a ``repr`` and equality of its
  configuration).

  Args:
    family: a key of :data:`FAMILIES`.
    paper: the paper(s) the method follows.
    summary: one line for the README's table.
    name: the name on the command line (default: the factory's).
    defaults: arguments for a call that gives none (the required ones).
    static: real-number arguments that set a shape and so must stay static
      under ``optax.inject_hyperparams`` (everything not annotated as a real
      number or schedule is static already).
    aliases: other names ``train.py`` accepts.
    gossip: a decentralized method.
  """
  def register(factory):
    factory = _recording(factory, name or factory.__name__)
    m = Method(name=name or factory.__name__, factory=factory, family=family,
               paper=paper, summary=summary, defaults=dict(defaults or {}),
               static_args=derive_static_args(factory, tuple(static)),
               aliases=tuple(aliases), gossip=gossip)
    taken = {x.name for x in _REGISTERED} | {
      a for x in _REGISTERED for a in x.aliases}
    clash = ({m.name} | set(m.aliases)) & taken
    if clash:
      raise ValueError(f"method name(s) {sorted(clash)} already registered")
    missing = [k for k in m.defaults if k not in m.parameters()]
    if missing:
      raise ValueError(f"{m.name}: defaults name {missing}, which the "
                       "factory does not take")
    _REGISTERED.append(m)
    return factory
  return register


def registered() -> list[Method]:
  """Every registered method, in family order then registration order."""
  order = list(FAMILIES)
  return sorted(_REGISTERED, key=lambda m: order.index(m.family))


def unregister(name: str) -> None:
  """Removes a method (for tests that register a toy one)."""
  _REGISTERED[:] = [m for m in _REGISTERED if m.name != name]
