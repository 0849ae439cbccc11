"""Registry entries for the communication-efficient optimizers.

The references are written in float64 numpy from the papers (1-bit Adam:
Tang et al. 2021, Algorithm 1; 1-bit LAMB: Li et al. 2021, Algorithm 1, with
DeepSpeed's published constants), around the numpy compressed allreduce of
``tests.entries_quantization`` (DeepSpeed's two-phase exchange with worker
and server error). The battery runs 3 steps with ``freeze_step=1``: one
warm-up step on the exact mean gradient, then two compressed steps.
"""

import numpy as np
import optax

import jaxcomm
from tests import harness
from tests import registry
from tests.entries_quantization import _onebit_ref_step

LR, B1, B2, EPS = 0.05, 0.9, 0.99, 1e-8
FREEZE = 1


def _momentum_round(t, grads, mu, res, server, n):
  """One step of the shared exchange: the mean gradient while warm, else
  the 1-bit average of the local momenta (worker error ``res``)."""
  names = sorted(k for k in grads if grads[k].dtype.kind == "f")
  comp = [k for k in names if k in harness.COMPRESSED]
  g = {k: np.asarray(grads[k], np.float64) for k in names}
  if t < FREEZE:
    gbar = {k: g[k].mean(axis=0) for k in names}
    return {k: B1 * mu[k] + (1 - B1) * gbar[k] for k in names}, gbar, res, \
      server
  local = {k: B1 * mu[k] + (1 - B1) * g[k] for k in names}   # [n, ...]
  new_mu = {k: local[k].mean(axis=0) for k in names}          # dense leaves
  xs = [[local[k][i] + res[i][j] for j, k in enumerate(comp)]
        for i in range(n)]
  mean, sent, server = _onebit_ref_step(xs, server, t, None, n)
  res = [[xs[i][j] - sent[i][j] for j in range(len(comp))] for i in range(n)]
  for j, k in enumerate(comp):
    new_mu[k] = mean[j]
  return new_mu, None, res, server


def _run(grads_seq, n, lamb):
  first = grads_seq[0]
  names = sorted(k for k in first if first[k].dtype.kind == "f")
  comp = [k for k in names if k in harness.COMPRESSED]
  params = harness.battery_params()
  p = {k: np.asarray(params[k], np.float64) for k in names}
  zeros = lambda: {k: np.zeros(first[k].shape[1:]) for k in names}
  mu, nu, vf = zeros(), zeros(), zeros()
  coeff = {k: 1.0 for k in names}
  factor = {k: 1.0 for k in names}
  res = [[np.zeros(first[k].shape[1:]) for k in comp] for _ in range(n)]
  server = {"shapes": None, "server": None}
  nu_count = 0
  out = []
  for t, grads in enumerate(grads_seq):
    prev = mu
    mu, gbar, res, server = _momentum_round(t, grads, mu, res, server, n)
    warm = t < FREEZE
    if warm:
      nu = {k: B2 * nu[k] + (1 - B2) * gbar[k] ** 2 for k in names}
      nu_count += 1
    c1, c2 = 1 - B1 ** (t + 1), 1 - B2 ** nu_count
    upd = {}
    for k in names:
      u = (mu[k] / c1) / (np.sqrt(nu[k] / c2) + EPS)
      if not lamb:
        upd[k] = -LR * u
        continue
      # LAMB (weight decay 0): trust ratio ||p|| / ||u|| (1 if either is 0)
      # while warm; then the frozen moving average times the factor.
      pn, un = np.linalg.norm(p[k]), np.linalg.norm(u)
      ratio = pn / un if pn > 0 and un > 0 else 1.0
      ratio = min(max(ratio, 0.01), 10.0)
      if warm:
        upd[k] = -LR * ratio * u
        coeff[k] = 0.9 * coeff[k] + 0.1 * ratio
        vf[k] = nu[k]
      else:
        g_rec = (mu[k] - B1 * prev[k]) / (1 - B1)
        vf[k] = B2 * vf[k] + (1 - B2) * g_rec ** 2
        f = np.max((np.sqrt(nu[k] / c2) + EPS) / (np.sqrt(vf[k] / c2) + EPS))
        f = min(max(f, 0.5), 4.0)
        f = min(max(f, factor[k] * 0.9), factor[k] * 1.1)
        factor[k] = f
        upd[k] = -LR * coeff[k] * f * u
    out.append(upd)
  return out, res, None


_BAD = [({"freeze_step": -1}, "freeze_step"),
        ({"freeze_step": 1.5}, "freeze_step"),
        ({"b1": 1.0}, "b1"), ({"b2": -0.1}, "b2"), ({"eps": 0.0}, "eps"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"bias_correction": 1}, "bias_correction")]

