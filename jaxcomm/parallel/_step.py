"""The data-parallel train step (:class:`DataParallel`) and what reads its
per-device params (:func:`synchronized`, :func:`consensus_distance`)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import _checks
from jaxcomm import _extra_args
from jaxcomm import _local_engine
from jaxcomm import _stages
from jaxcomm.collectives import _core
from jaxcomm.parallel import _layout
from jaxcomm.parallel import _placement
from jaxcomm.parallel import _shards


class DataParallel:
  """A jitted shard_map train step for any optax transformation.

  Params are replicated, the batch is split over the data axis, the
  optimizer state is laid out by :func:`state_layout`, and ``check_vma``
  stays on, so a transform that left devices disagreeing would fail to
  trace. Gradients are taken with respect to a device-varying view of the
  params: each device gets its *local* gradient and only ``tx`` decides what
  crosses the wire (differentiating through replicated params directly would
  let JAX insert its own dense psum).

  With a local-update optimizer (:func:`jaxcomm.local_sgd`,
  :func:`jaxcomm.adacomm`, :func:`jaxcomm.overlap_local_sgd`,
  :func:`jaxcomm.diloco`) params differ between devices between syncs:
  ``init`` returns them per device (a leading axis of size n sharded over
  the data axis, like per-device state; ``per_device_params`` is True), the
  step passes each device its own row and the loss as ``value``, and
  :meth:`synchronized` gives the model to evaluate or export.

  Mutable model state and randomness (BatchNorm statistics, dropout) are
  optional arguments of :meth:`step`: with ``model_state=`` the loss is
  called as ``loss_fn(params, batch, model_state=...)`` and returns
  ``(out, new_model_state)`` (``out`` is what it returns without:
  ``loss``, or ``(loss, aux)`` with ``has_aux``); the new state's floating
  leaves are averaged over the data axes (one fused all-reduce; BatchNorm's
  running statistics become the device mean) and ``step`` returns it as a
  fourth value. With ``rng=key`` the loss gets ``rng=`` this device's key,
  ``jax.random.fold_in(key, i)`` for its index ``i`` along the data axes,
  so dropout masks differ between devices; pass a new key each step (e.g.
  ``jax.random.fold_in(base, step)``) for them to differ between steps::

    def loss_fn(params, batch, model_state, rng):
      logits, new_state = apply(params, model_state, batch["x"], rng)
      return cross_entropy(logits, batch["y"]), new_state

    params, opt_state, metrics, model_state = dp.step(
      params, opt_state, batch, model_state=model_state,
      rng=jax.random.fold_in(key, t))

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``) on the device's local batch; ``model_state`` and ``rng``
      keyword arguments when :meth:`step` is given them (above). With Flax
      NNX, ``params`` is ``nnx.state(model, nnx.Param)`` (from
      ``graphdef, params = nnx.split(model, nnx.Param)``) and the loss
      calls ``nnx.merge(graphdef, params)``.
    tx: the optimizer.
    mesh: a mesh with an axis named ``axis_name``.
    axis_name: the data axis, or a tuple of them (e.g. ``("dcn", "ici")``
      on a pod: the batch is split over all of them, per-device state and
      params are laid out over all of them, and each compressor averages
      over the axes it was built with, so ``optax.chain(
      jaxcomm.mean_gradients(axis_name="ici"), jaxcomm.powersgd(2,
      axis_name="dcn"), ...)`` compresses only between slices).
    auto_axes: mesh axes left to the compiler (FSDP, tensor): the step is
      then manual over the data axes only, ``loss_fn`` sees whole
      (logical) arrays placed by ``NamedSharding`` over these axes (no
      collective written by hand), and ``tx`` runs on each device's own
      shards (:func:`update_on_shards`); every mesh axis must be a data
      axis or an auto axis. Default ``()``: block mode, every mesh axis
      manual, ``loss_fn`` on the device's blocks of params split over
      model axes.
    batch_axes: with ``auto_axes``, the axes the batch's leading axis is
      split over: the data axes, then some auto axes (default: all of
      them, as FSDP splits it; leave a tensor axis out to keep its devices
      on the same examples).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux leaves are
      averaged over devices.
    update_args: ``update_args(params, batch) -> dict``, run on each
      device's own batch, its items passed to ``tx.update`` as keyword
      arguments (``optax.chain`` hands them to every transformation that
      takes extra arguments): the batch statistic of
      :func:`jaxcomm.variance_sparsification` (``{"grad_variance": ...}``
      from its ``grad_and_variance``). Block mode only (a sharded step's
      update runs on shards the statistic is not cut to). A keyword that
      a jaxcomm method reads but no transformation of ``tx`` read (e.g.
      ``grad_variance`` with :func:`jaxcomm.topk` only) is refused at the
      first step; one that no jaxcomm method reads (another library's)
      is passed on with a warning when nothing jaxcomm's read it.
    donate: donate params and state buffers to the step.
    block: wait for the previous step's params and state before
      dispatching the next step. ``None`` (default): on a mesh of several
      CPU devices only. XLA's CPU collectives rendezvous every simulated
      device; with many steps queued (a loop that never reads a result)
      a device can reach a collective while the others still work through
      earlier steps on few cores, and XLA aborts the process after its
      collective timeout ("Termination timeout for all reduce ... 40
      seconds exceeded"). One step in flight keeps every wait within one
      step; the host still prepares the next batch meanwhile. ``False``
      dispatches freely (JAX's asynchronous default; then raise
      ``--xla_cpu_collective_timeout_seconds`` and
      ``--xla_cpu_collective_call_terminate_timeout_seconds`` in
      ``XLA_FLAGS`` before JAX starts, as train.py and the tests do);
      ``True`` blocks on any backend.

  Raises:
    ValueError: naming the argument: ``axis_name`` not an axis of
      ``mesh``, ``update_args`` not callable or given with ``auto_axes``,
      ``auto_axes`` or ``batch_axes`` that do not fit the mesh's axes,
      ``block`` not a bool; at the first :meth:`step`, when
      ``update_args`` does not return a dict, or gives a keyword (e.g.
      ``grad_variance``) that a jaxcomm method reads but no
      transformation of ``tx`` read.

  Examples:
    A least-squares fit on 8 devices, top-k (half of the 4 weights' gradient
    sent, the rest kept as each device's residual) before SGD; every step
    gets the 64-example batch split 8 per device:

    >>> import jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    >>> y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> mesh = jaxcomm.parallel.make_mesh()        # 8 devices on "data"
    >>> tx = optax.chain(
    ...   jaxcomm.topk(0.5, policy=jaxcomm.LeafPolicy(min_size=1)),
    ...   optax.sgd(0.1))
    >>> dp = jaxcomm.parallel.DataParallel(loss_fn, tx, mesh)
    >>> params, opt_state = dp.init({"w": jnp.zeros(4)})
    >>> opt_state[0].residual[0].shape             # a residual per device
    (8, 4)
    >>> for _ in range(60):
    ...   params, opt_state, metrics = dp.step(params, opt_state,
    ...                                        {"x": x, "y": y})
    >>> print(np.asarray(params["w"], np.float64).round(2))
    [ 1.  -2.   0.5  3. ]
    >>> float(metrics["loss"]) < 1e-4
    True
  """

  def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation,
               mesh, axis_name: str = "data", *, auto_axes=(),
               batch_axes=None, has_aux: bool = False, donate: bool = True,
               block: bool | None = None,
               update_args: Callable | None = None):
    _placement._data_size(mesh, axis_name)
    if update_args is not None and not callable(update_args):
      raise ValueError("update_args must be a callable (params, batch) -> "
                       f"dict, got {type(update_args).__name__}")
    if update_args is not None and auto_axes:
      raise ValueError(
        "update_args runs in block mode only: with auto_axes the update "
        "runs on each device's shards, which the statistic is not cut to")
    self.update_args = update_args
    self.auto_axes = (_shards.check_auto_axes(mesh, axis_name, auto_axes)
                      if auto_axes else ())
    names = _layout._names(axis_name)
    if batch_axes is None:
      batch_axes = names + self.auto_axes
    else:
      batch_axes = ((batch_axes,) if isinstance(batch_axes, str)
                    else tuple(batch_axes))
      if tuple(batch_axes[:len(names)]) != names or not set(
          batch_axes[len(names):]) <= set(self.auto_axes):
        raise ValueError(
          f"batch_axes={batch_axes!r}: must be the data axes {names} "
          f"followed by some of the auto axes {self.auto_axes}")
    self.batch_axes = batch_axes[0] if len(batch_axes) == 1 else batch_axes
    self.loss_fn = loss_fn
    self.tx = tx
    self.mesh = mesh
    self.axis_name = axis_name
    self.has_aux = has_aux
    self.donate = donate
    self.layout = None
    self.per_device_params = False
    self.param_specs = None
    self._steps = {}
    if block is not None:
      _checks.boolean("block", block)
    self.block = (block if block is not None else
                  self.num_devices > 1 and all(
                    d.platform == "cpu" for d in mesh.devices.flat))

  @property
  def num_devices(self) -> int:
    """The number of devices along the data axes."""
    return _placement._data_size(self.mesh, self.axis_name)

  def init(self, params):
    """Replicated params and the laid-out optimizer state.

    ``params`` may be abstract (``jax.ShapeDtypeStruct`` leaves, with a
    ``NamedSharding`` on ``mesh`` for a sharded model): then nothing is
    allocated, and the params and state come back abstract, each with the
    sharding the step takes, for :meth:`lower` to compile the step ahead
    of time, on any mesh (a compile-only TPU topology included:
    :mod:`jaxcomm.aot`).

    Args:
      params: the initial params (host or device arrays, placed with a
        ``NamedSharding`` over model axes for a sharded model; or
        ``jax.ShapeDtypeStruct`` leaves).

    Returns:
      ``(params, state)`` as the step takes them. Params are replicated
      over the data axes (per device, a leading axis of n rows, for a
      local-update optimizer) and the state laid out by
      :func:`state_layout` (:func:`init_state`).

    Raises:
      ValueError: when a params leaf is not floating (it has no gradient),
        params hold Flax NNX Variables other than ``nnx.Param``, abstract
        and concrete leaves are mixed, or the layout cannot be derived
        (:func:`state_layout`).
    """
    _layout._check_nnx_params(params, "DataParallel.init")
    if _is_abstract(params):
      return self._init_abstract(params)
    self._layout_for(params)
    state = _layout.init_state(self.tx, params, self.mesh, self.axis_name,
                               self.layout, specs=self.param_specs,
                               auto_axes=self.auto_axes)
    return jax.tree.map(self._place_initial, params,
                        self._param_shardings()), state

  def _layout_for(self, params):
    """Sets param_specs, per_device_params and layout for ``params``."""
    _check_differentiable(params)
    self.param_specs = _layout.param_specs(params, self.mesh, self.axis_name)
    block = jax.tree.map(
      lambda x, sp: jax.ShapeDtypeStruct(
        _layout._local_shape(np.shape(x), sp, self.mesh),
        jnp.result_type(x)), params, self.param_specs)
    self.per_device_params = _layout.local_params(self.tx, block)
    self.layout = _layout.state_layout(
      self.tx, params, self.mesh, self.axis_name,
      per_device_params=self.per_device_params, specs=self.param_specs,
      auto_axes=self.auto_axes)

  def _init_abstract(self, params):
    """:meth:`init` for abstract params: shapes, dtypes and shardings."""
    leaves = jax.tree.leaves(params)
    if not all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
      raise ValueError(
        "DataParallel.init: params mix abstract (jax.ShapeDtypeStruct) and "
        "concrete leaves; pass all of one kind")
    self._layout_for(params)
    specs, mesh, axis = self.param_specs, self.mesh, self.axis_name
    state = jax.eval_shape(
      lambda p: _layout.init_state(self.tx, p, mesh, axis, self.layout,
                                   specs=specs, auto_axes=self.auto_axes),
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                   params))
    state_specs = _layout.state_specs(self.layout, axis)
    state = jax.tree.map(
      lambda x, sp: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=NamedSharding(mesh, sp)),
      state, state_specs, is_leaf=lambda x: isinstance(x, P))
    n = self.num_devices
    lead = (n,) if self.per_device_params else ()
    params = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(lead + tuple(x.shape), x.dtype,
                                         sharding=sh),
      params, self._param_shardings())
    return params, state

  def abstract_batch(self, batch):
    """A batch's abstract inputs, for :meth:`lower` ahead of time.

    Args:
      batch: the global batch (arrays, or anything with a shape and a
        dtype).

    Returns:
      ``batch`` as ``jax.ShapeDtypeStruct`` leaves with the sharding
      :meth:`step` gives it (split over ``batch_axes``).
    """
    sharding = NamedSharding(self.mesh, P(self.batch_axes))
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x),
                                     sharding=sharding), batch)

  def _place_initial(self, x, sharding):
    """One params leaf as the step's input: per device (a leading axis of
    n rows) for a local-update optimizer, else as it is, placed by
    ``sharding``. A global array spanning other processes' devices (params
    sharded over a model axis across hosts) has no host view: it is placed
    by a jitted copy, shard by shard."""
    n = self.num_devices
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if self.per_device_params:
        return jax.jit(lambda v: jnp.broadcast_to(v[None], (n,) + v.shape),
                       out_shardings=sharding)(x)
      return jax.jit(lambda v: v, out_shardings=sharding)(x)
    host = np.asarray(jax.device_get(x))
    if self.per_device_params:
      host = np.broadcast_to(host[None], (n,) + host.shape)
    return _placement._global(host, sharding)

  def _param_shardings(self):
    wrap = ((lambda sp: _layout._with_data(sp, self.axis_name))
            if self.per_device_params else (lambda sp: sp))
    return jax.tree.map(lambda sp: NamedSharding(self.mesh, wrap(sp)),
                        self.param_specs,
                        is_leaf=lambda x: isinstance(x, P))

  def place_params(self, host_params):
    """Host params as this step's inputs.

    Call it after :meth:`init` (e.g. to start from a checkpoint).

    Args:
      host_params: params as host arrays, shaped as :meth:`init` returned
        them (with the leading axis of n rows for a local-update
        optimizer).

    Returns:
      The params as global arrays, split over model axes as given to
      :meth:`init`, and per device (a leading axis of size n over the data
      axis) for a local-update optimizer, else replicated over the data
      axis.
    """
    return jax.tree.map(_placement._global, host_params,
                        self._param_shardings())

  def synchronized(self, params):
    """The model to evaluate or export.

    Args:
      params: the params :meth:`step` returned.

    Returns:
      ``params`` themselves when they are replicated; with per-device
      params (local-update optimizers) their device average, replicated
      (exactly the common value when every device holds the same one, as
      right after a sync).
    """
    if not self.per_device_params:
      return params
    return synchronized(params, self.mesh, self.param_specs)

  def shard_batch(self, batch):
    """This process's slice of a batch as global arrays.

    Args:
      batch: this process's examples (the whole batch on one process),
        leading axis first (see :func:`shard_batch`).

    Returns:
      The batch as global arrays split over the data axes, and with
      ``auto_axes`` also over ``batch_axes`` inside each slice (as FSDP
      splits it).
    """
    return _placement.shard_batch(batch, self.mesh, self.batch_axes)

  def _build(self, with_state: bool, with_rng: bool):
    """The jitted shard_map step for this combination of optional inputs."""
    axis, layout = self.axis_name, self.layout
    per_device = self.per_device_params
    if self.auto_axes:
      # Manual over the data axes only: loss_fn on whole arrays, the
      # model axes left to the compiler, tx on each device's shards.
      update = _shards.update_on_shards(self.tx, layout, self.param_specs,
                                        axis, self.auto_axes, self.mesh)
      specs = _layout.state_specs(layout, axis, auto_axes=self.auto_axes)
      p_spec = P(axis) if per_device else P()
      manual = {"axis_names": set(_layout._names(axis))}
    else:
      update = functools.partial(_update_here, self.tx, layout, axis)
      specs = _layout.state_specs(layout, axis)
      p_spec = jax.tree.map(
        lambda sp: _layout._with_data(sp, axis) if per_device else sp,
        self.param_specs, is_leaf=lambda x: isinstance(x, P))
      manual = {}
    step = functools.partial(
      _device_step, self.loss_fn, update, axis,
      has_aux=self.has_aux, per_device=per_device, with_state=with_state,
      with_rng=with_rng, update_args=self.update_args)
    m_spec = P(axis) if per_device else P()
    extra_specs = (P(),) * (with_state + with_rng)
    mapped = jax.shard_map(
      step, mesh=self.mesh, in_specs=(p_spec, specs, P(axis)) + extra_specs,
      out_specs=(p_spec, specs, m_spec) + ((P(),) if with_state else ()),
      **manual)
    donated = (0, 1, 3) if with_state else (0, 1)
    return jax.jit(mapped, donate_argnums=donated if self.donate else ())

  def _prepare(self, params, state, batch, model_state, rng):
    """Checks the inputs and returns the built step and its arguments."""
    if self.layout is None:
      raise ValueError("call DataParallel.init(params) before step()")
    if model_state is not None and self.per_device_params:
      raise ValueError(
        "model_state is not supported with a local-update optimizer "
        "(per-device params): its steps send nothing between syncs, and "
        "model_state is averaged over the devices every step")
    _layout._check_state_tree(state, self.layout, "DataParallel.step")
    _check_not_donated(params=params, state=state, model_state=model_state)
    kind = (model_state is not None, rng is not None)
    if kind not in self._steps:
      self._steps[kind] = self._build(*kind)
    batch, model_state = self._place_inputs(batch, model_state)
    extra = tuple(x for x in (model_state, rng) if x is not None)
    return self._steps[kind], (params, state, batch) + extra

  def _place_inputs(self, batch, model_state):
    """Host (or single-device) batch and model state as global arrays:
    the batch split over the data axes, the model state replicated."""
    if _is_abstract(batch):
      batch = self.abstract_batch(batch) if any(
        getattr(x, "sharding", None) is None
        for x in jax.tree.leaves(batch)) else batch
      return batch, model_state
    if self.num_devices > 1:
      if not _on_mesh(batch):
        batch = self.shard_batch(batch)
      if model_state is not None and not _on_mesh(model_state):
        model_state = _placement.replicate(model_state, self.mesh)
    return batch, model_state

  def step(self, params, state, batch, *, model_state=None, rng=None):
    """One train step.

    Each device takes the gradient of ``loss_fn`` on its share of the
    batch, ``tx`` exchanges what it sends, and the updates are applied.

    Args:
      params: the params :meth:`init` (or the previous step) returned.
      state: the optimizer state, likewise.
      batch: the global batch, from :meth:`shard_batch`, or host arrays
        (sharded here); its leading axes are split over the data axes.
      model_state: mutable non-parameter model state (e.g. BatchNorm
        statistics, ``nnx.state(model, nnx.BatchStat)``), replicated;
        ``loss_fn`` gets it as ``model_state=`` and returns ``(out,
        new_model_state)``; the new state's floating leaves are averaged
        over the data axes, others must come out equal on every device.
      rng: a PRNG key for this step; ``loss_fn`` gets ``rng=
        jax.random.fold_in(rng, i)`` on the device of index ``i`` along the
        data axes.

    Returns:
      ``(params, state, metrics)``, plus the new model state as a fourth
      value when ``model_state`` is given. ``metrics`` holds ``"loss"``
      (and ``"aux"`` with ``has_aux``), device averages; with a
      local-update optimizer (``per_device_params``) they are per device
      (leading axis n), since those steps send nothing between syncs.

    Raises:
      ValueError: when :meth:`init` has not run, the state does not fit
        the layout, an input's buffers were donated to an earlier step,
        ``model_state`` is given with per-device params, or ``loss_fn``
        returns the wrong structure.
    """
    fn, args = self._prepare(params, state, batch, model_state, rng)
    if self.block:
      # The previous step's outputs: at most one step queued (see block).
      jax.block_until_ready((params, state, model_state))
    return fn(*args)

  def lower(self, params, state, batch, *, model_state=None, rng=None):
    """The lowered step, e.g. for :func:`jaxcomm.wire.report`.

    ``.compile()`` it for the compiled program. Takes concrete inputs or
    abstract ones (:meth:`init` of abstract params,
    :meth:`abstract_batch`): nothing is allocated then, and the mesh may
    be a compile-only topology.

    Args:
      params: the params, as for :meth:`step`.
      state: the optimizer state, as for :meth:`step`.
      batch: the batch, as for :meth:`step`.
      model_state: as for :meth:`step`.
      rng: as for :meth:`step`.

    Returns:
      The ``jax.stages.Lowered`` step.

    Raises:
      ValueError: as :meth:`step` does for its inputs.
    """
    fn, args = self._prepare(params, state, batch, model_state, rng)
    return fn.lower(*args)



def _check_differentiable(params) -> None:
  """Refuses params leaves that have no gradient (integers, booleans)."""
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    dtype = jnp.result_type(x)
    if not (jnp.issubdtype(dtype, jnp.floating)
            or jnp.issubdtype(dtype, jnp.complexfloating)):
      raise ValueError(
        f"params leaf {jax.tree_util.keystr(path)} is {dtype}: DataParallel "
        "differentiates every params leaf, and only floating (or complex) "
        "leaves have gradients; keep integer state (counters, indices) "
        "out of params, e.g. in the batch or closed over by loss_fn")


def _check_not_donated(**trees) -> None:
  """Names an input whose buffers an earlier step consumed."""
  for name, tree in trees.items():
    if any(isinstance(x, jax.Array) and x.is_deleted()
           for x in jax.tree.leaves(tree)):
      raise ValueError(
        f"{name} holds buffers donated to an earlier step (DataParallel "
        "donates params, state and model_state by default): pass the "
        "ones that step returned, or build DataParallel(..., "
        "donate=False)")


def _is_abstract(tree) -> bool:
  """Whether any leaf is a ``jax.ShapeDtypeStruct`` (ahead of time)."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _on_mesh(tree) -> bool:
  """Whether every leaf is already a global array over several devices."""
  return all(isinstance(x, jax.Array) and len(x.devices()) > 1
             for x in jax.tree.leaves(tree))


def _call_loss(loss_fn, params, batch, kwargs, *, with_state: bool,
               has_aux: bool):
  """``loss_fn`` on this device's batch: ``(loss, (aux, new_model_state))``
  (``aux`` ``{}`` without ``has_aux``, the state None without one)."""
  inside = dict(kwargs)
  if with_state:
    # Fresh nodes, made inside the differentiated function: a Flax NNX
    # Variable (BatchNorm's statistics) may be updated only at the trace
    # level that made it.
    inside["model_state"] = jax.tree.map(lambda x: x, kwargs["model_state"])
  out = loss_fn(params, batch, **inside)
  new_model_state = None
  if with_state:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise ValueError(
        "loss_fn: with model_state it must return (out, new_model_state), "
        "where out is the loss (or (loss, aux) with has_aux); got "
        f"{type(out).__name__}")
    out, new_model_state = out
  loss, aux = out if has_aux else (out, {})
  return loss, (aux, new_model_state)


def _update_here(tx, layout, axis, grads, state, params, **value):
  """Block mode's update: ``tx.update`` on the arrays this device holds
  (every mesh axis but the data axes ``axis`` splitting one model), the
  updates applied; state in and out as the step's in_specs give it."""
  local = _layout.to_local(state, layout)
  with _stages.one_model(axis):
    updates, new_local = tx.update(grads, local, params, **value)
  new_params = _local_engine.apply_updates(params, updates, new_local)
  return new_params, _layout.to_global(new_local, layout)


def _device_step(loss_fn, update, axis, params, state, batch, *extra,
                 has_aux: bool, per_device: bool, with_state: bool,
                 with_rng: bool, update_args=None):
  """One device's train step inside shard_map (see DataParallel): local
  gradient, ``update`` (``tx.update`` and the updates applied: here, or on
  each device's shards with auto axes), new params; ``extra`` holds the
  model state and the step's key when given."""
  if per_device:
    params = jax.tree.map(lambda x: x[0], params)
  kwargs = {}
  extra = list(extra)
  if with_state:
    kwargs["model_state"] = extra.pop(0)
  if with_rng:
    # This device's key: i along the data axes folded into the step's.
    kwargs["rng"] = jax.random.fold_in(extra.pop(0), _core.axis_index(axis))
  (loss, (aux, new_model_state)), grads = jax.value_and_grad(
    functools.partial(_call_loss, loss_fn, batch=batch, kwargs=kwargs,
                      with_state=with_state, has_aux=has_aux),
    has_aux=True)(_core.pvary(params, axis))
  value = {"value": loss} if per_device else {}
  if update_args is not None:
    # Params typed varying, as for the gradient above: a derivative taken
    # there is this device's own (with invariant params JAX sums it over
    # the data axes).
    more = update_args(_core.pvary(params, axis), batch)
    if not isinstance(more, dict) or not all(isinstance(k, str)
                                             for k in more):
      raise ValueError("update_args must return a dict of keyword "
                       f"arguments for tx.update, got {type(more).__name__}")
    value.update(more)
    # Optax offers each keyword to every transformation of tx: refuse one
    # that a jaxcomm method reads but none of tx read (dropped otherwise).
    with _extra_args.recording() as reads:
      new_params, new_state = update(grads, state, params, **value)
    _extra_args.check(more, reads)
  else:
    new_params, new_state = update(grads, state, params, **value)
  if per_device:
    new_params = jax.tree.map(lambda x: x[None], new_params)
  # Local-update steps send nothing between syncs, not even the loss:
  # their metrics stay per device (a leading axis of size n).
  reduce = ((lambda a: jnp.asarray(a)[None]) if per_device
            else (lambda a: jax.lax.pmean(a, axis)))
  metrics = {"loss": reduce(loss)}
  if has_aux:
    metrics["aux"] = jax.tree.map(reduce, aux)
  out = (new_params, new_state, metrics)
  if with_state:
    out += (_device_mean(new_model_state, axis),)
  return out

def _device_mean(tree, axis_name):
  """Inside shard_map: ``tree``'s floating leaves averaged over
  ``axis_name`` (those that vary over it, in one fused float32 psum,
  cast back), the other leaves as they are; a non-floating leaf that
  varies over ``axis_name`` is refused by name (its mean is not a value of
  its dtype)."""
  names = set(_layout._names(axis_name))
  paths, leaves = [], []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if names & _core.varying_axes(x):
      if not _core.is_inexact(x):
        raise ValueError(
          f"model_state leaf {jax.tree_util.keystr(path)} "
          f"({jnp.result_type(x)}) differs between devices after the step, "
          "and only floating leaves are averaged: keep it equal on every "
          "device (e.g. a counter that does not read the batch) or make it "
          "floating")
      paths.append(path)
      leaves.append(x)
  n = _core.axis_size(axis_name)
  summed = _core.fused_psum(leaves, axis_name)
  means = {jax.tree_util.keystr(p): (s / n).astype(x.dtype)
           for p, s, x in zip(paths, summed, leaves)}
  return jax.tree_util.tree_map_with_path(
    lambda p, x: means.get(jax.tree_util.keystr(p), x), tree)


def synchronized(params, mesh, specs=None):
  """Per-device params averaged over devices, replicated on ``mesh``.

  Args:
    params: per-device params, a leading device axis on every leaf.
    mesh: the mesh to place the result on.
    specs: the params' ``PartitionSpec`` tree over model axes (None:
      replicated everywhere).

  Returns:
    The device average of each leaf, replicated over the data axes (split
    over model axes as ``specs`` say); where every device holds the same
    value, that value exactly (a mean of equal floats may round).
  """
  rep = (NamedSharding(mesh, P()) if specs is None else jax.tree.map(
    lambda sp: NamedSharding(mesh, sp), specs,
    is_leaf=lambda x: isinstance(x, P)))

  def one(x):
    first = x[0]
    same = jnp.all(x == first[None])
    mean = jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype)
    return jnp.where(same, first, mean)

  return jax.jit(lambda p: jax.tree.map(one, p), out_shardings=rep)(params)


def consensus_distance(params) -> jax.Array:
  """How far decentralized or local training has let devices drift apart.

  Args:
    params: per-device params, a leading device axis on every leaf.

  Returns:
    ``max_i |x_i - mean_j x_j|`` over every element, a float32 scalar
    array (0 right after a sync).

  Examples:
    >>> import numpy as np, jaxcomm
    >>> rows = {"w": np.array([[1.0, 2.0], [3.0, 2.0]])}   # 2 devices
    >>> float(jaxcomm.parallel.consensus_distance(rows))
    1.0
  """
  def one(x):
    x = x.astype(jnp.float32)
    return jnp.max(jnp.abs(x - jnp.mean(x, axis=0, keepdims=True)))
  leaves = jax.tree.leaves(params)
  return jax.jit(lambda ls: jnp.max(jnp.stack([one(x) for x in ls])))(
    leaves) if leaves else jnp.zeros([], jnp.float32)
