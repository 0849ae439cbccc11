"""The project uses public JAX APIs only (users run JAX 0.10 to 0.12)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_private_jax_imports():
  files = [p for d in ("jaxcomm", "models", "benchmarks", "trainer")
           for p in (ROOT / d).rglob("*.py")] + [ROOT / "train.py"]
  assert len(files) > 20
  offenders = [str(p.relative_to(ROOT)) for p in files
               if "jax._src" in p.read_text()]
  assert not offenders, f"jax._src used in {offenders}"
