"""Every registered method refuses a bad argument by name when it is built:
non-finite floats, strings where a number goes, seeds that are not
non-negative ints; and a check names the first wrong argument."""

import math

import jax.numpy as jnp
import optax
import pytest

import jaxcomm
from jaxcomm import registry
from tests import harness

# The shared options of jaxcomm.compressed that take a float; the factories
# forward them through **options, unannotated.
_SHARED_FLOATS = ("clip_norm", "momentum", "residual_decay", "shift_rate")

# Float arguments for which an infinity or NaN is documented as meaningful,
# as {(method, argument): why}. None at present: "no clipping" and the
# like are spelled None, never inf.
_NONFINITE_ALLOWED: dict = {}


def _base(m) -> dict:
  """The arguments that build ``m`` (the registry's defaults, the
  harness's required values), on one device."""
  args = dict(m.defaults, **harness.required_args(m))
  if "axis_name" in m.parameters():
    args["axis_name"] = None
  return args


def _is_float(name, p) -> bool:
  text = str(p.annotation)
  return ("float" in text or "Schedule" in text
          or (isinstance(p.default, float) and not isinstance(p.default,
                                                              bool))
          or name in _SHARED_FLOATS)


def _is_number(name, p) -> bool:
  text = str(p.annotation)
  return _is_float(name, p) or "int" in text or (
    isinstance(p.default, int) and not isinstance(p.default, bool))


def _cases(pick):
  return [(m.name, k) for m in registry.methods()
          for k, p in m.parameters().items()
          if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
          if pick(k, p)]


def _refused(name, arg, value):
  m = registry.get(name)
  with pytest.raises(ValueError, match=rf"\b{arg}\b"):
    m.factory(**{**_base(m), arg: value})


def test_every_method_builds_from_its_base_arguments():
  for m in registry.methods():
    assert isinstance(m.factory(**_base(m)), optax.GradientTransformation)


def test_the_cases_cover_the_arguments_of_the_issue():
  floats = set(_cases(_is_float))
  assert {("ota_analog", "snr_db"), ("fedcom", "learning_rate"),
          ("fedcomgate", "learning_rate"), ("topk", "clip_norm"),
          ("dgc", "clip_norm")} <= floats
  assert ("sparcml", "ratio") in set(_cases(_is_number))
  assert ("gradiveq", "seed") in set(_cases(lambda k, p: k == "seed"))


@pytest.mark.parametrize("name,arg", _cases(_is_float))
def test_non_finite_floats_are_refused_by_name(name, arg):
  if (name, arg) in _NONFINITE_ALLOWED:
    pytest.skip(_NONFINITE_ALLOWED[(name, arg)])
  for value in (math.inf, -math.inf, math.nan):
    _refused(name, arg, value)


@pytest.mark.parametrize("name,arg", _cases(_is_number))
def test_a_string_for_a_number_is_refused_by_name(name, arg):
  _refused(name, arg, "1")
  _refused(name, arg, "0.1")


@pytest.mark.parametrize("name", [m.name for m in registry.methods()
                                  if "seed" in m.parameters()])
def test_seeds_are_non_negative_ints(name):
  for value in (1.5, -1, "1", True, 2**64):
    _refused(name, "seed", value)
  m = registry.get(name)
  m.factory(**{**_base(m), "seed": 7})           # a good one builds


def test_fedcom_names_the_period_before_the_learning_rate():
  for factory in (jaxcomm.fedcom, jaxcomm.fedcomgate):
    with pytest.raises(ValueError, match=r"^period must be"):
      factory(optax.sgd(0.1), 0, learning_rate=math.nan, axis_name=None)
    with pytest.raises(ValueError, match=r"^learning_rate must be"):
      factory(optax.sgd(0.1), 2, learning_rate=math.inf, axis_name=None)


@pytest.mark.parametrize("factory", [jaxcomm.topk, jaxcomm.scalecom,
                                     jaxcomm.sparcml, jaxcomm.stc])
def test_a_ratio_that_keeps_nothing_is_refused_at_init(factory):
  """``ratio * L < 1`` for the largest compressed leaf (4096 values):
  refused when ``init`` sees the leaves; ``1 / 4096`` keeps one."""
  params = {"w": jnp.zeros((64, 64))}
  policy = jaxcomm.LeafPolicy(min_size=1)
  tx = factory(1e-30, axis_name=None, policy=policy)
  with pytest.raises(ValueError, match=r"ratio=1e-30 keeps fewer than one"):
    tx.init(params)
  factory(1 / 4096, axis_name=None, policy=policy).init(params)
