"""Measured step times of real processes on a rate-limited network.

``make bench-network`` (or ``python -m benchmarks.network``) runs one
process per simulated host, each with one CPU device, joined by
``jax.distributed`` (gloo collectives) inside a fresh network namespace whose
loopback is rate-limited with ``tc ... tbf`` (see ``benchmarks/_netns.py``).
For each link rate, process count and gradient shape set it times the
data-parallel train step of every compressor that exists in ``jaxcomm``
(dense mean, bf16 cast, PowerSGD rank 4, top-k 1% with error feedback,
DGC 0.1%, onebit) and, with the optional ``torch`` extra, PyTorch DDP on the
same shapes in the same namespace, with and without its PowerSGD hook, for
two bucket sizes, each under a timeout.

Gradient shapes: ResNet-18 for CIFAR (:data:`RESNET18_SHAPES`, 11,173,962
parameters) and the default language model (``models.create("charlm")``).
The loss is synthetic, ``sum_j a |w_j|^2 / 2 + c sum(w_j)`` with per-device
scalars ``a, c``, so its gradient has exactly those shapes and costs almost
nothing to compute: the step time is communication plus the compressor's
own arithmetic. (No time-to-target-loss here: the loss is not a learning
problem.)

Next to each measurement it prints what :class:`jaxcomm.wire.CostModel`
predicts for the bytes the compressor claims, twice: for ``n`` hosts each
with its own link of the given rate, and for the namespace's loopback, which
is one medium shared by all processes (``n`` senders at once: the per-host
model with bandwidth ``B / n``).

With ``--hosts H`` the processes are split over ``H`` namespaces ("hosts",
``_netns.Hosts``): loopback inside a host, each host's link to the others
rate-limited each way. The mesh is ("dcn", "ici"), every compressor runs
as the pod recipe (a dense mean over "ici", then the method over "dcn";
``dense-flat`` and the local methods run over both axes at once), and
the table adds the bytes each host's link carried per step (its filter's
counters) against the claimed collectives.

With ``--hosts H --fsdp`` the model is sharded: the transformer LM split
by its logical axes over each host's processes (FSDP on the fast
loopback), each method between hosts on every device's shards
(``DataParallel(auto_axes=("fsdp",))``), next to ``plain-fsdp``, the jit
step with XLA's own float32 all-reduce.

Prints markdown tables, writes ``runs/bench/network.{json,md,png}``
(``network-Hhosts.*`` with hosts). If
network namespaces cannot be used (no root, no iproute2, a sandbox that
forbids them) it says so and exits 0.

Example::

  sudo .venv/bin/python -m benchmarks.network --quick
  sudo .venv/bin/python -m benchmarks.network \\
      --processes 2,4 --rates none,1,10 --models resnet18,charlm
  sudo .venv/bin/python -m benchmarks.network --hosts 2 --processes 4 \\
      --rates none,1 --models resnet18 --torch no
  sudo .venv/bin/python -m benchmarks.network --hosts 2 --processes 4 \\
      --fsdp --models transformer --rates none,1 --torch no \\
      --methods plain-fsdp,dense,bf16,int8,topk1%+ef,powersgd4,diloco50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

from benchmarks import _netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def _append(path, record):
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()


# ----------------------------------------------------------------- workers --

def _go_path(out, mi, ri):
  return f"{out}.go-{mi}-{ri}"


def _wait_go(out, mi, ri, timeout_s):
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(_go_path(out, mi, ri)):
    if time.monotonic() > deadline:
      raise TimeoutError(f"no go signal for method {mi}, rate {ri}")
    time.sleep(0.02)


def _time_at_rates(a, out, mi, method, step, params, state, batch,
                   period, finite_of, record):
  """Times ``step(params, state, batch) -> (params, state)`` at each rate
  the driver sets (it changes the loopback's rate, then says go): warm-up
  steps, then whole periods of timed ones, each blocked on; process 0
  appends the times with ``record``. Returns the last params and state."""
  import jax  # pylint: disable=import-outside-toplevel
  timed = -(-max(a.steps, period) // period) * period
  for ri in range(a.nrates):
    if out:
      _append(out, {"event": "ready", "method": method, "mi": mi, "ri": ri})
    _wait_go(a.out, mi, ri, a.init_timeout)
    for _ in range(a.warmup):
      params, state = step(params, state, batch)
      jax.block_until_ready((params, state))
    times = []
    for _ in range(timed):
      t0 = time.perf_counter()
      params, state = step(params, state, batch)
      jax.block_until_ready((params, state))
      times.append(time.perf_counter() - t0)
    if out:
      _append(out, dict(record, method=method, ri=ri, times=times,
                        finite=finite_of(params)))
  return params, state


def _jax_worker(a) -> int:
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import jaxcomm  # pylint: disable=import-outside-toplevel

  jaxcomm.parallel.initialize(f"{a.coordinator}:{a.port}", a.nproc, a.pid,
                              local_device_count=a.local_devices,
                              timeout_s=a.init_timeout)
  if a.fsdp_mode:
    return _fsdp_worker(a, jax, jnp, np, optax, jaxcomm)
  if a.hosts > 1:
    # One row of the ("dcn", "ici") mesh per host: processes are numbered
    # host by host (see _run_jax).
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jaxcomm.parallel.make_pod_mesh(num_slices=a.hosts,
                                          devices=devices)
    axes, slow = ("dcn", "ici"), "dcn"
  else:
    mesh = jaxcomm.parallel.make_mesh()
    axes, slow = "data", "data"
  n = mesh.devices.size
  n_slow = mesh.shape[slow]
  shapes = model_shapes(a.model)
  rng = np.random.RandomState(0)
  params0 = [0.01 * rng.standard_normal(s).astype(np.float32)
             for s in shapes]
  # Per-device scalars (a, c): every device's gradient a w + c differs.
  local = np.array([[1.0 + 0.1 * (a.pid * a.local_devices + d),
                     0.01 * (d + 1)] for d in range(a.local_devices)],
                   np.float32)

  def loss_fn(p, batch):
    s, c = batch[0, 0], batch[0, 1]
    return sum(0.5 * s * jnp.sum(w * w) + c * jnp.sum(w) for w in p)

  out = a.out if a.pid == 0 else None
  for mi, method in enumerate(a.methods.split(",")):
    attr, build = METHODS[method]
    if out:
      _append(out, {"event": "start", "method": method})
    if not hasattr(jaxcomm, attr):
      if out:
        _append(out, {"method": method, "skipped":
                      f"jaxcomm.{attr} does not exist in this checkout"})
      continue
    try:
      period, ops_n, inside = 1, n_slow, None
      claim_for, inside_ops = None, []
      if method in LOCAL_METHODS:
        _, period, make = LOCAL_METHODS[method]
        comp = tx = make(jaxcomm, optax, axes)
        ops_n = n
      elif method.endswith(SHARDED):
        per_host = n // n_slow
        comp = build(jaxcomm, jnp, slow)
        tx = optax.chain(jaxcomm.parallel.sharded_exchange(
          comp, "ici", fast_size=per_host), optax.sgd(1e-4))
        claim_for = jaxcomm.parallel.exchange_share(params0, per_host)
        share = claim_for["share"].shape[0]
        inside_ops = [("reduce-scatter", 4 * share * per_host),
                      ("all-gather", 4 * share * per_host)]
      elif method in FLAT_METHODS or a.hosts == 1:
        comp = build(jaxcomm, jnp, axes)
        tx = optax.chain(comp, optax.sgd(1e-4))
        ops_n = n
      else:
        # The pod recipe: a dense mean inside each host, then the method
        # between hosts.
        inside = jaxcomm.mean_gradients(axis_name="ici")
        comp = build(jaxcomm, jnp, slow)
        tx = optax.chain(inside, comp, optax.sgd(1e-4))
      dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh, axis_name=axes)
      params, state = dp.init(params0)
      batch = dp.shard_batch(local)
      t0 = time.perf_counter()
      params, state, _ = dp.step(params, state, batch)
      jax.block_until_ready((params, state))
      first = time.perf_counter() - t0
      abstract = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
      ops = jaxcomm.wire.claimed(
        comp, abstract if claim_for is None else claim_for, ops_n,
        step=0 if method in GOSSIP_METHODS else None)
      # Bytes per step: a local-update step sends one sync's bytes every
      # `period` steps. With hosts, the mean inside a host is not counted:
      # it stays on the host's loopback.
      sent = jaxcomm.wire.summarize(ops, ops_n).total_sent / period
      if inside is not None:
        inside_ops = jaxcomm.wire.claimed(inside, abstract, n // n_slow)

      def step(p, st, b, dp=dp):
        p, st, _ = dp.step(p, st, b)
        return p, st

      def finite_of(p):
        return bool(jax.device_get(jnp.all(jnp.stack(
          [jnp.all(jnp.isfinite(w)) for w in jax.tree.leaves(p)]))))

      params, state = _time_at_rates(
        a, out, mi, method, step, params, state, batch, period, finite_of,
        {"first_step": first, "ops": ops, "sent": sent, "devices": n,
         "ops_n": ops_n, "inside_ops": inside_ops, "period": period})
    except Exception as e:  # pylint: disable=broad-except
      if out:
        _append(out, {"method": method,
                      "error": f"{type(e).__name__}: {e}"[:500]})
      raise
    del params, state, dp
  jax.distributed.shutdown()
  return 0


def _fsdp_worker(a, jax, jnp, np, optax, jaxcomm) -> int:
  """--fsdp: a ("dcn", "fsdp") mesh, one row per host, the transformer LM
  split by its logical axes over the host's processes ("fsdp", the fast
  loopback) and the compressor between hosts on each device's shards
  (``DataParallel(auto_axes=("fsdp",))``); ``plain-fsdp`` is the jit step
  of the same loss, with XLA's own gradient all-reduce.

  The loss is the LM's next-token cross-entropy on random tokens (a
  synthetic loss that separates per example would let XLA reduce a few
  scalars instead of the gradient in the plain step).
  """
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from models import transformer  # pylint: disable=import-outside-toplevel

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  per_host = len(devices) // a.hosts
  mesh = jax.sharding.Mesh(np.array(devices).reshape(a.hosts, per_host),
                           ("dcn", "fsdp"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
  n = mesh.devices.size
  graphdef, abstract = nnx.split(transformer.TransformerLM(
    **TRANSFORMER, rngs=nnx.Rngs(0)), nnx.Param)
  host_tree = jax.tree.map(np.asarray, abstract)
  specs = transformer.partition_specs(host_tree, mesh.axis_names)
  is_spec = lambda x: isinstance(x, P)  # noqa: E731

  def params_now():
    return jax.tree.map(lambda x, sp: jax.make_array_from_callback(
      x.shape, NamedSharding(mesh, sp), lambda i, x=x: x[i]),
      host_tree, specs, is_leaf=is_spec)

  def loss_fn(p, b):
    logits = nnx.merge(graphdef, p)(b[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, b[:, 1:]).mean()

  seq = TRANSFORMER["max_len"]
  tokens = np.random.RandomState(0).randint(
    0, TRANSFORMER["vocab_size"], (2 * n, seq + 1)).astype(np.int32)
  batch = jax.make_array_from_callback(
    tokens.shape, NamedSharding(mesh, P(("dcn", "fsdp"))),
    lambda i: tokens[i])
  shards = jax.tree.map(
    lambda x, sp: jax.ShapeDtypeStruct(
      tuple(d // per_host if i < len(tuple(sp)) and tuple(sp)[i] == "fsdp"
            else d for i, d in enumerate(x.shape)), jnp.float32),
    host_tree, specs, is_leaf=is_spec)
  out = a.out if a.pid == 0 else None
  for mi, method in enumerate(a.methods.split(",")):
    if out:
      _append(out, {"event": "start", "method": method})
    try:
      period = 1
      if method == PLAIN_FSDP:
        @jax.jit
        def plain(p, b):
          g = jax.grad(loss_fn)(p, b)
          return jax.tree.map(lambda v, u: v - 1e-4 * u, p, g)

        def step(p, st, b):
          return plain(p, b), st
        params, state = params_now(), None
        ops = jaxcomm.wire.claimed(jaxcomm.mean_gradients(axis_name="dcn"),
                                   shards, a.hosts)
      else:
        if method in LOCAL_METHODS:
          _, period, make = LOCAL_METHODS[method]
          comp = tx = make(jaxcomm, optax, "dcn")
        else:
          comp = METHODS[method][1](jaxcomm, jnp, "dcn")
          tx = optax.chain(comp, optax.sgd(1e-4))
        dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh,
                                           axis_name="dcn",
                                           auto_axes=("fsdp",))
        params, state = dp.init(params_now())

        def step(p, st, b, dp=dp):
          p, st, _ = dp.step(p, st, b)
          return p, st
        ops = jaxcomm.wire.claimed(
          comp, shards, a.hosts,
          splits=jaxcomm.parallel.shard_splits(specs, mesh))
      t0 = time.perf_counter()
      params, state = step(params, state, batch)
      jax.block_until_ready(params)
      first = time.perf_counter() - t0
      sent = jaxcomm.wire.summarize(ops, a.hosts).total_sent / period
      def finite_of(p):
        return bool(all(np.isfinite(np.asarray(sh.data)).all()
                        for w in jax.tree.leaves(p)
                        for sh in w.addressable_shards))

      params, state = _time_at_rates(
        a, out, mi, method, step, params, state, batch, period, finite_of,
        {"first_step": first, "ops": ops, "sent": sent, "devices": n,
         "ops_n": a.hosts, "inside_ops": [], "period": period})
    except Exception as e:  # pylint: disable=broad-except
      if out:
        _append(out, {"method": method,
                      "error": f"{type(e).__name__}: {e}"[:500]})
      raise
  jax.distributed.shutdown()
  return 0


def _torch_worker(a) -> int:
  import datetime  # pylint: disable=import-outside-toplevel

  import torch  # pylint: disable=import-outside-toplevel
  import torch.distributed as dist  # pylint: disable=import-outside-toplevel
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
  from torch.nn.parallel import DistributedDataParallel

  torch.set_num_threads(1)
  os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
  dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.pid,
    world_size=a.nproc, timeout=datetime.timedelta(seconds=a.init_timeout))
  shapes = [_torch_layout(s) for s in model_shapes(a.model)]
  gen = torch.Generator().manual_seed(0)

  class Toy(torch.nn.Module):
    """Parameters of the benchmarked shapes and the synthetic loss."""

    def __init__(self):
      super().__init__()
      self.ws = torch.nn.ParameterList(
        [torch.nn.Parameter(0.01 * torch.randn(s, generator=gen))
         for s in shapes])

    def forward(self, sc):
      return sum(0.5 * sc[0] * (w * w).sum() + sc[1] * w.sum()
                 for w in self.ws)

  model = DistributedDataParallel(Toy(), bucket_cap_mb=a.bucket_mb)
  if a.hook == "powersgd":
    state = powerSGD_hook.PowerSGDState(
      process_group=None, matrix_approximation_rank=a.rank,
      start_powerSGD_iter=2, min_compression_rate=2,
      use_error_feedback=True, warm_start=True)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
  opt = torch.optim.SGD(model.parameters(), lr=1e-4)
  sc = torch.tensor([1.0 + 0.1 * a.pid, 0.01])
  out = a.out if a.pid == 0 else None
  times = []
  for i in range(a.warmup + a.steps):
    t0 = time.perf_counter()
    opt.zero_grad()
    model(sc).backward()
    opt.step()
    dt = time.perf_counter() - t0
    if i >= a.warmup:
      times.append(dt)
    if out:
      _append(out, {"event": "step", "i": i, "t": dt})
  if out:
    _append(out, {"method": a.label, "times": times})
  dist.destroy_process_group()
  return 0


# ------------------------------------------------------------------ driver --

def _env():
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split()
    if "xla_force_host_platform_device_count" not in f)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


class _Ports:
  def __init__(self):
    self.next = random.randint(20000, 40000)

  def take(self) -> int:
    self.next += 1
    return self.next


def _worker_argv(kind, pid, nproc, port, out, a, **kw):
  argv = [sys.executable, "-m", "benchmarks.network", f"--worker={kind}",
          f"--pid={pid}", f"--nproc={nproc}", f"--port={port}",
          f"--out={out}", f"--steps={a.steps}", f"--warmup={a.warmup}",
          f"--init-timeout={a.init_timeout}"]
  return argv + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]


def _run_jax(ns, ports, a, nproc, rates, model, tmp) -> list[dict]:
  """All methods at all rates for one (processes, model).

  One process group per attempt: each method is compiled once, then timed
  at every rate (the driver changes the loopback's rate between them while
  the workers wait). A method that makes no progress for ``a.timeout``
  seconds (a hang) or crashes is recorded as such; the methods after it run
  in a fresh group.
  """
  remaining = list(a.methods)
  rows = []
  attempt = 0
  while remaining:
    attempt += 1
    out = os.path.join(tmp, f"jax-{model}-{nproc}-{attempt}.jsonl")
    port = ports.take()
    hosts = getattr(ns, "n", 1)
    # Processes numbered host by host: pids [h p, (h + 1) p) on host h.
    cmds = [ns.command(_worker_argv(
      "jax", pid, nproc, port, out, a, model=model,
      methods=",".join(remaining), local_devices=1, nrates=len(rates),
      hosts=hosts, coordinator=ns.address(0), fsdp_mode=int(a.fsdp)),
      host=pid // (nproc // hosts)) for pid in range(nproc)]
    group = _netns.Group(cmds, env=_env(), cwd=ROOT)
    seen, last, timed_out = 0, time.monotonic(), False
    # With hosts: the bytes through each host's link while a method was
    # timed at a rate, read when its record arrives (the workers then
    # compile the next method or wait for the next go: no traffic).
    link = {}
    while group.running():
      recs = _netns.read_json_lines(out)
      for r in recs[seen:]:
        last = time.monotonic()
        if (hosts > 1 and r.get("times") and ns.rate is not None):
          link[(r["method"], r["ri"])] = ns.sent()
          print(f"    bytes each host sent through its link: "
                f"{link[(r['method'], r['ri'])]}", flush=True)
        if r.get("event") == "ready":
          ns.set_rate(rates[r["ri"]])
          open(_go_path(out, r["mi"], r["ri"]), "w").close()
          print(f"  {r['method']} at {_rate_label(rates[r['ri']])}",
                flush=True)
      seen = len(recs)
      if time.monotonic() - last > a.timeout:
        timed_out = True
        group.kill()
        break
      time.sleep(0.05)
    codes, outs = group.finish()
    for pid, text in enumerate(outs):
      with open(f"{out}.{pid}.log", "w") as f:
        f.write(text)
    recs = _netns.read_json_lines(out)
    started = [r["method"] for r in recs if r.get("event") == "start"]
    for m in list(remaining):
      done = [r for r in recs if r.get("method") == m and
              r.get("event") is None]
      for r in done:
        rate = rates[r["ri"]] if "ri" in r else None
        rows.append(dict(r, model=model, procs=nproc, rate=rate,
                         hosts=hosts))
        if (r.get("method"), r.get("ri")) in link:
          rows[-1]["link_bytes"] = link[(r["method"], r["ri"])]
          rows[-1]["link_steps"] = a.warmup + len(r["times"])
      complete = (any("skipped" in r or "error" in r for r in done)
                  or len({r.get("ri") for r in done}) == len(rates))
      if complete:
        remaining.remove(m)
      elif m in started:
        # Started, did not finish every rate: a hang or a crash.
        why = (f"no progress for {a.timeout:.0f} s (hang?)" if timed_out
               else f"exit codes {codes}: " + _tail(outs))
        got = {r.get("ri") for r in done}
        for ri, rate in enumerate(rates):
          if ri not in got:
            rows.append({"method": m, "error": why, "model": model,
                         "procs": nproc, "rate": rate})
        print(f"  {m}: {why}", flush=True)
        remaining.remove(m)
        break
    if not started and remaining:
      why = f"exit codes {codes}: " + _tail(outs)
      for m in remaining:
        rows.append({"method": m, "error": why, "model": model,
                     "procs": nproc, "rate": None})
      print(f"  workers failed before any method: {why}", flush=True)
      break
  return rows


def _tail(outs) -> str:
  """The most telling line of the workers' output (an error if any)."""
  keys = ("what():", "Error:", "error:", "Timeout", "Aborted")
  for o in outs:
    for line in reversed((o or "").strip().splitlines()):
      if any(k in line for k in keys):
        return line.strip()[-300:]
  return (outs[0] or "").strip()[-300:] if outs else ""


