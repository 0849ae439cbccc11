"""The one switch of the kernels, and ``pallas_call`` typed for shard_map.

:func:`mode` reads ``JAXCOMM_KERNELS``, :func:`auto_uses_kernel` is the
``auto`` table and :func:`resolve` combines them with a dispatcher's
``use_kernel`` argument; :func:`pallas_call` is the ``pl.pallas_call`` every
kernel here goes through. What they decide, the table and the figures behind
it are documented once, in :mod:`jaxcomm.kernels`.

Typing inside ``shard_map``: with ``check_vma=True`` every value inside
``jax.shard_map`` is typed with the mesh axes it varies over, and a
``pallas_call`` must say how its outputs vary. :func:`pallas_call` reads the
varying axes of the inputs from ``jax.typeof``, casts every input to their
union with ``jax.lax.pcast(..., to="varying")`` (a type-only cast, no data
moves) and types every output with that union through the
``manual_axis_type`` of its ``jax.ShapeDtypeStruct``: varying in, varying
out; invariant in, invariant out; outside ``shard_map`` nothing changes. In
interpret mode, JAX's default Pallas interpreter cannot run a kernel on
varying inputs (its grid loop, and any loop inside a kernel, are traced with
invariant types and then fail the loop's type check), so with varying inputs
the kernel is interpreted by Pallas' TPU interpreter
(``pltpu.InterpretParams()``), which handles them. Interpret mode exists for
tests on CPU; compiled kernels are not affected.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcomm._vma import mark_varying
from jaxcomm._vma import out_struct
from jaxcomm._vma import varying_axes

ENV_VAR = "JAXCOMM_KERNELS"
MODES = ("auto", "always", "never")
OPS = ("pack_signs", "unpack_signs", "vote", "topk_abs", "threshold_select")
ACCELERATORS = ("gpu", "tpu")
# auto: the top-k kernel for k up to this on GPU/TPU (jaxcomm.kernels).
TOPK_KERNEL_MAX_K = 64


def mode() -> str:
  """The kernel mode from ``JAXCOMM_KERNELS``: ``auto``, ``always``, ``never``.

  Read each time it is called (at trace time for the dispatchers); unset
  or empty means ``auto``.

  Returns:
    ``"auto"``, ``"always"`` or ``"never"``.

  Raises:
    ValueError: for any other value.

  Examples:
    >>> import os
    >>> from jaxcomm import kernels
    >>> saved = os.environ.pop(kernels.ENV_VAR, None)
    >>> kernels.mode()
    'auto'
    >>> os.environ[kernels.ENV_VAR] = "never"
    >>> kernels.mode()
    'never'
    >>> if saved is None:
    ...   del os.environ[kernels.ENV_VAR]
    ... else:
    ...   os.environ[kernels.ENV_VAR] = saved
  """
  return _choice(ENV_VAR, MODES)


def _choice(var: str, choices: tuple[str, ...]) -> str:
  """The value of environment variable ``var``, one of ``choices``
  (unset or empty: the first); a clear error naming ``var`` otherwise."""
  raw = os.environ.get(var, "")
  value = raw.strip().lower() or choices[0]
  if value not in choices:
    raise ValueError(
      f"{var} must be one of {', '.join(choices)} (unset means "
      f"{choices[0]}), got {raw!r}")
  return value


def auto_uses_kernel(op: str, backend: str, *, k: int | None = None) -> bool:
  """The ``auto`` choice for ``op`` on ``backend`` (the module's table)."""
  if op not in OPS:
    raise ValueError(f"unknown kernel op {op!r}; known: {', '.join(OPS)}")
  if op == "topk_abs" and backend in ACCELERATORS:
    return k is not None and int(k) <= TOPK_KERNEL_MAX_K
  # TPU, by the compiler's own estimate (compile-only, v5e, 4M values,
  # benchmarks/bench_kernels_tpu.py): the vote kernel 12.8 us against the
  # bit-sliced jnp's 36.2 us, no temporaries either way.
  return op == "vote" and backend == "tpu"


# auto on GPU: the bracketed top-k for k at least this (jaxcomm.kernels).
BRACKETED_TOPK_MIN_K = 512


def auto_bracketed_topk(backend: str, k: int | None = None) -> bool:
  """Whether the jnp top-k path is :func:`~jaxcomm.kernels.topk.
  topk_abs_bracketed` (where it pays) rather than ``lax.top_k``: on GPU
  for ``k >= 512`` (measured faster there from k=1024 on, slower at
  k=128; see :mod:`jaxcomm.kernels`); not on CPU, where ``lax.top_k``
  measured faster at ResNet-18 leaf sizes; not on TPU (unmeasured)."""
  return backend == "gpu" and (k is None or int(k) >= BRACKETED_TOPK_MIN_K)


# The top-k search on TPU: "sort" (lax.top_k, the default) or "radix".
TOPK_SEARCH_VAR = "JAXCOMM_TOPK_SEARCH"
TOPK_SEARCHES = ("sort", "radix")


def topk_search() -> str:
  """The TPU top-k search from ``JAXCOMM_TOPK_SEARCH``: ``sort`` (unset:
  ``lax.top_k``) or ``radix`` (:func:`~jaxcomm.kernels.topk.
  topk_abs_radix_segments` from ``topk.RADIX_TOPK_MIN_SIZE`` entries).

  ``radix`` compiles faster and, by the TPU compiler's own estimate,
  runs slower: on the TPU tier's ``mixed`` model (v5e, 2 slices,
  compile-only) top-k's step compiles in 9.5 s instead of 14.9 s, and the
  compiler estimates it at 3.1 ms a step instead of 0.37 ms, with 2.6 MiB
  more a chip (``benchmarks/bench_topk_compile.py``). No TPU has run
  either here.

  Raises:
    ValueError: naming the variable, for any other value.

  Example:
    >>> import os
    >>> from jaxcomm.kernels import _dispatch
    >>> saved = os.environ.pop(_dispatch.TOPK_SEARCH_VAR, None)
    >>> _dispatch.topk_search()
    'sort'
    >>> if saved is not None:
    ...   os.environ[_dispatch.TOPK_SEARCH_VAR] = saved
  """
  return _choice(TOPK_SEARCH_VAR, TOPK_SEARCHES)


def auto_radix_topk(backend: str, size: int) -> bool:
  """Whether the jnp top-k of ``size`` entries is the radix search
  (:func:`~jaxcomm.kernels.topk.topk_abs_radix_segments`) rather than
  ``lax.top_k``: on TPU under ``JAXCOMM_TOPK_SEARCH=radix``, from
  ``topk.RADIX_TOPK_MIN_SIZE`` entries (see
  :func:`topk_search` for what it trades); never on CPU or GPU, whose
  sorts compile quickly."""
  from jaxcomm.kernels import topk  # pylint: disable=import-outside-toplevel
  return (backend == "tpu" and topk_search() == "radix"
          and int(size) >= topk.RADIX_TOPK_MIN_SIZE)


def platform() -> str:
  """The platform the program being traced is compiled for.

  The devices of the mesh in context (inside ``jax.shard_map`` over a
  concrete mesh, under ``jax.set_mesh``, or in a nested shard_map over
  ``get_abstract_mesh()``): ``"tpu"`` when the step is compiled for a TPU
  topology on a host whose ``jax.default_backend()`` is ``"cpu"``
  (``jax.experimental.topologies``). Outside any mesh, the default
  backend.
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device",
                   None)
  name = getattr(device, "platform", None)
  if name in ("cuda", "rocm"):
    name = "gpu"
  return name or jax.default_backend()


def resolve(op: str, use_kernel: bool | None, interpret: bool, *,
            k: int | None = None) -> tuple[bool, bool]:
  """Returns ``(run_kernel, interpret)`` for ``op`` on the platform the
  step is compiled for (:func:`platform`).

  Args:
    op: one of :data:`OPS`.
    use_kernel: ``True`` / ``False`` force the path; ``None`` follows
      :func:`mode` (``auto`` asks :func:`auto_uses_kernel`).
    interpret: the caller's ``interpret``; forced on when a kernel runs on a
      backend without a Pallas lowering (CPU).
    k: the size the ``auto`` choice depends on (top-k's ``k``).
  """
  current = mode()            # validated even when use_kernel is explicit
  backend = platform()
  if use_kernel is None:
    if current == "always":
      use_kernel = True
    elif current == "never":
      use_kernel = False
    else:
      use_kernel = auto_uses_kernel(op, backend, k=k)
  elif op not in OPS:
    raise ValueError(f"unknown kernel op {op!r}; known: {', '.join(OPS)}")
  if use_kernel and backend not in ACCELERATORS:
    interpret = True
  return bool(use_kernel), bool(interpret)


# --------------------------------------------------------------------------
# pallas_call typed like its inputs inside shard_map
# --------------------------------------------------------------------------


def _is_struct(s) -> bool:
  return hasattr(s, "shape") and hasattr(s, "dtype")


def _varying_interpreter():
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.InterpretParams()


def pallas_call(kernel, *, out_shape, interpret: bool = False, **kwargs):
  """``pl.pallas_call`` whose outputs vary like its inputs (see module doc).

  Same arguments as ``pl.pallas_call``; ``out_shape`` entries need only
  ``.shape`` and ``.dtype``. Returns a function of the kernel's inputs.
  """
  def call(*args):
    args = [jnp.asarray(a) for a in args]
    axes = frozenset().union(*(varying_axes(a) for a in args))
    args = [mark_varying(a, axes) for a in args]
    shapes = jax.tree.map(lambda s: out_struct(s.shape, s.dtype, axes),
                          out_shape, is_leaf=_is_struct)
    interp = interpret
    if interpret and axes:
      interp = _varying_interpreter()
    return pl.pallas_call(kernel, out_shape=shapes, interpret=interp,
                          **kwargs)(*args)
  return call
