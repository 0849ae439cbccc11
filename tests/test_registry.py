"""jaxcomm.registry is the one list: the package's exports, the battery,
train.py's choices and the README's tables all agree with it."""

import dataclasses
import inspect
import json
import os
import re

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
import train
from benchmarks import readme_tables
from jaxcomm import registry
from tests import harness
from tests import registry as battery

_README = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                       "README.md")
# Public callables that are helpers, not methods.
# spy: a solver for L1-regularized problems (Grishchenko et al.), not a
# method for train.py's models.
_HELPERS = {"apply_updates", "local_states", "lupa_increment", "spy"}


def test_every_public_factory_is_registered_and_exported():
  """A lowercase public callable of jaxcomm.transforms is a method of the
  registry (or a named helper), and each method's factory is what
  ``jaxcomm.<attr>`` is."""
  public = {n for n in jaxcomm.transforms.__all__
            if n[0].islower() and callable(getattr(jaxcomm.transforms, n))}
  assert public - _HELPERS == {m.attr for m in registry.methods()}
  for m in registry.methods():
    assert getattr(jaxcomm, m.attr) is m.factory, m.name
    assert registry.get(m.name) is m
    assert registry.lookup(m.factory) is m
  for n in jaxcomm.transforms.__all__:   # state types too
    assert getattr(jaxcomm, n) is getattr(jaxcomm.transforms, n), n


def test_compressors_take_the_common_keywords():
  """Every compressor but the plain dense mean forwards the shared options
  of ``compressed()``; the whole optimizers and local methods take the
  axis."""
  for m in registry.methods("compressor"):
    params = m.parameters()
    if m.name == "dense":
      assert list(params) == ["axis_name"]
      continue
    missing = [k for k in registry.COMMON_KEYWORDS if k not in params]
    assert not missing, f"{m.name} lacks {missing}"
  for m in registry.methods("optimizer") + registry.methods("local"):
    assert "axis_name" in m.parameters(), m.name


@pytest.mark.parametrize("name", registry.names("compressor"))
def test_defaults_build_and_static_args_are_parameters(name):
  """``Method.make()`` builds with the registry's defaults alone, and every
  static argument and default is a real parameter of the factory."""
  m = registry.get(name)
  params = m.parameters()
  assert set(m.defaults) <= set(params), name
  assert set(m.static_args) <= set(params), (name, m.static_args)
  tx = m.make()
  assert isinstance(tx, optax.GradientTransformation)
  # inject_hyperparams with the registry's static args wraps it.
  static = tuple(set(m.static_args) & set(m.defaults)) + ("axis_name",)
  wrapped = optax.inject_hyperparams(m.factory, static_args=static)(
    **m.defaults)
  assert isinstance(wrapped, optax.GradientTransformation)


@pytest.mark.parametrize("name", registry.names("compressor"))
def test_every_codec_is_a_frozen_dataclass_value(name):
  """A compressor's codec is a frozen dataclass behind the Codec protocol:
  its fields (the hyperparameters) print in its repr, two builds of the
  same configuration give equal codecs that hash alike, and a field
  cannot be assigned."""
  m = registry.get(name)
  codec, again = jaxcomm.spec_of(m.make()).codec, jaxcomm.spec_of(
    m.make()).codec
  assert dataclasses.is_dataclass(codec), (name, type(codec))
  assert isinstance(codec, jaxcomm.Codec) and isinstance(
    codec, jaxcomm.CodecBase), name
  assert codec == again and hash(codec) == hash(again), name
  assert isinstance(codec.name, str) and codec.name, name
  for f in dataclasses.fields(codec):
    if not f.init:
      # Bookkeeping, not a hyperparameter (PowerSGD's warned-about
      # shapes): out of the repr, the comparison and the hash.
      assert not (f.repr or f.compare or f.hash), (name, f.name)
      continue
    assert f"{f.name}=" in repr(codec), (name, f.name, repr(codec))
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(codec, f.name, getattr(codec, f.name))
  # A capability is there as a method or not at all.
  for cap, members in ((jaxcomm.GossipCodec, ("message", "decode")),
                       (jaxcomm.SteppedCodec, ("wire_at",))):
    has = [callable(getattr(codec, a, None)) for a in members]
    assert all(has) or not any(has), (name, members)
    assert isinstance(codec, cap) == all(has), (name, cap)


