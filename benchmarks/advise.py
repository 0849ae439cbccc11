"""``python -m jaxcomm.advise`` with the repository's models behind
``--model`` (the library itself knows only ``--shapes``).

Run from the repository root, e.g.::

  python -m benchmarks.advise --model charlm --hosts 8 --per-host 8 \\
      --slow-gbit 10 --fast-gbit 800 --budget 0.05
"""

import sys

import jax
from flax import nnx

import models
from jaxcomm import advise


def model_params(name: str):
  """A registered model's params as ShapeDtypeStructs (no arrays made).

  Raises:
    ValueError: naming ``name`` and the models there are.
  """
  abstract = nnx.eval_shape(lambda: models.create(name))
  return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


def main(argv=None) -> int:
  return advise.main(argv, model_params=model_params)


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  sys.exit(main(sys.argv[1:]))
