"""Gradient leakage: how well one device's message reconstructs its
training input, per compressor (Zhu et al. 2019, "Deep leakage from
gradients", DLG). An evaluation, not a training method.

  python -m benchmarks.leakage [--quick] [--images 10] [--iters 300]
      [--table TABLE.md] [--figure docs/benchmarks/leakage.png]

Setting (the paper's): one device holds one private digit ``x`` (8x8
pixels in [0, 1], scikit-learn's digits through ``models.data.digits``,
the first test image of each class) and its label; the model is a small
MLP ``64 -> 64 -> 10`` with sigmoid hidden units (twice differentiable, as
DLG needs), freshly initialised per image, and the device sends its
message for the gradient of the cross-entropy of that one example. The
message is what the real jaxcomm compressor makes of it on one device
(``axis_name=None``): ``sent``, read as ``x - e'`` from the
error-feedback residual after the first step (``e = 0`` before it, so the
message is the compressor applied to the plain gradient: the attacker's
most favourable step; later steps add the residual of earlier ones).
Leaves the compressor does not take (by jaxcomm's default
:class:`jaxcomm.LeafPolicy`: the biases, under 256 elements) travel dense
in the fused psum and are seen exactly; the ``all leaves`` rows compress
them too (``LeafPolicy(min_size=0)``; PowerSGD takes matrices only).

The attack (DLG): a dummy input ``x'`` (uniform in [0, 1]) and dummy label
logits ``y'`` (normal) are optimised by L-BFGS (``optax.lbfgs``, zoom line
search) so that the attacker's model of the message of ``grad(x',
softmax(y'))`` matches the observed one in squared error, each leaf's
normalised by the observed leaf's squared norm (:func:`mismatch`). The
attacker knows the weights, the architecture, the compressor, its
settings and its shared state; per family, its model of the message
(what the receiver sees):

* dense, int8: the gradient itself (int8's dequantized values differ from
  it by at most half a code step per entry; rounding is not
  differentiable, so the dummy's gradient is matched to them as is);
* top-k: the gradient on the message's support (the attacker receives
  the indices): ``g' * 1[m != 0]``;
* PowerSGD: the message is ``P Q^T`` with ``P = orth(G Q_0)``
  orthonormal (both received; ``Q_0``, the warm-start state, is
  replicated, so known): the dummy's gradient ``G'`` is matched as ``P
  P^T G'`` to the message and as ``G' Q_0`` to ``m Q_0`` (equal for the
  true gradient, since ``G Q_0`` lies in the span of ``P``). At batch 1
  a dense layer's gradient is rank 1 (``x delta^T``), so PowerSGD of any
  rank sends it exactly;
* signs (onebit: ``||x||_2 / sqrt(d) sign(x)`` per leaf; signSGD:
  ``sign(x)``, both with ``sign(0) = +1``): ``sign`` is replaced by the
  smooth ``tanh(g / (tau rms(g)) + 2)`` (``+1`` at 0, as the codecs;
  ``tau = 0.02``, ``--sign-tau``), times onebit's scale ``rms(g')``
  (signSGD's ``1``);
* DiLoCo: the pseudo-gradient ``theta - x_H`` after ``H`` inner SGD steps
  on the private example (``jaxcomm.diloco`` on one device, the delta read
  from its anchor after the sync with outer ``sgd(1.0)``); the attacker
  unrolls the ``H`` steps from the known ``theta`` with the dummy example.

Labels: DLG's joint soft label (iDLG's analytic label is not used). The
reconstruction is clipped to [0, 1]; MSE is per pixel, PSNR ``10 log10(1 /
MSE)``. Bytes: one device's message (the codec's payload per device:
top-k's (value, index) words and PowerSGD's ``(n + m) r`` float32 as the
wire claim on 2 devices lists them per device; int8 one byte per element
and a float32 scale per 128; signs 32 to a word and onebit's scale per
leaf), plus the dense leaves as float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm

IN_FEATURES = 64
HIDDEN = 64
NUM_CLASSES = 10
SIGN_TAU = 0.02
DILOCO_LR = 0.1
INT8_BLOCK = 128

# ------------------------------------------------------------------ model --


def init_mlp(key, hidden: int = HIDDEN) -> dict:
  """The MLP's params: LeCun-normal weights, zero biases."""
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (IN_FEATURES, hidden)) / math.sqrt(
      IN_FEATURES),
    "b1": jnp.zeros((hidden,)),
    "w2": jax.random.normal(k2, (hidden, NUM_CLASSES)) / math.sqrt(hidden),
    "b2": jnp.zeros((NUM_CLASSES,)),
  }


