"""Bytes on the wire for every compressor, and what they would cost in time.

For the CIFAR ResNet-18 gradient shapes (11,173,962 parameters), prints per
compressor the bytes one device sends per step (ring formulas, from the
compressor's own claim, which the test battery checks against compiled HLO
on 8 devices), the ratio to the dense float32 psum, and the alpha-beta
model's predicted communication time for 8 and 64 hosts on 1, 10 and
25 Gbit/s links (50 us latency, ring algorithms). Nothing is timed here:
measured wall-clock figures come from ``benchmarks/network.py``.

Run: ``python -m benchmarks.bench_wire``.
"""

import jax.numpy as jnp

import jaxcomm
from benchmarks._common import resnet18_shapes


def _label(m) -> str:
  args = ", ".join(f"{k}={getattr(v, '__name__', v)}"
                   for k, v in m.defaults.items())
  return f"{m.attr}({args})"


# Every compressor of jaxcomm.registry with its defaults, then the variants
# the README's table quotes.
# (each ``make(**kw)`` passes ``kw``, e.g. ``axis_name=None``, through).
CONFIGS = [(_label(m), m.make)
           for m in jaxcomm.registry.methods("compressor")] + [
  ("topk(ratio=0.001)", lambda **kw: jaxcomm.topk(0.001, **kw)),
  ("randomk(ratio=0.001)", lambda **kw: jaxcomm.randomk(0.001, **kw)),
  ("gtopk(ratio=0.001)", lambda **kw: jaxcomm.gtopk(0.001, **kw)),
  ("csc(chunk_size=1024, ratio=0.001)",
   lambda **kw: jaxcomm.csc(1024, 0.001, **kw)),
  ("powersgd(rank=1)", lambda **kw: jaxcomm.powersgd(1, **kw)),
  ("powersgd(rank=2)", lambda **kw: jaxcomm.powersgd(2, **kw)),
]
LINKS = (1.0, 10.0, 25.0)
HOSTS = (8, 64)


def table() -> str:
  params = {k: jnp.zeros(v, jnp.float32)
            for k, v in resnet18_shapes().items()}
  head = ["compressor", "MB sent/device (n=8)", "vs dense"]
  head += [f"ms n={n} @{g:g}G" for n in HOSTS for g in LINKS]
  rows = ["| " + " | ".join(head) + " |",
          "|" + "---|" * 1 + "---:|" * (len(head) - 1)]
  for name, make in CONFIGS:
    tx = make()
    rep = jaxcomm.wire.summarize(jaxcomm.wire.claimed(tx, params, 8), n=8,
                                 params=params)
    cells = [name, f"{rep.total_sent / 1e6:.3f}", f"{rep.ratio:.1f}x"]
    for n in HOSTS:
      ops = jaxcomm.wire.claimed(tx, params, n)
      for g in LINKS:
        model = jaxcomm.wire.CostModel.link(g, latency_us=50.0)
        cells.append(f"{1e3 * model.predict(ops, n):.1f}")
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows)


def main():
  print("ResNet-18 (CIFAR) gradient, 11,173,962 parameters; bytes from each "
        "compressor's claim (checked against compiled HLO by the test "
        "battery); time = alpha-beta model, ring, 50 us latency.\n")
  print(table())


if __name__ == "__main__":
  main()
