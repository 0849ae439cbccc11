"""Benchmark of jaxcomm.kernels on the default backend (a markdown table).

Times sign packing, unpacking and the 8-worker vote, and top-k selection at
0.1% and 1% density, on a 25M-element float32 array, each as a ratio to one
memory copy of that array (a jitted ``x + 0``). On GPU/TPU it also times each
Pallas kernel against its jnp path (``use_kernel=True`` / ``False``) and the
top-k kernel against ``lax.top_k`` at k = 16, 128 and 1024: the figures the
``auto`` table of :mod:`jaxcomm.kernels` is chosen from. The "default path"
rows follow ``JAXCOMM_KERNELS`` (printed in the header). Approximate
selections also report the recall of the true top-k |mass|: the |x| mass of
the entries they keep that are in the exact top-k, over the mass of the
exact top-k (at most k entries kept).

Run: ``python -m benchmarks.bench_kernels [--size N] [--reps R]``. Wall-clock
numbers on a shared CPU host are noisy; read the ratios, not the digits. No
assertions on time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks._common import time_ms
from jaxcomm import kernels
from jaxcomm.kernels import bitpack
from jaxcomm.kernels import topk


def _mass_recall(x_abs: np.ndarray, kept: np.ndarray, exact: np.ndarray,
                 k: int) -> float:
  kept = kept[kept < x_abs.shape[0]][:k]
  hit = np.intersect1d(kept, exact, assume_unique=False)
  return float(x_abs[hit].sum() / x_abs[exact].sum())


def _unpack_via_unpackbits(words, length):
  u8 = lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
  bits = jnp.unpackbits(u8, bitorder="little")[:length]
  return jnp.where(bits == 1, 1.0, -1.0).astype(jnp.float32)


def _torch_topk(x_np: np.ndarray, k: int, reps: int):
  """Median ms of ``torch.topk(|x|, k)`` on the GPU when torch sees one
  (synchronized), else on the CPU; None without torch."""
  try:
    import torch
  except ImportError:
    return None
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  xt = torch.from_numpy(np.array(x_np)).to(dev)   # a writable copy
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  fn = lambda: torch.topk(xt.abs(), k, sorted=False)
  fn()
  sync()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    sync()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=25_000_000)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--workers", type=int, default=8)
  args = parser.parse_args(argv)
  n, reps = args.size, args.reps

  key = jax.random.key(0)
  x = jax.random.normal(key, (n,), jnp.float32)
  rows = []   # (name, ms, recall or None, note)

  copy_ms = time_ms(jax.jit(lambda v: v + 0), x, reps=reps)
  rows.append(("copy (`x + 0`)", copy_ms, None, "baseline"))

  rows.append(("`jnp.packbits(x > 0)` (uint8)",
               time_ms(jax.jit(lambda v: jnp.packbits(v > 0)), x, reps=reps),
               None, ""))
  rows.append(("pack_signs (default path)",
               time_ms(bitpack.pack_signs, x, reps=reps), None,
               f"backend={jax.default_backend()}"))
  rows.append(("pack_signs_reference (shift+OR)",
               time_ms(bitpack.pack_signs_reference, x, reps=reps), None, ""))
  rows.append(("pack_signs_packbits (packbits -> uint32)",
               time_ms(bitpack.pack_signs_packbits, x, reps=reps), None, ""))

  words = bitpack.pack_signs(x)
  rows.append(("unpack_signs (default path)",
               time_ms(lambda w: bitpack.unpack_signs(w, n), words, reps=reps),
               None, ""))
  unpackbits = jax.jit(_unpack_via_unpackbits, static_argnums=1)
  rows.append(("unpack via `jnp.unpackbits`",
               time_ms(unpackbits, words, n, reps=reps), None, ""))

  keys = jax.random.split(jax.random.key(1), args.workers)
  stacked = jax.vmap(lambda kk: bitpack.pack_signs_reference(
    jax.random.normal(kk, (n,), jnp.float32)))(keys)
  rows.append((f"vote, {args.workers} workers (default, bit-sliced)",
               time_ms(lambda w: bitpack.vote(w, n), stacked, reps=reps),
               None, "input: packed words"))
  rows.append((f"vote_reference, {args.workers} workers (unpack-count)",
               time_ms(lambda w: bitpack.vote_reference(w, n), stacked,
                     reps=reps), None, ""))

  if jax.default_backend() in ("gpu", "tpu"):
    # Kernel against jnp path, forced both ways (compiled, not interpreted).
    def both(label, fn, *fargs):
      for use in (True, False):
        path = "kernel" if use else "jnp"
        ms = time_ms(jax.jit(functools.partial(fn, use_kernel=use)), *fargs,
                     reps=reps)
        rows.append((f"{label}: {path}", ms, None, "use_kernel forced"))

    both("pack_signs", bitpack.pack_signs, x)
    both("unpack_signs",
         lambda w, use_kernel: bitpack.unpack_signs(w, n,
                                                    use_kernel=use_kernel),
         words)
    both(f"vote, {args.workers} workers",
         lambda w, use_kernel: bitpack.vote(w, n, use_kernel=use_kernel),
         stacked)
    for k in (16, 128, 1024):
      both(f"topk_abs k={k}",
           lambda v, use_kernel, k=k: topk.topk_abs(v, k,
                                                    use_kernel=use_kernel),
           x)
      rows.append((f"topk_abs k={k}: `lax.top_k`",
                   time_ms(jax.jit(functools.partial(
                     topk.topk_abs_reference, k=k)), x, reps=reps), None,
                   ""))
      rows.append((f"topk_abs k={k}: bracketed (exact)",
                   time_ms(jax.jit(functools.partial(
                     topk.topk_abs_bracketed, k=k)), x, reps=reps), None,
                   ""))

  x_np = np.asarray(x)
  x_abs = np.abs(x_np)
  for density in (0.001, 0.01):
    k = max(1, int(round(density * n)))
    sample = max(1, n // 100)   # a 1% sample, as in DGC's 0.1-1%
    tag = f"{100 * density:g}% (k={k})"
    exact_fn = jax.jit(lambda v, k=k: lax.top_k(jnp.abs(v), k))
    rows.append((f"top-k {tag}: `lax.top_k(abs)`",
                 time_ms(exact_fn, x, reps=max(1, reps // 2)), None, "exact"))
    exact = np.asarray(exact_fn(x)[1])

    bracketed_fn = jax.jit(functools.partial(topk.topk_abs_bracketed, k=k))
    same = bool(np.array_equal(np.asarray(bracketed_fn(x)[1]), exact))
    rows.append((f"top-k {tag}: `topk_abs_bracketed` (exact)",
                 time_ms(bracketed_fn, x, reps=reps), None,
                 f"same indices as lax.top_k: {same}"))
    rows.append((f"top-k {tag}: `topk_abs` (default path)",
                 time_ms(jax.jit(functools.partial(topk.topk_abs, k=k)), x,
                         reps=reps), None, ""))

    approx_fn = jax.jit(lambda v, k=k: lax.approx_max_k(jnp.abs(v), k))
    approx_idx = np.asarray(approx_fn(x)[1])
    rows.append((f"top-k {tag}: `lax.approx_max_k(abs)`",
                 time_ms(approx_fn, x, reps=max(1, reps // 2)),
                 _mass_recall(x_abs, approx_idx, exact, k),
                 "recall_target=0.95"))

    def sampled(v, kk, k=k, sample=sample, fn=topk.threshold_select):
      t = topk.sampled_threshold(v, k, kk, sample)
      return fn(v, t, k)

    sampled_fn = jax.jit(sampled)
    _, sel_idx, count = sampled_fn(x, key)
    rows.append((f"top-k {tag}: sampled_threshold + threshold_select",
                 time_ms(sampled_fn, x, key, reps=reps),
                 _mass_recall(x_abs, np.asarray(sel_idx), exact, k),
                 f"sample={sample}, capacity=k, count/k="
                 f"{int(count) / k:.2f}"))
    sampled_ref = jax.jit(functools.partial(
      sampled, fn=topk.threshold_select_reference))
    rows.append((f"top-k {tag}: same, reference cumsum+scatter compaction",
                 time_ms(sampled_ref, x, key, reps=max(1, reps // 2)), None,
                 ""))
    torch_ms = _torch_topk(x_np, k, max(1, reps // 2))
    rows.append((f"top-k {tag}: `torch.topk(abs)`", torch_ms, None,
                 "exact" if torch_ms is not None else "torch not installed"))

  print(f"\njaxcomm.kernels on {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), n={n:,} float32, "
        f"median of {reps} (top-k exact/approx: {max(1, reps // 2)}), "
        f"JAXCOMM_KERNELS={kernels.mode()}\n")
  print("| op | ms | x copy | recall of top-k mass | note |")
  print("|---|---:|---:|---:|---|")
  for name, ms, recall, note in rows:
    ms_s = "n/a" if ms is None else f"{ms:.3f}"
    ratio = "n/a" if ms is None else f"{ms / copy_ms:.2f}"
    rec = "" if recall is None else f"{recall:.3f}"
    print(f"| {name} | {ms_s} | {ratio} | {rec} | {note} |")


if __name__ == "__main__":
  main()
