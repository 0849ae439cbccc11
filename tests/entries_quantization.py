"""Registry entries for the quantization family, with numpy references.

Each reference is written from its paper in float64 numpy. Where a random
draw is compared with a probability (stochastic rounding), the probability
is formed in float32 as the compressor does, so that a draw lying within a
rounding error of it does not flip the outcome between the two; the draws
themselves are the jax random numbers of the documented key derivation
(``fold_in(step_key, device)``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm
from tests import registry

WORD = 32


def chunk_of(length: int, n: int) -> int:
  """The chunk each device owns, as ARCHITECTURE documents it: ``c =
  ceil(length / n)`` rounded up to a multiple of ``p``, the largest power
  of two in [32, 32768] with ``64 p <= c`` (32 when there is none)."""
  c = -(-length // n)
  p = max([32] + [2 ** e for e in range(5, 16) if 64 * 2 ** e <= c])
  return -(-c // p) * p


def stored_of(length: int) -> int:
  """A state buffer's width, as ARCHITECTURE documents it: ``length``
  rounded up to a multiple of 1,024 where that pads at most 1/64 of it,
  else ``length``. A chunk owner's server error is that wide, and the
  chunks are those of its width."""
  whole = -(-length // 1024) * 1024
  return whole if 64 * (whole - length) <= length else length


def _sign(x):
  return np.where(x >= 0, 1.0, -1.0)


def _flat(dev):
  return np.concatenate([np.ravel(x) for x in dev])


def _split(flat, like):
  out, off = [], 0
  for x in like:
    out.append(flat[off:off + x.size].reshape(x.shape))
    off += x.size
  return out


def codec_state(host_state):
  """The codec state inside a (host) optimizer state."""
  stack = [host_state]
  while stack:
    s = stack.pop()
    if isinstance(s, jaxcomm.CompressState):
      return s.codec[0]   # the one bucket
    if isinstance(s, (tuple, list)):
      stack.extend(s)
  raise AssertionError("no CompressState")


# ----------------------------------------------------------------- onebit --


def _onebit_ref_init(shapes):
  return {"shapes": shapes, "server": None}


def _onebit_ref_step(xs, state, step, key, n):
  """DeepSpeed's compressed allreduce (1-bit Adam, Tang et al. 2021)."""
  like = xs[0]
  length = sum(x.size for x in like)
  if state["server"] is None:
    state["server"] = [np.zeros(length) for _ in range(n)]
  sent, flat_w = [], []
  for dev in xs:
    w = [np.sqrt(np.sum(x * x) / x.size) * _sign(x) for x in dev]
    sent.append(w)
    flat_w.append(_flat(w))
  avg = np.mean(flat_w, axis=0)
  chunk = chunk_of(stored_of(length), n)
  ends = np.cumsum([x.size for x in like])
  starts = ends - np.asarray([x.size for x in like])
  mean = np.zeros(length)
  for k in range(n):
    lo, hi = k * chunk, min((k + 1) * chunk, length)
    if lo >= hi:
      continue
    y = avg[lo:hi] + state["server"][k][lo:hi] / n
    z = np.zeros_like(y)
    # One scale per leaf segment of the chunk (the part of a leaf in it).
    for a, b in zip(starts, ends):
      a, b = max(a, lo), min(b, hi)
      if a < b:
        seg = y[a - lo:b - lo]
        z[a - lo:b - lo] = np.sqrt(np.sum(seg * seg) / (b - a)) * _sign(seg)
    state["server"][k][lo:hi] = n * (y - z)
    mean[lo:hi] = z
  return _split(mean, like), sent, state


def _onebit_extra_mass(host_state):
  # Server error is kept in gradient-sum units on its chunk owner: the
  # mass it holds is the sum over devices (zero outside each owner's chunk).
  err = np.asarray(codec_state(host_state).server_error, np.float64)
  total = err.sum(axis=0)
  shapes = [(3, 3, 8, 16), (64, 48)]   # harness.COMPRESSED order
  return _split(total, [np.zeros(s) for s in shapes])


registry.register(registry.Entry(
  name="onebit",
  ref_init=_onebit_ref_init,
  ref_step=_onebit_ref_step,
  factory=jaxcomm.onebit,
  extra_mass=_onebit_extra_mass,
  bad_args=[({"error_feedback": 1}, "error_feedback"),
            ({"policy": 3}, "policy")],
))


# ---------------------------------------------------------- majority vote --


def _vote(vectors):
  count = np.sum([_sign(v) for v in vectors], axis=0)
  return np.where(count >= 0, 1.0, -1.0)


