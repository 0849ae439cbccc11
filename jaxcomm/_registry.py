"""Registration of public methods, beside their factories.

A family module marks each public factory with :func:`method`::

  @_registry.method(paper="Aji & Heafield 2017",
                    defaults={"ratio": 0.01}, static=("ratio",))
  @_compressor.shared_options
  def topk(ratio: float, *, ...):

The family (and a compressor's kind) is the package the factory lives in,
``jaxcomm.transforms.<package>`` (:data:`PACKAGES`); a factory outside
``jaxcomm.transforms`` names its ``family`` (and may name its ``kind``).
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

# A compressor's kind: what its message is.
KINDS = ("quantize", "sparsify", "lowrank")

# Each package of jaxcomm.transforms: its family and, for compressors, kind.
PACKAGES = {
  "quantize": ("compressor", "quantize"),
  "sparsify": ("compressor", "sparsify"),
  "lowrank": ("compressor", "lowrank"),
  "optimizers": ("optimizer", None),
  "local": ("local", None),
  "gossip": ("local", None),
  "delay": ("delay", None),
}

# The built-in methods in the README's table order (within each family; the
# families come in FAMILIES' order). A method registered from outside
# jaxcomm.transforms follows these, in registration order.
TABLE_ORDER = (
  # compressor
  "dense", "cast", "topk", "randomk", "threshold", "adacomp", "powersgd",
  "atomo", "dgc", "qsgd", "terngrad", "int8", "int4", "uint8",
  "dist_ef_sgdm", "ecq_sgd", "gtopk", "csc", "gmc", "gradiveq", "ibcd", "lag",
  "mgs", "mx", "natural", "onebit", "signsgd", "signum", "ef_signsgd",
  "ota_analog", "ota_onebit", "qcs", "scalecom", "sidco", "fetchsgd",
  "sparcml", "stc", "sbc", "variance_sparsification",
  # optimizer
  "demo", "onebit_adam", "onebit_lamb", "zero_one_adam",
  # local
  "dpsgd", "choco", "sgp", "dcd_psgd", "ecd_psgd", "diloco", "muloco",
  "fedcom", "fedcomgate", "hierarchical_sgd", "local_sgd", "adacomm",
  "overlap_local_sgd", "lupa_sgd", "squarm",
  # delay
  "pipe_sgd", "stale_sgd",
)


def package_of(module: str) -> str | None:
  """The :data:`PACKAGES` key of ``module`` (a dotted module name), or None
  for a module outside ``jaxcomm.transforms``.

  Raises:
    ValueError: ``module`` is in ``jaxcomm.transforms`` but in no family
      package.
  """
  prefix = "jaxcomm.transforms."
  if not module.startswith(prefix):
    return None
  package = module[len(prefix):].split(".")[0]
  if package not in PACKAGES:
    raise ValueError(f"module {module!r} is in no family package of "
                     f"jaxcomm.transforms ({sorted(PACKAGES)})")
  return package


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
      derived from the factory's signature (``derive_static_args``).
    aliases: other names ``train.py`` accepts.
    gossip: a decentralized method (no sync: params never agree exactly).
    kind: a compressor's kind, one of :data:`KINDS` (None for the other
      families, and for a compressor from outside ``jaxcomm.transforms``
      that names none).
    gap: why the method, at its :attr:`defaults` and the rate
      ``docs/benchmarks/lr.json`` gives it, trains more than 2 accuracy
      points short of dense on a task of ``benchmarks/defaults.py`` (the
      measured figure is in ``docs/benchmarks/defaults.json`` and the
      README's table); empty where it is within on all three.

  Raises:
    ValueError: when ``family`` is not a key of :data:`FAMILIES`, or
      ``kind`` is set for another family or is not one of :data:`KINDS`.

  Examples:
    >>> import jaxcomm
    >>> m = jaxcomm.registry.get("powersgd")
    >>> m.family, m.kind, m.attr
    ('compressor', 'lowrank', 'powersgd')
    >>> m.required()                      # what a call must pass
    {'rank': 4}
    >>> m.make()                          # jaxcomm.powersgd(rank=4)
    jaxcomm.powersgd(rank=4)
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
  kind: str | None = None
  gap: str = ""

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"Method {self.name!r}: family must be one of "
                       f"{sorted(FAMILIES)}, got {self.family!r}")
    if self.kind is not None and (self.family != "compressor"
                                  or self.kind not in KINDS):
      raise ValueError(f"Method {self.name!r}: kind must be None or, for a "
                       f"compressor, one of {list(KINDS)}, got "
                       f"{self.kind!r} (family {self.family!r})")

  @property
  def attr(self) -> str:
    """The factory's name on ``jaxcomm``."""
    return self.factory.__name__

  def parameters(self) -> Mapping[str, inspect.Parameter]:
    """The factory's parameters.

    Returns:
      ``inspect.signature(factory).parameters``: an ordered mapping of
      name to ``inspect.Parameter`` (the shared compressor options
      included).
    """
    return inspect.signature(self.factory).parameters

  def required(self) -> dict[str, Any]:
    """The :attr:`defaults` of the parameters that have no default.

    Returns:
      A dict of what a call must pass (e.g. top-k's ``ratio``), with the
      values :meth:`make` uses.
    """
    return {k: self.defaults[k] for k, p in self.parameters().items()
            if p.default is p.empty and k in self.defaults}

  def make(self, *args, **kwargs):
    """The factory called with :attr:`defaults` under ``kwargs``.

    Args:
      *args: positional arguments for the factory.
      **kwargs: keyword arguments for the factory; they override
        :attr:`defaults`.

    Returns:
      What the factory returns (an Optax transformation).
    """
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


