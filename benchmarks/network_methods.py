"""What :mod:`benchmarks.network` measures: the gradient shapes of its
models and the methods it times (jaxcomm compressors, the pod recipe's
flat and sharded variants, local-update and gossip methods)."""

from __future__ import annotations


def _resnet18_shapes() -> list[tuple[int, ...]]:
  """Parameter shapes of ResNet-18 for 32x32 inputs and 10 classes.

  Flax layout: conv kernels ``(kh, kw, in, out)``, dense ``(in, out)``;
  each norm has a scale and a bias. Running statistics are not parameters.
  """
  shapes = [(3, 3, 3, 64), (64,), (64,)]
  cin = 64
  for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
    for block in range(2):
      s = stride if block == 0 else 1
      shapes += [(3, 3, cin, cout), (cout,), (cout,),
                 (3, 3, cout, cout), (cout,), (cout,)]
      if s != 1 or cin != cout:
        shapes += [(1, 1, cin, cout), (cout,), (cout,)]
      cin = cout
  shapes += [(512, 10), (10,)]
  return shapes


RESNET18_SHAPES = _resnet18_shapes()


def _charlm_shapes() -> list[tuple[int, ...]]:
  import jax  # pylint: disable=import-outside-toplevel

  import models  # pylint: disable=import-outside-toplevel
  _, params, _ = models.functional(models.create("charlm"))
  return [tuple(x.shape) for x in jax.tree.leaves(params)]


# The transformer LM of benchmarks/bench_sharded.py (1.6M params).
TRANSFORMER = dict(vocab_size=128, d_model=256, num_heads=8, num_layers=2,
                   d_ff=1024, max_len=64)


def _transformer_shapes() -> list[tuple[int, ...]]:
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from models import transformer  # pylint: disable=import-outside-toplevel
  model = nnx.eval_shape(lambda: transformer.TransformerLM(
    **TRANSFORMER, rngs=nnx.Rngs(0)))
  _, params = nnx.split(model, nnx.Param)
  return [tuple(x.shape) for x in jax.tree.leaves(params)]


def model_shapes(name: str) -> list[tuple[int, ...]]:
  """The gradient shapes benchmarked under ``name``."""
  if name == "resnet18":
    return list(RESNET18_SHAPES)
  if name == "charlm":
    return _charlm_shapes()
  if name == "transformer":
    return _transformer_shapes()
  raise ValueError("model must be 'resnet18', 'charlm' or 'transformer', "
                   f"got {name!r}")


# The plain FSDP step (--fsdp): jax.jit over the sharded params, XLA's own
# float32 gradient all-reduce over every device; no jaxcomm.
PLAIN_FSDP = "plain-fsdp"


def _torch_layout(shape):
  """Flax layout to PyTorch's: conv (kh,kw,i,o) -> (o,i,kh,kw), dense
  (i,o) -> (o,i)."""
  if len(shape) == 4:
    return (shape[3], shape[2], shape[0], shape[1])
  if len(shape) == 2:
    return (shape[1], shape[0])
  return tuple(shape)


