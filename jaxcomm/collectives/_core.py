"""Axis handling and the basic collectives every compressor is built from.

Every function here takes ``axis_name`` which may be ``None``: then there is
no mapped axis, the "collective" is the identity on one device, and the
compression math can be used (and tested) without shard_map.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxcomm import _buckets
from jaxcomm._vma import mark_varying
from jaxcomm._vma import varying_axes  # noqa: F401 (re-exported)

AxisName = str | tuple[str, ...] | None


def _names(axis_name: AxisName) -> tuple[str, ...]:
  if axis_name is None:
    return ()
  if isinstance(axis_name, str):
    return (axis_name,)
  return tuple(axis_name)


def check_axis(axis_name: AxisName, who: str = "jaxcomm", *,
               grads=None) -> int:
  """Returns the size of ``axis_name``; a clear error if it is not bound,
  or if ``grads`` were already summed over it.

  Args:
    axis_name: a mapped axis name, a tuple of them, or None (size 1).
    who: the caller, named in the error message.
    grads: the gradients the caller is about to average (optional); see
      :func:`check_local`.

  Raises:
    ValueError: when called where the axis is not bound (outside shard_map or
      pmap), saying which name was expected and how to bind it; or when
      ``grads`` are typed invariant over the axis (:func:`check_local`).
  """
  size = 1
  for name in _names(axis_name):
    try:
      size *= jax.lax.axis_size(name)
    except NameError as e:
      raise ValueError(
        f"{who}: axis_name={name!r} is not bound here. Call the transform "
        f"inside jax.shard_map over a mesh with an axis named {name!r} (for "
        "example through jaxcomm.parallel.DataParallel) or inside "
        f"jax.pmap(..., axis_name={name!r}); or pass axis_name=None to run "
        "the compression math on one device without any collective."
      ) from e
  if grads is not None:
    check_local(grads, axis_name, who)
  return size


def vma_typed(name: str) -> bool:
  """Whether values are typed by the mapped axes they vary over here:
  inside ``jax.shard_map`` with ``check_vma=True``. The device index is
  varying over its axis by definition, so it is typed varying exactly when
  the typing is on (``check_vma=False`` and ``jax.pmap`` type every value
  invariant; ``vmap`` axes are not manual)."""
  return name in varying_axes(jax.lax.axis_index(name))


# Non-empty while jaxcomm.parallel.state_layout traces its probe: a guessed
# layout may type a state leaf that later feeds a compressor (MultiSteps'
# accumulated gradients) replicated; the real step is checked.
_PROBING = []


@contextlib.contextmanager
def probing():
  """Turns :func:`check_local` off while a layout probe traces."""
  _PROBING.append(True)
  try:
    yield
  finally:
    _PROBING.pop()


def check_local(grads, axis_name: AxisName, who: str = "jaxcomm") -> None:
  """Refuses gradients that were already summed over ``axis_name``.

  Inside ``jax.shard_map`` with ``check_vma=True``, differentiating a loss
  of per-device data with respect to params replicated over the axis makes
  JAX psum the gradient (the transpose of the implicit ``pvary``): a dense
  all-reduce before any compression, and a gradient ``n`` times the mean.
  Such a gradient is typed invariant over the axis, where a device's own
  gradient is varying. Every floating leaf must vary over each data axis;
  one that does not (a leaf averaged on purpose, say) can be marked with
  :func:`pvary` (type only, no data moves), and the transform then
  averages equal values. Where values are not typed (``check_vma=False``,
  ``jax.pmap``, ``axis_name=None``) nothing is checked.

  Raises:
    ValueError: naming the axis and up to five invariant leaves.
  """
  if _PROBING:
    return
  for name in _names(axis_name):
    if not vma_typed(name):
      continue
    summed = [jax.tree_util.keystr(path) or "(root)"
              for path, g in jax.tree_util.tree_leaves_with_path(grads)
              if is_inexact(g) and name not in varying_axes(g)]
    if not summed:
      continue
    n = jax.lax.axis_size(name)
    more = f" and {len(summed) - 5} more" if len(summed) > 5 else ""
    raise ValueError(
      f"{who}: the gradients are already summed over axis {name!r}: "
      f"{', '.join(summed[:5])}{more} typed invariant over {name!r} inside "
      "jax.shard_map. JAX psums a gradient taken with respect to params "
      f"replicated over {name!r}: a dense all-reduce before any compression "
      f"and an update {n} times the mean. Differentiate with respect to "
      f"jaxcomm.collectives.pvary(params, {name!r}), e.g. "
      f"jax.grad(loss_fn)(jaxcomm.collectives.pvary(params, {name!r}), "
      "batch), so that each device gets its own gradient "
      "(jaxcomm.parallel.DataParallel does this); a leaf averaged on "
      "purpose can be marked with jaxcomm.collectives.pvary(grads, "
      f"{name!r}) before this transform.")


def is_inexact(x) -> bool:
  """A floating or complex leaf with elements (one that has a gradient)."""
  dtype = getattr(x, "dtype", None)
  return (dtype is not None and dtype != jax.dtypes.float0
          and bool(jnp.issubdtype(dtype, jnp.inexact))
          and int(getattr(x, "size", 1)) > 0)


def vector(x, name: str, kind, dtype, min_length: int = 0) -> jax.Array:
  """``x`` as a 1-D array of ``dtype``, after checking that it is 1-D, of
  ``kind`` (``jnp.floating`` or ``jnp.integer``) and at least
  ``min_length`` long; ValueError naming ``name`` otherwise."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, kind):
    what = "a floating" if kind is jnp.floating else "an integer"
    raise ValueError(f"{name} must be {what} array, got {x.dtype}")
  if x.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
  if x.shape[0] < min_length:
    raise ValueError(f"{name} must have at least {min_length} elements, "
                     f"got shape {x.shape}")
  return x.astype(dtype)


