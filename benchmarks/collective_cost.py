"""What one collective costs among processes on the rate-limited loopback.

``python -m benchmarks.collective_cost`` (root, as the time-to-target
benchmark) starts ``P`` processes (one CPU device each, gloo) in the
namespace of :mod:`benchmarks._netns` and times jitted ``shard_map``
programs that run only collectives, block on each call, and report the
median over ``--calls`` calls:

* ``psum x1``: one all-reduce of ``n`` float32 values;
* ``psum x3``: three all-reduces of ``n / 3`` values each (the same bytes
  in three collectives; each depends on the last, so XLA cannot combine
  them);

for ``n`` = 1 and 1,048,576, at each rate, and a process's share of some
work (eight 64x768 @ 768x768 matmuls) alone and followed by an all-reduce
of one value. The first pair says what a collective costs beyond its bytes
when the processes wait for it; the second what meeting costs when each
process first computes on cores it shares with the others (4 processes on
2 cores here): the numbers the time-to-target breakdown needs to tell the
link from the rest.

Example::

  sudo .venv/bin/python -m benchmarks.collective_cost --rates 1,10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from benchmarks import _netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (1, 1 << 20)


def _median_ms(f, x, calls) -> float:
  """Median milliseconds of ``f(x)``, blocked on, after 3 warm calls."""
  import jax  # noqa: PLC0415
  for _ in range(3):
    jax.block_until_ready(f(x))
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def child(coordinator, nproc, pid, calls) -> None:
  """One process: times the programs, process 0 prints a JSON line."""
  from jaxcomm import parallel  # noqa: PLC0415
  parallel.initialize(coordinator, nproc, pid, local_device_count=1)
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  mesh = jax.make_mesh((nproc,), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))

  def chain(k):
    def body(x):
      parts = jnp.split(x, k)
      out = jax.lax.psum(parts[0], "data")
      for p in parts[1:]:
        # Depends on the last result: no combining into one collective.
        out = jax.lax.psum(p + out[:1] * 0, "data")
      return out
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                                 out_specs=P()))

  rows = []
  for n in SIZES:
    for k in (1, 3):
      m = max(n // k, 1) * k
      x = jax.make_array_from_callback(
        (nproc * m,), jax.sharding.NamedSharding(mesh, P("data")),
        lambda idx, m=m: jnp.ones((m,), jnp.float32))
      f = chain(k)
      rows.append({"values": m, "collectives": k,
                   "median_ms": _median_ms(f, x, calls)})
  # Compute then meet: a process's share of a step's work (matmuls), then
  # one all-reduce of a single value, against the same work alone.
  w = jnp.full((768, 768), 1e-3, jnp.float32)

  def work(x):
    h = jnp.broadcast_to(x[:1], (64, 768))
    for _ in range(8):
      h = jnp.tanh(h @ w)
    return h[:1, :1].reshape(1)

  x = jax.make_array_from_callback(
    (nproc,), jax.sharding.NamedSharding(mesh, P("data")),
    lambda idx: jnp.ones((1,), jnp.float32))
  for k, body in (("work alone", work),
                  ("work, then psum of 1 value",
                   lambda x: jax.lax.psum(work(x), "data"))):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                              out_specs=P("data") if k == "work alone"
                              else P()))
    rows.append({"values": 1, "collectives": k,
                 "median_ms": _median_ms(f, x, calls)})
  if pid == 0:
    print("ROWS " + json.dumps(rows), flush=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--rates", default="1,10", help="Gbit/s, comma-separated")
  p.add_argument("--calls", type=int, default=50)
  p.add_argument("--child", nargs=3, metavar=("ADDR", "N", "ID"),
                 help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.child:
    child(a.child[0], int(a.child[1]), int(a.child[2]), a.calls)
    return 0
  reason = _netns.unavailable()
  if reason:
    print(f"collective-cost benchmark skipped: {reason}. Nothing was "
          "measured.")
    return 0
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  port = random.randint(20000, 40000)
  lines = ["| link | values | collectives | median ms per call |",
           "|---|---:|---:|---:|"]
  with _netns.Namespace() as ns:
    for rate in (float(r) for r in a.rates.split(",")):
      ns.set_rate(rate)
      port += 1
      cmds = [ns.command([sys.executable, "-m", "benchmarks.collective_cost",
                          "--calls", str(a.calls), "--child",
                          f"127.0.0.1:{port}", str(a.processes), str(i)])
              for i in range(a.processes)]
      codes, outs, timed_out = _netns.run_group(cmds, 600, env=env, cwd=ROOT)
      if timed_out or any(codes):
        print(f"{rate:g} Gbit/s failed: {codes} {(outs[0] or '')[-400:]}")
        return 1
      rows = json.loads(next(l for l in outs[0].splitlines()
                             if l.startswith("ROWS "))[5:])
      for r in rows:
        lines.append(f"| {rate:g} Gbit/s | {r['values']:,} | "
                     f"{r['collectives']} | {r['median_ms']:.2f} |")
  print(f"{a.processes} processes, one CPU device each, median of "
        f"{a.calls} calls\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