def torch_ops(shapes, rank=None) -> list[tuple[str, int]]:
  """The all-reduces DDP issues per step (one fused payload per kind).

  Dense: every gradient in float32. With the PowerSGD hook (PyTorch's
  rule): a tensor viewed as ``(shape[0], rest)`` is compressed when
  ``(n + m) r * 2 < n m``, sending ``P`` (n x r) and ``Q`` (m x r) in two
  all-reduces; the others are all-reduced as they are. Bucketing splits
  these payloads over several calls but does not change their sum.
  """
  if rank is None:
    return [("all-reduce", 4 * sum(math.prod(s) for s in shapes))]
  dense, ps, qs = 0, 0, 0
  for s in shapes:
    s = _torch_layout(s)
    rows_, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
    if len(s) > 1 and (rows_ + cols) * rank * 2 < rows_ * cols:
      ps += 4 * rows_ * rank
      qs += 4 * cols * rank
    else:
      dense += 4 * math.prod(s)
  return [(k, b) for k, b in (("all-reduce", dense), ("all-reduce", ps),
                              ("all-reduce", qs)) if b]


def _run_torch(ns, ports, a, nproc, rate, model, tmp, bucket, hook):
  label = f"torch-ddp{'-powersgd' + str(a.torch_rank) if hook else ''}" \
          f"-b{bucket:g}"
  out = os.path.join(tmp, f"{label}-{model}-{nproc}-{rate}.jsonl")
  port = ports.take()
  cmds = [ns.command(_worker_argv(
    "torch", pid, nproc, port, out, a, model=model, bucket_mb=bucket,
    hook=hook or "none", rank=a.torch_rank, label=label))
    for pid in range(nproc)]
  codes, outs, timed_out = _netns.run_group(cmds, a.torch_timeout,
                                            env=_env(), cwd=ROOT)
  for pid, text in enumerate(outs):
    with open(f"{out}.{pid}.log", "w") as f:
      f.write(text or "")
  recs = _netns.read_json_lines(out)
  ops = torch_ops(model_shapes(model), a.torch_rank if hook else None)
  row = {"method": label, "model": model, "procs": nproc, "rate": rate,
         "torch": True, "bucket_mb": bucket, "devices": nproc, "ops": ops,
         "sent": 2.0 * (nproc - 1) / nproc * sum(b for _, b in ops)}
  final = [r for r in recs if r.get("method") == label]
  if final:
    row.update(final[-1])
  else:
    steps = [r for r in recs if r.get("event") == "step"]
    why = (f"hang: timeout after {a.torch_timeout:.0f} s, {len(steps)} of "
           f"{a.warmup + a.steps} steps done" if timed_out else
           f"exit codes {codes}: " + _tail(outs))
    row["error"] = why
    if steps:
      row["partial_step_times"] = [r["t"] for r in steps]
  return row


