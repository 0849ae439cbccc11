"""The worker processes of :mod:`benchmarks.network`, started by its driver
inside the rate-limited namespace (``python -m benchmarks.network
--worker=jax|torch``): each times its train step at every rate the driver
sets and process 0 appends the times to the driver's JSONL file."""

from __future__ import annotations

import json
import os
import time

from benchmarks.network_methods import FLAT_METHODS
from benchmarks.network_methods import GOSSIP_METHODS
from benchmarks.network_methods import LOCAL_METHODS
from benchmarks.network_methods import METHODS
from benchmarks.network_methods import PLAIN_FSDP
from benchmarks.network_methods import SHARDED
from benchmarks.network_methods import TRANSFORMER
from benchmarks.network_methods import _torch_layout
from benchmarks.network_methods import model_shapes


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
