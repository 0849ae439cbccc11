"""Adding a compressor is its module and its battery entry, nothing else.

A toy compressor (each value rounded to a multiple of ``step``, the rounded
values averaged, error feedback keeping the rounding) is written as a new
module, the way ARCHITECTURE.md ("Adding a method") says, and imported: it
is then a choice of ``train.py``, a row of the README's generated table,
and, with its battery entry (a numpy reference from its definition), it
passes the battery's reference and wire checks on 8 devices.
"""

import importlib
import sys
import textwrap

import numpy as np
import pytest

import jaxcomm
import train
from benchmarks import readme_tables
from jaxcomm import _registry
from tests import harness
from tests import registry as battery

_MODULE = textwrap.dedent('''
    """Rounding to a grid: a toy compressor for the registry's test."""

    import dataclasses

    import jax
    import jax.numpy as jnp

    import jaxcomm


    @dataclasses.dataclass(frozen=True)
    class ToyRoundCodec(jaxcomm.CodecBase):
      """Each value rounded to the nearest multiple of ``step``."""

      step: float
      name = "toy_round"

      def apply(self, x, state, ctx):
        sent = jnp.round(x / self.step) * self.step
        total = sent if ctx.axis_name is None else jax.lax.psum(
          sent, ctx.axis_name)
        return jaxcomm.CodecResult(mean=total / ctx.num_devices, sent=sent,
                                   state=state)

      def wire(self, layout, n):
        return [("all-reduce", 4 * layout.size)]


    @jaxcomm.registry.method(family="compressor", paper="(a toy)",
                             summary="values rounded to a grid, float32 mean",
                             defaults={"step": 0.25})
    def toy_round(step: float, *, axis_name="data", error_feedback=True,
                  policy=None, **options):
      """Each value rounded to the nearest multiple of ``step``."""
      return jaxcomm.compressed(ToyRoundCodec(step), axis_name=axis_name,
                                error_feedback=error_feedback, policy=policy,
                                **options)
''')


def _ref_step(step):
  """The definition: sent_i = step * round(x_i / step); mean over i."""
  def ref_step(xs, state, t, key, n):
    sent = [[step * np.round(x / step) for x in dev] for dev in xs]
    mean = [np.mean([sent[i][j] for i in range(n)], axis=0)
            for j in range(len(xs[0]))]
    return mean, sent, state
  return ref_step


@pytest.fixture
def toy(tmp_path):
  (tmp_path / "toy_round_module.py").write_text(_MODULE)
  sys.path.insert(0, str(tmp_path))
  try:
    module = importlib.import_module("toy_round_module")
    yield module
  finally:
    sys.path.remove(str(tmp_path))
    sys.modules.pop("toy_round_module", None)
    _registry.unregister("toy_round")
    battery.ENTRIES.pop("toy_round", None)
    battery.SOURCES.pop("toy_round", None)


def test_a_new_module_is_a_method_everywhere(toy, mesh):
  m = jaxcomm.registry.get("toy_round")
  assert m.factory is toy.toy_round and m.family == "compressor"
  # train.py: a choice, in --help, buildable with its registry defaults.
  assert "toy_round" in train.available_compressors()
  assert "toy_round" in train.build_parser().format_help()
  tx, name, kwargs = train.build_compressor("toy_round", "")
  assert name == "toy_round" and kwargs["step"] == 0.25
  # The README's generated table has its row (bytes from its claim).
  row = [r for r in readme_tables.table("compressor").splitlines()
         if "`toy_round(step=0.25)`" in r]
  assert len(row) == 1 and "(a toy)" in row[0] and "1.0x" in row[0], row
  # Its battery entry: the numpy reference from the definition.
  entry = battery.register(battery.Entry(
    name="toy_round", ref_init=lambda shapes: None, ref_step=_ref_step(0.25),
    factory=toy.toy_round, kwargs={"step": 0.25}))
  assert battery.load()["toy_round"] is entry
  assert entry.static_args == m.static_args
  # The battery's reference check on 8 devices, over 3 steps with error
  # feedback ...
  grads = harness.make_grads(3, 3)
  updates, state, _ = harness.device_run(entry.make(axis_name="data"), mesh,
                                         grads)
  want, residuals, _ = harness.numpy_run(entry, grads)
  for got, ref in zip(updates, want):
    for k in ref:
      np.testing.assert_allclose(np.asarray(got[k]), ref[k], rtol=1e-5,
                                 atol=1e-6, err_msg=k)
  got_res = harness.residuals_of(state, harness.battery_params())
  for i in range(harness.N):
    for j, r in enumerate(residuals[i]):
      np.testing.assert_allclose(got_res[j][i], r, rtol=1e-5, atol=1e-6)
  # ... and its wire check: the claim is what the compiled step moves.
  tx = entry.make(axis_name="data")
  params = harness.battery_params()
  hlo = jaxcomm.wire.report(harness.lower_update(tx, mesh), params=params)
  claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, harness.N),
                                 n=harness.N, params=params)
  assert hlo.payload == claim.payload