def _rate_key(rate) -> float:
  return math.inf if rate is None else rate


def _rate_label(rate) -> str:
  return "unlimited" if rate is None else f"{rate:g} Gbit/s"


def _median(r):
  """The median step time; for a local-update method (``period > 1``) the
  mean over whole periods, which is what its syncs cost per step."""
  if not r.get("times"):
    return math.nan
  if r.get("period", 1) > 1:
    return statistics.fmean(r["times"])
  return statistics.median(r["times"])


def _predictions(r, rate, latency_us):
  """(own link, shared link) seconds for a row's claimed ops.

  Own link: every process has a link of ``rate`` to itself. Shared: the
  processes that send over one link at once share it: all of them on the
  single loopback, the processes of one host on its link (``--hosts``).
  With hosts, only the ops between hosts are priced (the mean inside a
  host stays on its loopback).
  """
  import jaxcomm  # pylint: disable=import-outside-toplevel
  if rate is None or not r.get("ops"):
    return math.nan, math.nan
  n = r.get("ops_n", r["devices"])
  ops = [tuple(o) for o in r["ops"]]
  period = r.get("period", 1)
  share = r["procs"] // r.get("hosts", 1)
  link = jaxcomm.wire.CostModel.link(rate, latency_us).predict(ops, n)
  shared = jaxcomm.wire.CostModel.link(rate / share,
                                       latency_us).predict(ops, n)
  return link / period, shared / period


