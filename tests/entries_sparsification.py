"""Registry entries for the sparsifying compressors, with numpy references.

Each reference is written from the paper in float64 numpy and shares only
the conventions the codecs document: ``k = max(1, ceil(ratio * L))``, ties
broken towards the lower index, the key derivations of random-k (one
``fold_in(key, j)`` per leaf, ``jax.random.choice`` without replacement) and
of DGC's threshold sample (``jax.random.randint`` from ``fold_in(key, j)``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm
from tests import references
from tests import registry


def _largest(a, k):
  """Indices of the k largest values of a (lower index first on ties)."""
  return np.argsort(-a, kind="stable")[:k]


def _segments(dev, granularity):
  flats = [x.ravel() for x in dev]
  return flats if granularity == "leaf" else [np.concatenate(flats)]


def _unsegment(segs, like):
  flat = np.concatenate(segs)
  out, off = [], 0
  for x in like:
    out.append(flat[off:off + x.size].reshape(x.shape))
    off += x.size
  return out


def _finish(sent_segs, xs, n):
  """(mean, sent) per leaf from each device's sent segments."""
  sent = [_unsegment(s, xs[i]) for i, s in enumerate(sent_segs)]
  mean = [sum(sent[i][j] for i in range(n)) / n for j in range(len(xs[0]))]
  return mean, sent


# --------------------------------------------------------------- top-k ----

def _topk_ref(ratio, granularity):
  def step(xs, state, t, key, n):
    out = []
    for dev in xs:
      segs = []
      for x in _segments(dev, granularity):
        s = np.zeros_like(x)
        sel = _largest(np.abs(x), references.topk_count(ratio, x.size))
        s[sel] = x[sel]
        segs.append(s)
      out.append(segs)
    return (*_finish(out, xs, n), state)
  return step


def _topk_quantized_ref(ratio, bits):
  """Top-k per leaf, each leaf's selected values on ``2^bits`` levels over
  ``[-s, s]`` (``s`` the largest selected ``|value|``, nearest level)."""
  top = 2 ** bits - 1

  def step(xs, state, t, key, n):
    out = []
    for dev in xs:
      segs = []
      for x in _segments(dev, "leaf"):
        s = np.zeros_like(x)
        sel = _largest(np.abs(x), references.topk_count(ratio, x.size))
        v = x[sel]
        scale = np.abs(v).max()
        q = np.clip(np.round((v / scale + 1) * 0.5 * top), 0, top)
        s[sel] = (q * 2.0 / top - 1.0) * scale if scale > 0 else 0.0
        segs.append(s)
      out.append(segs)
    return (*_finish(out, xs, n), state)
  return step


_RATIO_BAD = [({"ratio": 0.0}, "ratio"), ({"ratio": 1.5}, "ratio"),
              ({"ratio": float("nan")}, "ratio")]

registry.register(registry.Entry(
  name="topk_ef",
  ref_init=lambda shapes: None,
  ref_step=_topk_ref(0.05, "leaf"),
  factory=jaxcomm.topk,
  kwargs={"ratio": 0.05},
  bad_args=_RATIO_BAD + [({"granularity": "layer"}, "granularity")],
))

registry.register(registry.Entry(
  # EF21 (Richtarik et al. 2021): top-k of the change of each device's
  # gradient estimate; the update is the aggregate estimate.
  name="topk_ef21",
  ref_init=lambda shapes: None,
  ref_step=_topk_ref(0.05, "leaf"),
  error_feedback="ef21",
  factory=jaxcomm.topk,
  kwargs={"ratio": 0.05, "error_feedback": "ef21"},
  bad_args=[({"error_feedback": "ef22"}, "error_feedback"),
            ({"error_feedback": 1}, "error_feedback"),
            ({"lr_schedule": lambda t: 0.1}, "lr_schedule")],
))

registry.register(registry.Entry(
  # SparseLoCo's message: top-k values in 2 bits, error feedback keeping
  # both what was not selected and the rounding of what was.
  name="topk_2bit",
  ref_init=lambda shapes: None,
  ref_step=_topk_quantized_ref(0.05, 2),
  factory=jaxcomm.topk,
  kwargs={"ratio": 0.05, "value_bits": 2},
  bad_args=[({"value_bits": 3}, "value_bits"),
            ({"value_bits": 16}, "value_bits")],
))

registry.register(registry.Entry(
  name="topk_model_noef",
  ref_init=lambda shapes: None,
  ref_step=_topk_ref(0.02, "model"),
  error_feedback=False,
  factory=jaxcomm.topk,
  kwargs={"ratio": 0.02, "granularity": "model", "error_feedback": False},
))


# ------------------------------------------------------------ random-k ----

def _fmix32_ref(h: int) -> int:
  h &= 0xFFFFFFFF
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & 0xFFFFFFFF
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & 0xFFFFFFFF
  return h ^ (h >> 16)


def randomk_permutation_ref(key, size, k, rounds=24):
  """Random-k's coordinates from their definition (``randomk_indices``):
  ``0..k-1`` through ``rounds`` swap-or-not rounds on ``[0, size)``, the
  round shifts and salts drawn from ``jax.random.split(key)`` as the
  definition says; plain Python integers."""
  ka, kb = jax.random.split(key)
  shifts = [int(v) for v in np.asarray(
    jax.random.randint(ka, (rounds,), 0, size, jnp.int32))]
  salts = [int(v) for v in np.asarray(
    jax.random.bits(kb, (rounds,), jnp.uint32))]
  out = []
  for v in range(k):
    for r in range(rounds):
      partner = (shifts[r] - v) % size
      if _fmix32_ref(max(v, partner) ^ salts[r]) & 1:
        v = partner
    out.append(v)
  assert len(set(out)) == k
  return np.asarray(out, np.int64)