def axis_size(axis_name: AxisName) -> int:
  """Static number of devices along ``axis_name``.

  Args:
    axis_name: a mapped axis name, a tuple of them (their sizes
      multiply), or None.

  Returns:
    An int (1 when ``axis_name`` is None).
  """
  size = 1
  for name in _names(axis_name):
    size *= jax.lax.axis_size(name)
  return size


def axis_index(axis_name: AxisName) -> jax.Array:
  """This device's index along ``axis_name``.

  Args:
    axis_name: a mapped axis name, a tuple of them (the index over their
      product, the first major), or None.

  Returns:
    An int32 scalar array (0 when ``axis_name`` is None).
  """
  names = _names(axis_name)
  if not names:
    return jnp.zeros([], jnp.int32)
  if len(names) == 1:
    return jax.lax.axis_index(names[0]).astype(jnp.int32)
  return jax.lax.axis_index(names).astype(jnp.int32)


def psum(x, axis_name: AxisName):
  """Sum over devices; the result is replicated (invariant) everywhere.

  On TPU the sum runs on whole ``(8, 128)`` tiles of the flattened values
  (at most one tile of padding), which the compiler would otherwise pad
  in the array's own tiled layout.

  Args:
    x: an array or a pytree of arrays.
    axis_name: the axis (or axes) to sum over, or None (the identity).

  Returns:
    ``x`` summed over the devices of ``axis_name``, the same structure.

  Examples:
    Each of 8 devices holds its index; the sum is 28 on every device:

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> f = jax.shard_map(
    ...   lambda x: jaxcomm.collectives.psum(x, "data"), mesh=mesh,
    ...   in_specs=P("data"), out_specs=P())
    >>> f(jnp.arange(8.0)).tolist()
    [28.0]
  """
  if axis_name is None:
    return x
  from jaxcomm.kernels import _dispatch  # collectives load before kernels
  if _dispatch.platform() == "tpu":
    return jax.tree.map(lambda a: _dense_rows_psum(a, axis_name), x)
  return jax.lax.psum(x, axis_name)


