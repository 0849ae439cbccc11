"""Sign bit packing and majority vote: Pallas kernels and jnp references.

Used by the sign compressors (signSGD with majority vote, 1-bit Adam/LAMB) to
put 32 signs in one ``uint32`` word before a collective, and to take the
majority over workers after an all-gather of packed words.

Conventions, shared by every function here:

* **Bit order.** Bit ``j`` (value ``1 << j``) of word ``i`` holds element
  ``32 * i + j``: the little-endian bit order of
  ``np.packbits(..., bitorder="little")`` read as little-endian ``uint32``.
* **Sign of zero.** Bit 1 means ``x >= 0``; so ``0.0`` and ``-0.0`` count as
  +1, and NaN (for which ``x >= 0`` is false) counts as -1.
* **Padding.** The ``32 * ceil(L / 32) - L`` bits past the end are 0.
* **Ties in the vote.** With ``n`` workers the majority bit is 1 iff
  ``2 * count >= n``, ``count`` being the workers whose bit is 1: the sign of
  the sum of the workers' +1/-1 values, with sign(0) = +1 as above. Ties only
  happen for even ``n`` and resolve to +1.

Each op comes three ways: ``*_reference`` (plain jnp, the definition),
``*_pallas`` (a ``pallas_call`` kernel blocked over words, keyword-only
``interpret``), and the public dispatcher (``pack_signs``, ``unpack_signs``,
``vote``). With ``use_kernel=None`` the dispatcher follows
``JAXCOMM_KERNELS`` (``auto`` by default: the jnp path on every backend, the
one measured fastest on CPU and on an H100; see
:mod:`jaxcomm.kernels` for the table and the figures);
``use_kernel=True`` forces the kernel (interpreted on CPU), ``False`` forces
jnp. Kernels are typed like their inputs inside ``jax.shard_map`` with
``check_vma=True`` (varying in, varying out).

Which jnp path is fastest on CPU was measured (``benchmarks/bench_kernels.py``,
25M float32 on a shared 2-core CPU host): the shift-and-OR reference beats a
``jnp.packbits`` based packer (which gives the same words) by 20-30%, so the
reference is the CPU packer; for unpacking, the shift-and-mask reference and a
``jnp.unpackbits`` path measured the same, and the reference is the CPU path.
For the vote, a bit-sliced counter (ripple-carry adders on whole words, then a
bitwise comparison with the static threshold; ``~2 log2(n)`` word ops per
worker instead of 32 per bit) measured 1.7x faster than the reference at 8
workers and 40x at 64, and is the CPU path. The same bit-sliced counter is
the body of the vote kernel.

Kernels and accelerators: the kernels use only ``pl.pallas_call`` with a grid
and block specs, integer shifts, compares and one-axis reductions, with
blocks that are powers of two and multiples of (8, 128) where TPU asks for
it. In JAX 0.10 a plain ``pl.pallas_call`` on GPU goes to Mosaic GPU, which
needs explicit layouts these portable kernels do not carry, so on GPU the
wrappers pass ``pallas.triton.CompilerParams()`` (the Triton lowering); on
TPU they lower through Mosaic. Both lowerings are checked on a CPU host in
``tests/test_kernels.py`` (the device-side compilation is not). The GPU
figures that set the default path come from one H100 run (quoted in
:mod:`jaxcomm.kernels`); nothing was timed on a TPU.

Inputs whose length is not a multiple of ``32 * block_words`` are padded in
the wrapper (one copy of the input); lengths that are multiples cost nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcomm.kernels import _dispatch

WORD_BITS = 32
_UNROLL_WORKERS = 64


# --------------------------------------------------------------------------
# Shared helpers (also used by jaxcomm.kernels.topk).
# --------------------------------------------------------------------------


def num_words(length: int) -> int:
  """Number of ``uint32`` words that hold ``length`` packed signs."""
  return -(-int(length) // WORD_BITS)


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _compiler_params(platform: str | None, interpret: bool):
  """Backend compiler params: Triton on GPU, Mosaic defaults elsewhere."""
  if interpret:
    return None
  platform = platform or _dispatch.platform()
  if platform in ("gpu", "cuda", "rocm"):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams()
  return None


def _as_int32(words: jax.Array) -> jax.Array:
  words = jnp.asarray(words)
  if words.dtype == jnp.int32:
    return words
  if words.dtype != jnp.uint32:
    raise TypeError(f"packed words must be uint32, got {words.dtype}")
  return lax.bitcast_convert_type(words, jnp.int32)


def _as_uint32(words: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(words, jnp.uint32)


def _tail_mask(length: int) -> int:
  """The valid bits of the last word, as a Python int."""
  rem = length % WORD_BITS
  return 0xFFFFFFFF if rem == 0 else (1 << rem) - 1


def _flat(x: jax.Array) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"expected a floating array, got {x.dtype}")
  return jnp.ravel(x)


# --------------------------------------------------------------------------
# pack_signs
# --------------------------------------------------------------------------


@jax.jit
def pack_signs_reference(x: jax.Array) -> jax.Array:
  """Packs the signs of ``x`` into ``uint32`` words (plain jnp).

  Args:
    x: a floating array of any shape, read flattened (length ``L``).

  Returns:
    ``uint32[ceil(L / 32)]``; bit ``j`` of word ``i`` is 1 iff
    ``x[32 * i + j] >= 0``; padding bits are 0.
  """
  x = _flat(x)
  length = x.shape[0]
  words = num_words(length)
  bits = (x >= 0).astype(jnp.uint32)
  bits = jnp.pad(bits, (0, words * WORD_BITS - length)).reshape(words,
                                                                WORD_BITS)
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
  return lax.reduce(bits << shifts, jnp.uint32(0), lax.bitwise_or, (1,))


@jax.jit
def pack_signs_packbits(x: jax.Array) -> jax.Array:
  """Same words as :func:`pack_signs_reference`, built on ``jnp.packbits``."""
  x = _flat(x)
  length = x.shape[0]
  words = num_words(length)
  u8 = jnp.packbits(x >= 0, bitorder="little")
  u8 = jnp.pad(u8, (0, 4 * words - u8.shape[0])).reshape(words, 4)
  u8 = u8.astype(jnp.uint32)
  return u8[:, 0] | (u8[:, 1] << 8) | (u8[:, 2] << 16) | (u8[:, 3] << 24)


def _pack_signs_kernel(x_ref, o_ref):
  x = x_ref[...]                                   # (block_words, 32)
  bits = (x >= 0).astype(jnp.int32)
  shifts = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  # The 32 shifted bits are distinct powers of two, so their int32 sum is
  # their OR (bit 31 wraps to the sign bit, which is what we want).
  o_ref[...] = jnp.sum(lax.shift_left(bits, shifts), axis=1, keepdims=True)


@functools.partial(
  jax.jit, static_argnames=("block_words", "interpret", "platform"))
def pack_signs_pallas(x: jax.Array, *, block_words: int = 1024,
                      interpret: bool = False,
                      platform: str | None = None) -> jax.Array:
  """Internal: the Pallas version of :func:`pack_signs_reference`.

  Args:
    x: a floating array of any shape, read flattened.
    block_words: words per grid step (rounded to a power of two >= 32).
    interpret: run the kernel in the Pallas interpreter (needed on CPU).
    platform: lowering target for the compiler params (default: the default
      backend); tests use it to lower for TPU/GPU on a CPU host.

  Returns:
    The packed ``uint32`` words, identical to the reference.
  """
  x = _flat(x)
  length = x.shape[0]
  words = num_words(length)
  bw = _next_pow2(min(max(block_words, 32), max(words, 32)))
  padded_words = -(-words // bw) * bw
  x = jnp.pad(x, (0, padded_words * WORD_BITS - length), constant_values=-1)
  out = _dispatch.pallas_call(
    _pack_signs_kernel,
    out_shape=jax.ShapeDtypeStruct((padded_words, 1), jnp.int32),
    grid=(padded_words // bw,),
    in_specs=[pl.BlockSpec((bw, WORD_BITS), lambda i: (i, 0))],
    out_specs=pl.BlockSpec((bw, 1), lambda i: (i, 0)),
    interpret=interpret,
    compiler_params=_compiler_params(platform, interpret),
    name="pack_signs",
  )(x.reshape(padded_words, WORD_BITS))
  return _as_uint32(out[:words, 0])


def pack_signs(x: jax.Array, *, interpret: bool = False,
               use_kernel: bool | None = None) -> jax.Array:
  """Packs the signs of a float array, 32 to a ``uint32`` word.

  .. math::
    w_i = \\sum_{j=0}^{31} [x_{32 i + j} \\ge 0] \\, 2^j

  Args:
    x: a floating array of any shape, read flattened (length ``L``).
    interpret: run the Pallas kernel in interpret mode.
    use_kernel: ``None`` (follow ``JAXCOMM_KERNELS``: ``auto``, the default,
      is jnp on every backend), ``True`` (always the kernel; interpreted on
      CPU) or ``False`` (always jnp).

  Returns:
    ``uint32[ceil(L / 32)]``: bit ``j`` of word ``i`` is 1 iff
    ``x[32 * i + j] >= 0`` (sign(0) = +1); padding bits are 0.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxcomm.kernels import bitpack
    >>> bitpack.pack_signs(jnp.array([1.0, -2.0, 0.0]))
    Array([5], dtype=uint32)
  """
  run_kernel, interpret = _dispatch.resolve("pack_signs", use_kernel,
                                            interpret)
  if run_kernel:
    return pack_signs_pallas(x, interpret=interpret)
  return pack_signs_reference(x)


# --------------------------------------------------------------------------
# unpack_signs
# --------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("length", "dtype"))
def unpack_signs_reference(words: jax.Array, length: int,
                           dtype=jnp.float32) -> jax.Array:
  """Unpacks ``uint32`` words into ``length`` values in {+1, -1} (plain jnp).

  Args:
    words: ``uint32[W]`` with ``W >= ceil(length / 32)``.
    length: number of signs to return (static).
    dtype: the floating dtype of the result.

  Returns:
    ``dtype[length]``: +1 where the bit is 1, -1 where it is 0.
  """
  words = _as_uint32(_as_int32(words))
  need = num_words(length)
  if words.ndim != 1 or words.shape[0] < need:
    raise ValueError(f"need uint32[{need}] words for length {length}, "
                     f"got shape {words.shape}")
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
  bits = (words[:need, None] >> shifts) & 1
  signs = jnp.where(bits == 1, 1, -1).astype(dtype)
  return signs.reshape(-1)[:length]


def _unpack_signs_kernel(w_ref, o_ref):
  w = w_ref[...]                                   # (block_words, 1) int32
  shifts = lax.broadcasted_iota(jnp.int32, o_ref.shape, 1)
  bits = lax.shift_right_logical(jnp.broadcast_to(w, o_ref.shape), shifts) & 1
  o_ref[...] = jnp.where(bits == 1, 1.0, -1.0).astype(o_ref.dtype)


@functools.partial(
  jax.jit,
  static_argnames=("length", "dtype", "block_words", "interpret", "platform"))
def unpack_signs_pallas(words: jax.Array, length: int, dtype=jnp.float32, *,
                        block_words: int = 1024, interpret: bool = False,
                        platform: str | None = None) -> jax.Array:
  """Internal: the Pallas version of :func:`unpack_signs_reference`.

  Same arguments, plus the kernel's own (``block_words``, ``interpret``,
  ``platform``); call :func:`unpack_signs`, which dispatches.
  """
  words = _as_int32(words)
  need = num_words(length)
  if words.ndim != 1 or words.shape[0] < need:
    raise ValueError(f"need uint32[{need}] words for length {length}, "
                     f"got shape {words.shape}")
  bw = _next_pow2(min(max(block_words, 32), max(need, 32)))
  padded_words = -(-need // bw) * bw
  words = jnp.pad(words[:need], (0, padded_words - need))
  out = _dispatch.pallas_call(
    _unpack_signs_kernel,
    out_shape=jax.ShapeDtypeStruct((padded_words, WORD_BITS), dtype),
    grid=(padded_words // bw,),
    in_specs=[pl.BlockSpec((bw, 1), lambda i: (i, 0))],
    out_specs=pl.BlockSpec((bw, WORD_BITS), lambda i: (i, 0)),
    interpret=interpret,
    compiler_params=_compiler_params(platform, interpret),
    name="unpack_signs",
  )(words.reshape(padded_words, 1))
  return out.reshape(-1)[:length]


def unpack_signs(words: jax.Array, length: int, dtype=jnp.float32, *,
                 interpret: bool = False,
                 use_kernel: bool | None = None) -> jax.Array:
  """Unpacks packed signs into ``length`` values in {+1, -1}.

  The inverse of :func:`pack_signs` up to the sign: ``unpack_signs(
  pack_signs(x), x.size)`` is ``where(x >= 0, 1, -1)``.

  Args:
    words: ``uint32[W]`` packed as by :func:`pack_signs`.
    length: number of signs (static).
    dtype: the floating dtype of the result.
    interpret: run the Pallas kernel in interpret mode.
    use_kernel: as in :func:`pack_signs`.

  Returns:
    ``dtype[length]`` of +1/-1.
  """
  run_kernel, interpret = _dispatch.resolve("unpack_signs", use_kernel,
                                            interpret)
  if run_kernel:
    return unpack_signs_pallas(words, length, dtype, interpret=interpret)
  return unpack_signs_reference(words, length, dtype)


# --------------------------------------------------------------------------
# vote
# --------------------------------------------------------------------------


def _check_votes(words: jax.Array, length: int) -> jax.Array:
  words = _as_int32(words)
  need = num_words(length)
  if words.ndim != 2 or words.shape[0] < 1 or words.shape[1] != need:
    raise ValueError(f"expected words of shape (n_workers, {need}) for "
                     f"length {length}, got {words.shape}")
  return words


def _mask_tail(voted: jax.Array, length: int) -> jax.Array:
  """Zeroes the padding bits of the last word (int32 words)."""
  mask = _tail_mask(length)
  if mask == 0xFFFFFFFF:
    return voted
  return voted.at[-1].set(voted[-1] & jnp.int32(mask))


@functools.partial(jax.jit, static_argnames=("length",))
def count_votes(words: jax.Array, length: int) -> jax.Array:
  """Per-element sum of the workers' +1/-1 signs.

  Args:
    words: ``uint32[n_workers, ceil(length / 32)]``, one packed row per worker.
    length: number of elements (static).

  Returns:
    The sum of the unpacked signs over workers, ``int32[length]``, each
    in ``[-n_workers, n_workers]`` (so ``vote`` is ``count_votes >= 0``).

  Raises:
    ValueError: when ``words`` is not ``(n_workers, ceil(length / 32))``.

  Examples:
    Three workers' signs of 4 elements, packed and counted:

    >>> import jax.numpy as jnp
    >>> from jaxcomm import kernels
    >>> signs = jnp.array([[1., -1., 1., 1.], [1., 1., -1., 1.],
    ...                    [-1., -1., -1., 1.]])
    >>> words = jnp.stack([kernels.pack_signs(r) for r in signs])
    >>> kernels.count_votes(words, 4).tolist()
    [1, -1, -1, 3]
  """
  words = _as_uint32(_check_votes(words, length))
  n = words.shape[0]
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
  bits = (words[:, :, None] >> shifts) & 1
  ones = jnp.sum(bits, axis=0, dtype=jnp.int32).reshape(-1)[:length]
  return 2 * ones - n


@functools.partial(jax.jit, static_argnames=("length",))
def vote_reference(words: jax.Array, length: int) -> jax.Array:
  """Majority vote over packed signs (plain jnp, unpack-count-repack).

  Args:
    words: ``uint32[n_workers, ceil(length / 32)]``.
    length: number of elements (static).

  Returns:
    ``uint32[ceil(length / 32)]``: bit 1 iff ``2 * count >= n_workers``
    (ties, possible for even ``n_workers``, give +1); padding bits 0.
  """
  words = _as_uint32(_check_votes(words, length))
  n = words.shape[0]
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
  bits = (words[:, :, None] >> shifts) & 1
  ones = jnp.sum(bits, axis=0, dtype=jnp.int32)            # (W, 32)
  majority = (2 * ones >= n).astype(jnp.uint32)
  voted = lax.reduce(majority << shifts, jnp.uint32(0), lax.bitwise_or, (1,))
  return _as_uint32(_mask_tail(_as_int32(voted), length))


def _bitsliced_majority(rows, n: int):
  """Majority bits of ``n`` int32 word rows, bit-sliced.

  ``rows`` is a callable ``r -> int32 array`` (all the same shape) or a
  sequence. Counts are kept as ``n.bit_length()`` bit planes and grown with a
  ripple-carry add per row; the result is ``count >= ceil(n / 2)`` evaluated
  with a bitwise comparator against the static threshold. Pure bitwise ops,
  so it runs the same in jnp and in a kernel.
  """
  get = rows if callable(rows) else rows.__getitem__
  planes_n = max(1, n.bit_length())
  first = get(0)
  zero = jnp.zeros_like(first)

  def add_row(r, planes):
    carry = get(r)
    out = []
    for p in planes:
      out.append(p ^ carry)
      carry = p & carry
    return tuple(out)

  planes = (first,) + (zero,) * (planes_n - 1)
  if n <= _UNROLL_WORKERS:
    # Unrolled, XLA fuses the whole count into one pass over the words.
    for r in range(1, n):
      planes = add_row(r, planes)
  else:
    planes = lax.fori_loop(1, n, add_row, planes)
  # count >= threshold, scanning bit planes from the most significant.
  threshold = (n + 1) // 2
  gt = zero
  eq = ~zero
  for b in reversed(range(planes_n)):
    if (threshold >> b) & 1:
      eq = eq & planes[b]
    else:
      gt = gt | (eq & planes[b])
      eq = eq & ~planes[b]
  return gt | eq


@functools.partial(jax.jit, static_argnames=("length",))
def vote_bitsliced(words: jax.Array, length: int) -> jax.Array:
  """Same result as :func:`vote_reference`, by bit-sliced counting (jnp)."""
  words = _check_votes(words, length)
  n = words.shape[0]
  voted = _bitsliced_majority(lambda r: words[r], n)
  return _as_uint32(_mask_tail(voted, length))


def _vote_kernel(w_ref, o_ref, *, n_workers):
  # w_ref: (padded_workers, block) int32; rows >= n_workers are padding.
  voted = _bitsliced_majority(
    lambda r: w_ref[pl.ds(r, 1), :], n_workers)
  o_ref[...] = voted


@functools.partial(
  jax.jit, static_argnames=("length", "block_words", "interpret", "platform"))
def vote_pallas(words: jax.Array, length: int, *, block_words: int = 1024,
                interpret: bool = False,
                platform: str | None = None) -> jax.Array:
  """Internal: the Pallas version of :func:`vote_reference`.

  Bit-sliced and lane-dense; call :func:`vote`, which dispatches.
  """
  words = _check_votes(words, length)
  n, w = words.shape
  rows = max(8, _next_pow2(n))
  bw = _next_pow2(min(max(block_words, 128), max(w, 128)))
  padded_words = -(-w // bw) * bw
  words = jnp.pad(words, ((0, rows - n), (0, padded_words - w)))
  out = _dispatch.pallas_call(
    functools.partial(_vote_kernel, n_workers=n),
    out_shape=jax.ShapeDtypeStruct((1, padded_words), jnp.int32),
    grid=(padded_words // bw,),
    in_specs=[pl.BlockSpec((rows, bw), lambda i: (0, i))],
    out_specs=pl.BlockSpec((1, bw), lambda i: (0, i)),
    interpret=interpret,
    compiler_params=_compiler_params(platform, interpret),
    name="vote_signs",
  )(words)
  return _as_uint32(_mask_tail(out[0, :w], length))


def vote(words: jax.Array, length: int, *, interpret: bool = False,
         use_kernel: bool | None = None) -> jax.Array:
  """Packed majority vote of ``n_workers`` packed sign vectors.

  .. math::
    \\mathrm{bit}_e = [\\textstyle\\sum_{w} s_{w,e} \\ge 0], \\quad
    s_{w,e} \\in \\{+1, -1\\}

  i.e. bit 1 iff at least ``ceil(n / 2)`` workers have bit 1; with an even
  number of workers a tie gives +1 (the same sign(0) = +1 rule as
  :func:`pack_signs`).

  Args:
    words: ``uint32[n_workers, ceil(length / 32)]``, e.g. the all-gather of
      every worker's :func:`pack_signs`.
    length: number of elements (static); padding bits of the result are 0.
    interpret: run the Pallas kernel in interpret mode.
    use_kernel: as in :func:`pack_signs`.

  Returns:
    ``uint32[ceil(length / 32)]``.

  References:
    Bernstein et al, `signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant <https://arxiv.org/abs/1810.05291>`_, 2019.
  """
  run_kernel, interpret = _dispatch.resolve("vote", use_kernel, interpret)
  if run_kernel:
    return vote_pallas(words, length, interpret=interpret)
  return vote_bitsliced(words, length)