def _randomk_ref(ratio):
  def step(xs, state, t, key, n):
    out = []
    for dev in xs:
      segs = []
      for j, x in enumerate(_segments(dev, "leaf")):
        idx = randomk_permutation_ref(jax.random.fold_in(key, j), x.size,
                                      references.topk_count(ratio, x.size))
        s = np.zeros_like(x)
        s[idx] = x[idx]
        segs.append(s)
      out.append(segs)
    return (*_finish(out, xs, n), state)
  return step


registry.register(registry.Entry(
  name="randomk_ef",
  ref_init=lambda shapes: None,
  ref_step=_randomk_ref(0.05),
  factory=jaxcomm.randomk,
  kwargs={"ratio": 0.05},
  bad_args=_RATIO_BAD,
  stochastic=True,
))


# ----------------------------------------------------------- threshold ----

def _threshold_ref(value, capacity_ratio):
  def step(xs, state, t, key, n):
    out = []
    for dev in xs:
      segs = []
      for x in _segments(dev, "leaf"):
        # Strom's threshold, with the documented capacity: of the
        # coordinates at or above it, the cap largest |x| (lower index
        # first on ties).
        cap = references.topk_count(capacity_ratio, x.size)
        above = np.nonzero(np.abs(x) >= value)[0]
        idx = above[np.argsort(-np.abs(x[above]), kind="stable")][:cap]
        s = np.zeros_like(x)
        s[idx] = x[idx]
        segs.append(s)
      out.append(segs)
    return (*_finish(out, xs, n), state)
  return step


registry.register(registry.Entry(
  name="threshold_ef",
  ref_init=lambda shapes: None,
  # About 13% of a unit normal exceeds 1.5: the 5% capacity overflows.
  ref_step=_threshold_ref(1.5, 0.05),
  factory=jaxcomm.threshold,
  kwargs={"value": 1.5, "capacity_ratio": 0.05},
  bad_args=[({"value": 0.0}, "value"), ({"value": float("inf")}, "value"),
            ({"capacity_ratio": 2.0}, "capacity_ratio")],
))


# ----------------------------------------------------------------- DGC ----

def dgc_bucket_sample_ref(key, sizes, sample_ratio, density):
  """Per leaf, the positions DGC's bucket selection samples: one
  ``randint(key, (S,), 0, m)`` for all leaves (``m`` = the leaf size of
  each slot, leaves in order), a leaf taking ``s_j`` consecutive slots, or
  all of its positions where ``s_j`` is the whole leaf."""
  ss = [references.dgc_sample_size(n, sample_ratio, density) for n in sizes]
  maxval = np.repeat(np.asarray(sizes, np.int32), ss)
  drawn = np.asarray(jax.random.randint(key, (int(sum(ss)),), 0,
                                        jnp.asarray(maxval), jnp.int32))
  out, start = [], 0
  for s, n in zip(ss, sizes):
    out.append(np.arange(n) if s == n else drawn[start:start + s])
    start += s
  return out


def dgc_select_ref(x, k, key, sample_ratio, density, max_rounds=10,
                   sample=None):
  """DGC's sampled threshold selection (numpy); returns (indices, count).

  ``sample``: the sampled positions (default: ``randint(key, (s,), 0,
  L)``, or all of ``x`` when ``s = L``)."""
  size = x.size
  a = np.abs(x)
  s = references.dgc_sample_size(size, sample_ratio, density)
  if sample is not None:
    sample = a[np.asarray(sample)]
    s = sample.size
  elif s == size:
    sample = a
  else:
    sample = a[np.asarray(jax.random.randint(key, (s,), 0, size))]
  kp = min(s, max(1, math.ceil(k * s / size)))
  t = np.sort(sample)[::-1][kp - 1]
  lo, hi = 0.0, np.inf
  count = int(np.sum(a >= t))
  for _ in range(max_rounds):
    if 0.8 * k <= count <= 1.3 * k:
      break
    if count > 1.3 * k:
      lo = t
    else:
      hi = t
    if lo > 0 and np.isfinite(hi):
      t = math.sqrt(lo * hi)
    else:
      t = t * 1.3 if count > 1.3 * k else t * 0.8
    count = int(np.sum(a >= t))
  above = np.nonzero(a >= t)[0][:min(size, math.ceil(1.3 * k))]
  keep = above[_largest(a[above], k)]
  return np.sort(keep), count