def pmax(x, axis_name: AxisName):
  """Maximum over devices; the result is replicated.

  Args:
    x: an array or a pytree of arrays.
    axis_name: the axis (or axes) to take the maximum over, or None (the
      identity).

  Returns:
    The elementwise maximum of ``x`` over the devices, the same structure.
  """
  if axis_name is None:
    return x
  return jax.lax.pmax(x, axis_name)


def all_gather(x, axis_name: AxisName, *, axis: int = 0, tiled: bool = False):
  """All-gather whose result is typed as replicated (invariant).

  ``jax.lax.all_gather`` returns a value typed as varying over the axis even
  though every device holds the same data, which would stop a replicated
  update from leaving shard_map with ``out_specs=P()`` under ``check_vma``.
  The invariant all-gather moves the same bytes and keeps the type honest.
  Compiled for TPU, a minor dimension that is not a multiple of 128 lanes
  is padded for the exchange (the compiler would otherwise all-reduce the
  whole padded buffer) and stripped after.

  Args:
    x: this device's array.
    axis_name: the axis (or axes) to gather over, or None: then ``x`` with
      a new axis of size 1 at ``axis`` (``x`` itself when ``tiled``).
    axis: where the devices' axis goes in the result.
    tiled: concatenate along ``axis`` instead of stacking a new axis.

  Returns:
    Every device's ``x``, in device order, the same on every device. Its
    shape is ``x.shape`` with ``n`` inserted at ``axis`` (or
    ``x.shape[axis]`` multiplied by ``n`` when ``tiled``).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> f = jax.shard_map(
    ...   lambda x: jaxcomm.collectives.all_gather(x, "data", tiled=True),
    ...   mesh=mesh, in_specs=P("data"), out_specs=P())
    >>> f(jnp.arange(8.0) * 10).tolist()
    [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
  """
  if axis_name is None:
    return x if tiled else jnp.expand_dims(x, axis)
  names = _names(axis_name)
  name = names[0] if len(names) == 1 else names
  return _lane_dense_gather(
    lambda v, a, t: _gather_invariant(v, name, a, t), x, axis, tiled)


LANES = 128


def _lane_dense_gather(gather, x, axis: int, tiled: bool):
  """``gather(x, axis, tiled)``; compiled for TPU, with the minor dimension
  padded to a multiple of 128 lanes first and stripped after.

  The TPU compiler implements an all-gather across slices whose minor
  dimension is not a multiple of 128 as an all-reduce of the whole
  (padded) gathered buffer: a top-k message of 13,108 words on 2 slices
  crossed as ``u32[26,8,128]``, twice the bytes of the all-gather. The
  padding is at most 127 elements per device.
  """
  from jaxcomm.kernels import _dispatch  # collectives load before kernels
  x = jnp.asarray(x)
  if x.ndim == 0 or x.shape[-1] % LANES == 0 or \
      _dispatch.platform() != "tpu":
    return gather(x, axis, tiled)
  m = x.shape[-1]
  padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (-m) % LANES)])
  g = gather(padded, 0, False)[..., :m]          # [n, *x.shape]
  g = jnp.moveaxis(g, 0, axis)
  if not tiled:
    return g
  shape = list(x.shape)
  shape[axis] *= g.shape[axis]
  return g.reshape(shape)


# How the public ``jax.lax.all_gather`` spells an invariant result
# (``to="invarying"`` on JAX 0.10); the first spelling the running JAX
# accepts is kept.
_INVARIANT_SPELLINGS = ["invarying", "invariant"]


def _gather_invariant(x, name, axis: int, tiled: bool):
  error = None
  for to in list(_INVARIANT_SPELLINGS):
    try:
      out = jax.lax.all_gather(x, name, axis=axis, tiled=tiled, to=to)
    except (TypeError, ValueError) as e:
      if "to" not in str(e):
        raise
      error = e
      continue
    _INVARIANT_SPELLINGS[:] = [to]
    return out
  raise NotImplementedError(
    "this JAX's jax.lax.all_gather cannot return an invariant result "
    f"(tried to={_INVARIANT_SPELLINGS}): {error}")


