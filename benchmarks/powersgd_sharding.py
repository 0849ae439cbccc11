"""PowerSGD under FSDP: per shard (what ``update_on_shards`` does) or the
low rank of the whole matrix? Bytes across the slices and LM loss.

Inside a sharded step each device holds a block of every matrix (the
transformer LM's ``embed`` dimension split over ``fsdp``). Two readings of
PowerSGD are possible there:

* **per shard** (jaxcomm's): each device runs PowerSGD on its own block
  ``M_b`` (``m_b x n_b``): factors ``P_b = M_b Q_b`` and ``Q_b = M_b^T P_b``
  all-reduced across the slices, ``(m_b + n_b) r`` floats per device. The
  blocks of one matrix share no factor, so the approximation has rank up to
  ``f r`` but each block pays for its own copy of the unsplit side;
* **whole matrix**: the exact rank-``r`` power step of ``M``: the split
  factor stays split (``P_b = M_b Q``, no exchange over fsdp), the other is
  summed over fsdp (``Q = sum_b M_b^T P_b``) and, reduce-scattered there,
  crosses the slices as ``1/f`` per device: ``(m + n) r / f`` floats per
  device, plus a psum over fsdp of ``r``-wide factors (and the Gram matrix
  of the split factor, to orthogonalize it).

This bench trains the transformer LM of ``bench_sharded`` (1.62M params,
its ``embed`` axis split 4 ways) on the char corpus with error-feedback
PowerSGD then Adam, simulating the compression math on one device: the
slice's mean gradient is what both readings approximate (their factors
are all-reduced, so the approximation is of the mean), and the per-device
residuals are replaced by one (the mean's). Rows: dense Adam; per shard
at rank r; whole matrix at the same rank (fewer bytes); whole matrix at
the rank that sends the per-shard bytes (per matrix, ``floor(f (m_b +
n_b) r / (m + n))``). Columns: floats each device sends across the slices
per step for the matrices (vectors travel dense in every row and are
left out), the mean relative error ``|M - A|_F / |M|_F`` of the
error-corrected gradient's approximation over the run, and the eval loss.

  python -m benchmarks.powersgd_sharding --steps 600 \
      --out docs/benchmarks/powersgd_sharding.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from models import data as mdata  # noqa: E402
from models import transformer  # noqa: E402

CONFIG = dict(d_model=256, num_heads=8, num_layers=2, d_ff=1024, max_len=64)
FSDP = 4


def _split_dim(spec) -> int | None:
  for i, e in enumerate(tuple(spec)):
    if e == "fsdp":
      return i
  return None


def _orth(p):
  q, _ = jnp.linalg.qr(p)
  return q


def plan(params, specs, rank: int, mode: str, fsdp: int = FSDP) -> dict:
  """Per matrix leaf (by path): ``(blocks, split dim, rank)``; vectors
  absent (dense). ``mode``: "shard", "whole" (same rank), "whole_eq" (the
  per-shard bytes)."""
  out = {}
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  spec_of = dict((jax.tree_util.keystr(p), s) for p, s in
                 jax.tree_util.tree_flatten_with_path(
                   specs, is_leaf=lambda x: isinstance(
                     x, jax.sharding.PartitionSpec))[0])
  for path, x in flat:
    if x.ndim != 2:
      continue
    key = jax.tree_util.keystr(path)
    dim = _split_dim(spec_of[key])
    m, n = x.shape
    blocks = fsdp if dim is not None else 1
    mb, nb = (m // blocks, n) if dim == 0 else (m, n // blocks)
    if mode == "shard":
      out[key] = (blocks, dim, rank)
    elif mode == "whole":
      out[key] = (1, dim, rank)
    else:
      r = max(rank, int(blocks * (mb + nb) * rank // (m + n)))
      out[key] = (1, dim, min(r, min(m, n)))
  return out


def floats_per_device(params, the_plan, fsdp: int = FSDP) -> float:
  """Floats one device sends across the slices for the matrices' factors
  (per all-reduce payload; the ring factor is the same in every row)."""
  total = 0.0
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = jax.tree_util.keystr(path)
    if key not in the_plan:
      continue
    blocks, dim, r = the_plan[key]
    m, n = x.shape
    if blocks > 1:   # per shard: the device's block, both factors
      mb, nb = (m // blocks, n) if dim == 0 else (m, n // blocks)
      total += (mb + nb) * r
    elif dim is not None:   # whole matrix, split over fsdp: 1/f of both
      total += (m + n) * r / fsdp
    else:   # a matrix not split over fsdp: every device holds it whole
      total += (m + n) * r
  return total


def powersgd_sim(the_plan, seed: int = 0) -> optax.GradientTransformation:
  """Error-feedback PowerSGD (one power step, warm-started Q) on the
  blocks of ``the_plan``; other leaves pass through. Records the relative
  approximation error of each step in the state."""

  def blocks_of(key, x):
    blocks, dim, _ = the_plan[key]
    return jnp.split(x, blocks, axis=dim) if blocks > 1 else [x]

  def init(params):
    qs, res = {}, {}
    k = jax.random.PRNGKey(seed)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
      key = jax.tree_util.keystr(path)
      if key not in the_plan:
        continue
      res[key] = jnp.zeros_like(x)
      r = the_plan[key][2]
      qs[key] = [jax.random.normal(jax.random.fold_in(k, i), (b.shape[1], r))
                 for i, b in enumerate(blocks_of(key, x))]
    return {"q": qs, "e": res, "err": jnp.zeros([]), "norm": jnp.zeros([])}

  def update(grads, state, params=None):
    del params
    flat, tdef = jax.tree_util.tree_flatten_with_path(grads)
    out, qs, res = [], {}, {}
    err2 = norm2 = jnp.zeros([])
    for path, g in flat:
      key = jax.tree_util.keystr(path)
      if key not in the_plan:
        out.append(g)
        continue
      m_full = g + state["e"][key]
      approx, new_q = [], []
      for b, q in zip(blocks_of(key, m_full), state["q"][key]):
        p = _orth(b @ q)
        q = b.T @ p
        approx.append(p @ q.T)
        new_q.append(q)
      blocks, dim, _ = the_plan[key]
      a = jnp.concatenate(approx, axis=dim) if blocks > 1 else approx[0]
      res[key] = m_full - a
      qs[key] = new_q
      err2 += jnp.sum(res[key] ** 2)
      norm2 += jnp.sum(m_full ** 2)
      out.append(a)
    return (jax.tree.unflatten(tdef, out),
            {"q": qs, "e": res,
             "err": jnp.sqrt(err2 / jnp.maximum(norm2, 1e-30)),
             "norm": norm2})

  return optax.GradientTransformation(init, update)


def run(rows_cfg, steps: int, lr: float, batch: int, seed: int) -> list:
  ids, vocab = mdata.text_corpus()
  cut = int(len(ids) * 0.9)
  seq = CONFIG["max_len"]
  train = mdata.char_sequences(ids[:cut], seq)
  test = mdata.char_sequences(ids[cut:], seq)
  model = transformer.TransformerLM(vocab_size=len(vocab), **CONFIG,
                                    rngs=nnx.Rngs(seed))
  graphdef, params0 = nnx.split(model, nnx.Param)
  specs = transformer.partition_specs(params0, ("dcn", "fsdp"))

  def loss_fn(p, x, y):
    logits = nnx.merge(graphdef, p)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  ev_x = jnp.asarray(test["inputs"][:256])
  ev_y = jnp.asarray(test["targets"][:256])
  eval_loss = jax.jit(loss_fn)
  results = []
  for label, rank, mode in rows_cfg:
    the_plan = {} if mode == "dense" else plan(params0, specs, rank, mode)
    comp = powersgd_sim(the_plan)
    tx = optax.chain(comp, optax.adam(lr))
    params = params0
    state = tx.init(params)

    @jax.jit
    def step(p, s, x, y, tx=tx):
      loss, g = jax.value_and_grad(loss_fn)(p, x, y)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, loss

    it = mdata.batches(train, batch, seed=seed, num_shards=1)
    errs = []
    t0 = time.perf_counter()
    for _ in range(steps):
      b = next(it)
      params, state, loss = step(params, state, jnp.asarray(b["inputs"]),
                                 jnp.asarray(b["targets"]))
      errs.append(float(state[0]["err"]))
    ev = float(eval_loss(params, ev_x, ev_y))
    results.append(dict(
      label=label, mode=mode, rank=rank, eval_loss=ev,
      train_loss=float(loss),
      floats=floats_per_device(params0, the_plan) if the_plan else None,
      rel_err=float(np.mean(errs)) if the_plan else None,
      ranks=sorted({v[2] for v in the_plan.values()}),
      seconds=time.perf_counter() - t0))
    print(results[-1], flush=True)
  return results


def table(results, steps, lr, batch) -> str:
  dense_floats = None
  lines = [f"Transformer LM ({CONFIG}), char corpus, {steps} steps of Adam "
           f"(lr {lr}) after the compression, batch {batch} x "
           f"{CONFIG['max_len']}, the `embed` axis split over fsdp={FSDP}; "
           "the compression math simulated on one device (see the module "
           "docstring).", "",
           "| reading | rank(s) | floats/device across slices (matrices) "
           "| mean rel. error | eval loss |", "|---|---|---:|---:|---:|"]
  for r in results:
    if r["floats"] is None:
      lines.append(f"| {r['label']} | - | dense | - | {r['eval_loss']:.4f} |")
      continue
    dense_floats = dense_floats or r["floats"]
    ranks = ",".join(str(k) for k in r["ranks"])
    lines.append(f"| {r['label']} | {ranks} | {r['floats']:,.0f} | "
                 f"{r['rel_err']:.3f} | {r['eval_loss']:.4f} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=600)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--ranks", default="1,4")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  rows = [("dense Adam", 0, "dense")]
  for r in (int(x) for x in a.ranks.split(",")):
    rows += [(f"per shard r{r}", r, "shard"),
             (f"whole matrix r{r}", r, "whole"),
             (f"whole matrix, per-shard bytes (from r{r})", r, "whole_eq")]
  results = run(rows, a.steps, a.lr, a.batch, a.seed)
  text = table(results, a.steps, a.lr, a.batch)
  print(text)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