def test_codecs_of_other_configurations_differ():
  spec = jaxcomm.spec_of
  assert spec(jaxcomm.topk(0.01)).codec == spec(jaxcomm.topk(0.01)).codec
  assert spec(jaxcomm.topk(0.01)).codec != spec(jaxcomm.topk(0.02)).codec
  assert spec(jaxcomm.powersgd(2)).codec != spec(jaxcomm.powersgd(4)).codec
  assert spec(jaxcomm.cast("bfloat16")).codec == (
    jaxcomm.transforms.quantize._dense.CastCodec("bfloat16"))
  # Gossip is a capability of top-k's float32 message only.
  assert isinstance(spec(jaxcomm.topk(0.01)).codec, jaxcomm.GossipCodec)
  assert not isinstance(spec(jaxcomm.topk(0.01, value_bits=2)).codec,
                        jaxcomm.GossipCodec)
  assert isinstance(spec(jaxcomm.dgc(0.01)).codec, jaxcomm.SteppedCodec)
  assert not isinstance(spec(jaxcomm.topk(0.01)).codec,
                        jaxcomm.SteppedCodec)


def test_compressed_refuses_what_is_not_a_codec():
  with pytest.raises(TypeError, match="codec must be a jaxcomm.Codec.*"
                     "without .*apply"):
    jaxcomm.compressed(object())


def test_get_names_the_choices():
  with pytest.raises(ValueError, match=r"unknown method 'nope'; valid "
                     r"choices: dense, cast"):
    registry.get("nope")
  with pytest.raises(ValueError, match="of family 'compressor'"):
    registry.get("diloco", "compressor")
  with pytest.raises(ValueError, match="family must be one of"):
    registry.methods("compressors")
  assert registry.get("BF16").name == "cast"
  assert registry.get("1bit").name == "onebit"


def test_battery_covers_the_registry():
  """Each compressor and whole optimizer has a battery entry, and each
  battery entry's factory is in the registry (static args come from it)."""
  entries = battery.load()
  covered = {registry.lookup(e.factory).name for e in entries.values()}
  want = set(registry.names("compressor")) | set(registry.names("optimizer"))
  # zero_one_adam is a local-update optimizer (params per device between
  # syncs): its reference lives in tests/test_local.py. The simulated
  # over-the-air channels are replayed from the same key draws in
  # tests/test_over_the_air.py (the battery's references take no key of
  # the codec's own).
  assert want - covered == {"zero_one_adam", "ota_analog", "ota_onebit"}
  for e in entries.values():
    m = registry.lookup(e.factory)
    assert m is not None, e.name
    assert set(e.static_args) == set(m.static_args), e.name


def test_train_reads_the_registry():
  """train.py's choices are the registry's, and --help lists every
  method with its paper."""
  assert list(train.COMPRESSORS) == registry.names("compressor")
  assert train.COMM_OPTIMIZERS == tuple(registry.names("optimizer"))
  assert train.LOCAL_METHODS == tuple(registry.names("local"))
  assert set(train.GOSSIP_METHODS) == {"dpsgd", "choco", "sgp", "dcd_psgd",
                                       "ecd_psgd", "squarm"}
  text = train.build_parser().format_help()
  for m in registry.methods():
    assert re.search(rf"^  {m.name} +{re.escape(m.paper)}", text,
                     re.M), m.name
  for alias, name in train.ALIASES.items():
    assert train.resolve_compressor(alias) == name


def _readme_rows():
  """(first cell, last cell) of every README table row whose first cell
  names a factory call."""
  with open(_README, encoding="utf-8") as f:
    text = f.read()
  rows = []
  for line in text.splitlines():
    if re.match(r"\| `\w+\(", line):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      rows.append((cells[0], cells))
  return rows


