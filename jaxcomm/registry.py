"""The one list of jaxcomm's methods: name, factory, family and paper.

``train.py`` (its ``--compressor``, ``--optimizer`` and ``--local``
choices), the benchmarks, the test battery and the README's tables all read
this list, so a new compressor is its factory (in its family's module,
listed in that module's ``__all__``) plus one :class:`Method` line here.

  >>> import jaxcomm
  >>> m = jaxcomm.registry.get("topk")
  >>> tx = m.make(ratio=0.001)           # the factory, defaults filled in
  >>> [m.name for m in jaxcomm.registry.methods("compressor")][:3]
  ['dense', 'cast', 'int8']
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any
from typing import Callable
from typing import Mapping

import jax.numpy as jnp
import optax

from jaxcomm import transforms as _t

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
}


@dataclasses.dataclass(frozen=True)
class Method:
  """One public method.

  Attributes:
    name: its name on the command line and in tables.
    factory: the public factory (an attribute of ``jaxcomm``).
    family: a key of :data:`FAMILIES`.
    paper: the paper(s) it follows, as the README's table cites them.
    defaults: arguments used when the caller gives none (the required
      ones, e.g. ``ratio``, and the defaults ``train.py`` runs).
    static_args: arguments ``optax.inject_hyperparams`` must keep static
      (shapes, strings, booleans, seeds, policies).
    optimizer: for a compressor, the optimizer chained after it that the
      working learning rate below was measured with.
    lr: that learning rate (digits MLP, 8 devices: ``make bench-lr``),
      or None where it was not swept.
    aliases: other names ``train.py`` accepts.
    gossip: a decentralized method (no sync: params never agree exactly).
  """

  name: str
  factory: Callable[..., optax.GradientTransformation]
  family: str
  paper: str
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  static_args: tuple[str, ...] = ()
  optimizer: str | None = None
  lr: float | None = None
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

  def make(self, *args, **kwargs) -> optax.GradientTransformation:
    """The factory called with :attr:`defaults` under ``kwargs``."""
    return self.factory(*args, **{**self.defaults, **kwargs})


_STATIC_EF = ("error_feedback", "policy")
_STATIC_SPARSE = ("ratio", "granularity", "error_feedback", "policy")
_STATIC_STOCHASTIC = ("error_feedback", "policy", "seed")

METHODS: tuple[Method, ...] = (
  # -------------------------------------------------------------- dense --
  Method("dense", _t.mean_gradients, "compressor", "—",
         static_args=("axis_name",), optimizer="sgd momentum 0.9", lr=0.1,
         aliases=("none", "mean", "mean_gradients")),
  Method("cast", _t.cast, "compressor", "Micikevicius et al. 2018",
         defaults={"dtype": jnp.bfloat16},
         static_args=("dtype", "error_feedback", "policy"),
         optimizer="sgd momentum 0.9", lr=0.3, aliases=("bf16", "fp16")),
  # ------------------------------------------------------- quantization --
  Method("int8", _t.int8, "compressor", "Dettmers 2016",
         static_args=("bucket_size", "error_feedback", "policy"),
         optimizer="sgd momentum 0.9", lr=0.1),
  Method("uint8", _t.uint8, "compressor",
         "PyTorch DDP uint8 hook; Dettmers 2016",
         static_args=("bucket_size", "error_feedback", "policy"),
         optimizer="sgd momentum 0.9", lr=0.3),
  Method("qsgd", _t.qsgd, "compressor", "Alistarh et al. 2017",
         static_args=("levels", "bucket_size") + _STATIC_STOCHASTIC,
         optimizer="sgd momentum 0.9", lr=0.3),
  Method("terngrad", _t.terngrad, "compressor", "Wen et al. 2017",
         static_args=_STATIC_STOCHASTIC,
         optimizer="sgd momentum 0.9", lr=0.03),
  Method("natural", _t.natural, "compressor", "Horváth et al. 2019",
         static_args=_STATIC_STOCHASTIC,
         optimizer="sgd momentum 0.9", lr=0.3),
  Method("onebit", _t.onebit, "compressor",
         "Seide et al. 2014; Tang et al. 2021", static_args=_STATIC_EF,
         optimizer="sgd momentum 0.9", lr=0.03, aliases=("1bit",)),
  Method("signsgd", _t.signsgd, "compressor", "Bernstein et al. 2018",
         static_args=_STATIC_EF, optimizer="sgd", lr=0.001),
  Method("signum", _t.signum, "compressor", "Bernstein et al. 2018, 2019",
         static_args=_STATIC_EF, optimizer="sgd", lr=0.001),
  Method("ef_signsgd", _t.ef_signsgd, "compressor",
         "Karimireddy et al. 2019", static_args=_STATIC_EF,
         optimizer="sgd momentum 0.9", lr=0.03, aliases=("signsgd_ef",)),
  # ----------------------------------------------------- sparsification --
  Method("topk", _t.topk, "compressor",
         "Aji & Heafield 2017; Stich et al. 2018",
         defaults={"ratio": 0.01}, static_args=_STATIC_SPARSE + (
           "value_bits",), optimizer="sgd momentum 0.9", lr=0.03),
  Method("randomk", _t.randomk, "compressor", "Stich et al. 2018",
         defaults={"ratio": 0.01}, static_args=_STATIC_SPARSE,
         optimizer="sgd momentum 0.9", lr=0.01),
  Method("threshold", _t.threshold, "compressor", "Strom 2015",
         defaults={"value": 1e-3},
         static_args=("capacity_ratio", "error_feedback", "policy"),
         optimizer="sgd momentum 0.9", lr=0.1),
  Method("dgc", _t.dgc, "compressor", "Lin et al. 2018",
         defaults={"ratio": 0.001},
         static_args=("ratio", "warmup_steps_per_stage",
                      "warmup_densities", "sample_ratio", "exact", "max_rounds",
                      "error_feedback", "policy"),
         optimizer="sgd (momentum inside dgc)", lr=0.1),
  Method("gtopk", _t.gtopk, "compressor", "Shi et al. 2019",
         defaults={"ratio": 0.01}, static_args=_STATIC_SPARSE,
         optimizer="sgd momentum 0.9", lr=0.03),
  Method("csc", _t.csc, "compressor", "Sun et al. 2019 (GradientFlow)",
         defaults={"chunk_size": 64, "ratio": 0.01},
         static_args=("chunk_size", "ratio", "error_feedback", "policy"),
         optimizer="sgd momentum 0.9", lr=0.01),
  # ---------------------------------------------------------- low rank --
  Method("powersgd", _t.powersgd, "compressor", "Vogels et al. 2019",
         defaults={"rank": 4},
         static_args=("rank", "min_compression_rate", "error_feedback",
                      "warm_start", "num_iters_per_step", "seed", "policy",
                      "batch_same_shape", "orthogonalization",
                      "start_step"),
         optimizer="sgd momentum 0.9", lr=0.3),
  # --------------------------------------------------------- optimizers --
  Method("onebit_adam", _t.onebit_adam, "optimizer", "Tang et al. 2021",
         static_args=("freeze_step", "bias_correction", "policy")),
  Method("zero_one_adam", _t.zero_one_adam, "optimizer", "Lu et al. 2022",
         static_args=("var_freeze_step", "policy")),
  Method("onebit_lamb", _t.onebit_lamb, "optimizer", "Li et al. 2021",
         static_args=("freeze_step", "bias_correction", "policy")),
  # ------------------------------------------------------------- local --
  Method("local_sgd", _t.local_sgd, "local", "Stich 2018; Lin et al. 2020"),
  Method("adacomm", _t.adacomm, "local", "Wang & Joshi 2019"),
  Method("overlap_local_sgd", _t.overlap_local_sgd, "local",
         "Wang, Liang & Joshi 2020"),
  Method("dpsgd", _t.dpsgd, "local", "Lian et al. 2017; Ying et al. 2021",
         gossip=True),
  Method("choco", _t.choco, "local", "Koloskova et al. 2019", gossip=True),
  Method("sgp", _t.sgp, "local", "Assran et al. 2019", gossip=True),
  Method("diloco", _t.diloco, "local",
         "Douillard et al. 2023; Streaming DiLoCo 2025; SparseLoCo 2025"),
)

_BY_NAME = {m.name: m for m in METHODS}
_ALIASES = {a: m.name for m in METHODS for a in m.aliases}


def methods(family: str | None = None) -> list[Method]:
  """Every method, or those of one family (in table order)."""
  if family is not None and family not in FAMILIES:
    raise ValueError(f"family must be one of {sorted(FAMILIES)}, got "
                     f"{family!r}")
  return [m for m in METHODS if family is None or m.family == family]


def names(family: str | None = None) -> list[str]:
  """The names of :func:`methods`."""
  return [m.name for m in methods(family)]


def get(name: str, family: str | None = None) -> Method:
  """The method called ``name`` (or one of its aliases, any case).

  Raises:
    ValueError: naming ``name`` and the valid choices.
  """
  key = str(name).lower()
  key = _ALIASES.get(key, key)
  m = _BY_NAME.get(key)
  if m is None or (family is not None and m.family != family):
    raise ValueError(f"unknown method {name!r}"
                     + (f" of family {family!r}" if family else "")
                     + f"; valid choices: {', '.join(names(family))}")
  return m


def lookup(factory: Callable) -> Method | None:
  """The method whose factory is ``factory``, or None."""
  for m in METHODS:
    if m.factory is factory:
      return m
  return None