def _signsgd_ref(scale):
  def step(xs, state, t, key, n):
    mean = [scale * _vote([dev[j] for dev in xs]) for j in range(len(xs[0]))]
    sent = [[scale * _sign(x) for x in dev] for dev in xs]
    return mean, sent, state
  return step


registry.register(registry.Entry(
  name="signsgd",
  ref_init=lambda shapes: None,
  ref_step=_signsgd_ref(0.5),
  factory=jaxcomm.signsgd,
  kwargs={"scale": 0.5},
  error_feedback=False,
  conserves=False,
  bad_args=[({"scale": 0.0}, "scale"), ({"scale": "x"}, "scale")],
))


def _signum_ref(beta):
  def step(xs, state, t, key, n):
    if state is None:
      state = [[np.zeros_like(x) for x in dev] for dev in xs]
    state = [[beta * m + (1 - beta) * x for m, x in zip(ms, dev)]
             for ms, dev in zip(state, xs)]
    mean = [_vote([ms[j] for ms in state]) for j in range(len(xs[0]))]
    sent = [[_sign(m) for m in ms] for ms in state]
    return mean, sent, state
  return step


registry.register(registry.Entry(
  name="signum",
  ref_init=lambda shapes: None,
  ref_step=_signum_ref(0.9),
  factory=jaxcomm.signum,
  kwargs={"beta": 0.9},
  error_feedback=False,
  conserves=False,
  bad_args=[({"beta": 1.0}, "beta"), ({"beta": -0.1}, "beta")],
))


# ------------------------------------------------------------- ef_signsgd --


def _ef_sign_ref(xs, state, t, key, n):
  sent = [[np.mean(np.abs(x)) * _sign(x) for x in dev] for dev in xs]
  mean = [np.mean([s[j] for s in sent], axis=0) for j in range(len(xs[0]))]
  return mean, sent, state


registry.register(registry.Entry(
  name="ef_signsgd",
  ref_init=lambda shapes: None,
  ref_step=_ef_sign_ref,
  factory=jaxcomm.ef_signsgd,
  bad_args=[({"error_feedback": "yes"}, "error_feedback")],
))


# ------------------------------------------------------ shared-scale ints --


