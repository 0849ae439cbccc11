"""Registry entries for the sketching compressors, with numpy references.

FetchSGD (Rothchild et al. 2020, Algorithm 1) in float64 numpy, from the
paper: each device count-sketches its gradient (Charikar et al. 2002), the
sketches are averaged, ``S_u = rho S_u + S``, ``S_e += S_u`` (learning rate
1: the optimizer after the compressor applies it), ``Delta = Top-k(U(S_e))``
with ``U`` the median over rows of ``s_r(j) S_e[r, h_r(j)]``, ``S_e -=
S(Delta)``, and the momentum sketch zeroed in the cells the extracted
coordinates hash to. Shared with the code only: the hash's documented
definition (``jaxcomm.transforms.sparsify._sketch``), recomputed here in Python
integers, ``k = max(1, ceil(ratio * L))``, ties towards the lower index,
and the bucket layout (the compressed leaves of distinct shapes side by
side in tree order).
"""

import numpy as np

import jaxcomm
from tests import references
from tests import registry

_M32 = 0xFFFFFFFF


def fmix32(h):
  """MurmurHash3's 32-bit finalizer on uint64 arrays holding uint32."""
  h = np.asarray(h, np.uint64) & _M32
  h ^= h >> np.uint64(16)
  h = (h * np.uint64(0x85EBCA6B)) & _M32
  h ^= h >> np.uint64(13)
  h = (h * np.uint64(0xC2B2AE35)) & _M32
  return h ^ (h >> np.uint64(16))


def count_sketch_hash(positions, rows, cols, seed=0):
  """``(h, s)``, each ``[rows, len(positions)]``: the column and sign of
  every position in every row, from the definition::

    c_r    = fmix(seed * 0x9E3779B9 + (r + 1) * 0x85EBCA6B)   (mod 2^32)
    v_r(j) = fmix(fmix(j XOR c_r) + c_r)
    h_r(j) = (v_r(j) >> 1) mod cols,   s_r(j) = +1 if v_r(j) odd else -1
  """
  j = np.asarray(positions, np.uint64)[None, :]
  r = np.arange(rows, dtype=np.uint64)[:, None]
  c = fmix32((seed % 2**32) * 0x9E3779B9 % 2**32
             + (r + np.uint64(1)) * np.uint64(0x85EBCA6B))
  v = fmix32((fmix32(j ^ c) + c) & _M32)
  h = ((v >> np.uint64(1)) % np.uint64(cols)).astype(np.int64)
  s = np.where(v & np.uint64(1), 1.0, -1.0)
  return h, s


def sketch(vec, h, s, cols):
  """The count sketch of ``vec``: ``S[r, h_r(j)] += s_r(j) vec_j``."""
  out = np.zeros((h.shape[0], cols))
  for r in range(h.shape[0]):
    np.add.at(out[r], h[r], s[r] * vec)
  return out


def fetchsgd_step(grads, s_u, s_e, k, rows, cols, rho, seed=0, lr=1.0,
                  masking=True):
  """One round of Algorithm 1 on flat device gradients ``grads[i]``.

  Returns ``(delta, s_u, s_e)`` (new arrays); ``lr`` multiplies ``S_u``
  into ``S_e`` as in the paper (``Delta`` is then the weight change).
  """
  size = grads[0].size
  h, s = count_sketch_hash(np.arange(size), rows, cols, seed)
  mean_sketch = sum(sketch(g, h, s, cols) for g in grads) / len(grads)
  s_u = rho * s_u + mean_sketch
  s_e = s_e + lr * s_u
  est = np.median(s * np.take_along_axis(s_e, h, axis=1), axis=0)
  sel = np.argsort(-np.abs(est), kind="stable")[:k]
  delta = np.zeros(size)
  delta[sel] = est[sel]
  s_e = s_e - sketch(delta, h, s, cols)
  if masking:
    s_u = s_u.copy()
    for r in range(rows):
      s_u[r, h[r, sel]] = 0.0
  return delta, s_u, s_e


def _fetchsgd_ref(k_ratio, rows, cols, rho):
  def init(shapes):
    assert len(set(map(tuple, shapes))) == len(shapes), (
      "the reference lays leaves side by side in tree order: distinct "
      "shapes only")
    return np.zeros((rows, cols)), np.zeros((rows, cols))

  def step(xs, state, t, key, n):
    flats = [np.concatenate([x.ravel() for x in dev]) for dev in xs]
    k = references.topk_count(k_ratio, flats[0].size)
    delta, s_u, s_e = fetchsgd_step(flats, *state, k, rows, cols, rho)
    mean, off = [], 0
    for x in xs[0]:
      mean.append(delta[off:off + x.size].reshape(x.shape))
      off += x.size
    # No residual: what every device "sent" is the update itself.
    return mean, [list(mean) for _ in range(n)], (s_u, s_e)

  return init, step


_init, _step = _fetchsgd_ref(0.01, 5, 256, 0.9)

registry.register(registry.Entry(
  # The error lives in the (replicated) error sketch, not in per-device
  # residuals, and the update is a non-linear recovery from the summed
  # sketch: no per-device mass balance to check.
  name="fetchsgd",
  ref_init=_init,
  ref_step=_step,
  error_feedback=False,
  conserves=False,
  factory=jaxcomm.fetchsgd,
  kwargs={"k_ratio": 0.01, "cols": 256, "momentum": 0.9},
  bad_args=[({"k_ratio": 0.0}, "k_ratio"), ({"k_ratio": 1.5}, "k_ratio"),
            ({"k_ratio": float("nan")}, "k_ratio"),
            ({"rows": 0}, "rows"), ({"rows": 2.0}, "rows"),
            ({"cols": 0}, "cols"), ({"cols": -3}, "cols"),
            ({"momentum": 1.0}, "momentum"), ({"momentum": -0.1}, "momentum"),
            ({"momentum": float("nan")}, "momentum"),
            ({"error_feedback": True}, "error_feedback"),
            ({"error_feedback": "ef21"}, "error_feedback"),
            ({"momentum_masking": 1}, "momentum_masking"),
            ({"residual_decay": 0.5}, "residual_decay")],
))