def test_readme_tables_match_the_registry():
  """Every method has a README row (its factory called in the first cell)
  citing the registry's paper; every factory a row names is a method."""
  rows = _readme_rows()
  named = set()
  for first, _ in rows:
    named |= set(re.findall(r"`(\w+)\(", first))
  attrs = {m.attr for m in registry.methods()}
  for m in registry.methods():
    mine = [cells for first, cells in rows
            if re.search(rf"`{m.attr}\(", first)]
    assert mine, f"README has no table row for {m.attr}"
    assert any(m.paper in c for cells in mine for c in cells), (
      f"README row for {m.attr} does not cite {m.paper!r}")
  assert named <= attrs, named - attrs


def _compressor_table():
  """README's compressor table as {factory attr: {header: cell}}, read
  from the markdown itself (cells split at unescaped pipes)."""
  with open(_README, encoding="utf-8") as f:
    text = f.read()
  block = text.split("<!-- registry:compressor -->")[1].split(
    "<!-- /registry:compressor -->")[0]
  lines = [ln for ln in block.strip().splitlines() if ln.startswith("|")]
  split = lambda ln: [c.strip() for c in
                      re.split(r"(?<!\\)\|", ln.strip())[1:-1]]
  header = split(lines[0])
  table = {}
  for ln in lines[2:]:
    cells = dict(zip(header, split(ln), strict=True))
    attr = re.match(r"`(\w+)\(", cells[header[0]]).group(1)
    table[attr] = cells
  return header, table


def test_readme_gives_the_working_learning_rate():
  """Friction: rates differ ~100x between compressors, and a method that
  keeps its own momentum wants plain SGD after it (dist_ef_sgdm with
  momentum SGD at its rate: 34.8% on digits instead of 84.0%). The
  compressor table's "then" column is, for every compressor,
  docs/benchmarks/lr.json's optimizer and rate, read here from the json
  and the markdown independently of the generator."""
  with open(os.path.join(os.path.dirname(_README), "docs", "benchmarks",
                         "lr.json"), encoding="utf-8") as f:
    lrs = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
  assert set(lrs) == set(registry.names("compressor"))
  header, table = _compressor_table()
  column = next(h for h in header if h.startswith("then"))
  assert "lr" in column, header
  cell_re = re.compile(r"`optax\.sgd\(([0-9.e+-]+)(?:, momentum=([0-9.]+))?"
                       r"\)`(?: \((.+)\))?")
  for m in registry.methods("compressor"):
    entry, cell = lrs[m.name], table[m.attr][column]
    if entry["lr"] is None:
      assert cell == "not swept", (m.name, cell)
      continue
    got = cell_re.fullmatch(cell)
    assert got, (m.name, cell)
    assert float(got.group(1)) == entry["lr"], (m.name, entry, cell)
    opt = entry["optimizer"]
    if opt == "sgd momentum 0.9":
      assert got.group(2) is not None and float(got.group(2)) == 0.9, (
        m.name, entry, cell)
      assert got.group(3) is None, (m.name, cell)
    else:
      # Plain SGD: "sgd", or "sgd (momentum inside NAME)".
      inside = re.fullmatch(r"sgd \(momentum inside (\w+)\)", opt)
      assert opt == "sgd" or inside, (m.name, opt)
      assert got.group(2) is None, (
        f"{m.name}: lr.json says {opt!r}, the README adds momentum: {cell}")
      if inside:
        assert got.group(3) == f"momentum inside {inside.group(1)}", (
          m.name, cell)