def _buckets(x, b):
  v = np.ravel(x)
  b = min(b, v.size) if b else v.size
  c = -(-v.size // b)
  return np.pad(v, (0, b * c - v.size)).reshape(c, b)


def _uniform(key, i, size):
  return np.asarray(jax.random.uniform(jax.random.fold_in(key, i), (size,),
                                       jnp.float32))


def _integer_ref(bucket, stat, quantize, unit, stochastic, prepare=None):
  """Shared scale = max over devices of the bucket statistic; codes summed."""
  def step(xs, state, t, key, n):
    nl = len(xs[0])
    prep = [[x if prepare is None else prepare(x) for x in dev]
            for dev in xs]
    xb = [[_buckets(x, bucket) for x in dev] for dev in prep]
    shared = [np.max([stat(xb[i][j]) for i in range(n)], axis=0)
              for j in range(nl)]
    total = sum(b.size for b in xb[0])
    mean = [np.zeros_like(x) for x in xs[0]]
    sent = []
    for i in range(n):
      u = _uniform(key, i, total) if stochastic else None
      off, mine = 0, []
      for j in range(nl):
        b = xb[i][j]
        uj = None if u is None else u[off:off + b.size].reshape(b.shape)
        off += b.size
        val = quantize(b, shared[j][:, None], uj) * unit(shared[j])[:, None]
        val = val.ravel()[:xs[i][j].size].reshape(xs[i][j].shape)
        mine.append(val)
        mean[j] = mean[j] + val / n
      sent.append(mine)
    return mean, sent, state
  return step


def _ratio32(x, s):
  """|x| / s formed in float32, as the compressor forms it."""
  x32, s32 = np.float32(np.abs(x)), np.float32(s)
  safe = np.where(s32 > 0, s32, np.float32(1))
  return np.where(s32 > 0, x32 / safe, np.float32(0))


def _qsgd_quantize(levels):
  def quantize(b, s, u):
    r = _ratio32(b, s) * np.float32(levels)
    low = np.floor(r)
    lev = np.minimum(low + (u < r - low), levels)
    return np.sign(b) * lev
  return quantize


registry.register(registry.Entry(
  name="qsgd",
  ref_init=lambda shapes: None,
  ref_step=_integer_ref(128, lambda b: np.sqrt(np.sum(b * b, axis=1)),
                        _qsgd_quantize(7), lambda s: s / 7, True),
  factory=jaxcomm.qsgd,
  kwargs={"levels": 7, "bucket_size": 128},
  error_feedback=False,
  stochastic=True,
  bad_args=[({"levels": 0}, "levels"), ({"levels": 2.5}, "levels"),
            ({"levels": 2**31 - 1}, "levels"), ({"levels": 2**40}, "levels"),
            ({"bucket_size": 0}, "bucket_size")],
))


def _tern_quantize(b, s, u):
  return np.sign(b) * (u < _ratio32(b, s))


def _tern_clip(c):
  def prepare(x):
    bound = c * np.std(x)
    return np.clip(x, -bound, bound)
  return prepare


registry.register(registry.Entry(
  name="terngrad",
  ref_init=lambda shapes: None,
  ref_step=_integer_ref(None, lambda b: np.max(np.abs(b), axis=1),
                        _tern_quantize, lambda s: s, True,
                        prepare=_tern_clip(2.5)),
  factory=jaxcomm.terngrad,
  kwargs={"clip_sigma": 2.5},
  error_feedback=False,
  stochastic=True,
  bad_args=[({"clip_sigma": 0.0}, "clip_sigma")],
))


def _int8_quantize(b, s, u):
  del u
  r = _ratio32(b, s) * np.float32(127) * np.float32(np.sign(b))
  return np.round(r)


registry.register(registry.Entry(
  name="int8",
  ref_init=lambda shapes: None,
  ref_step=_integer_ref(128, lambda b: np.max(np.abs(b), axis=1),
                        _int8_quantize, lambda s: s / 127, False),
  factory=jaxcomm.int8,
  kwargs={"bucket_size": 128, "exchange": "exact"},
  bad_args=[({"bucket_size": 0}, "bucket_size"),
            ({"bucket_size": 2.5}, "bucket_size")],
))


def bf16_up(u):
  """The smallest bfloat16 value >= ``u`` (a float32 >= 0), from the
  bfloat16 format: the float32's top 16 bits, plus one unit of the last
  kept bit when any of the dropped 16 bits is set."""
  b = int(np.asarray(u, np.float32).view(np.uint32))
  top = b & 0xFFFF0000
  if b & 0xFFFF:
    top += 0x10000
  return np.uint32(top).view(np.float32)


def _requantized_ref(bits, block):
  """The requantized two-phase all-reduce (EQuARX, Google 2025; ZeRO++'s
  qgZ), from its definition, with the owner's rounding kept as server
  error (in gradient-sum units, as onebit's).

  ``q = 2^(bits-1) - 1``. The flat vector (leaves in tree order) is cut
  into ``n`` chunks of ``C = ceil(S / n)`` rounded up to 32 elements
  (``S = stored_of(L)``, the server error's width), each chunk into
  blocks of ``block`` elements (the last block of a chunk short; elements
  past ``L`` are not there). A block ``v`` has the step
  ``s``, the smallest bfloat16 value >= ``max|v| (1 / q)``, and is sent
  as ``round(v (1 / s))`` (half to even), decoding to ``code * s``; each
  product and quotient is rounded to float32 as the compressor rounds it
  (the owner's sums decide later roundings). The owner of chunk ``k`` sums
  the ``n`` decoded chunks in
  device order in float32 (the sum decides later roundings, so it is the
  transform's float32 sum, not a float64 one), adds its server error,
  rounds that sum the same way block by block (``z``), keeps ``y - z``;
  the mean is ``z / n``.
  """
  q = 2 ** (bits - 1) - 1

  def rounded(v):
    v = np.asarray(v, np.float32)
    step = bf16_up(np.max(np.abs(v)) * np.float32(1.0 / q))
    inv = np.float32(1) / step if step > 0 else np.float32(0)
    return np.round(v * inv) * step

  def blocks(lo, hi):
    return [(a, min(a + block, hi)) for a in range(lo, hi, block)]

  def step(xs, state, t, key, n):
    like = xs[0]
    length = sum(x.size for x in like)
    if state["server"] is None:
      state["server"] = [np.zeros(length, np.float32) for _ in range(n)]
    chunk = chunk_of(stored_of(length), n)
    flats = [_flat(dev) for dev in xs]
    dec = [np.zeros(length, np.float32) for _ in range(n)]
    mean = np.zeros(length)
    for k in range(n):
      lo, hi = k * chunk, min((k + 1) * chunk, length)
      if lo >= hi:
        continue
      for i in range(n):
        for a, b in blocks(lo, (k + 1) * chunk):
          b = min(b, length)
          if a < b:
            dec[i][a:b] = rounded(flats[i][a:b])
      y = dec[0][lo:hi].copy()
      for i in range(1, n):
        y = y + dec[i][lo:hi]
      y = y + state["server"][k][lo:hi]
      z = np.zeros(hi - lo, np.float32)
      for a, b in blocks(lo, (k + 1) * chunk):
        b = min(b, hi)
        if a < b:
          z[a - lo:b - lo] = rounded(y[a - lo:b - lo])
      state["server"][k][lo:hi] = y - z
      mean[lo:hi] = z.astype(np.float64) / n
    sent = [_split(d.astype(np.float64), like) for d in dec]
    return _split(mean, like), sent, state
  return step


def _server_error_mass(host_state):
  """The requantized exchange's server error, summed over its owners."""
  err = np.asarray(codec_state(host_state).server_error, np.float64)
  shapes = [(3, 3, 8, 16), (64, 48)]   # harness.COMPRESSED order
  return _split(err.sum(axis=0), [np.zeros(s) for s in shapes])


registry.register(registry.Entry(
  name="int8_requantized",
  ref_init=lambda shapes: {"server": None},
  ref_step=_requantized_ref(8, 128),
  factory=jaxcomm.int8,
  kwargs={"bucket_size": 128, "exchange": "requantized"},
  extra_mass=_server_error_mass,
  bad_args=[({"exchange": "fast"}, "exchange"),
            ({"exchange": 8}, "exchange"),
            ({"bucket_size": 0}, "bucket_size"),
            ({"error_feedback": "ef21"}, "error_feedback")],
))

# int4 as the factory makes it (exchange=None): requantized on 8 devices,
# 64-element blocks (a chunk of 544 elements: 8 whole blocks and a short
# one).
registry.register(registry.Entry(
  name="int4",
  ref_init=lambda shapes: {"server": None},
  ref_step=_requantized_ref(4, 64),
  factory=jaxcomm.int4,
  kwargs={"bucket_size": 64},
  extra_mass=_server_error_mass,
  bad_args=[({"bucket_size": 0}, "bucket_size"),
            ({"bucket_size": 2.5}, "bucket_size"),
            ({"exchange": "int4"}, "exchange"),
            ({"exchange": "requantized", "error_feedback": "ef21"},
             "error_feedback")],
))


def _uint8_ref(bucket):
  """Asymmetric 8-bit codes: lo = min, s = (max - lo) / 255 over each real
  bucket (padding excluded), bounds shared over devices; q = round((x - lo)
  / s), the ratio formed in float32 as the compressor forms it.
  """
  def step(xs, state, t, key, n):
    mean = [np.zeros_like(x) for x in xs[0]]
    sent = [[None] * len(xs[0]) for _ in range(n)]
    for j, x0 in enumerate(xs[0]):
      d = x0.size
      b = min(bucket, d)
      for start in range(0, d, b):
        vals = [np.ravel(xs[i][j])[start:start + b] for i in range(n)]
        lo = np.float32(min(np.min(v) for v in vals))
        hi = np.float32(max(np.max(v) for v in vals))
        s = (hi - lo) / np.float32(255)
        for i in range(n):
          if s > 0:
            r = (np.float32(vals[i]) - lo) / s
            q = np.clip(np.round(r), 0, 255).astype(np.float64)
          else:
            q = np.zeros(vals[i].shape)
          # Decoded in float32, as the transform decodes (and keeps the
          # residual x - dec): a float64 decode drifts the residual by an
          # ulp a step, enough to move a later value across a tie.
          dec = (lo + s * np.float32(q)).astype(np.float64)
          if sent[i][j] is None:
            sent[i][j] = np.zeros(d)
          sent[i][j][start:start + b] = dec
      for i in range(n):
        sent[i][j] = sent[i][j].reshape(x0.shape)
        mean[j] = mean[j] + sent[i][j] / n
    return mean, sent, state
  return step


registry.register(registry.Entry(
  name="uint8",
  ref_init=lambda shapes: None,
  ref_step=_uint8_ref(128),
  factory=jaxcomm.uint8,
  kwargs={"bucket_size": 128},
  # Over 5 steps a residual an ulp off (XLA's float32 decode) put one
  # value on the other side of a rounding tie at step 3.
  forced_memory=True,
  bad_args=[({"bucket_size": 0}, "bucket_size"),
            ({"bucket_size": 2.5}, "bucket_size")],
))


# Bucket widths that do not divide the leaves (1152 and 3072 elements):
# each leaf's last bucket is partial (padded with zeros, or with its last
# value for uint8), and the references cut the leaves themselves.
registry.register(registry.Entry(
  name="qsgd_partial_buckets",
  ref_init=lambda shapes: None,
  ref_step=_integer_ref(100, lambda b: np.sqrt(np.sum(b * b, axis=1)),
                        _qsgd_quantize(7), lambda s: s / 7, True),
  factory=jaxcomm.qsgd,
  kwargs={"levels": 7, "bucket_size": 100, "error_feedback": True},
  stochastic=True,
))

registry.register(registry.Entry(
  name="uint8_partial_buckets",
  ref_init=lambda shapes: None,
  ref_step=_uint8_ref(100),
  factory=jaxcomm.uint8,
  # Without error feedback: x is the float32 gradient in both, so no
  # float32/float64 residual drift can move a value across a rounding tie.
  kwargs={"bucket_size": 100, "error_feedback": False},
  error_feedback=False,
))


# ---------------------------------------------------------------- natural --


def natural_ref(x, key):
  """Natural compression (Horvath et al. 2019), from the paper's definition.

  For ``x != 0`` with ``2^a <= |x| < 2^(a+1)`` (``a = floor(log2 |x|)``),
  ``C(x) = sign(x) 2^(a+1)`` with probability ``p = (|x| - 2^a) / 2^a`` and
  ``sign(x) 2^a`` otherwise (so ``E C(x) = x``); ``C(0) = 0``. ``x`` is
  taken as float32 (what the transform rounds). The uniform draw ``u`` is
  the transform's documented one: 23 random bits per element,
  ``jax.random.bits(key) >> 9``, read as ``u = bits / 2^23``; rounding up
  iff ``u < p``. (Subnormal inputs and the largest binade, where the
  transform saturates, are outside what the battery feeds it.)
  """
  mag = np.abs(np.asarray(x, np.float32).astype(np.float64))
  nonzero = mag > 0
  _, e = np.frexp(np.where(nonzero, mag, 1.0))   # mag = m 2^e, m in [.5, 1)
  low = np.ldexp(1.0, e - 1)                      # 2^floor(log2 |x|)
  p = (mag - low) / low
  bits = np.asarray(jax.random.bits(key, mag.shape, jnp.uint32)) >> 9
  u = bits.astype(np.float64) / 2.0 ** 23
  rounded = np.where(u < p, 2.0 * low, low)
  return np.where(nonzero, np.sign(np.asarray(x, np.float64)) * rounded, 0.0)


def _natural_ref(xs, state, t, key, n):
  """Workers round with their own keys; from n = 3 on, the owner of each
  chunk rounds the chunk's average again with key ``fold_in(key, n + k)``.
  """
  flats = [natural_ref(_flat(dev), jax.random.fold_in(key, i))
           for i, dev in enumerate(xs)]
  sent = [_split(f, dev) for f, dev in zip(flats, xs)]
  length = flats[0].size
  if n <= 2:
    mean = np.mean(flats, axis=0)
  else:
    chunk = chunk_of(length, n)
    avg = np.zeros(n * chunk, np.float32)
    avg[:length] = np.sum(np.asarray(flats, np.float32), axis=0) / n
    mean = np.concatenate([
      natural_ref(avg[k * chunk:(k + 1) * chunk],
                  jax.random.fold_in(key, n + k)) for k in range(n)])
    mean = mean[:length]
  return _split(mean, xs[0]), sent, state


registry.register(registry.Entry(
  name="natural",
  ref_init=lambda shapes: None,
  ref_step=_natural_ref,
  factory=jaxcomm.natural,
  error_feedback=False,
  stochastic=True,
  bad_args=[({"policy": 3}, "policy"),
            ({"error_feedback": None}, "error_feedback")],
))


# ------------------------------------------------------------------ diana --
# DIANA (Mishchenko et al. 2019) around the unbiased quantizers: the
# harness (numpy_run) keeps each device's shift h_i and h = mean_i h_i,
# feeds the reference x_i = g_i - h_i, returns h + mean_i C(x_i) and moves
# h_i by alpha C(x_i), h by alpha mean_i C(x_i). alpha = 0.5 is a power
# of two: alpha * C(x) is exact in float32 and float64 alike.

_DIANA_BAD_ARGS = [({"shift_rate": 0.0}, "shift_rate"),
                   ({"shift_rate": 1.5}, "shift_rate"),
                   ({"shift_rate": float("nan")}, "shift_rate"),
                   ({"momentum": 0.9}, "momentum"),
                   ({"lr_schedule": lambda step: 0.1}, "lr_schedule"),
                   ({"error_feedback": "Diana"}, "error_feedback")]

registry.register(registry.Entry(
  name="qsgd_diana",
  ref_init=lambda shapes: None,
  ref_step=_integer_ref(128, lambda b: np.sqrt(np.sum(b * b, axis=1)),
                        _qsgd_quantize(7), lambda s: s / 7, True),
  factory=jaxcomm.qsgd,
  kwargs={"levels": 7, "bucket_size": 128, "error_feedback": "diana",
          "shift_rate": 0.5},
  error_feedback="diana",
  stochastic=True,
  bad_args=_DIANA_BAD_ARGS,
))

registry.register(registry.Entry(
  name="terngrad_diana",
  ref_init=lambda shapes: None,
  ref_step=_integer_ref(None, lambda b: np.max(np.abs(b), axis=1),
                        _tern_quantize, lambda s: s, True),
  factory=jaxcomm.terngrad,
  kwargs={"error_feedback": "diana", "shift_rate": 0.5},
  error_feedback="diana",
  stochastic=True,
  bad_args=_DIANA_BAD_ARGS + [({"clip_sigma": 2.5}, "error_feedback")],
))


# ---------------------------------------------------------------- ECQ-SGD --


def _ecq_quantize(v, s, u, levels):
  """Q(v) of Wu et al. 2018 on one leaf: ``S / s sign(v) xi`` with
  ``xi = floor(r) + Bernoulli(r - floor(r))``, ``r = s |v| / S``; the
  ratio formed in float32 as the compressor forms it."""
  r = _ratio32(v, s) * np.float32(levels)
  low = np.floor(r)
  lev = np.minimum(low + (u < r - low), levels)
  return np.sign(v) * lev * (np.float64(np.float32(s)) / levels)


def ecq_run(levels, alpha, beta, seed=0):
  """ECQ-SGD (Wu et al. 2018, Section 3): per device, ``q = Q(g + alpha
  h)``, ``h = beta h + g - q``; the update is ``mean_i q_i``. ``S``: per
  leaf, the largest ``max |g + alpha h|`` over devices (the documented
  shared scale). Noise: ``uniform(fold_in(step_key, i))`` over the
  compressed leaves flattened (the codec's draw). Float32 where the
  transform computes (``x = h + g``, then ``h = x - g``,
  ``g + alpha h``)."""
  f32 = np.float32
  comp = ("conv", "w")

  def run(grads_seq, n):
    h = [[np.zeros(grads_seq[0][k].shape[1:], f32) for k in comp]
         for _ in range(n)]
    key = jax.random.PRNGKey(seed)
    out, sent_all = [], []
    for grads in grads_seq:
      key, sub = jax.random.split(key)
      ys, hs = [], []
      for i in range(n):
        g = [np.asarray(grads[k][i], f32) for k in comp]
        x = [hj + gj for hj, gj in zip(h[i], g)]
        hh = [xj - gj for xj, gj in zip(x, g)]
        y = x if alpha == 1.0 else [gj + f32(alpha) * hj
                                    for gj, hj in zip(g, hh)]
        ys.append(y)
        hs.append((g, hh))
      scale = [max(np.abs(ys[i][j]).max() for i in range(n))
               for j in range(len(comp))]
      qs = []
      for i in range(n):
        total = sum(y.size for y in ys[i])
        u = _uniform(sub, i, total)
        off, q = 0, []
        for j, y in enumerate(ys[i]):
          uj = u[off:off + y.size].reshape(y.shape)
          off += y.size
          q.append(_ecq_quantize(y.astype(np.float64), scale[j], uj,
                                 levels))
        qs.append(q)
        g, hh = hs[i]
        h[i] = [(f32(beta) * hj.astype(np.float64) + gj - qj).astype(f32)
                if beta != 1.0 else
                (hj.astype(np.float64) + gj - qj).astype(f32)
                for hj, gj, qj in zip(hh, g, q)]
      upd = {k: sum(qs[i][j] for i in range(n)) / n
             for j, k in enumerate(comp)}
      upd["b"] = np.asarray(grads["b"], np.float64).mean(axis=0)
      out.append(upd)
      sent_all.append(qs)
    return out, [[r.astype(np.float64) for r in dev] for dev in h], sent_all
  return run


def _ecq_no_ref_step(xs, state, t, key, n):
  raise AssertionError("ecq_sgd's reference is its numpy_run (it needs g)")


_ECQ_BAD = [({"levels": 0}, "levels"), ({"levels": 2.5}, "levels"),
            ({"levels": 2**20}, "levels"), ({"alpha": -0.5}, "alpha"),
            ({"alpha": float("inf")}, "alpha"), ({"beta": 1.5}, "beta"),
            ({"beta": float("nan")}, "beta"), ({"bucket_size": 0},
                                                "bucket_size"),
            ({"error_feedback": False}, "error_feedback"),
            ({"momentum": 0.9}, "momentum")]

registry.register(registry.Entry(
  # The paper's decayed, partly compensated error: beta < 1 forgets a
  # share of h every step (no mass balance), alpha != 1.
  name="ecq_sgd",
  ref_init=lambda shapes: None,
  ref_step=_ecq_no_ref_step,
  numpy_run=ecq_run(7, 0.5, 0.9),
  factory=jaxcomm.ecq_sgd,
  kwargs={"levels": 7, "alpha": 0.5, "beta": 0.9},
  stochastic=True,
  conserves=False,
  bad_args=_ECQ_BAD,
))

registry.register(registry.Entry(
  # alpha = beta = 1: classic error feedback around the same quantizer;
  # the battery checks its mass balance.
  name="ecq_sgd_undecayed",
  ref_init=lambda shapes: None,
  ref_step=_ecq_no_ref_step,
  numpy_run=ecq_run(3, 1.0, 1.0),
  factory=jaxcomm.ecq_sgd,
  kwargs={"levels": 3, "alpha": 1.0, "beta": 1.0},
  stochastic=True,
))


# ---------------------------------------------------------- dist-EF-SGDM --


def _l1_scaled_sign(v):
  """``C(v) = ||v||_1 / d sign(v)`` (Zheng et al. 2019; sign(0) = +1)."""
  return np.sum(np.abs(v)) / v.size * _sign(v)


def dist_ef_sgdm_run(mu):
  """Zheng, Huang, Kwok 2019, dist-EF-BlockSGDM with the leaves as
  blocks: per device ``m = mu m + g``, ``p = m + e``, ``D = C(p)``, ``e =
  p - D``; the server (each device for its chunk of ``ceil(S / n)``
  rounded up to 32, ``S = stored_of(L)``, one block per leaf segment of
  the chunk) ``p~ =
  mean_i D_i + e~``, ``D~ = C(p~)``, ``e~ = p~ - D~`` (kept as ``n e~``,
  the documented units); the update is ``D~``. Momentum and worker error
  in float32, as the transform keeps them."""
  f32 = np.float32
  comp = ("conv", "w")

  def run(grads_seq, n):
    like = [np.zeros(grads_seq[0][k].shape[1:]) for k in comp]
    length = sum(x.size for x in like)
    m = [[np.zeros(x.shape, f32) for x in like] for _ in range(n)]
    e = [[np.zeros(x.shape, f32) for x in like] for _ in range(n)]
    server = [np.zeros(length) for _ in range(n)]
    chunk = chunk_of(stored_of(length), n)
    ends = np.cumsum([x.size for x in like])
    starts = ends - np.asarray([x.size for x in like])
    out, sent_all = [], []
    for grads in grads_seq:
      sent, flat_w = [], []
      for i in range(n):
        g = [np.asarray(grads[k][i], f32) for k in comp]
        m[i] = [f32(mu) * mj + gj for mj, gj in zip(m[i], g)]
        p = [(ej + mj).astype(np.float64) for ej, mj in zip(e[i], m[i])]
        d = [_l1_scaled_sign(pj) for pj in p]
        e[i] = [(pj - dj).astype(f32) for pj, dj in zip(p, d)]
        sent.append(d)
        flat_w.append(_flat(d))
      avg = np.mean(flat_w, axis=0)
      mean = np.zeros(length)
      for k in range(n):
        lo, hi = k * chunk, min((k + 1) * chunk, length)
        if lo >= hi:
          continue
        y = avg[lo:hi] + server[k][lo:hi] / n
        z = np.zeros_like(y)
        for a, b in zip(starts, ends):
          a, b = max(a, lo), min(b, hi)
          if a < b:
            z[a - lo:b - lo] = _l1_scaled_sign(y[a - lo:b - lo])
        server[k][lo:hi] = n * (y - z)
        mean[lo:hi] = z
      upd = {k: v for k, v in zip(comp, _split(mean, like))}
      upd["b"] = np.asarray(grads["b"], np.float64).mean(axis=0)
      out.append(upd)
      sent_all.append(sent)
    return out, [[r.astype(np.float64) for r in dev] for dev in e], sent_all
  return run


def _dist_ef_no_ref_step(xs, state, t, key, n):
  raise AssertionError("dist_ef_sgdm's reference is its numpy_run (it "
                       "keeps the momentum)")


_DIST_EF_BAD = [({"momentum": 1.0}, "momentum"),
                ({"momentum": -0.1}, "momentum"),
                ({"momentum": float("nan")}, "momentum"),
                ({"error_feedback": False}, "error_feedback"),
                ({"momentum_masking": True}, "momentum_masking")]

registry.register(registry.Entry(
  # The paper's method, mu = 0.9: the momentum re-adds past gradients, so
  # the mass balance is of momenta, not of gradients.
  name="dist_ef_sgdm",
  ref_init=lambda shapes: None,
  ref_step=_dist_ef_no_ref_step,
  numpy_run=dist_ef_sgdm_run(0.9),
  factory=jaxcomm.dist_ef_sgdm,
  kwargs={"momentum": 0.9},
  extra_mass=_onebit_extra_mass,
  conserves=False,
  bad_args=_DIST_EF_BAD,
))

registry.register(registry.Entry(
  # mu = 0 (dist-EF-SGD): workers' and server's errors hold every
  # gradient not yet applied; the battery checks the balance.
  name="dist_ef_sgd",
  ref_init=lambda shapes: None,
  ref_step=_dist_ef_no_ref_step,
  numpy_run=dist_ef_sgdm_run(0.0),
  factory=jaxcomm.dist_ef_sgdm,
  kwargs={"momentum": 0.0},
  extra_mass=_onebit_extra_mass,
  bad_args=_DIST_EF_BAD,
))


# ------------------------------------------- quantized compressive sampling

def _sylvester(b):
  h = np.ones((1, 1))
  while h.shape[0] < b:
    h = np.block([[h, h], [h, -h]])
  return h


def _qcs_ref(ratio, block, levels):
  """Abdi, Fekri 2020: the compressed leaves (flattened, concatenated in
  bucket order, zero-padded) as a ``[B, c]`` grid whose columns are
  blocks; per step, from the step's key ``k = fold_in(key, first leaf)``:
  signs ``D`` (-1 where ``uniform(fold_in(k, 0), (B, c)) < 1/2``), rows
  ``R`` (the ``m`` largest of ``uniform(fold_in(k, 1), (B,))``,
  descending). Device ``i`` measures ``y_i = R H (D x_i) / sqrt(B)`` (``H``
  built by Sylvester's construction), rounds ``s |y_i| / S`` (``S`` the
  largest ``|y|`` over devices) up with probability its fraction (uniforms
  ``fold_in(fold_in(k, 2), i)`` over ``[m, c]``), and the update is ``D
  H^T R^T (sum_i q_i) S / s / sqrt(B) / n``."""
  def step(xs, state, t, key, n):
    sizes = [x.size for x in xs[0]]
    size = sum(sizes)
    c = -(-size // block)
    m = max(1, min(block, math.ceil(ratio * block - 1e-9)))
    k = jax.random.fold_in(key, 0)
    signs = np.where(np.asarray(jax.random.uniform(
      jax.random.fold_in(k, 0), (block, c))) < 0.5, -1.0, 1.0)
    rows = np.argsort(-np.asarray(jax.random.uniform(
      jax.random.fold_in(k, 1), (block,))), kind="stable")[:m]
    p = _sylvester(block)[rows] / np.sqrt(block)             # [m, B]
    grids = [np.pad(np.concatenate([np.ravel(x) for x in dev]),
                    (0, block * c - size)).reshape(block, c) for dev in xs]
    ys = [p @ (signs * g) for g in grids]
    scale = max(np.abs(y).max() for y in ys)
    qs = []
    for i, y in enumerate(ys):
      u = np.asarray(jax.random.uniform(
        jax.random.fold_in(jax.random.fold_in(k, 2), i), (m, c)),
        np.float64)
      r = np.abs(y) / scale * levels if scale > 0 else np.zeros_like(y)
      lev = np.minimum(np.floor(r) + (u < r - np.floor(r)), levels)
      qs.append(np.where(y < 0, -1.0, 1.0) * lev * scale / levels)

    def back(z):
      return (signs * (p.T @ z)).reshape(-1)[:size]

    def split(flat):
      out, off = [], 0
      for x in xs[0]:
        out.append(flat[off:off + x.size].reshape(x.shape))
        off += x.size
      return out

    mean = back(sum(qs) / n)
    return split(mean), [split(back(q)) for q in qs], state
  return step


_QCS_BAD = [({"ratio": 0.0}, "ratio"), ({"ratio": 1.5}, "ratio"),
            ({"ratio": float("nan")}, "ratio"),
            ({"block": 100}, "block"), ({"block": 1}, "block"),
            ({"block": 2.5}, "block"),
            ({"levels": 0}, "levels"), ({"levels": 40000}, "levels"),
            ({"error_feedback": "yes"}, "error_feedback")]

registry.register(registry.Entry(
  # 66 blocks of 64, 32 measurements each, 3 levels (3-bit codes).
  name="qcs",
  ref_init=lambda shapes: None,
  ref_step=_qcs_ref(0.5, 64, 3),
  factory=jaxcomm.qcs,
  kwargs={"ratio": 0.5, "block": 64, "levels": 3},
  stochastic=True,
  bad_args=_QCS_BAD,
))
