"""PowerSGD on the gradient shapes of a ResNet-18 (CIFAR variant), on CPU.

Prints three markdown tables:

1. orthogonalization: Gram-Schmidt, Householder QR (``jnp.linalg.qr``) and
   Cholesky-QR2 (with its Householder fallback) on the ``P`` blocks of every
   compressed ResNet-18 matrix (batched per shape, as PowerSGD runs them):
   time, and loss of orthogonality ``max |P^T P - I|`` for blocks of
   condition number 1e2, 1e4, 1e6;
2. step overhead on one device (``axis_name=None``: no collective, so the
   figure is the compression math alone, compress + decompress + error
   feedback): ``tx.update`` of ``powersgd(rank)`` minus ``tx.update`` of
   ``mean_gradients`` (the dense path), rank 1, 2, 4, with same-shape
   batching on and off; next to it, in the same run and round-robin with
   it, PyTorch's DDP ``powerSGD_hook`` overhead on the same shapes (single
   process gloo group: hook time minus ``allreduce_hook`` time) if
   ``torch`` imports, otherwise that column is skipped with how to enable
   it;
3. bytes on the wire per step on 8 devices, read from the compiled HLO of
   the shard_map'd update, against the dense float32 psum.

The shapes are the CIFAR ResNet-18 (3x3 stem, 10 classes, 11,173,962
parameters) in Flax layout (conv kernels ``(kh, kw, in, out)``, viewed as
``(kh kw in, out)``). Gradients are Gaussian.

Run: ``python -m benchmarks.bench_powersgd [--reps R]``. One run on a shared
CPU host is noisy: read the ratios, not the digits. No assertions on time.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxcomm  # noqa: E402
from benchmarks._common import resnet18_shapes  # noqa: E402
from benchmarks._common import time_ms  # noqa: E402
from jaxcomm.collectives import _lowrank  # noqa: E402
from jaxcomm.transforms.lowrank import _powersgd  # noqa: E402


def _grads(shapes, seed=0):
  rng = np.random.RandomState(seed)
  return {k: jnp.asarray(rng.randn(*s).astype(np.float32))
          for k, s in shapes.items()}


def _compressed_shapes(shapes, rank):
  tx = jaxcomm.powersgd(rank=rank, axis_name=None)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in
            shapes.items()}
  spec = jaxcomm._compressor.spec_of(tx)  # pylint: disable=protected-access
  paths = spec.paths(params)
  leaves = jax.tree.leaves(params)
  return [tuple(l.shape) for l, p in zip(leaves, paths) if p == "compress"]


def _ill_conditioned(rng, b, n, r, cond):
  u, _ = np.linalg.qr(rng.randn(b, n, r))
  v, _ = np.linalg.qr(rng.randn(b, r, r))
  s = np.logspace(0, -np.log10(cond), r)
  return jnp.asarray((u * s[None, None, :]) @ v, jnp.float32)


def orthogonalization_table(reps: int, ranks=(2, 4)) -> str:
  shapes = resnet18_shapes()
  rows = ["| method | rank | time (ms, all ResNet-18 P blocks) | "
          "max abs(P^T P - I), cond 1e2 | cond 1e4 | cond 1e6 |",
          "|---|---:|---:|---:|---:|---:|"]
  rng = np.random.RandomState(0)
  for rank in ranks:
    comp = _compressed_shapes(shapes, rank)
    groups = _powersgd._groups(comp, True)  # pylint: disable=protected-access
    blocks = [jnp.asarray(rng.randn(len(idx), ms[0], rank), jnp.float32)
              for ms, idx in groups]
    for name in _lowrank.ORTHOGONALIZATIONS:
      f = _lowrank.orthogonalizer(name, rank)
      fn = jax.jit(lambda bs, f=f: [f(b, 0.0) for b in bs])
      ms = time_ms(fn, blocks, warmup=2, reps=reps)
      errs = []
      for cond in (1e2, 1e4, 1e6):
        worst = 0.0
        for ms_, idx in groups:
          p = _ill_conditioned(rng, len(idx), ms_[0], rank, cond)
          q = np.asarray(jax.jit(lambda p, f=f: f(p, 0.0))(p), np.float64)
          g = np.einsum("bnk,bnj->bkj", q, q) - np.eye(rank)
          worst = max(worst, float(np.abs(g).max()))
        errs.append(f"{worst:.1e}")
      rows.append(f"| {name} | {rank} | {ms:.3f} | " + " | ".join(errs)
                  + " |")
  return "\n".join(rows)


def _jax_step(tx, grads):
  """A no-argument callable running one jitted ``tx.update`` (blocking)."""
  state = tx.init(grads)
  fn = jax.jit(tx.update)
  return lambda: jax.block_until_ready(fn(grads, state, grads))


def _torch_steps(ranks):
  """No-argument callables for torch's hooks, or a reason they are absent.

  One flat gradient buffer of the same shapes (PyTorch layout: conv
  ``(out, in, kh, kw)``, linear ``(out, in)``) in a single-process gloo
  group; ``allreduce_hook`` is the dense baseline.
  """
  try:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook  # noqa: PLC0415
  except ImportError:
    return None, ("PyTorch column skipped: `import torch` failed in this "
                  "environment. Enable it with `pip install torch==2.13.0` "
                  "(an optional benchmark extra, never a dependency of "
                  "jaxcomm) and run again.")
  os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
  os.environ.setdefault("MASTER_PORT", "29533")
  if not dist.is_initialized():
    dist.init_process_group("gloo", rank=0, world_size=1)

  def to_torch(s):
    if len(s) == 4:
      return (s[3], s[2], s[0], s[1])
    if len(s) == 2:
      return (s[1], s[0])
    return s

  rng = np.random.RandomState(0)
  tensors = [torch.from_numpy(rng.randn(*to_torch(s)).astype(np.float32))
             for s in resnet18_shapes().values()]
  flat = torch.cat([t.reshape(-1) for t in tensors])

  class _Bucket:
    """The GradBucket interface the hooks use, over one flat buffer."""

    def __init__(self, buf, grads):
      self._buf, self._grads = buf, grads

    def buffer(self):
      return self._buf

    def gradients(self):
      return self._grads

    def parameters(self):
      return self._grads

    def index(self):
      return 0

    def is_last(self):
      return True

    def set_buffer(self, b):
      self._buf.copy_(b)

  def make(hook, state):
    def run():
      buf = flat.clone()
      views, off = [], 0
      for t in tensors:
        views.append(buf[off:off + t.numel()].view_as(t))
        off += t.numel()
      return hook(state, _Bucket(buf, views)).wait()
    return run

  steps = {"dense": make(default_hooks.allreduce_hook, None)}
  for rank in ranks:
    for batch in (True, False):
      state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank,
        start_powerSGD_iter=2, min_compression_rate=2,
        use_error_feedback=True, warm_start=True,
        batch_tensors_with_same_shape=batch)
      steps[(rank, batch)] = make(powerSGD_hook.powerSGD_hook, state)
  return steps, f"torch {torch.__version__}"


def overhead_table(reps: int, ranks=(1, 2, 4)) -> str:
  """jaxcomm's and torch's step overheads, measured round-robin.

  All callables are warmed up, then run in turn, ``reps`` rounds, so that
  load from other processes on a shared host hits them alike; each figure
  is the median over the rounds.
  """
  shapes = resnet18_shapes()
  grads = _grads(shapes)
  steps = {("jax", "dense"): _jax_step(jaxcomm.mean_gradients(
    axis_name=None), grads)}
  for rank in ranks:
    for batch in (True, False):
      steps[("jax", rank, batch)] = _jax_step(jaxcomm.powersgd(
        rank=rank, axis_name=None, batch_same_shape=batch), grads)
  torch_steps, torch_note = _torch_steps(ranks)
  if torch_steps is not None:
    for k, f in torch_steps.items():
      steps[("torch", k)] = f
  for f in steps.values():           # warm-up (and torch's 2 dense iters)
    for _ in range(3):
      f()
  times = {k: [] for k in steps}
  for _ in range(reps):
    for k, f in steps.items():
      start = time.perf_counter()
      f()
      times[k].append(time.perf_counter() - start)
  med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
  base = med[("jax", "dense")]
  lines = [f"dense path, median ms per step: jaxcomm `mean_gradients` "
           f"{base:.2f}"]
  if torch_steps is not None:
    lines[0] += f"; {torch_note} `allreduce_hook` {med[('torch', 'dense')]:.2f}"
  else:
    lines.append("")
    lines.append(torch_note)
  lines += ["", "| rank | batched same shapes | jaxcomm overhead (ms) | torch "
            "powerSGD_hook overhead (ms) | jaxcomm / torch |",
            "|---:|:---:|---:|---:|---:|"]
  for rank in ranks:
    for batch in (False, True):
      jx = med[("jax", rank, batch)] - base
      if torch_steps is not None:
        tt = med[("torch", (rank, batch))] - med[("torch", "dense")]
        tcol, ratio = f"{tt:.2f}", f"{jx / tt:.2f}"
      else:
        tcol, ratio = "skipped", "-"
      lines.append(f"| {rank} | {'yes' if batch else 'no (default)'} | "
                   f"{jx:.2f} | {tcol} | {ratio} |")
  return "\n".join(lines)


def wire_table(ranks=(1, 2, 4), n: int = 8) -> str:
  shapes = resnet18_shapes()
  params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
  mesh = jaxcomm.parallel.make_mesh(n)
  rows = ["| transform | compressed leaves | payload bytes (HLO) | "
          "claimed | sent bytes/device | dense psum sent | ratio |",
          "|---|---:|---:|---:|---:|---:|---:|"]
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  for rank in ranks:
    tx = jaxcomm.powersgd(rank=rank)
    layout = jaxcomm.parallel.state_layout(tx, params, mesh)
    specs = jaxcomm.parallel.state_specs(layout)
    state = jaxcomm.parallel.init_state(tx, params, mesh, layout=layout)

    def step(p, s, g, tx=tx, layout=layout):
      g = jax.tree.map(lambda x: x[0], g)
      u, s2 = tx.update(g, jaxcomm.parallel.to_local(s, layout), p)
      return u, jaxcomm.parallel.to_global(s2, layout)

    fn = jax.jit(jax.shard_map(step, mesh=mesh,
                               in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs)))
    grads = {k: jax.ShapeDtypeStruct((n,) + s, jnp.float32)
             for k, s in shapes.items()}
    rep = jaxcomm.wire.report(fn.lower(params, state, grads), params=params)
    claim = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, n), n=n,
                                   params=params)
    comp = len(_compressed_shapes(shapes, rank))
    total = sum(rep.payload.values())
    rows.append(
      f"| powersgd(rank={rank}) | {comp} of {len(shapes)} | {total:,} | "
      f"{sum(claim.payload.values()):,} | {rep.total_sent:,.0f} | "
      f"{rep.dense_sent:,.0f} | {rep.ratio:.1f}x |")
  return "\n".join(rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=20)
  args = parser.parse_args(argv)
  shapes = resnet18_shapes()
  total = sum(int(np.prod(s)) for s in shapes.values())
  print(f"# PowerSGD on ResNet-18 (CIFAR) gradient shapes: {total:,} "
        f"parameters in {len(shapes)} leaves; backend "
        f"{jax.default_backend()}, {os.cpu_count()} CPU cores\n")
  print("## Orthogonalization of the P blocks\n")
  print(orthogonalization_table(args.reps))
  print("\n## Step overhead, one device (axis_name=None), against "
        "PyTorch's powerSGD_hook\n")
  print(overhead_table(args.reps))
  print("\n## Bytes on the wire per step, 8 devices\n")
  print(wire_table())


if __name__ == "__main__":
  main()