def _fmt(x, digits=3):
  return "—" if x is None or (isinstance(x, float) and math.isnan(x)) \
    else f"{x:.{digits}f}"


def table(rows, latency_us) -> str:
  """The markdown table of all rows."""
  lines = [
    "| shapes | procs | link | method | step s (median; local: mean) "
    "| vs dense "
    "| MB sent/device | model: own links s | model: shared link s "
    "| note |",
    "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
  dense = {(r["model"], r["procs"], r["rate"]): _median(r) for r in rows
           if r["method"] == "dense" and r.get("times")}
  for r in rows:
    med = _median(r)
    d = dense.get((r["model"], r["procs"], r["rate"]), math.nan)
    link, shared = _predictions(r, r["rate"], latency_us)
    sent = r.get("sent")
    note = r.get("skipped") or r.get("error") or ""
    if r.get("finite") is False:
      note = (note + " non-finite params").strip()
    lines.append(
      f"| {r['model']} | {r['procs']} | {_rate_label(r['rate'])} "
      f"| {r['method']} | {_fmt(med)} | "
      f"{_fmt(med / d, 2) if d == d and med == med else '—'} | "
      f"{_fmt(sent / 1e6, 2) if sent is not None else '—'} | "
      f"{_fmt(link)} | {_fmt(shared)} | {note.replace('|', '/')[:160]} |")
  return "\n".join(lines)


def link_table(rows) -> str:
  """With hosts: bytes each host's link carried per step, as read from its
  filter's counters, against the claimed collectives.

  Claimed per host: with the mean inside hosts first, every process of a
  host sends its own exchange between hosts (sent per device x processes
  per host); a flat ring over all processes (numbered host by host) leaves
  each host once, carrying one process's ring traffic (sent per device).
  The counters include TCP/IP headers and acknowledgements. Local-update
  methods are left out: their syncs do not fall evenly on the timed steps.
  """
  lines = ["| link | method | MB/step through each host's link: measured "
           "| claimed | measured / claimed |", "|---|---|---:|---:|---:|"]
  for r in rows:
    if not r.get("link_bytes") or r.get("period", 1) != 1:
      continue
    per_host = r["procs"] // r["hosts"]
    flat = r.get("ops_n", r["devices"]) == r["devices"]
    claimed = r["sent"] * (1 if flat else per_host)
    got = statistics.fmean(r["link_bytes"]) / r["link_steps"]
    lines.append(f"| {_rate_label(r['rate'])} | {r['method']} | "
                 f"{got / 1e6:.3f} | {claimed / 1e6:.3f} | "
                 f"{got / claimed:.3f} |")
  return "\n".join(lines)


def targets(rows) -> str:
  """The issue's two ratio targets, from the rows of this run."""
  out = []
  for r in rows:
    if (r["method"] != "powersgd4" or r["model"] != "resnet18"
        or r.get("hosts", 1) > 1
        or r["rate"] != 1.0 or not r.get("times")):
      continue
    key = (r["model"], r["procs"], r["rate"])
    same = [x for x in rows if (x["model"], x["procs"], x["rate"]) == key
            and x.get("times")]
    p = _median(r)
    dense = [_median(x) for x in same if x["method"] == "dense"]
    if dense:
      out.append(f"- {r['procs']} procs, 1 Gbit/s: PowerSGD-4 / dense = "
                 f"{p:.3f} / {dense[0]:.3f} = {p / dense[0]:.2f} "
                 "(target <= 0.2)")
    for x in same:
      if x.get("torch") and "powersgd" in x["method"]:
        t = _median(x)
        out.append(f"- {r['procs']} procs, 1 Gbit/s: jaxcomm PowerSGD-4 / "
                   f"{x['method']} = {p:.3f} / {t:.3f} = {p / t:.2f} "
                   "(target <= 0.8)")
  return "\n".join(out) or "- (no PowerSGD rank 4 measurement at 1 Gbit/s)"


def plot(rows, path, latency_us=50.0) -> None:
  """Step time per method, one panel per gradient shape set, log scale."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  good = [r for r in rows if r.get("times")]
  models = sorted({r["model"] for r in good})
  if not models:
    return
  fig, axes = plt.subplots(len(models), 1, figsize=(11, 4 * len(models)),
                           squeeze=False)
  for ax, model in zip(axes[:, 0], models):
    mine = [r for r in good if r["model"] == model]
    configs = sorted({(r["procs"], -1 if r["rate"] is None else r["rate"])
                      for r in mine})
    methods = list(dict.fromkeys(r["method"] for r in mine))
    width = 0.8 / max(1, len(methods))
    pred_x, pred_y, heights = [], [], []
    for j, m in enumerate(methods):
      xs, ys = [], []
      for i, (p, rate) in enumerate(configs):
        for r in mine:
          rr = -1 if r["rate"] is None else r["rate"]
          if r["method"] == m and r["procs"] == p and rr == rate:
            xs.append(i + j * width)
            ys.append(_median(r))
            shared = _predictions(r, r["rate"], latency_us)[1]
            if shared == shared and shared > 0:
              pred_x.append(xs[-1])
              pred_y.append(shared)
      ax.bar(xs, ys, width, label=m)
      heights += ys
    if pred_x:
      ax.scatter(pred_x, pred_y, marker="_", s=200, color="k", zorder=3,
                 label="model: shared loopback (comm only)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
    ax.set_xticklabels([f"{p} procs\n{_rate_label(None if r < 0 else r)}"
                        for p, r in configs])
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(heights + pred_y) / 3)
    ax.set_ylabel("step time, s (median)")
    ax.set_title(f"{model} gradient shapes, rate-limited loopback")
    ax.legend(fontsize=7, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _parse_rates(text):
  return [None if t in ("none", "unlimited", "0") else float(t)
          for t in text.split(",") if t]


def _torch_available() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return importlib.util.find_spec("torch") is not None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--processes", default="2,4")
  p.add_argument("--rates", default=None,
                 help="Gbit/s, comma separated; 'none' = no limit "
                 "(default: none,1,10; with --quick: 1)")
  p.add_argument("--models", default="resnet18,charlm")
  p.add_argument("--methods", default=",".join(
    m for m in METHODS if m not in SURVEY_METHODS + (PLAIN_FSDP,)))
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--torch", choices=("auto", "no"), default="auto")
  p.add_argument("--torch-buckets", default="25,100")
  p.add_argument("--torch-rank", type=int, default=4)
  p.add_argument("--torch-models", default="resnet18")
  p.add_argument("--timeout", type=float, default=300.0,
                 help="seconds without progress before a jaxcomm method "
                 "counts as hung (compiling included)")
  p.add_argument("--torch-timeout", type=float, default=150.0,
                 help="seconds for one PyTorch run (start-up included)")
  p.add_argument("--init-timeout", type=int, default=120)
  p.add_argument("--latency-us", type=float, default=50.0)
  p.add_argument("--hosts", type=int, default=1,
                 help="simulated hosts: > 1 puts the processes, in equal "
                 "numbers, in that many namespaces joined by links "
                 "rate-limited each way (fast loopback inside a host), on "
                 "a ('dcn', 'ici') mesh: a dense mean inside each host, "
                 "then the method between hosts")
  p.add_argument("--fsdp", action="store_true",
                 help="with --hosts > 1: a sharded model, params split over "
                 "each host's processes (FSDP on the fast loopback), the "
                 "method between hosts on each device's shards; "
                 f"'{PLAIN_FSDP}' is the plain jit step")
  p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench"))
  p.add_argument("--quick", action="store_true",
                 help="2 processes, 1 Gbit/s, ResNet-18 shapes, 3 steps")
  # Worker mode (run inside the namespace by the driver).
  p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
  for flag, typ in (("pid", int), ("nproc", int), ("port", int),
                    ("out", str), ("model", str), ("local-devices", int),
                    ("bucket-mb", float), ("hook", str), ("rank", int),
                    ("label", str), ("nrates", int),
                    ("coordinator", str)):
    p.add_argument(f"--{flag}", type=typ, help=argparse.SUPPRESS)
  p.add_argument("--fsdp-mode", type=int, default=0, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker == "jax":
    return _jax_worker(a)
  if a.worker == "torch":
    return _torch_worker(a)

  if a.quick:
    a.processes, a.models, a.steps, a.warmup = "2", "resnet18", 3, 2
  if a.rates is None:
    a.rates = "1" if a.quick else "none,1,10"
  unknown = [m for m in a.methods.split(",") if m not in METHODS]
  if unknown:
    p.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
  a.methods = a.methods.split(",")
  if a.warmup < 1:
    p.error("--warmup must be >= 1")
  procs = [int(x) for x in a.processes.split(",")]
  rates = _parse_rates(a.rates)
  model_names = a.models.split(",")
  use_torch = a.torch == "auto" and _torch_available()
  if a.hosts < 1:
    p.error(f"--hosts must be >= 1, got {a.hosts}")
  if a.hosts > 1:
    bad = [x for x in procs if x % a.hosts or x == a.hosts]
    if bad:
      p.error(f"--processes {bad}: with --hosts {a.hosts} each count must "
              "be a multiple of it, with at least 2 processes per host")
    gossip = [m for m in a.methods if m in GOSSIP_METHODS]
    if gossip:
      p.error(f"--hosts > 1 runs the pod recipe; gossip methods {gossip} "
              "have no such form")
    if use_torch:
      print("note: PyTorch DDP rows are measured on one namespace only "
            "(--hosts 1); skipped")
      use_torch = False
  elif any(m.endswith(SHARDED) for m in a.methods):
    p.error("the -sharded methods split the exchange between hosts over a "
            "host's processes: they need --hosts > 1")
  if a.fsdp:
    if model_names != ["transformer"]:
      p.error("--fsdp trains the transformer LM's step: --models "
              "transformer")
    if a.hosts < 2:
      p.error("--fsdp splits the params over each host's processes: it "
              "needs --hosts > 1")
    bad = [m for m in a.methods if m.endswith(SHARDED)
           or m in FLAT_METHODS or m in GOSSIP_METHODS]
    if bad:
      p.error(f"--fsdp: methods {bad} do not run on a sharded model (each "
              "device already exchanges its own shards between hosts)")
  elif PLAIN_FSDP in a.methods:
    p.error(f"{PLAIN_FSDP} is the plain step of a sharded model: add --fsdp")

  reason = _netns.unavailable()
  if not reason and a.hosts > 1:
    try:
      with _netns.Hosts(a.hosts):
        pass
    except (subprocess.CalledProcessError, OSError) as e:
      reason = f"cannot join namespaces by veth and bridge: {_netns._err(e)}"
  if reason:
    print(f"network benchmark skipped: {reason}. Nothing was measured.")
    return 0

  import jaxcomm  # pylint: disable=import-outside-toplevel
  missing = [m for m in a.methods if not hasattr(jaxcomm, METHODS[m][0])]
  for m in missing:
    print(f"note: jaxcomm.{METHODS[m][0]} does not exist in this checkout; "
          f"{m} is skipped")
  a.methods = [m for m in a.methods if m not in missing]
  if not use_torch:
    print("note: torch is not installed (pip install -e '.[torch]'); the "
          "PyTorch DDP rows are skipped" if a.torch == "auto" else
          "note: PyTorch DDP rows skipped (--torch=no)")
  for m in model_names:
    s = model_shapes(m)
    print(f"{m}: {len(s)} tensors, "
          f"{sum(math.prod(x) for x in s):,} parameters")
  print("resnet18 shapes (kh, kw, in, out) / (in, out) / (c,): "
        + ", ".join("x".join(map(str, s)) for s in RESNET18_SHAPES))

  os.makedirs(a.out_dir, exist_ok=True)
  tmp = os.path.join(a.out_dir, "network-logs")
  os.makedirs(tmp, exist_ok=True)
  for f in os.listdir(tmp):
    os.remove(os.path.join(tmp, f))
  ports = _Ports()
  rows = []
  t_all = time.perf_counter()
  with (_netns.Hosts(a.hosts) if a.hosts > 1
        else _netns.Namespace()) as ns:
    if a.hosts > 1:
      print(f"{a.hosts} hosts ({', '.join(ns.names)}) joined by a bridge; "
            "the rate limits each host's link both ways", flush=True)
    else:
      print(f"namespace {ns.name}: loopback only", flush=True)
    for nproc in procs:
      for model in model_names:
        t0 = time.perf_counter()
        print(f"{nproc} processes, {model} gradients ...", flush=True)
        got = _run_jax(ns, ports, a, nproc, rates, model, tmp) \
          if a.methods else []
        if use_torch and model in a.torch_models.split(","):
          for rate in rates:
            ns.set_rate(rate)
            for bucket in [float(b) for b in a.torch_buckets.split(",")]:
              for hook in (None, "powersgd"):
                got.append(_run_torch(ns, ports, a, nproc, rate, model, tmp,
                                      bucket, hook))
                print(f"  {got[-1]['method']} at {_rate_label(rate)}",
                      flush=True)
        for r in sorted(got, key=lambda r: _rate_key(r["rate"])):
          state = _fmt(_median(r)) + " s" if r.get("times") else \
            (r.get("skipped") or r.get("error"))
          print(f"  {_rate_label(r['rate'])} {r['method']}: {state}",
                flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows += got
  rows.sort(key=lambda r: (r["model"], r["procs"], _rate_key(r["rate"])))
  where = ("a rate-limited loopback" if a.hosts == 1 else
           f"{a.hosts} hosts joined by rate-limited links (loopback inside "
           "each; " + ("the params split over each host's processes, the "
                       "method between hosts on each device's shards)"
                       if a.fsdp else
                       "the method between hosts after a dense mean "
                       "inside)"))
  md = [f"## Measured step times on {where}", "",
        f"Processes {a.processes}; rates (Gbit/s) {a.rates}; one CPU device "
        f"per process; median of {a.steps} steps after {a.warmup} warm-up "
        f"steps at each rate; "
        f"model columns: jaxcomm.wire.CostModel.link(rate, "
        f"{a.latency_us:g} us) on the claimed collectives "
        "(communication only).", "",
        table(rows, a.latency_us), ""]
  if a.hosts > 1:
    md += ["Bytes through each host's link (its tbf counters; TCP/IP "
           "headers included):", "", link_table(rows)]
  else:
    md += ["Targets:", targets(rows)]
  text = "\n".join(md)
  print("\n" + text)
  stem = ("network" if a.hosts == 1 else f"network-{a.hosts}hosts"
          + ("-fsdp" if a.fsdp else ""))
  with open(os.path.join(a.out_dir, f"{stem}.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(a.out_dir, f"{stem}.json"), "w") as f:
    json.dump({"args": {k: v for k, v in vars(a).items()
                        if not k.startswith("_")}, "rows": rows}, f,
              indent=1, default=str)
  try:
    plot(rows, os.path.join(a.out_dir, f"{stem}.png"), a.latency_us)
    print(f"\nplot: {os.path.join(a.out_dir, stem + '.png')}")
  except Exception as e:  # pylint: disable=broad-except
    print(f"plot failed: {type(e).__name__}: {e}")
  print(f"(total {time.perf_counter() - t_all:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