for _name, _factory, _lamb, _dense, _extra in (
    ("onebit_adam", jaxcomm.onebit_adam, False, optax.adam, []),
    ("onebit_lamb", jaxcomm.onebit_lamb, True, optax.lamb,
     [({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff"),
      ({"factor_min": 0.0}, "factor_min")])):
  registry.register(registry.Entry(
    name=_name,
    ref_init=lambda shapes: None,
    ref_step=None,
    numpy_run=(lambda grads_seq, n, lamb=_lamb: _run(grads_seq, n, lamb)),
    factory=_factory,
    kwargs={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS,
            "freeze_step": FREEZE},
    bad_args=_BAD + _extra,
    # What the exchange averages is the momentum, not the gradient: the
    # momentum's balance is checked in tests/test_optimizers.py.
    conserves=False,
    rtol=2e-4, atol=1e-5,
    dense_optimizer=(lambda dense=_dense: dense(LR)),
  ))


# ------------------------------------------------------------------ DeMo --
# Peng, Quesnelle & Kingma 2024 (arXiv 2411.19870), Algorithm 1 and the
# authors' reference optimizer: per device m = beta m + g; the top-k
# coefficients of each tile's orthonormal 2-D DCT-II are taken out of m and
# all-gathered; the step is -lr sign(IDCT(mean of the coefficients)). The
# departures jaxcomm states: coefficients averaged over all n devices (the
# reference averages each over its senders), a leaf of more dimensions is
# the matrix (prod(shape[:-1]), shape[-1]), the policy's dense leaves are
# DeMo with every coefficient taken (the exact mean gradient's sign).

DEMO = {"learning_rate": LR, "compression_decay": 0.9,
        "compression_topk": 6, "compression_chunk": 8}


def demo_dct(n):
  """The orthonormal DCT-II matrix from its formula (float64)."""
  d = np.zeros((n, n))
  for k in range(n):
    scale = np.sqrt((1.0 if k == 0 else 2.0) / n)
    for j in range(n):
      d[k, j] = scale * np.cos(np.pi * (2 * j + 1) * k / (2 * n))
  return d


def demo_tiles(shape, chunk):
  """(rows, cols, h, w): the leaf as a matrix, tile sides the largest
  divisors of its dimensions not above ``chunk`` (the reference's
  ``_get_smaller_split``)."""
  rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
  cols = int(shape[-1]) if shape else 1
  side = lambda s: max(d for d in range(1, chunk + 1) if s % d == 0)
  return rows, cols, side(rows), side(cols)


def demo_extract(m, topk, chunk):
  """The coefficients DeMo takes out of momentum ``m``: per tile the
  ``topk`` of largest magnitude (ties: lower index), as a dense array of
  DCT coefficients [tiles_r, tiles_c, h, w] (zeros elsewhere)."""
  rows, cols, h, w = demo_tiles(m.shape, chunk)
  x = m.reshape(rows // h, h, cols // w, w)
  coef = np.einsum("yhxw,ah,bw->yxab", x, demo_dct(h), demo_dct(w))
  flat = coef.reshape(-1, h * w)
  keep = np.zeros_like(flat)
  for t in range(flat.shape[0]):
    order = np.argsort(-np.abs(flat[t]), kind="stable")[:topk]
    keep[t, order] = flat[t, order]
  return keep.reshape(coef.shape)


def demo_inverse(coef, shape):
  h, w = coef.shape[2:]
  x = np.einsum("yxab,ah,bw->yhxw", coef, demo_dct(h), demo_dct(w))
  return x.reshape(shape)


def demo_run(grads_seq, n, params=None, compressed=None, *, lr=LR,
             decay=0.9, topk=6, chunk=8, sign=True, weight_decay=0.0):
  """DeMo in float64 numpy over ``grads_seq`` on ``n`` devices.

  ``compressed``: the leaves that go through the exchange (default the
  battery's); other floating leaves are the exact mean (DeMo taking every
  coefficient). The momentum is rounded to float32 after every step, as
  the transform stores it. Returns (updates, momenta[i][j], None).
  """
  first = grads_seq[0]
  names = sorted(k for k in first if np.asarray(first[k]).dtype.kind == "f")
  comp = list(harness.COMPRESSED) if compressed is None else list(compressed)
  params = harness.battery_params() if params is None else params
  p = {k: np.asarray(params[k], np.float64) for k in names}
  f32 = lambda a: np.asarray(a, np.float32).astype(np.float64)
  mom = [[np.zeros(first[k].shape[1:]) for k in comp] for _ in range(n)]
  out = []
  for grads in grads_seq:
    upd = {}
    for k in names:
      g = np.asarray(grads[k], np.float64)
      if k in comp:
        j = comp.index(k)
        total = 0.0
        for i in range(n):
          x = f32(decay * mom[i][j] + g[i])
          c = demo_extract(x, topk, chunk)
          mom[i][j] = f32(x - demo_inverse(c, x.shape))
          total = total + c
        q = demo_inverse(total / n, g.shape[1:])
      else:
        q = g.mean(axis=0)
      d = np.sign(q) if sign else q
      # Decoupled weight decay on the params (whole arrays, or a block's
      # shard when the sharded tests pass block gradients and no decay).
      upd[k] = -lr * (d + weight_decay * p[k]) if weight_decay else -lr * d
    out.append(upd)
  return out, mom, None


registry.register(registry.Entry(
  name="demo",
  ref_init=lambda shapes: None,
  ref_step=None,
  numpy_run=lambda grads_seq, n: demo_run(grads_seq, n),
  factory=jaxcomm.demo,
  kwargs=dict(DEMO),
  bad_args=[({"compression_decay": 1.0}, "compression_decay"),
            ({"compression_decay": -0.1}, "compression_decay"),
            ({"compression_topk": 0}, "compression_topk"),
            ({"compression_topk": 64}, "compression_topk"),
            ({"compression_topk": 2.5}, "compression_topk"),
            ({"compression_chunk": 1}, "compression_chunk"),
            ({"learning_rate": -1.0}, "learning_rate"),
            ({"weight_decay": -0.1}, "weight_decay"),
            ({"sign": 1}, "sign")],
  # The exchange moves the momentum's fast components, and the step is
  # their sign: no gradient balance (the momentum's is checked in
  # tests/test_optimizers.py with sign=False).
  conserves=False,
  dense_optimizer=lambda: optax.signum(LR, beta=0.9),
))
