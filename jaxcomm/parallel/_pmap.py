"""The same step through legacy ``jax.pmap``."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _local_engine
from jaxcomm.parallel._placement import _check_leading


def pmap_train_step(loss_fn: Callable, tx: optax.GradientTransformation,
                    axis_name: str = "data", *, has_aux: bool = False):
  """The same train step as :class:`DataParallel`, through ``jax.pmap``.

  Every input carries a leading device axis: params and state replicated
  with :func:`pmap_replicate`, the batch reshaped to ``(n, local, ...)``.
  Each device takes its local gradient, ``tx.update`` averages it (a
  local-update optimizer also gets the loss as ``value``), and the
  updates are applied.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``) on one device's batch.
    tx: the optimizer, built with ``axis_name`` as its data axis.
    axis_name: the name ``jax.pmap`` gives the device axis.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)`` (aux is dropped).

  Returns:
    ``step(params, state, batch) -> (params, state, metrics)``, metrics
    ``{"loss": ...}`` averaged over devices (one value per device row);
    ``step.lower`` lowers it.

  Raises:
    ValueError: when the returned step is called with an input whose
      leaves lack a leading axis of ``jax.local_device_count()``, naming
      the input and leaf.
  """
  def step(params, state, batch):
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
    loss = out[0] if has_aux else out
    extra = ({"value": loss} if _local_engine.local_states(state) else {})
    updates, state = tx.update(grads, state, params, **extra)
    params = _local_engine.apply_updates(params, updates, state)
    return params, state, {"loss": jax.lax.pmean(loss, axis_name)}

  mapped = jax.pmap(step, axis_name=axis_name)

  def checked(params, state, batch):
    n = jax.local_device_count()
    for name, tree, hint in (
        ("params", params, "replicate params with pmap_replicate"),
        ("state", state, "replicate the state with pmap_replicate"),
        ("batch", batch, "reshape the batch to (devices, examples per "
                         "device, ...)")):
      _check_leading(tree, n, f"pmap_train_step needs a leading device axis "
                     f"of {n} (jax.local_device_count()) on every input: "
                     f"{hint}", multiple=False, name=name)
    return mapped(params, state, batch)

  checked.lower = mapped.lower
  return checked


def pmap_replicate(tree, devices=None):
  """Stacks a pytree once per device, for :func:`pmap_train_step`.

  Args:
    tree: a pytree of arrays (params, or an optimizer state).
    devices: the devices (default ``jax.local_devices()``).

  Returns:
    ``tree`` with a leading axis of ``len(devices)`` on every leaf, one
    copy on each device.
  """
  devices = devices if devices is not None else jax.local_devices()
  return jax.device_put_replicated(tree, devices) if hasattr(
    jax, "device_put_replicated") else jax.tree.map(
      lambda x: jnp.stack([x] * len(devices)), tree)