def test_every_gap_of_the_defaults_is_explained_and_shown():
  """docs/benchmarks/defaults.json (``python -m benchmarks.defaults``:
  every compressor at its registry defaults and lr.json's rate, on three
  tasks) read here on its own: a compressor more than 2 accuracy points
  short of dense on some task has a ``gap`` in the registry saying why,
  one within on every task has none, and the README's last column shows
  the measured shortfall (to 0.1 point) and its task, or "within 2
  points"."""
  with open(os.path.join(os.path.dirname(_README), "docs", "benchmarks",
                         "defaults.json"), encoding="utf-8") as f:
    result = json.load(f)
  dense = {r["task"]: r["accuracy"] for r in result["rows"]
           if r["method"] == "dense"}
  assert len(dense) == 3, sorted(dense)
  worst = {}
  for r in result["rows"]:
    d = r["accuracy"] - dense[r["task"]]
    d = -np.inf if np.isnan(d) else d
    if d < worst.get(r["method"], (np.inf, ""))[0]:
      worst[r["method"]] = (d, result["tasks"][r["task"]]["label"])
  assert set(worst) == set(registry.names("compressor"))
  header, table = _compressor_table()
  column = header[-1]
  assert column.startswith("at these"), header
  for m in registry.methods("compressor"):
    d, task = worst[m.name]
    cell = table[m.attr][column]
    if d >= -2.0:
      assert not m.gap, f"{m.name}: within 2 points ({d:+.1f}) but a gap"
      assert cell == "within 2 points", (m.name, cell)
    else:
      assert m.gap, f"{m.name}: {d:+.1f} points on {task}, no gap said"
      shown = "diverged" if d == -np.inf else f"{d:.1f} points"
      assert cell.startswith(f"{shown} ({task.split(' (')[0]})"), (
        m.name, cell)


def test_readme_tables_are_generated_from_the_registry():
  """The README's method tables are what ``make docs`` writes: a method
  added, renamed or re-described makes this fail until it is run."""
  with open(_README, encoding="utf-8") as f:
    text = f.read()
  assert readme_tables.render(text) == text, (
    "README.md's method tables are stale: run `make docs`")


@pytest.mark.parametrize("name", registry.names())
def test_inject_hyperparams_with_the_derived_static_args(name):
  """``optax.inject_hyperparams(factory, static_args=m.static_args)``
  builds, initialises and updates every registered method (int periods,
  freeze steps and seeds stay Python values), with its update equal to the
  plain factory's."""
  m = registry.get(name)
  args = dict(harness.required_args(m), axis_name=None)
  injected = optax.inject_hyperparams(m.factory,
                                      static_args=m.static_args)(**args)
  plain = m.factory(**args)
  params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros((8,))}
  grads = {"w": jnp.linspace(-1.0, 1.0, 128).reshape(16, 8),
           "b": jnp.linspace(0.5, -0.5, 8)}
  extra = {"value": jnp.float32(1.0)} if m.family == "local" else {}
  u1, _ = injected.update(grads, injected.init(params), params, **extra)
  u2, _ = plain.update(grads, plain.init(params), params, **extra)
  # Traced hyperparameters are not constant-folded: rounding may differ.
  chex.assert_trees_all_close(u1, u2, rtol=2e-5, atol=2e-5)


def test_static_args_are_derived_from_the_signature():
  """Ints, bools, strings and optimizers are static; real numbers are not,
  unless the registration says they set a shape (top-k's ratio)."""
  topk = registry.get("topk")
  assert {"ratio", "granularity", "value_bits", "seed", "axis_name",
          "policy", "error_feedback", "start_step"} <= set(topk.static_args)
  assert "clip_norm" not in topk.static_args
  assert "residual_decay" not in topk.static_args
  signum = registry.get("signum")
  assert "beta" not in signum.static_args
  assert {"inner", "period"} <= set(registry.get("local_sgd").static_args)
  # alpha is a real number, but the factory needs its value (a Python
  # float) to build the step: declared static where it is registered.
  assert "alpha" in registry.get("overlap_local_sgd").static_args
  tx = optax.inject_hyperparams(
    jaxcomm.overlap_local_sgd,
    static_args=registry.get("overlap_local_sgd").static_args)(
      optax.sgd(0.1), 2, alpha=0.25, axis_name=None)
  tx.init({"w": jnp.zeros(3)})
  adam = registry.get("onebit_adam")
  assert "freeze_step" in adam.static_args
  assert "learning_rate" not in adam.static_args
  assert "b1" not in adam.static_args
  with pytest.raises(ValueError, match="does not take"):
    registry.derive_static_args(jaxcomm.topk, ("nope",))


def test_method_validates_its_family():
  with pytest.raises(ValueError, match="family must be one of"):
    registry.Method("x", jaxcomm.topk, "compressors", "-")
  assert inspect.signature(registry.Method.make)


