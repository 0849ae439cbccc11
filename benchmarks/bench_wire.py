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

CONFIGS = [
  ("dense mean", lambda: jaxcomm.mean_gradients()),
  ("bf16 cast", lambda: jaxcomm.cast(jnp.bfloat16)),
  ("int8", lambda: jaxcomm.int8()),
  ("uint8", lambda: jaxcomm.uint8()),
  ("qsgd(127, 128)", lambda: jaxcomm.qsgd()),
  ("terngrad", lambda: jaxcomm.terngrad()),
  ("natural", lambda: jaxcomm.natural()),
  ("onebit", lambda: jaxcomm.onebit()),
  ("signsgd (majority)", lambda: jaxcomm.signsgd()),
  ("signum (majority)", lambda: jaxcomm.signum()),
  ("ef_signsgd", lambda: jaxcomm.ef_signsgd()),
  ("topk 1%", lambda: jaxcomm.topk(0.01)),
  ("topk 0.1%", lambda: jaxcomm.topk(0.001)),
  ("randomk 0.1%", lambda: jaxcomm.randomk(0.001)),
  ("threshold 1e-3", lambda: jaxcomm.threshold(1e-3)),
  ("gtopk 0.1%", lambda: jaxcomm.gtopk(0.001)),
  ("csc(1024, 0.1%)", lambda: jaxcomm.csc(1024, 0.001)),
  ("dgc 0.1%", lambda: jaxcomm.dgc(0.001)),
  ("powersgd r1", lambda: jaxcomm.powersgd(1)),
  ("powersgd r2", lambda: jaxcomm.powersgd(2)),
  ("powersgd r4", lambda: jaxcomm.powersgd(4)),
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