# In registration order; registered() puts them in table order.
_REGISTERED: list[Method] = []


def _family_and_kind(factory: Callable, family: str | None,
                      kind: str | None) -> tuple[str, str | None]:
  """``factory``'s family and kind: from its package in
  ``jaxcomm.transforms`` (:data:`PACKAGES`), which ``family`` and ``kind``
  may only repeat, or else as given (``family`` required)."""
  where = factory.__module__
  package = package_of(where)
  if package is None:
    if family is None:
      raise ValueError(f"{factory.__name__} (in {where}) needs family=, one "
                       f"of {sorted(FAMILIES)}: only the packages of "
                       "jaxcomm.transforms imply it")
    return family, kind
  want = PACKAGES[package]
  if family is not None and family != want[0]:
    raise ValueError(f"{factory.__name__} is in jaxcomm.transforms.{package} "
                     f"(family {want[0]!r}); family={family!r} contradicts it")
  if kind is not None and kind != want[1]:
    raise ValueError(f"{factory.__name__} is in jaxcomm.transforms.{package} "
                     f"(kind {want[1]!r}); kind={kind!r} contradicts it")
  return want


def method(*, paper: str, family: str | None = None,
           kind: str | None = None, summary: str = "",
           name: str | None = None, defaults: Mapping[str, Any] | None = None,
           static: tuple[str, ...] = (), aliases: tuple[str, ...] = (),
           gossip: bool = False, gap: str = "") -> Callable:
  """Registers the decorated factory as a public method.

  Args:
    paper: the paper(s) the method follows.
    family: a key of :data:`FAMILIES`; implied by the package for a factory
      in ``jaxcomm.transforms`` (where it may only repeat it), required
      elsewhere.
    kind: a compressor's kind (:data:`KINDS`); implied likewise, optional
      elsewhere.
    summary: one line for the README's table.
    name: the name on the command line (default: the factory's).
    defaults: arguments for a call that gives none (the required ones).
    static: real-number arguments that set a shape and so must stay static
      under ``optax.inject_hyperparams`` (everything not annotated as a real
      number or schedule is static already).
    aliases: other names ``train.py`` accepts.
    gossip: a decentralized method.
    gap: why its defaults train more than 2 points short of dense on a
      task of ``benchmarks/defaults.py`` (:attr:`Method.gap`).

  Returns:
    A decorator. It returns the factory wrapped so that what it builds is
    a ``Built`` transformation (the same transformation, with a ``repr``
    and equality of its configuration), and adds the method to
    :func:`jaxcomm.registry.methods`.

  Raises:
    ValueError: when the decorator is applied: the family or kind is
      missing or not one of :data:`FAMILIES` / :data:`KINDS`, the name or
      an alias is taken, ``defaults`` or ``static`` name an argument the
      factory does not take.
  """
  def register(factory):
    fam, knd = _family_and_kind(factory, family, kind)
    factory = _recording(factory, name or factory.__name__)
    m = Method(name=name or factory.__name__, factory=factory, family=fam,
               paper=paper, summary=summary, defaults=dict(defaults or {}),
               static_args=derive_static_args(factory, tuple(static)),
               aliases=tuple(aliases), gossip=gossip, kind=knd, gap=gap)
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
  """Every registered method: in family order, then the built-in ones in
  :data:`TABLE_ORDER`, then the others in registration order."""
  order = list(FAMILIES)
  rank = {n: i for i, n in enumerate(TABLE_ORDER)}
  return sorted(_REGISTERED, key=lambda m: (
    order.index(m.family), rank.get(m.name, len(rank))))


def unregister(name: str) -> None:
  """Removes a method (for tests that register a toy one)."""
  _REGISTERED[:] = [m for m in _REGISTERED if m.name != name]
