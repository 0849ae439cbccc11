"""The project uses public JAX APIs only (users run JAX 0.10 to 0.12)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_private_jax_imports():
  files = [p for d in ("jaxcomm", "models", "benchmarks", "trainer")
           for p in (ROOT / d).rglob("*.py")] + [ROOT / "train.py"]
  assert len(files) > 20
  offenders = [str(p.relative_to(ROOT)) for p in files
               if "jax._src" in p.read_text()]
  assert not offenders, f"jax._src used in {offenders}"


def test_star_import_binds_every_listed_name():
  """``from jaxcomm import *`` gives exactly ``jaxcomm.__all__`` (the
  lazily loaded ``advise`` included), each the attribute itself."""
  import jaxcomm
  namespace = {}
  exec("from jaxcomm import *", namespace)  # pylint: disable=exec-used
  namespace.pop("__builtins__")
  assert sorted(namespace) == sorted(jaxcomm.__all__)
  for name in jaxcomm.__all__:
    assert namespace[name] is getattr(jaxcomm, name), name
  assert "__version__" not in jaxcomm.__all__
  assert isinstance(jaxcomm.__version__, str)


def test_advise_loads_on_first_use():
  """``jaxcomm.advise`` is listed but imported only when first read, so
  ``python -m jaxcomm.advise`` runs it without a second copy."""
  code = ("import sys, jaxcomm; "
          "assert 'jaxcomm.advise' not in sys.modules; "
          "assert 'advise' in jaxcomm.__all__; "
          "m = jaxcomm.advise; "
          "assert sys.modules['jaxcomm.advise'] is m; "
          "assert callable(m.advise)")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]


def test_internal_names_stay_importable():
  """Names left out of ``__all__`` (Pallas kernels, command-line entry
  points, helpers the tests and benchmarks use) are still importable."""
  import jaxcomm._aot_cli
  import jaxcomm.kernels.bitpack
  import jaxcomm.kernels.threshold
  import jaxcomm.kernels.topk
  for module, names in (
      (jaxcomm._aot_cli, ["main", "cli_value", "does_not_fit"]),
      (jaxcomm.advise, ["main"]),
      (jaxcomm.kernels.bitpack, ["pack_signs_pallas", "unpack_signs_pallas",
                                 "vote_pallas"]),
      (jaxcomm.kernels.topk, ["topk_abs_pallas"]),
      (jaxcomm.kernels.threshold, ["threshold_mask_pallas",
                                   "threshold_select_pallas"]),
      (jaxcomm.collectives, ["check_axis", "check_local", "padded_length"]),
      (jaxcomm.registry, ["COMMON_KEYWORDS", "derive_static_args"]),
      (jaxcomm.parallel, ["_global"])):
    for name in names:
      assert callable(getattr(module, name)) or name == "COMMON_KEYWORDS", (
        module.__name__, name)
      assert name not in getattr(module, "__all__", ()), (module.__name__,
                                                          name)