# name -> (jaxcomm attribute, builder). The builder gets the jaxcomm module,
# jax.numpy and the axis it compresses over: the data axis, or with
# --hosts > 1 the axis between hosts ("dcn"), after a dense mean inside
# each host ("ici"); "dense-flat" gets both axes and no mean before it.
METHODS = {
  "dense": ("mean_gradients",
            lambda jc, jnp, ax: jc.mean_gradients(axis_name=ax)),
  "dense-flat": ("mean_gradients",
                 lambda jc, jnp, ax: jc.mean_gradients(axis_name=ax)),
  "bf16": ("cast", lambda jc, jnp, ax: jc.cast(jnp.bfloat16, axis_name=ax)),
  # The frontier against bf16: requantized low-bit all-reduces and the OCP
  # microscaling formats (two phases, as bf16's).
  "int8": ("int8", lambda jc, jnp, ax: jc.int8(axis_name=ax)),
  "int4": ("int4", lambda jc, jnp, ax: jc.int4(axis_name=ax)),
  "mxfp8": ("mx", lambda jc, jnp, ax: jc.mx("mxfp8", axis_name=ax)),
  "mxfp4+ef": ("mx", lambda jc, jnp, ax: jc.mx(
    "mxfp4", error_feedback=True, axis_name=ax)),
  "powersgd4": ("powersgd", lambda jc, jnp, ax: jc.powersgd(4, axis_name=ax)),
  "topk1%+ef": ("topk", lambda jc, jnp, ax: jc.topk(
    0.01, error_feedback=True, axis_name=ax)),
  "dgc0.1%": ("dgc", lambda jc, jnp, ax: jc.dgc(0.001, axis_name=ax)),
  "onebit": ("onebit", lambda jc, jnp, ax: jc.onebit(axis_name=ax)),
  # The survey's remaining methods, each in its paper's setting (not in
  # the default run: --methods names them).
  "stc1%": ("stc", lambda jc, jnp, ax: jc.stc(0.01, axis_name=ax)),
  "sbc1%": ("sbc", lambda jc, jnp, ax: jc.sbc(0.01, axis_name=ax)),
  "sidco1%": ("sidco", lambda jc, jnp, ax: jc.sidco(0.01, axis_name=ax)),
  "adacomp": ("adacomp", lambda jc, jnp, ax: jc.adacomp(axis_name=ax)),
  "fetchsgd": ("fetchsgd", lambda jc, jnp, ax: jc.fetchsgd(
    0.001, cols=50000, axis_name=ax)),
  "atomo2": ("atomo", lambda jc, jnp, ax: jc.atomo(2, axis_name=ax)),
  "scalecom1%": ("scalecom", lambda jc, jnp, ax: jc.scalecom(
    0.01, axis_name=ax)),
  "lag": ("lag", lambda jc, jnp, ax: jc.lag(1.0, axis_name=ax)),
  "qsgd+diana": ("qsgd", lambda jc, jnp, ax: jc.qsgd(
    error_feedback="diana", axis_name=ax)),
  # Issue 39, each at its defaults or at top-k's 1% (not in the default
  # run). MGS merges layers by a 1 Gbit/s, 50 us link.
  "gmc1%": ("gmc", lambda jc, jnp, ax: jc.gmc(0.01, axis_name=ax)),
  "sparcml1%": ("sparcml", lambda jc, jnp, ax: jc.sparcml(
    0.01, axis_name=ax)),
  "ecq_sgd": ("ecq_sgd", lambda jc, jnp, ax: jc.ecq_sgd(axis_name=ax)),
  "ibcd": ("ibcd", lambda jc, jnp, ax: jc.ibcd(axis_name=ax)),
  "dist_ef_sgdm": ("dist_ef_sgdm", lambda jc, jnp, ax: jc.dist_ef_sgdm(
    axis_name=ax)),
  "mgs1%": ("mgs", lambda jc, jnp, ax: jc.mgs(
    0.01, jc.wire.CostModel.link(1.0, 50.0), axis_name=ax)),
  "qcs": ("qcs", lambda jc, jnp, ax: jc.qcs(axis_name=ax)),
  "gradiveq": ("gradiveq", lambda jc, jnp, ax: jc.gradiveq(axis_name=ax)),
  "variance": ("variance_sparsification", lambda jc, jnp, ax:
               jc.variance_sparsification(axis_name=ax)),
}
SURVEY_METHODS = ("stc1%", "sbc1%", "sidco1%", "adacomp", "fetchsgd",
                  "atomo2", "scalecom1%", "lag", "qsgd+diana", "gmc1%",
                  "sparcml1%", "ecq_sgd", "ibcd", "dist_ef_sgdm", "mgs1%",
                  "qcs", "gradiveq", "variance")
# Methods that run over every data axis at once, with no mean inside hosts
# first (--hosts > 1).
FLAT_METHODS = ("dense-flat",)
# With --hosts > 1 only: the method between hosts once per host, each
# device of a host exchanging its share (jaxcomm.parallel.sharded_exchange).
SHARDED = "-sharded"
METHODS.update({m + SHARDED: METHODS[m]
                for m in ("dense", "bf16", "topk1%+ef", "onebit")})
# Local-update optimizers (whole optimizers, not chained before SGD) and
# their period: a sync every H steps, so they are timed over a whole
# number of periods and reported as the mean step time.
LOCAL_METHODS = {
  "localsgd8": ("local_sgd", 8, lambda jc, optax, ax: jc.local_sgd(
    optax.sgd(1e-4, momentum=0.9), 8, axis_name=ax)),
  "diloco50": ("diloco", 50, lambda jc, optax, ax: jc.diloco(
    optax.adamw(1e-4), optax.sgd(0.7, momentum=0.9, nesterov=True), 50,
    axis_name=ax)),
  "diloco50+topk2%2bit": ("diloco", 50, lambda jc, optax, ax: jc.diloco(
    optax.adamw(1e-4), optax.sgd(0.7, momentum=0.9, nesterov=True), 50,
    compressor=jc.topk(0.02, value_bits=2, axis_name=ax), axis_name=ax)),
  # Decentralized: every step gossips with the neighbours (period 1).
  "dpsgd-ring": ("dpsgd", 1, lambda jc, optax, ax: jc.dpsgd(
    optax.sgd(1e-4, momentum=0.9), topology="ring", axis_name=ax)),
  "dpsgd-exp": ("dpsgd", 1, lambda jc, optax, ax: jc.dpsgd(
    optax.sgd(1e-4, momentum=0.9), topology="exponential", axis_name=ax)),
  "choco-ring+topk10%": ("choco", 1, lambda jc, optax, ax: jc.choco(
    optax.sgd(1e-4, momentum=0.9), jc.topk(0.1, axis_name=ax), gamma=0.5,
    axis_name=ax)),
  "sgp-exp": ("sgp", 1, lambda jc, optax, ax: jc.sgp(
    optax.sgd(1e-4, momentum=0.9), axis_name=ax)),
}
# Time-varying gossip compiles every phase's permutes; a step runs one.
GOSSIP_METHODS = ("dpsgd-ring", "dpsgd-exp", "choco-ring+topk10%",
                  "sgp-exp")
METHODS.update({k: (v[0], None) for k, v in LOCAL_METHODS.items()})
METHODS[PLAIN_FSDP] = ("mean_gradients", None)
