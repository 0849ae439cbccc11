"""Sparse ternary and sparse binary compression (Sattler et al.): top-k
positions sent Golomb-coded, values replaced by one mean per leaf.

========= ================================= =============================
name      message per leaf of L elements     values
========= ================================= =============================
stc       k Golomb-coded positions, k signs  ``sign * mean |kept|``
sbc       k Golomb-coded positions           one signed mean
========= ================================= =============================

Both keep ``k = max(1, ceil(ratio * L))`` positions per leaf, as
:func:`jaxcomm.topk` does, and travel as one all-gather of every device's
``uint32`` message; each device decodes all ``n`` messages and adds them.
Positions cost about ``log2(1/ratio) + 2`` bits instead of 8 to 32
(:mod:`jaxcomm.collectives._golomb`); a leaf's message is one float32 (the
mean), ``k`` sign bits (STC only) and the Golomb bits, rounded up to whole
words. Error feedback (on by default, as in both papers) keeps everything a
device did not send: the unselected coordinates and the difference between
each kept value and the mean that replaced it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm.collectives import _core
from jaxcomm.collectives import _golomb
from jaxcomm.kernels import topk as _topk
from jaxcomm.transforms.sparsify._sparsification import num_selected


def _padding(k: int, signs: bool) -> int:
  """How far past its leaf a position may reach. STC sends a selected zero
  (a leaf with fewer than k nonzeros) at a padding position past the leaf,
  which the decoder drops: ``mu sign(0) = 0``, which no sign bit can say.
  At least one selected value is nonzero when ``mu > 0`` (else every slot
  stays in the leaf, carrying 0), so at most ``k - 1`` pad."""
  return k - 1 if signs else 0


def _pos_bits(k: int, size: int, signs: bool) -> int:
  """Bits of one leaf's message after the mean: coded positions, signs."""
  return (_golomb.capacity_bits(k, size, _padding(k, signs))
          + (k if signs else 0))


