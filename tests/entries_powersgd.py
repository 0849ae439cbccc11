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
        ({"error_feedback": "yes"}, "error_feedback"),
        ({"sharded": "block"}, "sharded"),
        ({"sharded": "whole", "num_iters_per_step": 2},
         "num_iters_per_step")]


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


# --------------------------------------------------------------- ATOMO ----

def atomo_probabilities(sigma, budget):
  """Wang et al. 2018, the water-filling loop of their probability
  algorithm: ``p_i = min(1, s' sigma_i / sum_{unsaturated} sigma)`` with
  ``s'`` the budget left after the saturated atoms (``p = 1``), repeated
  until no new atom saturates. Atoms with ``sigma = 0`` get ``p = 0``."""
  sigma = np.asarray(sigma, np.float64)
  s = min(budget, sigma.size)
  sat = np.zeros(sigma.size, bool)
  while True:
    free = ~sat & (sigma > 0)
    left = s - sat.sum()
    if not free.any() or left <= 0:
      p = sat.astype(np.float64)
      break
    p = np.where(sat, 1.0, left * sigma / sigma[free].sum())
    new = free & (p >= 1.0)
    if not new.any():
      break
    sat |= new
  return np.minimum(p, 1.0)


def atomo_uniform(key, device, leaf):
  """The transform's documented draw: one uniform per device and leaf."""
  return float(jax.random.uniform(
    jax.random.fold_in(jax.random.fold_in(key, device), leaf), (),
    jnp.float32))


def atomo_kept(p, u):
  """Systematic sampling: atom ``i`` is kept iff ``floor(C_i - u) >
  floor(C_{i-1} - u)``, ``C`` the cumulative ``p`` (``C_0 = 0``)."""
  c = np.concatenate([[0.0], np.cumsum(p)])
  return np.floor(c[1:] - u) > np.floor(c[:-1] - u)


def numpy_atomo(m, budget, u):
  """One matrix's unbiased ATOMO estimate (float64). The SVD's signs do
  not matter: each term ``sigma / p * u_i v_i^T`` is sign-invariant."""
  left, sigma, right = np.linalg.svd(m, full_matrices=False)
  p = atomo_probabilities(sigma, budget)
  keep = atomo_kept(p, u)
  w = np.where(keep, sigma / np.where(keep, p, 1.0), 0.0)
  return (left * w) @ right


def _atomo_ref(budget):
  def step(xs, state, t, key, n):
    del t
    sent = []
    for i in range(n):
      sent.append([numpy_atomo(x.reshape(_mat(x.shape)), budget,
                               atomo_uniform(key, i, j)).reshape(x.shape)
                   for j, x in enumerate(xs[i])])
    mean = [sum(sent[i][j] for i in range(n)) / n for j in range(len(xs[0]))]
    return mean, sent, state
  return step


registry.register(registry.Entry(
  name="atomo_s2", ref_init=lambda shapes: None, ref_step=_atomo_ref(2),
  factory=jaxcomm.atomo, kwargs={"budget": 2}, error_feedback=False,
  stochastic=True, rtol=1e-3, atol=1e-2,
  bad_args=[({"budget": 0}, "budget"), ({"budget": 2.5}, "budget"),
            ({"budget": True}, "budget"), ({"budget": None}, "budget")]))


# ------------------------------------------------------------ GradiVeQ ----

def _gradiveq_ref(dim, rank, refresh):
  """Yu et al. 2018: the compressed leaves (flattened, concatenated in
  bucket order, zero-padded) as slices of ``dim`` consecutive elements.
  A refresh step (``t % refresh == 0``, or no basis yet) averages the
  devices' gradients exactly and takes as the new basis the top ``rank``
  right singular vectors of the averaged slices (numpy's SVD: their
  principal directions, uncentred); otherwise device ``i`` sends ``c_i =
  U^T v`` for each slice ``v``, the sum of the ``c_i`` is decompressed by
  ``U`` and divided by ``n``, and device ``i``'s share is ``U c_i``."""
  def ref_init(shapes):
    del shapes
    return None

  def ref_step(xs, state, t, key, n):
    del key
    sizes = [x.size for x in xs[0]]
    size = sum(sizes)
    s = -(-size // dim)
    grids = [np.pad(np.concatenate([np.ravel(x) for x in dev]),
                    (0, s * dim - size)).reshape(s, dim) for dev in xs]
    if state is None or t % refresh == 0:
      mean = sum(grids) / n
      sent = grids
      _, _, vt = np.linalg.svd(mean, full_matrices=False)
      state = vt[:rank].T                                  # [d, k]
    else:
      u = state
      coeffs = [g @ u for g in grids]                      # [S, k]
      mean = sum(coeffs) @ u.T / n
      sent = [c @ u.T for c in coeffs]

    def split(flat):
      flat, out, off = flat.reshape(-1), [], 0
      for x in xs[0]:
        out.append(flat[off:off + x.size].reshape(x.shape))
        off += x.size
      return out

    return split(mean), [split(v) for v in sent], state

  return ref_init, ref_step


_GRADIVEQ_BAD = [({"dim": 0}, "dim"), ({"dim": 2.5}, "dim"),
                 ({"rank": 0}, "rank"), ({"rank": 129}, "rank"),
                 ({"refresh": 0}, "refresh"), ({"refresh": 1.5}, "refresh"),
                 ({"error_feedback": "yes"}, "error_feedback")]


def _gradiveq_entry(name, kwargs, ef=True):
  ref_init, ref_step = _gradiveq_ref(kwargs["dim"], kwargs["rank"],
                                     kwargs["refresh"])
  return registry.register(registry.Entry(
    name=name, ref_init=ref_init, ref_step=ref_step,
    factory=jaxcomm.gradiveq, kwargs=kwargs, error_feedback=ef,
    bad_args=_GRADIVEQ_BAD, rtol=1e-3, atol=1e-4))


# 33 slices of 128 onto 8 directions, the basis refreshed every 2 steps
# (dense at steps 0, 2, 4; projected at 1, 3).
_gradiveq_entry("gradiveq", {"dim": 128, "rank": 8, "refresh": 2})
