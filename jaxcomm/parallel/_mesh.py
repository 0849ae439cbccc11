"""Meshes: one data axis, or a pod's slow and fast axes."""

from __future__ import annotations

import jax
import numpy as np

from jaxcomm import _checks

# ----------------------------------------------------------------- meshes --

def make_mesh(num_devices: int | None = None, axis_name: str = "data", *,
              model: int = 1, model_axis: str = "model", devices=None):
  """A mesh whose data axis is ``axis_name`` (Auto axis types).

  Args:
    num_devices: devices on the data axis (default: all devices / model).
    axis_name: name of the data axis.
    model: size of an optional second axis (e.g. for tensor parallelism);
      1 gives a one-axis mesh. Compression runs over the data axis only.
    model_axis: name of that second axis.
    devices: devices to use (default ``jax.devices()``).

  Returns:
    A ``jax.sharding.Mesh`` of shape ``(num_devices,)`` over
    ``(axis_name,)``, or ``(num_devices, model)`` over ``(axis_name,
    model_axis)``.

  Raises:
    ValueError: when ``model < 1``, or ``num_devices * model`` is not
      between 1 and the number of devices.

  Examples:
    On the 8 devices of the test suite (CPU devices simulated with
    ``--xla_force_host_platform_device_count=8``):

    >>> import jaxcomm
    >>> dict(jaxcomm.parallel.make_mesh().shape)
    {'data': 8}
    >>> dict(jaxcomm.parallel.make_mesh(model=2, model_axis="fsdp").shape)
    {'data': 4, 'fsdp': 2}
  """
  devices = list(devices if devices is not None else jax.devices())
  if model < 1:
    raise ValueError(f"model must be >= 1, got {model}")
  if num_devices is None:
    num_devices = len(devices) // model
  if num_devices < 1 or num_devices * model > len(devices):
    raise ValueError(
      f"num_devices={num_devices} x model={model} needs "
      f"{num_devices * model} devices, have {len(devices)}")
  devices = devices[:num_devices * model]
  if model == 1:
    shape, names = (num_devices,), (axis_name,)
  else:
    shape, names = (num_devices, model), (axis_name, model_axis)
  return jax.make_mesh(shape, names, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def make_pod_mesh(num_slices: int | None = None, *, slow_axis: str = "dcn",
                  fast_axis: str = "ici", devices=None):
  """A ``(slow_axis, fast_axis)`` mesh: one row per slice or host.

  Devices are grouped by their ``slice_index`` where it tells several
  slices apart (TPU multislice: ICI inside a slice, DCN between slices),
  else by ``process_index`` (a GPU cluster with one process per host: NVLink
  inside, the network between); ``num_slices`` instead cuts the devices,
  in order, into that many equal groups (one process driving several
  hosts, or simulated CPU devices). Each group is one row along
  ``slow_axis``, its devices in order along ``fast_axis``. Use
  ``axis_name=(slow_axis, fast_axis)`` in :class:`DataParallel`, dense
  averaging over ``fast_axis`` and compression over ``slow_axis``.

  Args:
    num_slices: cut the devices, in order, into this many equal groups
      (None: group them by slice, else by process).
    slow_axis: the name of the axis across groups.
    fast_axis: the name of the axis inside a group.
    devices: devices to use (default ``jax.devices()``).

  Returns:
    A ``jax.sharding.Mesh`` of shape ``(groups, devices per group)``, both
    axes Auto.

  Raises:
    ValueError: naming the argument: an axis name that is not a
      non-empty str, equal axis names, ``num_slices`` not a positive int
      or not dividing the devices, groups of different sizes.

  Examples:
    >>> import jaxcomm
    >>> dict(jaxcomm.parallel.make_pod_mesh(2).shape)
    {'dcn': 2, 'ici': 4}
  """
  for name, v in (("slow_axis", slow_axis), ("fast_axis", fast_axis)):
    if not isinstance(v, str) or not v:
      raise ValueError(f"{name} must be a non-empty str, got {v!r}")
  if slow_axis == fast_axis:
    raise ValueError(f"slow_axis and fast_axis must differ, both are "
                     f"{slow_axis!r}")
  devices = list(devices if devices is not None else jax.devices())
  if num_slices is not None:
    num_slices = _checks.integer("num_slices", num_slices, 1)
    if len(devices) % num_slices:
      raise ValueError(f"num_slices={num_slices} does not divide the "
                       f"{len(devices)} devices")
    per = len(devices) // num_slices
    groups = [devices[i * per:(i + 1) * per] for i in range(num_slices)]
  else:
    # slice_index where it tells slices apart (CPU and single-slice
    # devices may report 0 for all), else the process (host).
    slices = {getattr(d, "slice_index", None) for d in devices}
    key = ((lambda d: d.slice_index) if None not in slices
           and len(slices) > 1 else (lambda d: d.process_index))
    by = {}
    for d in devices:
      by.setdefault(key(d), []).append(d)
    groups = [by[k] for k in sorted(by)]
    if len({len(g) for g in groups}) != 1:
      raise ValueError(
        "slices (or hosts) hold different numbers of devices "
        f"{[len(g) for g in groups]}: pass num_slices or devices")
  arr = np.empty((len(groups), len(groups[0])), dtype=object)
  for i, g in enumerate(groups):
    for j, d in enumerate(g):
      arr[i, j] = d
  return jax.sharding.Mesh(arr, (slow_axis, fast_axis),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
