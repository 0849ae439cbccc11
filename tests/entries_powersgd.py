"""Registry entries for PowerSGD, with an independent float64 numpy reference.

The reference follows Vogels et al. 2019 (Algorithm 1 with the error
feedback of Algorithm 2): for each compressed leaf, viewed as the matrix
``(prod(shape[:-1]), shape[-1])``, ``P = orth(sum_i M_i Q)``,
``Q_i = M_i^T P``, ``Q = sum_i Q_i``, update ``P Q^T / n`` and device ``i``
sent ``P Q_i^T``. Orthogonalization is numpy's QR for every method (the
result ``P P^T`` does not depend on the method or on column signs). The
initial ``Q`` of compressed leaf ``j`` is drawn as the transform documents:
``jax.random.normal(fold_in(PRNGKey(seed), j), (m_j, r))``; without warm
start from the step's key instead of ``PRNGKey(seed)``.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm
from tests import registry


def _mat(shape):
  return (int(np.prod(shape[:-1])), int(shape[-1]))


def _draw(key, j, m, rank):
  return np.asarray(jax.random.normal(jax.random.fold_in(key, j), (m, rank),
                                      jnp.float32), np.float64)


def _orth(p):
  if p.shape[1] == 1:
    norm = np.linalg.norm(p)
    return p / norm if norm > 0 else np.zeros_like(p)
  q, _ = np.linalg.qr(p)
  return q


def numpy_powersgd(ms, q, rank, num_iters=1):
  """One PowerSGD step on the matrices ``ms[i]`` of ``n`` devices.

  Returns:
    (mean, sent per device, the first round's aggregated Q).
  """
  n = len(ms)
  rest = list(ms)
  sent = [np.zeros_like(m) for m in ms]
  mean = np.zeros_like(ms[0])
  first = None
  for k in range(num_iters):
    p = _orth(sum(r @ q for r in rest))
    q_i = [r.T @ p for r in rest]
    q = sum(q_i)
    sent = [s + p @ qi.T for s, qi in zip(sent, q_i)]
    mean = mean + p @ q.T / n
    if k == 0:
      first = q
    rest = [m - s for m, s in zip(ms, sent)]
  del rank
  return mean, sent, first


def _ref(rank, num_iters=1, warm_start=True, seed=0):
  def ref_init(shapes):
    key = jax.random.PRNGKey(seed)
    return [_draw(key, j, _mat(s)[1], rank) for j, s in enumerate(shapes)]

  def ref_step(xs, state, step, key, n):
    del step
    means, sent_all, new_state = [], [[] for _ in range(n)], []
    for j in range(len(xs[0])):
      shape = xs[0][j].shape
      ms = [xs[i][j].reshape(_mat(shape)) for i in range(n)]
      q0 = state[j] if warm_start else _draw(key, j, _mat(shape)[1], rank)
      mean, sent, q = numpy_powersgd(ms, q0, rank, num_iters)
      zero_col = ~np.any(q != 0, axis=0)
      new_state.append(np.where(zero_col[None], state[j], q))
      means.append(mean.reshape(shape))
      for i in range(n):
        sent_all[i].append(sent[i].reshape(shape))
    return means, sent_all, new_state

  return ref_init, ref_step


_BAD = [({"rank": 0}, "rank"), ({"rank": 2.5}, "rank"),
        ({"min_compression_rate": -1.0}, "min_compression_rate"),
        ({"num_iters_per_step": 0}, "num_iters_per_step"),
        ({"orthogonalization": "svd"}, "orthogonalization"),
        ({"orthogonalization_epsilon": -1.0}, "orthogonalization_epsilon"),
        ({"warm_start": 1}, "warm_start"),
        ({"batch_same_shape": "yes"}, "batch_same_shape"),
        ({"seed": 1.5}, "seed"),
        ({"start_step": -1}, "start_step"),
        ({"error_feedback": "yes"}, "error_feedback")]


def _entry(name, kwargs, *, num_iters=1, warm_start=True, ef=True,
           bad=()):
  ref_init, ref_step = _ref(kwargs["rank"], num_iters, warm_start,
                            kwargs.get("seed", 0))
  return registry.register(registry.Entry(
    name=name, ref_init=ref_init, ref_step=ref_step,
    factory=jaxcomm.powersgd, kwargs=kwargs, error_feedback=ef,
    bad_args=list(bad), rtol=1e-3, atol=1e-4,
    stochastic=not warm_start))


_entry("powersgd_r2", {"rank": 2}, bad=_BAD)
_entry("powersgd_r2_ef21", {"rank": 2, "error_feedback": "ef21"},
       ef="ef21")
_entry("powersgd_r1_noef_cold",
       {"rank": 1, "error_feedback": False, "warm_start": False},
       warm_start=False, ef=False)
_entry("powersgd_r4_iters2_cholesky_batched",
       {"rank": 4, "num_iters_per_step": 2, "orthogonalization": "cholesky",
        "orthogonalization_epsilon": 1e-7, "batch_same_shape": True,
        "seed": 3},
       num_iters=2)
