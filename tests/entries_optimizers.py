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
    dense_baseline=(lambda dense=_dense: optax.chain(
      jaxcomm.mean_gradients(), dense(LR))),
  ))