def _row_words(k: int, size: int, signs: bool) -> int:
  """uint32 words of one leaf's message: the mean, then the bits."""
  return 1 + -(-_pos_bits(k, size, signs) // 32)


def _wire(layout, n, ratio, signs):
  words = sum(g.count * _row_words(num_selected(ratio, g.leaf_size),
                                   g.leaf_size, signs)
              for g in layout.groups)
  return [("all-gather", 4 * n * words)]


def _stc_select(x, layout, ratio):
  """Per group: sorted positions ``[G, k]``, the values sent there
  (``mu sign(x)``, ``mu = mean|kept|``), ``mu`` and the sign bits.

  A selected zero (a leaf with fewer than k nonzeros) is sent at a padding
  position ``L + j`` past the leaf, which decodes to nothing: the paper's
  ``mu sign(0) = 0``. Where ``mu = 0`` every slot carries 0 and stays put
  (so at most ``k - 1`` pad, :func:`_padding`)."""
  groups = [(g.offset, g.count, g.leaf_size, num_selected(ratio, g.leaf_size))
            for g in layout.groups]
  out = []
  for g, (vals, idx) in zip(layout.groups,
                            _topk.topk_abs_groups(x, groups, order="any")):
    pos = idx - (g.offset + g.leaf_size * jnp.arange(g.count,
                                                     dtype=jnp.int32)[:, None])
    mu = jnp.mean(jnp.abs(vals), axis=-1, keepdims=True)
    pad = (vals == 0) & (mu > 0)
    pos = jnp.where(pad, g.leaf_size - 1 + jnp.cumsum(pad, axis=-1,
                                                      dtype=jnp.int32), pos)
    # Positions in increasing order, their values carried along (one sort).
    pos, vals = jax.lax.sort((pos, vals), dimension=-1, num_keys=1)
    out.append((pos, mu * jnp.sign(vals), mu[:, 0], vals < 0))
  return out


def _sbc_select(x, layout, ratio):
  """Per group: the positions of the k largest values or of the k most
  negative ones, whichever group has the larger mean magnitude, and the
  signed mean sent for all of them."""
  out = []
  for g, rows in zip(layout.groups, layout.views(x)):
    k = num_selected(ratio, g.leaf_size)
    pos_v, pos_i = jax.lax.top_k(rows, k)
    neg_v, neg_i = jax.lax.top_k(-rows, k)
    mu_pos = jnp.mean(pos_v, axis=-1)
    mu_neg = jnp.mean(neg_v, axis=-1)
    positive = mu_pos >= mu_neg
    idx = jnp.where(positive[:, None], pos_i, neg_i)
    mu = jnp.where(positive, mu_pos, -mu_neg)
    pos = jnp.sort(idx, axis=-1)
    out.append((pos, jnp.broadcast_to(mu[:, None], pos.shape), mu, None))
  return out


def _scatter(layout, pos, vals, lead=()):
  """Dense ``[size]`` bucket from per-group ``pos``/``vals`` ``[..., G, k]``
  (leading axes summed)."""
  flat_idx, flat_val = [], []
  for g, p, v in zip(layout.groups, pos, vals):
    base = g.offset + g.leaf_size * jnp.arange(g.count, dtype=jnp.int32)
    # A padding position (value 0) adds nothing to its leaf's last entry.
    p = jnp.minimum(p, g.leaf_size - 1)
    flat_idx.append((p + base[:, None]).reshape(-1))
    flat_val.append(v.reshape(-1))
  idx = jnp.concatenate(flat_idx)
  return _core.zeros_after(layout.size, idx).at[idx].add(
    jnp.concatenate(flat_val))


def _encode(layout, sel, ratio, signs):
  """This device's message: per group ``[G, words]``, flattened and
  concatenated."""
  coded = _golomb.encode_many(
    [s[0] for s in sel], [g.leaf_size for g in layout.groups],
    [_padding(s[0].shape[-1], signs) for s in sel])
  rows = [jnp.concatenate([neg, bits], axis=-1) if signs else bits
          for bits, (_, _, _, neg) in zip(coded, sel)]
  parts = []
  for packed, (_, _, mu, _) in zip(_pack_rows(rows), sel):
    words = jnp.concatenate(
      [_core.to_words(mu.astype(jnp.float32))[:, None], packed], axis=-1)
    parts.append(words.reshape(-1))
  return jnp.concatenate(parts)


def _pack_rows(rows: list) -> list:
  """``[pack_bits(r) for r in rows]`` (each ``bool[..., B_i]``) as one
  packing of every row, each padded to whole words."""
  flat, shapes = [], []
  for r in rows:
    w = -(-r.shape[-1] // 32)
    pad = [(0, 0)] * (r.ndim - 1) + [(0, 32 * w - r.shape[-1])]
    flat.append(jnp.pad(r, pad).reshape(-1))
    shapes.append(r.shape[:-1] + (w,))
  words = _golomb.pack_bits(jnp.concatenate(flat))
  out, off = [], 0
  for shape in shapes:
    size = math.prod(shape)
    out.append(words[off:off + size].reshape(shape))
    off += size
  return out


def _decode(layout, words, ratio, signs):
  """Messages ``uint32[m, W]`` -> per group (positions, values)
  ``[m, G, k]``."""
  m = words.shape[0]
  parts, mus, off = [], [], 0
  for g in layout.groups:
    k = num_selected(ratio, g.leaf_size)
    w = _row_words(k, g.leaf_size, signs)
    part = words[:, off:off + g.count * w].reshape(m, g.count, w)
    off += g.count * w
    mus.append(_core.from_words(part[..., 0], jnp.float32))
    parts.append(part[..., 1:])
  # Every row's bits in one unpacking, then cut per group.
  every = _golomb.unpack_bits(
    jnp.concatenate([p.reshape(-1) for p in parts]), 32 * sum(
      p.size for p in parts))
  codes, ks, val_all, off = [], [], [], 0
  for g, part, mu in zip(layout.groups, parts, mus):
    k = num_selected(ratio, g.leaf_size)
    nbits = _pos_bits(k, g.leaf_size, signs)
    size = 32 * part.size
    bits = every[off:off + size].reshape(part.shape[:-1] + (-1,))[
      ..., :nbits]
    off += size
    if signs:
      neg, bits = bits[..., :k], bits[..., k:]
      vals = jnp.where(neg, -mu[..., None], mu[..., None])
    else:
      vals = jnp.broadcast_to(mu[..., None], (m, g.count, k))
    codes.append(bits)
    ks.append(k)
    val_all.append(vals)
  pos_all = _golomb.decode_many(codes, ks,
                                [g.leaf_size for g in layout.groups])
  # Padding positions (STC's selected zeros) carry nothing.
  val_all = [jnp.where(p < g.leaf_size, v, 0.0)
             for g, p, v in zip(layout.groups, pos_all, val_all)]
  return pos_all, val_all


# Each variant's selection (STC's message also carries the signs).
_SELECT = {"stc": _stc_select, "sbc": _sbc_select}


@dataclasses.dataclass(frozen=True)
class TernaryCodec(_codec.CodecBase):
  """STC or SBC: each leaf's k selected positions Golomb-coded, their
  values replaced by one mean per leaf (STC: with one sign bit each), one
  all-gather of every device's message.

  Attributes:
    variant: ``"stc"`` (top-k by ``|x|``, signs times the mean magnitude)
      or ``"sbc"`` (top-k of one sign, one signed mean).
    ratio: fraction of each leaf's coordinates kept, in ``(0, 1]``.
  """

  variant: str
  ratio: float

  def __post_init__(self):
    _checks.choice("variant", self.variant, tuple(_SELECT))

  @property
  def name(self):
    return f"{self.variant}({self.ratio})"

  @property
  def _signs(self) -> bool:
    return self.variant == "stc"

  def check_layouts(self, layouts):
    _checks.selects_one("ratio", self.ratio,
                        [s for lay in layouts for s in lay.sizes],
                        self.variant)

  def _local(self, x, layout):
    sel = _SELECT[self.variant](x, layout, self.ratio)
    sent = _scatter(layout, [s[0] for s in sel], [s[1] for s in sel])
    return sel, sent

  def apply(self, x, state, ctx):
    sel, sent = self._local(x, ctx.layout)
    words = _core.all_gather(_encode(ctx.layout, sel, self.ratio,
                                     self._signs), ctx.axis_name)
    pos, vals = _decode(ctx.layout, words, self.ratio, self._signs)
    total = _scatter(ctx.layout, pos, vals)
    return _codec.CodecResult(mean=total / ctx.num_devices, sent=sent,
                              state=state)

  def wire(self, layout, n):
    return _wire(layout, n, self.ratio, self._signs)

  def message(self, x, ctx):
    sel, sent = self._local(x, ctx.layout)
    return _encode(ctx.layout, sel, self.ratio, self._signs), sent

  def decode(self, words, ctx):
    pos, vals = _decode(ctx.layout, words[None], self.ratio, self._signs)
    return _scatter(ctx.layout, pos, vals)


@_registry.method(
    gap=(
      "top-k 1% as signs times one mean: as top-k, plus the signs' "
      "rounding"),
    paper="Sattler et al. 2019 (STC)",
    summary="top-k signs x mean |kept|, Golomb-coded positions, EF",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def stc(ratio: float, *, axis_name="data", error_feedback: bool = True,
        policy=None, seed: int = 0, **options):
  """Sparse ternary compression: top-k, each kept value sign times a mean.

  Top-k, then every kept value replaced by its sign times the mean
  magnitude of the kept values.

  .. math::
    x_i = g_i + e_i, \\quad \\mu_i = \\frac{1}{k} \\sum_{j \\in T_i}
    |x_{ij}|, \\quad s_{ij} = \\mu_i \\, \\mathrm{sign}(x_{ij}) \\,
    \\mathbb{1}[j \\in T_i], \\quad e_i \\leftarrow x_i - s_i

  with ``T_i`` the ``k = max(1, ceil(ratio * L))`` entries of largest
  magnitude of each leaf (ties: lower index first); a kept zero (a leaf
  with fewer than ``k`` nonzeros) sends 0, at a padding position past the
  leaf that the decoder drops. A leaf's message is
  ``mu`` (float32), ``k`` sign bits and the positions Golomb-coded
  (``jaxcomm/collectives/_golomb.py``: about ``log2(1/ratio) + 2`` bits
  each), one all-gather of every device's message; the update is the mean
  of the decoded messages. Sattler et al. also compress the downstream
  (server -> client) update; in an all-gather there is none.

  Args:
    ratio: fraction of each leaf's coordinates kept, in ``(0, 1]``
      (static); one below ``1 / L`` for every leaf is refused at init.
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent (the paper's residual).
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused by STC itself).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), or an ``axis_name``, ``error_feedback``, ``policy`` or
      option that :func:`jaxcomm.compressed` refuses. ``tx.init`` raises
      one when ``ratio`` keeps fewer than one element of every compressed
      leaf.

  Examples:
    ``k = 2`` of 8 values: device ``i`` (1 to 8) has the gradient ``i *
    [4, -2, 1, 0, ...]``. It keeps ``4i, -2i`` and sends ``mu = 3i`` with
    their signs; the update is the mean, and device 8's residual keeps
    ``32 - 24``, ``-16 + 24`` and the unsent ``8``:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.stc(0.25, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array(
    ...   [4.0, -2, 1, 0, 0, 0, 0, 0])
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(update).round(3))
    [ 13.5 -13.5   0.    0.    0.    0.    0.    0. ]
    >>> print(np.asarray(residual[7]).round(3))
    [8. 8. 8. 0. 0. 0. 0. 0.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.stc(0.01), optax.sgd(0.1))

  References:
    Sattler et al, `Robust and Communication-Efficient Federated Learning
    from Non-IID Data <https://arxiv.org/abs/1903.02891>`_, 2019.
  """
  ratio = _checks.ratio("ratio", ratio)
  return _compressor.compressed(
    TernaryCodec("stc", ratio), axis_name=axis_name,
    error_feedback=error_feedback, policy=policy, seed=seed, **options)


@_registry.method(
    gap=(
      "top-k 1% of one sign, one mean: as top-k, plus the other sign's "
      "delay"),
    paper="Sattler et al. 2018 (SBC)",
    summary="top-k of one sign, one mean, Golomb-coded positions, EF",
    defaults={"ratio": 0.01},
    static=("ratio",))
@_compressor.shared_options
def sbc(ratio: float, *, axis_name="data", error_feedback: bool = True,
        policy=None, seed: int = 0, **options):
  """Sparse binary compression: k values of one sign, sent as their mean.

  The k largest and the k most negative values are compared by their
  mean magnitudes; only the larger group is sent, every value replaced
  by its mean.

  .. math::
    \\mu^+ = \\frac{1}{k} \\sum \\mathrm{top}_k(x), \\quad
    \\mu^- = \\frac{1}{k} \\sum \\mathrm{top}_k(-x), \\quad
    s = \\begin{cases} \\mu^+ \\, \\mathbb{1}_{\\mathrm{top}_k(x)} &
    \\mu^+ \\geq \\mu^- \\\\ -\\mu^- \\, \\mathbb{1}_{\\mathrm{top}_k(-x)}
    & \\text{otherwise} \\end{cases}

  per leaf, ``k = max(1, ceil(ratio * L))`` (ties: lower index first). A
  leaf's message is the signed mean (float32) and the ``k`` positions
  Golomb-coded: no value bits at all. With error feedback (the paper's
  residual accumulation) what was not sent, including the whole other sign,
  waits for a later step.

  Args:
    ratio: fraction of each leaf's coordinates kept, in ``(0, 1]``
      (static); one below ``1 / L`` for every leaf is refused at init.
    axis_name: the data axis (a name, a tuple of names, or None).
    error_feedback: keep what was not sent.
    policy: a :class:`jaxcomm.LeafPolicy`.
    seed: seed of the state's PRNG key (unused by SBC itself).
    **options: ``start_step``, ``clip_norm``, ``momentum``,
      ``momentum_masking``, ``lr_schedule``, ``residual_decay`` and
      ``shift_rate``, the options every compressor takes, forwarded to
      :func:`jaxcomm.compressed` (``shift_rate``, DIANA's, is refused:
      the message is biased).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.CompressState` (with error feedback, its residual
    holds what each device has not sent yet).

  Raises:
    ValueError: naming the argument, for a ``ratio`` outside ``(0, 1]``
      (or traced), or an ``axis_name``, ``error_feedback``, ``policy`` or
      option that :func:`jaxcomm.compressed` refuses. ``tx.init`` raises
      one when ``ratio`` keeps fewer than one element of every compressed
      leaf.

  Examples:
    ``k = 2`` of 8 values: device ``i`` (1 to 8) has the gradient ``i *
    [4, 2, -1, -3, 0, ...]``. Its two largest average ``3i``, its two most
    negative ``-2i``: the positive pair wins and both travel as ``3i``.
    Device 8's residual keeps ``32 - 24``, ``16 - 24`` and the whole
    negative side:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()       # 8 devices on "data"
    >>> tx = jaxcomm.sbc(0.25, policy=jaxcomm.LeafPolicy(min_size=1))
    >>> def step(g):                               # this device's [1, 8]
    ...   update, state = tx.update(g[0], tx.init(g[0]))
    ...   return update, state.residual[0][None]
    >>> grads = np.arange(1.0, 9.0)[:, None] * np.array(
    ...   [4.0, 2, -1, -3, 0, 0, 0, 0])
    >>> update, residual = jax.jit(jax.shard_map(
    ...   step, mesh=mesh, in_specs=P("data"),
    ...   out_specs=(P(), P("data"))))(grads)
    >>> print(np.asarray(update).round(3))
    [13.5 13.5  0.   0.   0.   0.   0.   0. ]
    >>> print(np.asarray(residual[7]).round(3))
    [  8.  -8.  -8. -24.   0.   0.   0.   0.]

    In training, an optimizer follows it:

    >>> opt = optax.chain(jaxcomm.sbc(0.01), optax.sgd(0.1))

  References:
    Sattler et al, `Sparse Binary Compression: Towards Distributed Deep
    Learning with minimal Communication <https://arxiv.org/abs/1805.08768>`_,
    2018.
  """
  ratio = _checks.ratio("ratio", ratio)
  return _compressor.compressed(
    TernaryCodec("sbc", ratio), axis_name=axis_name,
    error_feedback=error_feedback, policy=policy, seed=seed, **options)


__all__ = ["stc", "sbc"]