def _dgc_ref(momentum, clip_norm, steps_per_stage, sample_ratio,
             densities, exact):
  def init(shapes):
    return None

  def step(xs, state, t, key, n):
    if state is None:
      state = {"u": [[np.zeros_like(x) for x in dev] for dev in xs],
               "v": [[np.zeros_like(x) for x in dev] for dev in xs]}
    stage = min(t // steps_per_stage, len(densities) - 1)
    density = densities[stage]
    new_u, new_v, sent_h, sent_true = [], [], [], []
    for i, dev in enumerate(xs):
      # The harness hands x = v + g; recover g, then clip and accumulate.
      g = [x - v for x, v in zip(dev, state["v"][i])]
      norm = math.sqrt(sum(float(np.sum(y * y)) for y in g))
      scale = min(1.0, clip_norm / math.sqrt(n) / max(norm, 1e-30))
      g = [y * scale for y in g]
      u = [momentum * ui + y for ui, y in zip(state["u"][i], g)]
      v = [vi + ui for vi, ui in zip(state["v"][i], u)]
      s_dev = []
      samples = dgc_bucket_sample_ref(key, [vj.size for vj in v],
                                      sample_ratio, density)
      for j, vj in enumerate(v):
        flat = vj.ravel()
        k = references.topk_count(density, flat.size)
        if exact:
          idx = _largest(np.abs(flat), k)
        else:
          idx, _ = dgc_select_ref(flat, k, None, sample_ratio, density,
                                  sample=samples[j])
        s = np.zeros_like(flat)
        s[idx] = flat[idx]
        s_dev.append(s.reshape(vj.shape))
      new_v.append([vj - s for vj, s in zip(v, s_dev)])
      new_u.append([np.where(s != 0, 0.0, uj) for uj, s in zip(u, s_dev)])
      sent_true.append(s_dev)
      # So that the harness's residual x - sent equals the new v.
      sent_h.append([x - nv for x, nv in zip(dev, new_v[-1])])
    mean = [sum(sent_true[i][j] for i in range(n)) / n
            for j in range(len(xs[0]))]
    return mean, sent_h, {"u": new_u, "v": new_v}
  return init, step


# Exact selection here (the sampled threshold's compaction is slow to
# compile, and the battery compiles a dozen times); the sampled path is
# compared with dgc_select_ref in tests/test_sparsification.py.
_DGC_KW = {"ratio": 0.01, "momentum": 0.9, "clip_norm": 300.0,
           "warmup_steps_per_stage": 2, "warmup_densities": (0.0625,),
           "exact": True}
_dgc_init, _dgc_step = _dgc_ref(0.9, 300.0, 2, 0.01, (0.0625, 0.01),
                                exact=True)

registry.register(registry.Entry(
  name="dgc_warmup_exact",
  ref_init=_dgc_init,
  ref_step=_dgc_step,
  factory=jaxcomm.dgc,
  kwargs=_DGC_KW,
  bad_args=_RATIO_BAD + [({"momentum": 1.5}, "momentum"),
                         ({"clip_norm": -1.0}, "clip_norm"),
                         ({"warmup_steps_per_stage": -1},
                          "warmup_steps_per_stage"),
                         ({"sample_ratio": 0.0}, "sample_ratio"),
                         ({"warmup_densities": (0.5, 2.0)},
                          "warmup_densities")],
  # Momentum correction creates mass (u is re-added every step).
  conserves=False,
))


# -------------------------------------------------------------- gTop-k ----

def _gtopk_ref(ratio):
  def step(xs, state, t, key, n):
    rounds = int(math.log2(n))
    segs = [_segments(dev, "leaf") for dev in xs]
    sent = [[np.zeros_like(s) for s in dev] for dev in segs]
    for j in range(len(segs[0])):
      size = segs[0][j].size
      k = references.topk_count(ratio, size)
      # Each device's list: index -> (value, set of contributing devices).
      lists = []
      for i in range(n):
        x = segs[i][j]
        lists.append({int(q): (x[q], {i}) for q in _largest(np.abs(x), k)})
      for r in range(rounds):
        new = []
        for i in range(n):
          a, b = lists[i], lists[i ^ (1 << r)]
          merged = {}
          for q in set(a) | set(b):
            va, ca = a.get(q, (0.0, set()))
            vb, cb = b.get(q, (0.0, set()))
            merged[q] = (va + vb, ca | cb)
          order = sorted(merged, key=lambda q: (-abs(merged[q][0]), q))
          new.append({q: merged[q] for q in order[:k]})
        lists = new
      for q, (_, who) in lists[0].items():
        for i in who:
          sent[i][j][q] = segs[i][j][q]
    return (*_finish(sent, xs, n), state)
  return step


registry.register(registry.Entry(
  name="gtopk_ef",
  ref_init=lambda shapes: None,
  ref_step=_gtopk_ref(0.02),
  factory=jaxcomm.gtopk,
  kwargs={"ratio": 0.02},
  bad_args=_RATIO_BAD,
))


# ----------------------------------------------------------------- CSC ----

def _csc_ref(chunk_size, ratio):
  def step(xs, state, t, key, n):
    flats = [np.concatenate([x.ravel() for x in dev]) for dev in xs]
    size = flats[0].size
    chunks = -(-size // chunk_size)
    pad = chunks * chunk_size - size
    norms = sum(np.abs(np.pad(f, (0, pad))).reshape(chunks, -1).sum(axis=1)
                for f in flats)
    chosen = np.zeros(chunks, bool)
    chosen[_largest(norms, references.topk_count(ratio, chunks))] = True
    mask = np.repeat(chosen, chunk_size)[:size]
    out = [[np.where(mask, f, 0.0)] for f in flats]
    return (*_finish(out, xs, n), state)
  return step


registry.register(registry.Entry(
  name="csc_ef",
  ref_init=lambda shapes: None,
  # 4224 compressed elements: chunks of 100 do not divide (last is padded).
  ref_step=_csc_ref(100, 0.1),
  factory=jaxcomm.csc,
  kwargs={"chunk_size": 100, "ratio": 0.1},
  bad_args=_RATIO_BAD + [({"chunk_size": 0}, "chunk_size"),
                         ({"chunk_size": 2.5}, "chunk_size")],
))


# ------------------------------------------------------------ STC, SBC ----

def _stc_ref(ratio):
  """Sattler et al. 2019: per leaf, the top-k by magnitude, each kept value
  replaced by its sign times the mean magnitude of the kept values."""
  def step(xs, state, t, key, n):
    out = []
    for dev in xs:
      segs = []
      for x in _segments(dev, "leaf"):
        s = np.zeros_like(x)
        sel = _largest(np.abs(x), references.topk_count(ratio, x.size))
        s[sel] = np.abs(x[sel]).mean() * np.sign(x[sel])
        segs.append(s)
      out.append(segs)
    return (*_finish(out, xs, n), state)
  return step


def _sbc_ref(ratio):
  """Sattler et al. 2018: per leaf, the k largest and the k most negative
  values; the group with the larger mean magnitude is sent as its mean."""
  def step(xs, state, t, key, n):
    out = []
    for dev in xs:
      segs = []
      for x in _segments(dev, "leaf"):
        k = references.topk_count(ratio, x.size)
        s = np.zeros_like(x)
        pos, neg = _largest(x, k), _largest(-x, k)
        mu_pos, mu_neg = x[pos].mean(), (-x[neg]).mean()
        if mu_pos >= mu_neg:
          s[pos] = mu_pos
        else:
          s[neg] = -mu_neg
        segs.append(s)
      out.append(segs)
    return (*_finish(out, xs, n), state)
  return step


registry.register(registry.Entry(
  name="stc_ef",
  ref_init=lambda shapes: None,
  ref_step=_stc_ref(0.05),
  factory=jaxcomm.stc,
  kwargs={"ratio": 0.05},
  bad_args=_RATIO_BAD,
))

registry.register(registry.Entry(
  name="sbc_ef",
  ref_init=lambda shapes: None,
  ref_step=_sbc_ref(0.05),
  factory=jaxcomm.sbc,
  kwargs={"ratio": 0.05},
  bad_args=_RATIO_BAD,
))


# --------------------------------------------------------------- SIDCo ----

def _sidco_threshold(mag, ratio, stages, first_ratio, dist):
  """Abdelmoniem et al. 2021: the threshold of one leaf's ``|x|``, fitted
  in stages (stage 1 on all of ``|x|``, later ones on the exceedances
  shifted by their minimum)."""
  def quantile(y, d):
    m = y.mean()
    if dist == "exponential":
      return m * np.log(1 / d)        # exponential MLE: rate 1 / mean
    v = y.var(ddof=1) if y.size > 1 else 0.0
    r = m * m / max(v, np.finfo(np.float32).tiny)
    a, c = 0.5 * m * (r + 1), 0.5 * (r - 1)   # GPD, method of moments
    return a * np.log(1 / d) if abs(c) < 1e-6 else a * (1 - d ** c) / c

  if stages == 1 or ratio >= first_ratio:
    dens = [ratio]
  else:
    dens = [first_ratio] + [(ratio / first_ratio) ** (1 / (stages - 1))] * (
      stages - 1)
  t = quantile(mag, dens[0])
  for d in dens[1:]:
    exc = mag[mag > t]
    if exc.size:
      t = exc.min() + quantile(exc - exc.min(), d)
  return t


def _sidco_ref(ratio, stages, first_ratio, dist, capacity_factor):
  def step(xs, state, t, key, n):
    out = []
    for dev in xs:
      segs = []
      for x in _segments(dev, "leaf"):
        thr = _sidco_threshold(np.abs(x), ratio, stages, first_ratio, dist)
        cap = min(x.size, max(1, math.ceil(
          capacity_factor * references.topk_count(ratio, x.size))))
        sel = np.flatnonzero(np.abs(x) > thr)[:cap]   # first by index
        s = np.zeros_like(x)
        s[sel] = x[sel]
        segs.append(s)
      out.append(segs)
    return (*_finish(out, xs, n), state)
  return step


registry.register(registry.Entry(
  name="sidco_exp_ef",
  ref_init=lambda shapes: None,
  ref_step=_sidco_ref(0.05, 3, 0.25, "exponential", 2.0),
  factory=jaxcomm.sidco,
  kwargs={"ratio": 0.05},
  bad_args=_RATIO_BAD + [({"first_ratio": 0.0}, "first_ratio"),
                         ({"stages": 0}, "stages"),
                         ({"distribution": "gamma"}, "distribution"),
                         ({"capacity_factor": 0.5}, "capacity_factor")],
))

registry.register(registry.Entry(
  name="sidco_gpareto_ef",
  ref_init=lambda shapes: None,
  ref_step=_sidco_ref(0.05, 2, 0.25, "gpareto", 2.0),
  factory=jaxcomm.sidco,
  kwargs={"ratio": 0.05, "distribution": "gpareto", "stages": 2},
))


# ------------------------------------------------------------ ScaleCom ----

def _scalecom_ref(ratio, beta):
  """Chen et al. 2020, Algorithm 1: the leader ``t mod n`` picks, per leaf,
  its k largest ``|x|``; every device sends its own values there and the
  update is their mean. The memory is low-pass filtered, ``m_t = (1 - beta)
  m_{t-1} + beta (x_t - C(x_t))``; the harness keeps ``x - sent`` as the
  memory, so sent is ``x - m_t``. The state holds each device's ``m``."""
  def init(shapes):
    return None

  def step(xs, state, t, key, n):
    if state is None:
      state = [[np.zeros_like(x) for x in dev] for dev in xs]
    lead = t % n
    chosen = [[np.zeros_like(x) for x in dev] for dev in xs]
    for j, xl in enumerate(xs[lead]):
      flat = xl.ravel()
      sel = _largest(np.abs(flat), references.topk_count(ratio, flat.size))
      for i in range(n):
        c = chosen[i][j].reshape(-1)
        c[sel] = xs[i][j].ravel()[sel]
    mean = [sum(chosen[i][j] for i in range(n)) / n
            for j in range(len(xs[0]))]
    memory = [[(1 - beta) * m + beta * (x - c)
               for m, x, c in zip(state[i], xs[i], chosen[i])]
              for i in range(n)]
    sent = [[x - m for x, m in zip(xs[i], memory[i])] for i in range(n)]
    return mean, sent, memory
  return init, step


_SCALECOM_BAD = _RATIO_BAD + [({"beta": 0.0}, "beta"), ({"beta": 1.5}, "beta"),
                              ({"beta": 0.5, "error_feedback": False}, "beta")]

registry.register(registry.Entry(
  name="scalecom_ef",
  ref_init=_scalecom_ref(0.05, 1.0)[0],
  ref_step=_scalecom_ref(0.05, 1.0)[1],
  factory=jaxcomm.scalecom,
  kwargs={"ratio": 0.05},
  bad_args=_SCALECOM_BAD,
))

registry.register(registry.Entry(
  name="scalecom_lowpass_ef",
  ref_init=_scalecom_ref(0.05, 0.3)[0],
  ref_step=_scalecom_ref(0.05, 0.3)[1],
  factory=jaxcomm.scalecom,
  kwargs={"ratio": 0.05, "beta": 0.3},
  conserves=False,
))


# ------------------------------------------------------------- AdaComp ----

def _adacomp_rule(x, g, bin_size):
  """Chen et al. 2018, one leaf: ``G = x`` (residue + latest gradient),
  ``H = G + g``; bins of ``bin_size`` consecutive elements (the last one
  shorter where it does not divide); ``j`` is selected iff ``|H_j| >= max
  |G|`` over its bin (and ``G_j != 0``). Returns the flat bool mask."""
  big, h = x.ravel(), harness_f32(x + g).ravel()
  keep = np.zeros(big.size, bool)
  for start in range(0, big.size, bin_size):
    gmax = np.abs(big[start:start + bin_size]).max()
    for j in range(start, min(start + bin_size, big.size)):
      keep[j] = abs(h[j]) >= gmax and big[j] != 0
  return keep


def _adacomp_bucket(xs, gs, bin_size, capacity_factor):
  """One bucket's message: the rule on each leaf (``xs``, ``gs`` in bucket
  order), at most ``ceil(capacity_factor * bins)`` pairs over the bucket
  (``bins``: ``ceil(L / bin_size)`` per leaf); when more are selected, the
  largest ``|G|`` (equal ones first by bucket position). Returns each
  leaf's sent values and the count selected."""
  flat = np.concatenate([x.ravel() for x in xs])
  keep = np.concatenate([_adacomp_rule(x, g, bin_size)
                         for x, g in zip(xs, gs)])
  bins = sum(-(-x.size // bin_size) for x in xs)
  cap = min(flat.size, max(1, math.ceil(capacity_factor * bins)))
  chosen = np.flatnonzero(keep)
  if chosen.size > cap:
    order = np.lexsort((chosen, -np.abs(flat[chosen])))
    chosen = chosen[order[:cap]]
  s = np.zeros_like(flat)
  s[chosen] = flat[chosen]
  out, start = [], 0
  for x in xs:
    out.append(s[start:start + x.size].reshape(x.shape))
    start += x.size
  return out, int(keep.sum())


def _adacomp_select(x, g, bin_size, capacity_factor):
  """:func:`_adacomp_bucket` of a bucket of one leaf: (sent, selected)."""
  s, count = _adacomp_bucket([x], [g], bin_size, capacity_factor)
  return s[0], count


def harness_f32(x):
  """Rounded to float32, kept as float64 (the transform's arithmetic)."""
  return np.asarray(x, np.float32).astype(np.float64)


def _adacomp_run(bin_size, capacity_factor):
  """The whole error-feedback loop (the rule needs the raw gradient beside
  ``x = g + e``, which ``ref_step`` does not see)."""
  def run(grads_seq, n):
    comp = ["conv", "w"]
    res = [[np.zeros(grads_seq[0][k].shape[1:]) for k in comp]
           for _ in range(n)]
    out, sent_all = [], []
    for grads in grads_seq:
      sent = []
      for i in range(n):
        gs = [np.asarray(grads[k][i], np.float64) for k in comp]
        xs = [harness_f32(res[i][j] + g) for j, g in enumerate(gs)]
        dev, _ = _adacomp_bucket(xs, gs, bin_size, capacity_factor)
        res[i] = [harness_f32(x - s) for x, s in zip(xs, dev)]
        sent.append(dev)
      upd = {k: sum(sent[i][j] for i in range(n)) / n
             for j, k in enumerate(comp)}
      upd["b"] = np.asarray(grads["b"], np.float64).mean(axis=0)
      out.append(upd)
      sent_all.append(sent)
    return out, res, sent_all
  return run


def _adacomp_no_ref_step(xs, state, t, key, n):
  raise AssertionError("adacomp's reference is its numpy_run (it needs g)")


registry.register(registry.Entry(
  name="adacomp_ef",
  ref_init=lambda shapes: None,
  ref_step=_adacomp_no_ref_step,
  numpy_run=_adacomp_run(16, 3.0),
  factory=jaxcomm.adacomp,
  kwargs={"bin_size": 16, "capacity_factor": 3.0},
  bad_args=[({"bin_size": 0}, "bin_size"), ({"bin_size": 2.5}, "bin_size"),
            ({"capacity_factor": 0.5}, "capacity_factor")],
))


# ----------------------------------------------------------------- GMC ----

def _gmc_ref(ratio, beta):
  """Zhao et al. 2019, Algorithm 1 (GMC) in gradient units: the global
  momentum ``d`` is the last aggregated update; each device sparsifies
  ``z_i = u_i + g_i + beta d`` (``x = u_i + g_i`` from the harness) with
  per-leaf top-k, keeps ``u_i = z_i - s_i`` and the update is ``d =
  mean_i s_i``. The harness keeps ``x - sent`` as the memory, so sent is
  ``s_i - beta d``. ``d`` is kept in float32, as the transform keeps it."""
  def init(shapes):
    return None

  def step(xs, state, t, key, n):
    d = state if state is not None else [np.zeros_like(x) for x in xs[0]]
    push = [harness_f32(np.float32(beta) * harness_f32(dj)) for dj in d]
    chosen, sent_h = [], []
    for dev in xs:
      z = [harness_f32(x + p) for x, p in zip(dev, push)]
      s = [references.np_topk(zj, ratio) for zj in z]
      chosen.append(s)
      sent_h.append([sj - p for sj, p in zip(s, push)])
    mean = [sum(chosen[i][j] for i in range(n)) / n
            for j in range(len(xs[0]))]
    return mean, sent_h, [harness_f32(m) for m in mean]
  return init, step


registry.register(registry.Entry(
  name="gmc_ef",
  ref_init=_gmc_ref(0.05, 0.9)[0],
  ref_step=_gmc_ref(0.05, 0.9)[1],
  factory=jaxcomm.gmc,
  kwargs={"ratio": 0.05, "beta": 0.9},
  bad_args=_RATIO_BAD + [({"beta": 1.0}, "beta"), ({"beta": -0.1}, "beta"),
                         ({"beta": float("nan")}, "beta"),
                         ({"error_feedback": False}, "error_feedback"),
                         ({"momentum": 0.9}, "momentum")],
  # The global momentum re-adds the last update every step: the memory
  # and the updates hold sum_t g_t plus beta times the past updates
  # (tests/test_gmc.py checks that balance).
  conserves=False,
))


# ------------------------------------------------------------- SparCML ----

registry.register(registry.Entry(
  # Renggli et al. 2019: top-k (per leaf) with error accumulation, summed
  # exactly by the sparse all-reduce (the exchange changes the bytes and
  # the order of the additions, not the sum). At 5% on 8 devices the
  # battery's bucket has the measured switch (tests/test_sparcml.py takes
  # both of its branches).
  name="sparcml_ef",
  ref_init=lambda shapes: None,
  ref_step=_topk_ref(0.05, "leaf"),
  factory=jaxcomm.sparcml,
  kwargs={"ratio": 0.05},
  bad_args=_RATIO_BAD,
))


# ---------------------------------------------------------------- IBCD ----

def _ibcd_ref(ratio, block_size):
  """Mishchenko, Hanzely, Richtarik 2020, Algorithm 1: the compressed
  leaves (flattened and concatenated in bucket order) are cut into ``m``
  blocks of ``block_size``; device ``i`` keeps a uniform subset of ``k =
  max(1, ceil(tau m))`` blocks, ``tau = ratio`` or ``1 / n``, and the
  update is ``(1 / n) sum_i (x_i)_{U_i}``, not rescaled. The subsets: the
  ``k`` largest of ``m`` uniform numbers from ``fold_in(fold_in(key,
  first leaf), i)`` (the documented draw); the selection, the masking and
  the sum are numpy's."""
  def step(xs, state, t, key, n):
    sizes = [x.size for x in xs[0]]
    size = sum(sizes)
    m = -(-size // block_size)
    tau = 1.0 / n if ratio is None else ratio
    k = max(1, min(m, math.ceil(tau * m - 1e-9)))
    bucket_key = jax.random.fold_in(key, 0)
    total = np.zeros(m * block_size)
    sent = []
    for i, dev in enumerate(xs):
      u = np.asarray(jax.random.uniform(jax.random.fold_in(bucket_key, i),
                                        (m,)))
      chosen = np.argsort(-u, kind="stable")[:k]
      mask = np.zeros(m * block_size)
      for b in chosen:
        mask[b * block_size:(b + 1) * block_size] = 1.0
      flat = np.concatenate([np.ravel(x) for x in dev])
      s = np.pad(flat, (0, m * block_size - size)) * mask
      total += s
      parts, off = [], 0
      for x in dev:
        parts.append(s[off:off + x.size].reshape(x.shape))
        off += x.size
      sent.append(parts)
    mean, off = [], 0
    for x in xs[0]:
      mean.append(total[off:off + x.size].reshape(x.shape) / n)
      off += x.size
    return mean, sent, state
  return step


_IBCD_BAD = [({"ratio": 0.0}, "ratio"), ({"ratio": 1.5}, "ratio"),
             ({"ratio": float("nan")}, "ratio"),
             ({"block_size": 0}, "block_size"),
             ({"block_size": 2.5}, "block_size"),
             ({"error_feedback": "yes"}, "error_feedback")]

registry.register(registry.Entry(
  # The paper's method: tau = 1/n of 33 blocks of 128 (5 per device on 8
  # devices), all-gathered; nothing kept of the unsent blocks.
  name="ibcd",
  ref_init=lambda shapes: None,
  ref_step=_ibcd_ref(None, 128),
  factory=jaxcomm.ibcd,
  kwargs={"block_size": 128},
  error_feedback=False,
  stochastic=True,
  bad_args=_IBCD_BAD,
))

registry.register(registry.Entry(
  # With error feedback (not in the paper) at tau = 0.5: 17 of 33 blocks,
  # more than 2/n of them, so the chosen blocks travel in a dense psum.
  name="ibcd_ef",
  ref_init=lambda shapes: None,
  ref_step=_ibcd_ref(0.5, 128),
  factory=jaxcomm.ibcd,
  kwargs={"ratio": 0.5, "block_size": 128, "error_feedback": True},
  stochastic=True,
  bad_args=_IBCD_BAD,
))


# ----------------------------------------------------------------- MGS ----

def _mgs_groups_ref(sizes, n, ratio, gbit, latency_us, backward_seconds):
  """Shi et al. 2020's merge, as the authors' code decides it, with the
  whole timeline recomputed after every merge: layers in forward order,
  backward from the last; layer l's backward time its share of
  ``backward_seconds`` by size, no top-k time; a group's all-gather of
  ``k = topk_count(ratio, |G|)`` pairs (values, then indices in the
  narrowest of 8/16/32 bits for ``|G|``, packed to 32-bit words) costs
  ``(n - 1) alpha + (n - 1)/n bytes beta`` on a ring. The open group G
  takes the next layer l when ``tb(l) - wait(G) < tc(G) + tc(l) -
  tc(G + l)``, ``wait(G)`` the time G's message waits for the link."""
  alpha, beta = latency_us * 1e-6, 8.0 / (gbit * 1e9)
  total = float(sum(sizes))

  def tc(p):
    k = references.topk_count(ratio, p)
    per = 4 if p < 2**8 else 2 if p < 2**16 else 1
    words = k + -(-k // per)
    return (n - 1) * alpha + (n - 1) / n * 4 * n * words * beta

  def tb(l):
    return backward_seconds * sizes[l] / total

  def comm_start_of_open(groups, open_group):
    # Times of the closed groups (backward order) then the open one.
    t = free = 0.0
    for g in groups + [open_group]:
      t += sum(tb(l) for l in g)
      start = max(t, free)
      free = start + tc(sum(sizes[l] for l in g))
    return t, start

  groups, cur = [], [len(sizes) - 1]
  for l in range(len(sizes) - 2, -1, -1):
    ready, start = comm_start_of_open(groups, cur)
    p = sum(sizes[j] for j in cur)
    if tb(l) - (start - ready) < tc(p) + tc(sizes[l]) - tc(p + sizes[l]):
      cur = cur + [l]
    else:
      groups.append(cur)
      cur = [l]
  groups.append(cur)
  return sorted((min(g), max(g) + 1) for g in groups)


def _mgs_ref(ratio, backward_seconds):
  """Top-k over each merged group (the leaves concatenated in bucket
  order), the devices' selections averaged (error feedback from the
  harness). On the battery's 8 devices and leaves, 1 ms of backward pass
  merges the two leaves, 100 ms keeps them apart (tests/test_mgs.py)."""
  def step(xs, state, t, key, n):
    sizes = [x.size for x in xs[0]]
    groups = _mgs_groups_ref(sizes, n, ratio, 10.0, 50.0, backward_seconds)
    sent = []
    for dev in xs:
      parts = [None] * len(dev)
      for lo, hi in groups:
        flat = np.concatenate([np.ravel(dev[j]) for j in range(lo, hi)])
        kept = references.np_topk(flat, ratio)
        off = 0
        for j in range(lo, hi):
          parts[j] = kept[off:off + dev[j].size].reshape(dev[j].shape)
          off += dev[j].size
      sent.append(parts)
    mean = [sum(sent[i][j] for i in range(n)) / n
            for j in range(len(xs[0]))]
    return mean, sent, state
  return step


_MGS_BAD = _RATIO_BAD + [({"backward_seconds": -1.0}, "backward_seconds"),
                         ({"backward_seconds": float("inf")},
                          "backward_seconds"),
                         ({"topk_seconds_per_element": -1e-9},
                          "topk_seconds_per_element"),
                         ({"link": 10.0}, "link")]

registry.register(registry.Entry(
  # A short backward pass (1 ms) on a 10 Gbit/s, 50 us link: waiting for
  # the first leaf costs less than a second startup, the two leaves merge
  # into one top-k.
  name="mgs_merged",
  ref_init=lambda shapes: None,
  ref_step=_mgs_ref(0.05, 0.001),
  factory=jaxcomm.mgs,
  kwargs={"ratio": 0.05, "backward_seconds": 0.001},
  bad_args=_MGS_BAD,
))

registry.register(registry.Entry(
  # A long one (100 ms): the last leaf's message goes while the first
  # leaf's gradient is computed, so each leaf is a group (layer-wise).
  name="mgs_layerwise",
  ref_init=lambda shapes: None,
  ref_step=_mgs_ref(0.05, 0.1),
  factory=jaxcomm.mgs,
  kwargs={"ratio": 0.05, "backward_seconds": 0.1},
  bad_args=_MGS_BAD,
))


# ------------------------------------------- variance-based (Tsuzuku) ----

def variance_capacity_ref(size, capacity_ratio):
  """Words of a bucket's message: ``max(1, ceil(ratio * L))``, at most L."""
  return min(size, max(1, math.ceil(capacity_ratio * size * (1 - 1e-9))))


def _nearest_pow2_exponent(x32):
  """Biased float32 exponent of the power of two nearest ``|x|`` (ties
  up, at most 254); 0 for zeros and subnormals."""
  bits = np.abs(x32).astype(np.float32).view(np.int32)
  e = bits >> 23
  up = ((bits & 0x7FFFFF) >= 0x400000).astype(np.int32)
  return np.where(e == 0, 0, np.minimum(e + up, 254))


def variance_bucket_ref(xs, vs, ss, alpha, zeta, capacity_ratio,
                        exponent_bits):
  """Tsuzuku et al. 2018 on one device's bucket (leaves in bucket order):
  ``v = zeta^2 v + s``; candidates ``alpha v < r^2`` (``r = x``); ``|r|``
  rounded to the nearest power of two ``2^k``; per leaf ``E`` the largest
  ``k`` of its candidates, code ``E - k`` below ``2^exponent_bits``; at
  most the capacity, the largest ``2^k`` first (equal ones by position);
  sent ``sign(r) 2^k``; ``v = 0`` where sent. All in float32 arithmetic,
  as the transform's. Returns (sent per leaf (float64), new v per leaf
  (float32), count meeting the criterion with a code)."""
  f32 = np.float32
  sizes = [x.size for x in xs]
  x = np.concatenate([np.asarray(a, f32).ravel() for a in xs])
  v = np.concatenate([np.asarray(a, f32).ravel() for a in vs])
  s = np.concatenate([np.asarray(a, f32).ravel() for a in ss])
  if float(zeta) != 1.0:
    z = f32(zeta)
    v = (f32(z * z) * v).astype(f32)
  v = (v + s).astype(f32)
  k = _nearest_pow2_exponent(x)
  cand = (f32(alpha) * v < x * x) & (k > 0)
  code = np.zeros(x.size, np.int64)
  start = 0
  for size in sizes:
    seg = slice(start, start + size)
    top = k[seg][cand[seg]].max() if cand[seg].any() else 0
    code[seg] = top - k[seg]
    start += size
  ok = cand & (code < 2 ** exponent_bits)
  chosen = np.flatnonzero(ok)
  cap = variance_capacity_ref(x.size, capacity_ratio)
  if chosen.size > cap:
    # The largest powers of two first, then the lower positions.
    order = np.lexsort((chosen, -k[chosen]))
    chosen = chosen[order[:cap]]
  sent = np.zeros(x.size)
  sent[chosen] = np.sign(x[chosen]) * np.ldexp(1.0, k[chosen] - 127)
  v[chosen] = 0.0
  out_s, out_v, start = [], [], 0
  for a, size in zip(xs, sizes):
    out_s.append(sent[start:start + size].reshape(np.shape(a)))
    out_v.append(v[start:start + size].reshape(np.shape(a)))
    start += size
  return out_s, out_v, int(ok.sum())


def variance_run_ref(alpha, zeta, capacity_ratio, exponent_bits,
                     comp=("conv", "w"), dense=("b",)):
  """The whole loop (``r = zeta e + g`` in float32, as compressed() forms
  it; the codec's ``v`` per device): ``run(grads_seq, n, variances=None)``
  with ``variances[t]`` the handed ``grad_variance`` trees (None: each
  device's ``g^2``, the statistic the codec forms without one). Returns
  (updates, residuals, sent) as ``Entry.numpy_run``, and keeps the last
  ``v`` and counts in ``run.last``."""
  f32 = np.float32

  def run(grads_seq, n, variances=None):
    shapes = [np.shape(grads_seq[0][k])[1:] for k in comp]
    res = [[np.zeros(s, f32) for s in shapes] for _ in range(n)]
    var = [[np.zeros(s, f32) for s in shapes] for _ in range(n)]
    out, sent_all, counts = [], [], []
    for t, grads in enumerate(grads_seq):
      sent, step_counts = [], []
      for i in range(n):
        gs = [np.asarray(grads[k][i], f32) for k in comp]
        if variances is None:
          ss = [(g * g).astype(f32) for g in gs]
        else:
          ss = [np.asarray(variances[t][k][i], f32) for k in comp]
        es = res[i] if float(zeta) == 1.0 else [
          (f32(zeta) * e).astype(f32) for e in res[i]]
        xs = [(e + g).astype(f32) for e, g in zip(es, gs)]
        dev, var[i], count = variance_bucket_ref(
          xs, var[i], ss, alpha, zeta, capacity_ratio, exponent_bits)
        res[i] = [(x - s).astype(f32) for x, s in zip(xs, dev)]
        sent.append(dev)
        step_counts.append(count)
      upd = {k: sum(sent[i][j] for i in range(n)) / n
             for j, k in enumerate(comp)}
      for k in dense:
        upd[k] = np.asarray(grads[k], np.float64).mean(axis=0)
      out.append(upd)
      sent_all.append(sent)
      counts.append(step_counts)
    run.last = {"variance": var, "selected": counts}
    return out, [[r.astype(np.float64) for r in dev] for dev in res], \
      sent_all
  return run


def _variance_no_ref_step(xs, state, t, key, n):
  raise AssertionError("variance_sparsification's reference is its "
                       "numpy_run (its statistic needs g)")


registry.register(registry.Entry(
  # Without a handed grad_variance the codec's statistic is each device's
  # g^2 (its step's gradient as the batch's one sample); the reference
  # forms the same from the gradients (numpy_run: ref_step sees only x).
  # alpha 0.5 sends at the first step (r^2 = g^2 > 0.5 v); the capacity
  # (10% of the bucket) binds at the steps after.
  name="variance_sparsification",
  ref_init=lambda shapes: None,
  ref_step=_variance_no_ref_step,
  numpy_run=variance_run_ref(0.5, 1.0, 0.1, 3),
  factory=jaxcomm.variance_sparsification,
  kwargs={"alpha": 0.5, "capacity_ratio": 0.1, "exponent_bits": 3,
          "residual_decay": 1.0},
  bad_args=[({"alpha": -1.0}, "alpha"), ({"alpha": float("nan")}, "alpha"),
            ({"capacity_ratio": 0.0}, "capacity_ratio"),
            ({"capacity_ratio": 1.5}, "capacity_ratio"),
            ({"exponent_bits": 0}, "exponent_bits"),
            ({"exponent_bits": 9}, "exponent_bits"),
            ({"residual_decay": 1.5}, "residual_decay"),
            ({"error_feedback": False}, "error_feedback")],
))