def all_gather_varying(x, axis_name: AxisName, *, axis: int = 0,
                       tiled: bool = False):
  """Plain all-gather: the result is typed as varying over the axis.

  For a gathered value each device goes on to use differently (its own
  rows of it); see :func:`all_gather` for the replicated one.

  Args:
    x: this device's array.
    axis_name: the axis to gather over, or None: then ``x`` with a new
      axis of size 1 at ``axis`` (``x`` itself when ``tiled``).
    axis: where the devices' axis goes in the result.
    tiled: concatenate along ``axis`` instead of stacking a new axis.

  Returns:
    Every device's ``x``, in device order, as :func:`all_gather` gives
    it.
  """
  if axis_name is None:
    return x if tiled else jnp.expand_dims(x, axis)
  return _lane_dense_gather(
    lambda v, a, t: jax.lax.all_gather(v, axis_name, axis=a, tiled=t), x,
    axis, tiled)


def all_to_all(x, axis_name: AxisName, split_axis: int = 0,
               concat_axis: int = 0):
  """Tiled all-to-all: chunk ``i`` of ``split_axis`` goes to device ``i``.

  Args:
    x: this device's array; ``x.shape[split_axis]`` a multiple of the
      number of devices.
    axis_name: the axis to exchange over, or None (the identity).
    split_axis: the axis cut into one chunk per device.
    concat_axis: the axis the received chunks are concatenated along, in
      the order of the devices that sent them.

  Returns:
    This device's received chunks, concatenated (the same shape as ``x``
    when ``split_axis == concat_axis``).

  Examples:
    Device ``i`` holds ``[10 i, 10 i + 1, ..., 10 i + 7]``; after the
    exchange device ``j`` holds element ``j`` of every device's row:

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> f = jax.shard_map(
    ...   lambda x: jaxcomm.collectives.all_to_all(x[0], "data")[None],
    ...   mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> x = 10 * jnp.arange(8)[:, None] + jnp.arange(8)[None, :]
    >>> f(x)[1].tolist()
    [1, 11, 21, 31, 41, 51, 61, 71]
  """
  if axis_name is None:
    return x
  return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


def ppermute(x, axis_name: AxisName, perm: Sequence[tuple[int, int]]):
  """Collective permute: each pair ``(i, j)`` sends device i's ``x`` to j.

  Args:
    x: this device's array (or pytree of arrays).
    axis_name: the axis to permute over, or None (the identity).
    perm: ``(source, destination)`` index pairs along the axis; each
      index is a source at most once and a destination at most once. A
      device no pair sends to receives zeros.

  Returns:
    What this device received, the shape of ``x``.

  Examples:
    A ring shift: every device receives its left neighbour's index.

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> ring = [(i, (i + 1) % 8) for i in range(8)]
    >>> f = jax.shard_map(
    ...   lambda x: jaxcomm.collectives.ppermute(x, "data", ring),
    ...   mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> f(jnp.arange(8)).tolist()
    [7, 0, 1, 2, 3, 4, 5, 6]
  """
  if axis_name is None:
    return x
  return jax.lax.ppermute(x, axis_name, perm)


def pvary(x, axis_name: AxisName):
  """Marks a replicated value as varying over ``axis_name`` (no data moves).

  Inside ``jax.shard_map`` with ``check_vma=True``: differentiate a loss
  with respect to ``pvary(params, axis)`` to get each device's own
  gradient (with respect to replicated params JAX sums it over the axis),
  or mark a leaf averaged on purpose before a compressor.

  Args:
    x: an array or a pytree of arrays.
    axis_name: the axis (or axes) to type ``x`` varying over, or None
      (the identity).

  Returns:
    ``x`` itself, typed varying over ``axis_name``.
  """
  if axis_name is None:
    return x
  names = _names(axis_name)
  def one(a):
    return mark_varying(a, names)
  return jax.tree.map(one, x)