# The family packages of jaxcomm/transforms/ and what their place says:
# (family, kind).
_PACKAGES = {
  "quantize": ("compressor", "quantize"),
  "sparsify": ("compressor", "sparsify"),
  "lowrank": ("compressor", "lowrank"),
  "optimizers": ("optimizer", None),
  "local": ("local", None),
  "gossip": ("local", None),
  "delay": ("delay", None),
}


def test_family_and_kind_are_the_package_of_the_source_file():
  """Each method's family (and a compressor's kind) is that of the folder
  of jaxcomm/transforms/ its definition's file stands in, and the
  compressors' kinds are exactly quantize, sparsify and lowrank."""
  root = os.path.join(os.path.dirname(os.path.abspath(jaxcomm.__file__)),
                      "transforms")
  kinds = set()
  for m in registry.methods():
    path = os.path.abspath(inspect.getsourcefile(inspect.unwrap(m.factory)))
    rel = os.path.relpath(path, root).split(os.sep)
    assert len(rel) == 2 and rel[0] in _PACKAGES, (m.name, path)
    assert (m.family, m.kind) == _PACKAGES[rel[0]], (m.name, rel)
    if m.family == "compressor":
      kinds.add(m.kind)
  assert kinds == {"quantize", "sparsify", "lowrank"}


def test_registration_refuses_a_family_its_package_contradicts():
  """Inside jaxcomm.transforms the package decides the family; outside,
  ``family=`` must be given. Neither refused factory is registered."""
  def mine(axis_name="data"):
    return optax.identity()
  before = registry.names()
  mine.__module__ = "jaxcomm.transforms.quantize._mine"
  with pytest.raises(ValueError, match="contradicts"):
    registry.method(paper="-", family="local")(mine)
  with pytest.raises(ValueError, match="contradicts"):
    registry.method(paper="-", kind="sparsify")(mine)
  mine.__module__ = "somewhere_else"
  with pytest.raises(ValueError, match="needs family="):
    registry.method(paper="-")(mine)
  with pytest.raises(ValueError, match="kind must be None"):
    registry.method(paper="-", family="local", kind="quantize")(mine)
  assert registry.names() == before


def test_every_method_has_its_place_in_the_table_order():
  """The README's row order names each built-in method once."""
  order = jaxcomm._registry.TABLE_ORDER  # pylint: disable=protected-access
  assert len(order) == len(set(order))
  assert set(order) == set(registry.names())


def test_a_built_method_is_a_value():
  """``repr`` says what a compressor is; equal configurations compare and
  hash equal, other ones do not; it still unpacks and chains like any
  Optax transformation, and carries its spec."""
  a, b = jaxcomm.topk(0.01), jaxcomm.topk(ratio=0.01, granularity="leaf")
  assert repr(a) == "jaxcomm.topk(ratio=0.01)"
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  assert a != jaxcomm.topk(0.02) and a != jaxcomm.randomk(0.01)
  assert repr(jaxcomm.powersgd(4, error_feedback=False)) == (
    "jaxcomm.powersgd(rank=4, error_feedback=False)")
  assert a.method == "topk" and a.arguments["granularity"] == "leaf"
  assert a.spec is jaxcomm.spec_of(a) and a.spec.axis_name == "data"
  init, update = a
  assert callable(init) and callable(update)
  assert isinstance(a, optax.GradientTransformationExtraArgs)
  tx = optax.chain(jaxcomm.topk(0.5, axis_name=None, policy=jaxcomm.LeafPolicy(
    min_size=1)), optax.sgd(1.0))
  params = {"w": jnp.zeros((64,))}
  u, _ = tx.update({"w": jnp.arange(64.0)}, tx.init(params), params)
  assert int((u["w"] != 0).sum()) == 32
  import copy  # pylint: disable=import-outside-toplevel
  assert copy.copy(a) == a and copy.deepcopy(a) == a
  assert repr(copy.deepcopy(a)) == repr(a)
  opt = jaxcomm.onebit_adam(1e-3, freeze_step=10)
  assert repr(opt) == "jaxcomm.onebit_adam(learning_rate=0.001, freeze_step=10)"
