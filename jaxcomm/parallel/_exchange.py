"""One exchange per host: :func:`sharded_exchange`."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm import _buckets
from jaxcomm import _checks
from jaxcomm import _codec
from jaxcomm import _policy
from jaxcomm.collectives import _core


class ShardedExchangeState(NamedTuple):
  """State of :func:`sharded_exchange`.

  Attributes:
    inner: the inner compressor's state, for this device's share of the
      flattened gradient.
  """

  inner: optax.OptState


def exchange_share(params, fast_size: int) -> dict:
  """What :func:`sharded_exchange`'s compressor sees on each device.

  Args:
    params: the params (or gradients, or their shapes).
    fast_size: the number of devices along the fast axis.

  Returns:
    ``{"share": jax.ShapeDtypeStruct}``: one float32 vector of ``ceil(n /
    fast_size)`` values for ``n`` floating values in ``params`` (complex
    ones count twice), abstract, e.g. for :func:`jaxcomm.wire.claimed`.

  Raises:
    ValueError: when ``fast_size`` is not a positive int, or a leaf is not
      floating or complex.

  Examples:
    >>> import jax.numpy as jnp, jaxcomm
    >>> params = {"w": jnp.zeros(6), "b": jnp.zeros(3)}
    >>> jaxcomm.parallel.exchange_share(params, 4)["share"].shape
    (3,)
  """
  d = _checks.integer("fast_size", fast_size, 1)
  leaves = jax.tree.leaves(params)
  bad = [str(x.dtype) for x in leaves
         if not jnp.issubdtype(x.dtype, jnp.inexact)]
  if bad:
    raise ValueError("sharded_exchange: every gradient leaf must be "
                     f"floating or complex, got {bad}")
  # Complex leaves travel as (real, imaginary) pairs.
  n = sum(int(np.prod(_buckets.real_shape(x))) for x in leaves)
  return {"share": jax.ShapeDtypeStruct((-(-n // d),), jnp.float32)}


def sharded_exchange(compressor: optax.GradientTransformation,
                     fast_axis: str = "ici", *, fast_size: int
                     ) -> optax.GradientTransformation:
  """Runs ``compressor`` between hosts once per host, not once per device.

  In the pod recipe (``mean_gradients(axis_name="ici")`` then a compressor
  over "dcn") every device of a host exchanges the same averaged values
  between hosts: a host's link carries ``d`` copies for ``d`` devices, and
  each device compresses the whole gradient. Here the devices of a host
  split the work, as the 2D-torus all-reduce does (Mikami et al. 2018,
  "Massively Distributed SGD": reduce-scatter along one dimension,
  all-reduce along the other, all-gather back), with the compressor's
  exchange in the middle: the gradient is flattened (float32), averaged and
  scattered over ``fast_axis`` (one reduce-scatter: device ``j`` of ``d``
  gets the ``j``-th ``1/d`` of it, zero-padded to a multiple of ``d``), the
  compressor runs on that share between hosts, and the shares are gathered
  back over ``fast_axis`` (one all-gather). Each device's error feedback
  covers its own share.

  The compressor sees one flat vector (a single leaf, ``{"share": v}``,
  see :func:`exchange_share`), so methods defined per matrix lose their
  structure: a compressor that compresses some of ``params`` but would
  pass the share through dense (PowerSGD, which takes matrices only, or a
  leaf policy) is refused at ``init``. Elementwise and sparsifying
  compressors (cast, top-k, DGC, onebit, the quantizers) work, with
  top-k's ``k`` taken over each share; the dense mean works too.

  Args:
    compressor: a jaxcomm compressor whose ``axis_name`` is the slow axis
      (e.g. ``jaxcomm.topk(0.01, axis_name="dcn")``).
    fast_axis: the mesh axis inside a host.
    fast_size: its size, ``mesh.shape[fast_axis]`` (the state's shape
      depends on it, and ``init`` may run outside the mesh).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; all floating gradients
    come back as the mean update in their own shapes and dtypes.

  Raises:
    ValueError: when ``compressor`` is not a jaxcomm compressor,
      ``fast_axis`` is not one axis name or is the compressor's own axis,
      or ``fast_size`` is not a positive int; at ``init`` when the
      compressor would pass the share through dense; at ``update`` when
      ``fast_axis`` is not bound or has another size.

  Examples:
    Two slices of 4 devices (``make_pod_mesh``); the exact mean between
    slices (``mean_gradients`` over ``"dcn"``) as the compressor, so the
    update is the mean of the 8 devices' gradients 0 to 7. In training,
    pass ``axis_name=("dcn", "ici")`` to :class:`DataParallel` and chain
    an optimizer after it.

    >>> import jax, jax.numpy as jnp, jaxcomm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxcomm.parallel.make_pod_mesh(2)   # dcn=2 x ici=4
    >>> tx = jaxcomm.parallel.sharded_exchange(
    ...   jaxcomm.mean_gradients(axis_name="dcn"), "ici", fast_size=4)
    >>> def step(g):
    ...   update, _ = tx.update({"w": g[0]}, tx.init({"w": g[0]}))
    ...   return update["w"]
    >>> grads = jnp.arange(8.0)[:, None] * jnp.ones((8, 6))
    >>> jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(("dcn", "ici")),
    ...                       out_specs=P()))(grads).tolist()
    [3.5, 3.5, 3.5, 3.5, 3.5, 3.5]
  """
  spec = _codec.spec_of(compressor)
  if not isinstance(fast_axis, str):
    raise ValueError(f"fast_axis must be one mesh axis name, got "
                     f"{fast_axis!r}")
  d = _checks.integer("fast_size", fast_size, 1)
  slow = spec.axis_name
  if slow is None or fast_axis in _core._names(slow):
    raise ValueError(
      f"the compressor's axis_name={slow!r} must be the slow axis, other "
      f"than fast_axis={fast_axis!r}")

  def init_fn(params):
    share = exchange_share(params, d)
    # Sharding must not silently turn a compressing compressor dense.
    if (_policy.COMPRESS in spec.paths(params)
        and spec.paths(share) != [_policy.COMPRESS]):
      raise ValueError(
        f"sharded_exchange: {spec.codec.name} would not compress this "
        f"device's share (a vector of {share['share'].shape[0]} values): "
        "its leaf policy or the method itself (PowerSGD takes matrices "
        "only) passes it through dense. Use the compressor after "
        f"mean_gradients(axis_name={fast_axis!r}) instead")
    return ShardedExchangeState(compressor.init(
      jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), share)))

  def update_fn(updates, state, params=None, **extra):
    del params
    size = _core.check_axis(fast_axis, "sharded_exchange", grads=updates)
    if size != d:
      raise ValueError(f"sharded_exchange: fast_size={d} but axis "
                       f"{fast_axis!r} has {size} devices")
    share = exchange_share(updates, d)["share"].shape[0]
    leaves, treedef = jax.tree.flatten(updates)
    flat = _buckets.flatten_real(leaves)
    n = flat.shape[0]
    flat = jnp.pad(flat, (0, share * d - n))
    mine = jax.lax.psum_scatter(flat, fast_axis, tiled=True) / d
    out, inner = compressor.update({"share": mine}, state.inner, None,
                                   **extra)
    full = _core.all_gather(out["share"], fast_axis, tiled=True)[:n]
    return (treedef.unflatten(_buckets.unflatten_like(full, leaves)),
            ShardedExchangeState(inner))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