def zeros_after(size: int, after: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``jnp.zeros((size,), dtype)`` made from ``after`` (e.g. a scatter's
  indices): the dense buffer a scatter fills is not allocated before the
  scatter can run.

  XLA treats a broadcast of zeros as free to schedule anywhere, and on CPU
  it put the copy a scatter loop starts from at the top of the step: a
  dense buffer per scatter lived through the backward pass, the step's
  peak. Here the zero is ``|float(a) * 0|`` of ``a = after[0]`` (of
  ``a != a`` for a float ``after``): +0 for any value, and not folded by
  the compiler, which keeps float products by zero and float
  self-comparisons, so the buffer exists only once ``after`` does.
  ``lax.optimization_barrier`` did not hold: XLA removes it before it
  schedules.
  """
  if after.size == 0:
    return jnp.zeros((size,), dtype)
  first = after.reshape(-1)[0]
  if not jnp.issubdtype(first.dtype, jnp.integer):
    first = first != first
  zero = jnp.abs(first.astype(jnp.float32) * jnp.float32(0.0))
  return jnp.broadcast_to(zero.astype(dtype), (size,))


def after(x: jax.Array, dep: jax.Array) -> jax.Array:
  """``x``, computed only once the float array ``dep`` exists: ``x`` where
  ``dep``'s first value is a number, NaN where it is NaN (a NaN there
  makes the step non-finite anyway).

  XLA computes a value that depends only on the step's inputs (e.g. the
  params flattened into a buffer) as early as it can, and on CPU such a
  buffer lived through the backward pass, the step's peak. A select on a
  float self-comparison is not folded by the compiler, so this ties ``x``
  to ``dep``; ``lax.optimization_barrier`` did not hold (XLA removes it
  before it schedules).
  """
  if dep.size == 0:
    return x
  first = dep.reshape(-1)[0]
  return jnp.where(first != first, jnp.asarray(jnp.nan, x.dtype), x)


def fused_psum(leaves: Sequence[jax.Array], axis_name: AxisName,
               dtype=jnp.float32) -> list[jax.Array]:
  """One psum for many leaves (tensor fusion).

  The leaves are flattened, concatenated, summed in one collective and
  split back.

  Args:
    leaves: arrays of any shapes; cast to ``dtype`` for the exchange.
    axis_name: the axis to sum over, or None.
    dtype: the dtype on the wire.

  Returns:
    The summed leaves, in their shapes, in ``dtype``.
  """
  leaves = list(leaves)
  if not leaves:
    return []
  total = psum(_buckets.flatten(leaves, dtype), axis_name)
  return _buckets.unflatten(total, [l.shape for l in leaves])


def _dense_rows_psum(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """``psum(x)`` as whole (8, 128) tiles of its flattened values, for TPU
  (scalars and arrays under 128 values as they are).

  The TPU compiler sums an array in its tiled layout, and a flattened one
  in the layout of what it was flattened from: PowerSGD's ``P`` of ``(2,
  256, 2)`` (rank 2 in the minor dimension, tiled to 128 lanes) crossed
  the slices as ``f32[2,256,128]``, 64x its 4 KiB, and FetchSGD's sketch
  of 5 rows as 8. Summed as rows of 128 it crosses as ``f32[2,8,128]``
  (at most one tile of padding, 4 KiB).
  """
  x = jnp.asarray(x)
  if x.size < LANES:
    return jax.lax.psum(x, axis_name)
  rows, restore = _tile_rows(x)
  return restore(jax.lax.psum(rows, axis_name))


def _tile_rows(x: jax.Array):
  """``(rows, restore)``: ``x``'s flattened values as whole (8, 128) tiles
  of rows of 128, and the function that takes such rows back to ``x``'s
  shape."""
  flat = x.reshape(-1)
  size = flat.shape[0]
  # A tail of zeros (to whole tiles, or one more tile when already whole):
  # the concatenate keeps the compiler from moving the sum back above the
  # flattening, into the layout of the arrays flattened (an optimization
  # barrier instead did not: PowerSGD's factors then crossed as the
  # gradient). A whole tile, not one row of 128: a partial tile made the
  # compiler copy the operand once more and zero its padding, a gradient-
  # sized buffer where the sum is a bucket (1-bit Adam's dense warm-up,
  # block mode on two v6e slices: 1.88x -> 1.61x the plain step's memory;
  # LAG's sum 1.56x -> 1.29x).
  tail = (-size) % (8 * LANES) or 8 * LANES
  rows = jnp.pad(flat, (0, tail)).reshape(-1, LANES)
  return rows, lambda r: r.reshape(-1)[:size].reshape(x.shape)


def psum_layout(x: jax.Array):
  """``(laid_out, restore)``: ``x`` as :func:`psum` sums it on this
  platform (on TPU whole tiles of its values, see ``_dense_rows_psum``;
  elsewhere ``x`` itself), and the way back. For a psum inside a
  ``lax.cond``: with ``x`` laid out before the cond and restored after it
  (:func:`psum_laid_out` in the branch), the branch holds only the
  collective. LAG's cond on two v5e slices (sharded MLP): 1.83x the plain
  step's memory per chip with the padding and slicing inside the branch,
  1.31x outside."""
  from jaxcomm.kernels import _dispatch  # collectives load before kernels
  x = jnp.asarray(x)
  if _dispatch.platform() != "tpu" or x.size < LANES:
    return x, lambda r: r
  return _tile_rows(x)


def psum_laid_out(laid_out: jax.Array, axis_name: AxisName) -> jax.Array:
  """The sum over devices of :func:`psum_layout`'s array, as laid out."""
  if axis_name is None:
    return laid_out
  return jax.lax.psum(laid_out, axis_name)


