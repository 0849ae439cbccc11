"""Pallas kernels for the hot loops of jaxcomm, each beside a jnp reference.

``bitpack``: sign packing, unpacking and the packed majority vote.
``topk``: top-k by magnitude (a Pallas kernel for small k, an exact
bracketed threshold search for large k), threshold selection and sampled
thresholds.

The names below dispatch between a Pallas kernel and a jnp path: every
dispatcher (``pack_signs``, ``unpack_signs``, ``vote``, ``topk_abs``,
``threshold_select``, and ``sampled_threshold``, whose top-k of the sample
follows ``topk_abs``) asks one function, :func:`mode`, and one table.

**The switch.** The environment variable ``JAXCOMM_KERNELS`` is read at trace
time, each time a dispatcher is traced:

* ``auto`` (the default, also when unset or empty): the path measured
  fastest for the backend and size, from the table below;
* ``always``: the kernel everywhere (interpreted on CPU, where Pallas has no
  compiled lowering);
* ``never``: the jnp path everywhere.

An explicit ``use_kernel=True`` / ``False`` argument wins over the variable.
Any other value raises ``ValueError``. A function that ``jax.jit`` already
traced and cached keeps the path it was traced with.

**The ``auto`` table** (backend x op -> path). GPU figures: one H100, 25M
float32, median time as a ratio to a jitted ``x + 0`` of the same array
(lower is faster).

===========  ================  ===========================================
backend      op                ``auto`` path, and the figure behind it
===========  ================  ===========================================
gpu          pack_signs        jnp ``pack_signs_reference``: 0.73-0.81x,
                               against the kernel's 1.46-1.55x and
                               ``jnp.packbits``'s 0.72-0.88x
gpu          unpack_signs      jnp reference: 0.71-0.82x, against the
                               kernel's 1.27-1.70x
gpu          vote              bit-sliced jnp: 0.55-0.65x; the kernel
                               measured 2.96x once and 0.55-0.62x in two
                               later runs (8 workers): a tie, jnp kept
gpu          topk_abs          the kernel for ``k <= 64``; ``lax.top_k``
                               for ``64 < k < 512``; the exact bracketed
                               threshold search
                               (``topk.topk_abs_bracketed``) from 512 where
                               it pays. Measured: the kernel 3.6x at k=16
                               against ``lax.top_k``'s 214x and the
                               bracketed 11.7x; at k=128 ``lax.top_k``
                               7.3x, bracketed 8.4x, the kernel 10.6x; at
                               k=1024 bracketed 4.2x, ``lax.top_k`` 6.6x,
                               the kernel 107x; at k=25,000 / 250,000
                               bracketed 3.4x / 3.6x against ``lax.top_k``
                               6.7x / 7.3x and ``torch.topk`` on the same
                               GPU 3.8x / 3.6x. The cuts (64, 512) lie
                               between measured sizes.
gpu          threshold_select  jnp (mask packed by jnp, then compaction):
                               not measured; its mask kernel is the
                               pack_signs kernel plus a compare, and that
                               kernel lost to jnp
tpu          pack_signs,       jnp. No TPU ran here; by the TPU compiler's
             unpack_signs      own estimate (v5e, 4M values, compile-only,
                               ``benchmarks/bench_kernels_tpu.py``) the
                               kernels are 205 us against jnp's 251 us
                               (pack) and 207 us against 205 us (unpack),
                               but each takes 64 MiB of temporaries for a
                               16 MiB input (its ``(words, 32)`` blocks
                               tiled to 128 lanes) where jnp takes none
tpu          vote              the kernel: 12.8 us against the bit-sliced
                               jnp's 36.2 us (compiler's estimate, v5e,
                               8 rows of 4M signs), no temporaries
tpu          threshold_select  jnp: 1510 us against the mask kernel's
                               2275 us (estimate)
tpu          topk_abs          the kernel for ``k <= 64`` (6.3 us at k=16,
                               8.2 us at k=64, against ``lax.top_k``'s
                               160 us and 16 MiB of temporaries:
                               estimate), ``lax.top_k`` above; with
                               ``JAXCOMM_TOPK_SEARCH=radix`` the radix
                               search from 16,384 entries (compiles in
                               0.5-0.8 s where ``lax.top_k`` of 32,768
                               takes 3.5 s; estimated slower at run time)
cpu          all               jnp: the fastest jnp path measured on CPU
                               (see :mod:`~jaxcomm.kernels.bitpack` and
                               :mod:`~jaxcomm.kernels.topk`)
other        all               jnp
===========  ================  ===========================================

**Inside ``jax.shard_map``** with ``check_vma=True``, every kernel's outputs
are typed varying over the mesh axes its inputs vary over (invariant inputs
give invariant outputs), in interpret mode too; see
``jaxcomm.kernels._dispatch``.
"""

from jaxcomm.kernels import bitpack
from jaxcomm.kernels import threshold
from jaxcomm.kernels import topk
from jaxcomm.kernels._dispatch import ENV_VAR
from jaxcomm.kernels._dispatch import mode
from jaxcomm.kernels.bitpack import count_votes
from jaxcomm.kernels.bitpack import pack_signs
from jaxcomm.kernels.bitpack import unpack_signs
from jaxcomm.kernels.bitpack import vote
from jaxcomm.kernels.topk import sampled_threshold
from jaxcomm.kernels.topk import threshold_select
from jaxcomm.kernels.topk import topk_abs

__all__ = [
  "ENV_VAR",
  "bitpack",
  "count_votes",
  "mode",
  "pack_signs",
  "sampled_threshold",
  "threshold_select",
  "topk",
  "topk_abs",
  "unpack_signs",
  "vote",
]