def logits(params, x):
  """``x`` (``[..., 64]``) through ``sigmoid(x W1 + b1) W2 + b2``."""
  h = jax.nn.sigmoid(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def loss(params, x, label_probs):
  """Cross-entropy of one example against a (soft) label."""
  return -jnp.sum(label_probs * jax.nn.log_softmax(logits(params, x)))


example_grad = jax.grad(loss)


def diloco_delta(params, x, label_probs, period: int, lr: float = DILOCO_LR):
  """``theta - x_H``: ``period`` SGD steps on one example from ``params``
  (the attacker's model of DiLoCo's pseudo-gradient)."""
  def body(p, _):
    g = example_grad(p, x, label_probs)
    return jax.tree.map(lambda a, b: a - lr * b, p, g), None
  end, _ = jax.lax.scan(body, params, None, length=period)
  return jax.tree.map(lambda a, b: a - b, params, end)


# -------------------------------------------------------------- settings --


@dataclasses.dataclass(frozen=True)
class Setting:
  """One row: a compressor and its argument.

  Attributes:
    kind: ``dense``, ``topk``, ``int8``, ``powersgd``, ``onebit``,
      ``signsgd`` or ``diloco``.
    arg: top-k's ratio, PowerSGD's rank, DiLoCo's period ``H``.
    all_leaves: compress every leaf the codec accepts
      (``LeafPolicy(min_size=0)``), not only jaxcomm's default.
  """

  kind: str
  arg: float | int | None = None
  all_leaves: bool = False

  @property
  def name(self) -> str:
    base = {"dense": "dense gradient", "int8": "int8", "onebit": "onebit",
            "signsgd": "signSGD"}.get(self.kind)
    if base is None:
      base = {"topk": f"top-k {self.arg:g}",
              "powersgd": f"PowerSGD rank {self.arg}",
              "diloco": f"DiLoCo H={self.arg}"}[self.kind]
    return base + (", all leaves" if self.all_leaves else "")


SETTINGS = (
  Setting("dense"),
  Setting("topk", 0.2), Setting("topk", 0.1), Setting("topk", 0.02),
  Setting("int8"),
  Setting("powersgd", 4), Setting("powersgd", 1),
  Setting("onebit"), Setting("signsgd"),
  Setting("diloco", 4), Setting("diloco", 16),
  Setting("topk", 0.2, True), Setting("topk", 0.02, True),
  Setting("int8", all_leaves=True),
  Setting("onebit", all_leaves=True), Setting("signsgd", all_leaves=True),
)

QUICK_SETTINGS = (
  Setting("dense"), Setting("topk", 0.1), Setting("int8"),
  Setting("powersgd", 1), Setting("onebit"), Setting("diloco", 4),
)


def compressor(s: Setting):
  """The jaxcomm compressor of ``s`` on one device, with error feedback
  (its residual gives back what was sent); None for dense and DiLoCo."""
  policy = jaxcomm.LeafPolicy(min_size=0) if s.all_leaves else None
  kw = dict(axis_name=None, error_feedback=True, policy=policy)
  if s.kind == "topk":
    return jaxcomm.topk(s.arg, **kw)
  if s.kind == "int8":
    return jaxcomm.int8(**kw)
  if s.kind == "powersgd":
    return jaxcomm.powersgd(int(s.arg), **kw)
  if s.kind == "onebit":
    return jaxcomm.onebit(**kw)
  if s.kind == "signsgd":
    return jaxcomm.signsgd(**kw)
  if s.kind in ("dense", "diloco"):
    return None
  raise ValueError(f"unknown kind {s.kind!r}")


def paths(s: Setting, params) -> dict:
  """Per leaf name: ``compress`` or ``dense`` (jaxcomm's decision)."""
  tx = compressor(s)
  names = sorted(params)
  if tx is None:
    return {k: "dense" for k in names}
  return dict(zip(names, jaxcomm.spec_of(tx).paths(params)))


# ------------------------------------------------------------- messages --


def sent_message(tx, grads) -> dict:
  """What one device's message decodes to, per leaf, after the first step
  of ``tx`` (a jaxcomm compressor on one device, with error feedback):
  ``sent = x - e'`` on the compressed leaves (``x = g``: the residual is
  zero before the first step), the gradient itself on the leaves that
  travel in the dense psum."""
  state = tx.init(grads)
  _, new = jax.jit(tx.update)(grads, state)
  spec = jaxcomm.spec_of(tx)
  leaves, treedef = jax.tree.flatten(grads)
  residual = iter(spec.leaves_of(new.residual, grads))
  out = []
  for leaf, path in zip(leaves, spec.paths(grads)):
    out.append(leaf - next(residual).reshape(leaf.shape)
               if path == "compress" else leaf)
  return jax.tree.unflatten(treedef, out)


def diloco_message(params, x, label: int, period: int,
                   lr: float = DILOCO_LR) -> dict:
  """DiLoCo's pseudo-gradient ``theta - x_H`` of one device after
  ``period`` inner SGD steps on one example: ``jaxcomm.diloco`` on one
  device (``axis_name=None``), outer ``sgd(1.0)``, so that the sync sets
  the anchor to ``theta - delta``; the delta is read from it."""
  tx = jaxcomm.diloco(optax.sgd(lr), optax.sgd(1.0), period,
                      axis_name=None)
  onehot = jax.nn.one_hot(label, NUM_CLASSES)

  @jax.jit
  def step(p, state):
    g = example_grad(p, x, onehot)
    u, state = tx.update(g, state, p)
    return jaxcomm.apply_updates(p, u, state), state

  p, state = params, tx.init(params)
  for _ in range(period):
    p, state = step(p, state)
  (local,) = jaxcomm.local_states(state)
  return jax.tree.map(lambda a, b: a - b, params, local.anchor)


def observe(s: Setting, params, x, label: int) -> dict:
  """The message the receiver sees for ``s`` (per leaf)."""
  if s.kind == "diloco":
    return diloco_message(params, x, label, int(s.arg))
  g = example_grad(params, x, jax.nn.one_hot(label, NUM_CLASSES))
  tx = compressor(s)
  return g if tx is None else sent_message(tx, g)


def message_bytes(s: Setting, params) -> int:
  """Bytes of one device's message for ``s`` (see the module docstring)."""
  route = paths(s, params)
  comp = [k for k in sorted(params) if route[k] == "compress"]
  sizes = {k: int(np.size(params[k])) for k in params}
  dense = sum(4 * sizes[k] for k in params if route[k] == "dense")
  total = sum(sizes[k] for k in comp)
  if s.kind in ("dense", "diloco") or not comp:
    return dense
  if s.kind == "topk":
    idx = np.dtype(jaxcomm.collectives.index_dtype(total)).itemsize
    pairs = sum(max(1, min(sizes[k], math.ceil(s.arg * sizes[k]
                                               * (1 - 1e-9))))
                for k in comp)
    body = math.ceil(pairs * (4 + idx) / 4) * 4
  elif s.kind == "int8":
    body = total + 4 * sum(-(-sizes[k] // INT8_BLOCK) for k in comp)
  elif s.kind == "powersgd":
    body = sum(4 * (params[k].shape[0] + params[k].shape[1]) * int(s.arg)
               for k in comp)
  elif s.kind == "onebit":
    body = 4 * -(-total // 32) + 4 * len(comp)
  elif s.kind == "signsgd":
    body = 4 * -(-total // 32)
  else:
    raise ValueError(s.kind)
  return body + dense


def claimed_bytes(s: Setting, params) -> int | None:
  """Top-k's and PowerSGD's message bytes as their wire claim lists them
  for one device of 2 (top-k: the all-gather of 2 messages, halved;
  PowerSGD: the P and Q all-reduces), plus the dense psum less its
  1-element non-finite flag. None for the others (their claims are of
  two-phase exchanges, not of the message)."""
  tx = compressor(s)
  if s.kind not in ("topk", "powersgd"):
    return None
  ops = jaxcomm.wire.claimed(tx, params, 2)
  body = sum(b / (2 if k == "all-gather" else 1) for k, b in ops[:-1])
  return int(body + ops[-1][1] - 4)


# --------------------------------------------------------------- attack --


def _rms(g):
  return jnp.sqrt(jnp.mean(jnp.square(g)) + 1e-30)


def initial_q(s: Setting, route: dict, params) -> dict:
  """PowerSGD's ``Q`` at the first step per compressed leaf (as its
  docstring defines it: ``normal(fold_in(PRNGKey(seed), j), (m, r))``
  for the ``j``-th compressed leaf; every device holds it)."""
  out, j = {}, 0
  for k in sorted(params):
    if route[k] == "compress":
      out[k] = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(0),
                                                    j),
                                 (params[k].shape[-1], int(s.arg)))
      j += 1
  return out


def aux_of(s: Setting, message: dict, route: dict, params) -> dict:
  """What the attacker knows beforehand, per leaf: top-k's support (read
  off the message), PowerSGD's ``P`` (the message's leading ``rank`` left
  singular vectors: the span of the ``P`` it receives) and ``Q_0``."""
  out = {}
  q0 = initial_q(s, route, params) if s.kind == "powersgd" else {}
  for k, m in message.items():
    if route[k] == "compress" and s.kind == "topk":
      out[k] = (m != 0).astype(jnp.float32)
    elif route[k] == "compress" and s.kind == "powersgd":
      u, _, _ = jnp.linalg.svd(m, full_matrices=False)
      out[k] = (u[..., :int(s.arg)], q0[k])
    else:
      out[k] = jnp.zeros(())
  return out


def sign_surrogate(g):
  """A smooth stand-in for ``sign`` with ``sign(0) = +1``, as the codecs
  define it: ``tanh(g / (tau rms(g)) + 2)`` (``tanh(2) = 0.96`` at 0)."""
  return jnp.tanh(g / (SIGN_TAU * _rms(g)) + 2.0)


def mismatch(s: Setting, route: dict, params, x, label_probs, message,
             aux):
  """The attacker's objective for a dummy example: per leaf, the squared
  error between its model of the dummy's message and the observed one,
  over the observed one's squared norm, summed over leaves. PowerSGD
  adds, per compressed leaf, ``||(I - P P^T) G' Q_0||^2`` (over ``||m
  Q_0||^2``): the dummy's ``P' = orth(G' Q_0)`` must lie in the span of
  the observed ``P``, or its message differs (``P P^T G'`` alone leaves
  the rest of ``G'`` free)."""
  if s.kind == "diloco":
    pred = diloco_delta(params, x, label_probs, int(s.arg))
  else:
    pred = example_grad(params, x, label_probs)
  total = 0.0
  for k, m in message.items():
    gk = pred[k]
    if route[k] == "compress" and s.kind == "topk":
      gk = gk * aux[k]
    elif route[k] == "compress" and s.kind == "powersgd":
      p, q0 = aux[k]
      gq = gk @ q0
      ref = m @ q0
      total = total + jnp.sum(jnp.square(gq - ref)) / (
        jnp.sum(jnp.square(ref)) + 1e-30)
      gk = p @ (p.T @ gk)
    elif route[k] == "compress" and s.kind in ("onebit", "signsgd"):
      gk = sign_surrogate(gk) * (_rms(gk) if s.kind == "onebit" else 1.0)
    total = total + jnp.sum(jnp.square(gk - m)) / (
      jnp.sum(jnp.square(m)) + 1e-30)
  return total


def attack(s: Setting, route: dict, params, message, aux, key,
           iters: int):
  """DLG by L-BFGS from a random start: ``(x', label logits', objective,
  the start x)``."""

  def objective(z):
    return mismatch(s, route, params, z[0], jax.nn.softmax(z[1]), message,
                    aux)

  kx, ky = jax.random.split(key)
  z0 = (jax.random.uniform(kx, (IN_FEATURES,)),
        jax.random.normal(ky, (NUM_CLASSES,)))
  opt = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(objective)

  def body(_, carry):
    z, state = carry
    value, grad = value_and_grad(z, state=state)
    updates, state = opt.update(grad, state, z, value=value, grad=grad,
                                value_fn=objective)
    return optax.apply_updates(z, updates), state

  z, _ = jax.lax.fori_loop(0, iters, body, (z0, opt.init(z0)))
  return z[0], z[1], objective(z), z0[0]


# ---------------------------------------------------------------- runs --


def load_images(num: int):
  """The first test digit of each class, ``num`` of them (classes 0, 1,
  ... cycling): flat ``[num, 64]`` pixels in [0, 1] and labels."""
  from models import data as mdata

  _, test = mdata.digits()
  xs, ys = [], []
  for i in range(num):
    c = i % NUM_CLASSES
    rank = i // NUM_CLASSES
    idx = np.flatnonzero(test["label"] == c)[rank]
    xs.append(test["image"][idx].reshape(-1))
    ys.append(c)
  return np.stack(xs).astype(np.float32), np.asarray(ys, np.int32)


def psnr(mse):
  return 10.0 * np.log10(1.0 / np.maximum(mse, 1e-12))


def run_setting(s: Setting, images, labels, iters: int, seed: int = 0):
  """The attack on every image for ``s``: per-image dict of results."""
  num = len(images)
  params = [init_mlp(jax.random.PRNGKey(1000 * seed + i))
            for i in range(num)]
  route = paths(s, params[0])
  msgs = [observe(s, p, jnp.asarray(x), int(y))
          for p, x, y in zip(params, images, labels)]
  auxs = [aux_of(s, m, route, p) for m, p in zip(msgs, params)]
  stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
  keys = jnp.stack([jax.random.PRNGKey(7 + 1000 * seed + i)
                    for i in range(num)])
  run = jax.jit(jax.vmap(
    lambda p, m, a, k: attack(s, route, p, m, a, k, iters)))
  x_hat, y_hat, final, x0 = run(stack(params), stack(msgs), stack(auxs),
                                keys)
  x_hat = np.asarray(x_hat)
  finite = np.isfinite(x_hat).all(axis=1)
  x_hat = np.where(finite[:, None], x_hat, 0.5)
  rec = np.clip(x_hat, 0.0, 1.0)
  mse = np.mean((rec - images) ** 2, axis=1)
  mse0 = np.mean((np.asarray(x0) - images) ** 2, axis=1)
  support = None
  if s.kind == "topk":
    # The support read off the message is the sent indices unless a sent
    # value is exactly 0: count the support against k.
    support = [int(sum(np.count_nonzero(m[k]) for k in m
                       if route[k] == "compress")) for m in msgs]
  return dict(recon=rec, mse=mse, mse0=mse0,
              label_ok=np.asarray(y_hat).argmax(axis=1) == labels,
              loss=np.asarray(final), finite=finite, support=support,
              bytes=message_bytes(s, params[0]),
              claimed=claimed_bytes(s, params[0]))


def _table(rows, dense_bytes, num, iters, mean_mse) -> str:
  out = ["| message | bytes | of dense | MSE mean | MSE median | "
         "PSNR mean (dB) | PSNR median (dB) | label right |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for s, r in rows:
    p = psnr(r["mse"])
    out.append(
      f"| {s.name} | {r['bytes']:,} | {r['bytes'] / dense_bytes:.3f} | "
      f"{r['mse'].mean():.2e} | {np.median(r['mse']):.2e} | "
      f"{p.mean():.1f} | {np.median(p):.1f} | "
      f"{int(r['label_ok'].sum())}/{num} |")
  p0 = psnr(mean_mse)
  out.append(f"| (the mean training digit, no message) | 0 | 0 | "
             f"{mean_mse.mean():.2e} | {np.median(mean_mse):.2e} | "
             f"{p0.mean():.1f} | {np.median(p0):.1f} | |")
  del iters
  return "\n".join(out)


def figure(rows, images, path, show: int):
  """A grid: the private digits, then each row's reconstructions."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  show = min(show, len(images))
  nrows = len(rows) + 1
  fig, axes = plt.subplots(nrows, show, figsize=(0.75 * show + 2.2,
                                                 0.75 * nrows + 0.3),
                           squeeze=False)
  for r in range(nrows):
    name = "private input" if r == 0 else rows[r - 1][0].name
    for c in range(show):
      img = images[c] if r == 0 else rows[r - 1][1]["recon"][c]
      ax = axes[r][c]
      ax.imshow(img.reshape(8, 8), cmap="gray_r", vmin=0.0, vmax=1.0,
                interpolation="nearest")
      ax.set_xticks([])
      ax.set_yticks([])
      if c == 0:
        ax.set_ylabel(name, rotation=0, ha="right", va="center",
                      fontsize=7)
  fig.tight_layout(pad=0.2)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  global SIGN_TAU
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="6 settings, 3 images, 60 iterations")
  ap.add_argument("--images", type=int, default=10)
  ap.add_argument("--iters", type=int, default=300)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--sign-tau", type=float, default=SIGN_TAU,
                  help="sharpness of the attacker's smooth sign")
  ap.add_argument("--table", default=None,
                  help="also write the markdown table to this file")
  ap.add_argument("--figure", default=None,
                  help="write the figure of the reconstructions here (.png)")
  args = ap.parse_args(argv)
  SIGN_TAU = args.sign_tau
  settings = QUICK_SETTINGS if args.quick else SETTINGS
  num = 3 if args.quick else args.images
  iters = 60 if args.quick else args.iters
  images, labels = load_images(num)
  from models import data as mdata
  train, _ = mdata.digits()
  mean_digit = train["image"].reshape(len(train["image"]), -1).mean(axis=0)
  mean_mse = np.mean((mean_digit[None] - images) ** 2, axis=1)

  rows = []
  t0 = time.time()
  for s in settings:
    t = time.time()
    r = run_setting(s, images, labels, iters, args.seed)
    rows.append((s, r))
    extra = ""
    if r["claimed"] is not None and r["claimed"] != r["bytes"]:
      extra = f"  (wire claim {r['claimed']})"
    if r["support"] is not None:
      extra += f"  support {min(r['support'])}..{max(r['support'])}"
    print(f"{s.name:28s} bytes {r['bytes']:6d}  MSE {r['mse'].mean():.4f} "
          f"(median {np.median(r['mse']):.4f}, start "
          f"{r['mse0'].mean():.3f})  labels {int(r['label_ok'].sum())}/"
          f"{num}  nonfinite {int((~r['finite']).sum())}  "
          f"{time.time() - t:.1f}s{extra}", flush=True)
  dense_bytes = rows[0][1]["bytes"]
  table = _table(rows, dense_bytes, num, iters, mean_mse)
  print(table)
  print(f"random start: MSE {np.mean([r['mse0'].mean() for _, r in rows]):.4f}"
        f"; total {time.time() - t0:.0f}s")
  if args.table:
    with open(args.table, "w", encoding="utf-8") as f:
      f.write(table + "\n")
  if args.figure:
    figure(rows, images, args.figure, show=num)
  return 0


if __name__ == "__main__":
  sys.exit(main())