def padded_length(size: int, n: int) -> int:
  """``size`` rounded up to a multiple of ``n``."""
  return -(-size // n) * n


# A packed vector's length is rounded up to a multiple of ALIGN_MIN (one
# 32-bit word of 1-bit codes) and, once it is long, of a larger power of two
# (at most ALIGN_MAX, at most 1/ALIGN_SHARE of the length in padding).
ALIGN_MIN, ALIGN_MAX, ALIGN_SHARE = 32, 32768, 64


def aligned_length(size: int) -> int:
  """``size`` rounded up to the alignment of packed vectors.

  A multiple of 32 (a word of 1-bit codes), and for long vectors of the
  largest power of two up to 32,768 that pads at most ``1/64`` of
  ``size``: a vector packed into fields of ``q`` words (:func:`pack_fields`)
  then has ``q`` a multiple of the TPU's 1-D tile (1,024 elements) for any
  code width, so that reshaping it between ``[L]``, ``[n, c]`` and ``[n,
  fields, q]`` is not a relayout. Otherwise the TPU compiler copies it
  through a loop into a buffer allocated ahead of time, and schedules that
  allocation early: on the 124M LM on two v5e slices int8's step held
  twenty such gradient-sized buffers at its peak, 1.62x the plain step's
  temporaries (``docs/benchmarks/tpu.md``). Short vectors (below 4,096
  elements) keep the multiple of 32.
  """
  align = ALIGN_MIN
  while align < ALIGN_MAX and 2 * align * ALIGN_SHARE <= size:
    align *= 2
  return padded_length(size, align)


def chunk_length(length: int, n: int) -> int:
  """Elements of a ``length``-vector each of ``n`` devices owns in a
  chunked (reduce-scatter style) exchange: ``ceil(length / n)``, aligned
  (:func:`aligned_length`)."""
  return aligned_length(-(-length // n))


def scatter_gather_sum(flat: jax.Array, axis_name: AxisName,
                       wire_dtype) -> jax.Array:
  """Sum of a flat vector over devices in a narrow dtype on the wire.

  The messages are ``wire_dtype``, the accumulation float32.

  Two phases, like a ring all-reduce: an all-to-all sends chunk ``j`` of
  every device's (cast) vector to device ``j``, which adds the ``n`` chunks
  in float32; an all-gather of the summed chunks (cast again) gives every
  device the whole sum. Each device sends ``2 (n-1)/n`` times the wire-dtype
  buffer, as a ring all-reduce in that dtype would, but the sum itself is
  never rounded to ``wire_dtype`` more than once, and no backend promotes
  the reduction to float32 behind our back (XLA's CPU backend does that to
  a bf16 all-reduce).

  Args:
    flat: 1-D float32 vector (the same length on every device).
    axis_name: the axis to sum over, or None.
    wire_dtype: dtype of both messages.

  Returns:
    The sum, a float32 vector of ``flat``'s length, identical on all
    devices.
  """
  if axis_name is None:
    return wire_cast(flat, wire_dtype).astype(jnp.float32)
  n = axis_size(axis_name)
  size = flat.shape[0]
  per_word = 4 // jnp.dtype(wire_dtype).itemsize
  chunk = padded_length(-(-size // n), per_word)
  x = wire_cast(jnp.pad(flat, (0, chunk * n - size)), wire_dtype)
  words = to_words(x.reshape(n, chunk))               # [n, chunk / per_word]
  got = from_words(all_to_all(words, axis_name, 0, 0), wire_dtype)
  mine = jnp.sum(got.astype(jnp.float32), axis=0)     # my chunk of the sum
  # Gathered flat (a gather along a new leading axis compiled for TPU
  # slices as an all-reduce of the whole gathered buffer: twice the bytes);
  # words unpack per chunk (fields are slices of the chunk they came from).
  out = all_gather(to_words(wire_cast(mine, wire_dtype)), axis_name,
                   tiled=True).reshape(n, -1)
  return from_words(out, wire_dtype).astype(jnp.float32).reshape(-1)[:size]


def wire_cast(x: jax.Array, dtype) -> jax.Array:
  """``x.astype(dtype)``, saturating at the largest finite value for the
  8-bit floats (E4M3FN has no infinity: an overflow would be NaN)."""
  if jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
    top = float(jnp.finfo(dtype).max)
    x = jnp.clip(x, -top, top)
  return x.astype(dtype)


def pack_fields(u: jax.Array, bits: int) -> jax.Array:
  """Packs ``bits``-bit codes into ``uint32`` words (lane-dense).

  ``uint32[..., m]`` codes become ``uint32[..., m * bits / 32]`` words,
  packed along a major direction. With ``per = 32 // bits`` fields to a
  word and ``q = m // per`` words, word ``i`` holds codes
  ``i, q + i, 2q + i, ...`` in fields ``0, 1, 2, ...``: each field is a
  contiguous slice of the last axis, so packing is ``per`` element-wise
  shifts and ORs of ``q``-long slices. Packing
  neighbours into one word (``reshape(..., q, per)``) puts ``per`` in the
  minor dimension, which the TPU compiler tiles to 128 lanes: 16x to 64x
  the memory (``u32[2,524544,2]`` took 512 MiB for 8 MiB of bf16).

  Args:
    u: ``uint32`` codes below ``2**bits``; the last axis a multiple of
      ``32 // bits``.
    bits: 1, 2, 4, 8, 16 or 32.

  Returns:
    ``uint32[..., m * bits / 32]``: the packed words.

  Raises:
    ValueError: when ``bits`` does not divide 32 or the last axis is not a
      multiple of ``32 // bits``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxcomm import collectives
    >>> codes = jnp.array([1, 2, 3, 0, 3, 3, 2, 1], jnp.uint32)
    >>> words = collectives.pack_fields(codes, 8)      # 4 codes a word
    >>> words.shape
    (2,)
    >>> collectives.unpack_fields(words, 8).tolist()
    [1, 2, 3, 0, 3, 3, 2, 1]
  """
  if bits not in (1, 2, 4, 8, 16, 32):
    raise ValueError(f"pack_fields: bits must divide 32, got {bits}")
  per = 32 // bits
  u = jnp.asarray(u, jnp.uint32)
  m = u.shape[-1]
  if m % per:
    raise ValueError(
      f"pack_fields: last axis {m} must be a multiple of {per}")
  if per == 1:
    return u
  q = m // per
  lead = u.shape[:-1]
  shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
  if q % LANES == 0:
    # (..., per, q / 128, 128): each field as rows of 128 lanes, the
    # layout of the flat vector the fields are cut from.
    rows = u.reshape(lead + (per, q // LANES, LANES))
    words = jnp.sum(rows << shifts[:, None, None], axis=-3, dtype=jnp.uint32)
    return words.reshape(lead + (q,))
  # (..., per, q): field j is row j; rows of q along the minor dimension.
  rows = u.reshape(lead + (per, q))
  # Disjoint bit fields: the sum is the bitwise OR.
  return jnp.sum(rows << shifts[:, None], axis=-2, dtype=jnp.uint32)


def unpack_fields(w: jax.Array, bits: int, m: int | None = None
                  ) -> jax.Array:
  """Inverse of :func:`pack_fields`.

  Args:
    w: ``uint32[..., q]`` words :func:`pack_fields` made.
    bits: the code width they were packed with.
    m: how many codes to return (None: all ``q * 32 / bits``).

  Returns:
    ``uint32[..., m]``: the codes.
  """
  per = 32 // bits
  if per == 1:
    return w if m is None else w[..., :m]
  mask = jnp.uint32((1 << bits) - 1)
  shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
  lead, q = w.shape[:-1], w.shape[-1]
  # A broadcast, shifts and a reshape: fused into the consumer on CPU (a
  # concatenate of the fields was a buffer of the codes: natural
  # compression's step 1.40x the plain FSDP step's memory at fsdp=2). As
  # in pack_fields, rows of 128 lanes where the words make whole rows.
  if q % LANES == 0:
    rows = w.reshape(lead + (1, q // LANES, LANES))
    out = ((rows >> shifts[:, None, None]) & mask).reshape(lead + (per * q,))
  else:
    out = ((w[..., None, :] >> shifts[:, None]) & mask).reshape(
      lead + (per * q,))
  return out if m is None else out[..., :m]


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def to_words(x: jax.Array) -> jax.Array:
  """Packs a narrow dtype into ``uint32`` words along the last axis.

  The values' bits are packed by :func:`pack_fields` (lane-dense on TPU).
  Collectives move words: XLA backends may widen a bf16/fp16/int8 collective
  to 32 bits (the CPU backend does), which would double or quadruple the
  bytes on the wire.

  Args:
    x: an array of a 1-, 2- or 4-byte dtype; its last axis a multiple of
      ``4 // itemsize``.

  Returns:
    ``uint32[..., x.shape[-1] * itemsize / 4]``: the same bytes as words.

  Raises:
    ValueError: when the last axis is not a multiple of ``4 // itemsize``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jaxcomm import collectives
    >>> x = jnp.array([1.5, -2.0, 0.25, 8.0], jnp.bfloat16)
    >>> words = collectives.to_words(x)
    >>> words.dtype, words.shape
    (dtype('uint32'), (2,))
    >>> collectives.from_words(words, jnp.bfloat16).tolist()
    [1.5, -2.0, 0.25, 8.0]
  """
  itemsize = jnp.dtype(x.dtype).itemsize
  if itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  per = 4 // itemsize
  if x.shape[-1] % per:
    raise ValueError(
      f"to_words: last axis {x.shape[-1]} must be a multiple of {per}")
  u = jax.lax.bitcast_convert_type(x, _UINT[itemsize]).astype(jnp.uint32)
  return pack_fields(u, 8 * itemsize)


def from_words(w: jax.Array, dtype) -> jax.Array:
  """Inverse of :func:`to_words`.

  Args:
    w: ``uint32`` words :func:`to_words` made.
    dtype: the dtype they were packed from.

  Returns:
    The values as ``dtype``, ``w.shape[-1] * 4 / itemsize`` along the
    last axis.
  """
  itemsize = jnp.dtype(dtype).itemsize
  if itemsize == 4:
    return jax.lax.bitcast_convert_type(w, dtype)
  u = unpack_fields(w, 8 * itemsize).astype(_UINT[itemsize])
  return jax.lax.bitcast_convert_type(u, dtype)
