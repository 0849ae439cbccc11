"""How a state type's per-device fields move to another device count.

``jaxcomm.parallel.resize_state`` keeps what a state still owes the
*averaged* update: every compressor applies ``mean_i`` of what devices send,
so a per-device buffer ``b_i`` (an error-feedback residual, a worker error,
EF21's estimate ``h_i``, a local momentum) counts as ``mean_i b_i``. Merging
devices therefore averages their buffers and splitting one copies it; that
keeps ``mean_i b_i`` (and EF21's ``h = mean_i h_i``) exactly. A state type
whose fields follow another rule registers it here, beside its definition:

* :data:`OWNED`: device ``k`` holds the mass of its own chunk ``k`` of a
  flattened buffer, in full (onebit's server error); the total over devices
  is re-cut into the new devices' chunks;
* :func:`restart` ``(value)``: memory that only holds for the device count
  (a gossip graph) it was built on; every new device starts from
  ``value``, as at init;
* :data:`WARM`: a warm start that owes the update nothing (PowerSGD's
  ``Q``): averaged or copied with the data axis like a buffer, and rebuilt
  as at init when the model axes' sizes change (a block of another shape
  needs one of its own; ``jaxcomm.parallel.reshard_state``).
"""

from __future__ import annotations

from typing import Any

OWNED = "owned"
WARM = "warm"

_KINDS: dict[type, dict[str, Any]] = {}


def restart(value: float) -> tuple[str, float]:
  """The kind of a field that restarts at ``value`` on a new device count."""
  return ("restart", float(value))


def register(cls: type, **fields) -> type:
  """Declares how ``cls``'s (a NamedTuple state) fields resize.

  Raises:
    ValueError: for a field ``cls`` does not have or an unknown kind.
  """
  for name, kind in fields.items():
    if name not in getattr(cls, "_fields", ()):
      raise ValueError(f"{cls.__name__} has no field {name!r}")
    if kind not in (OWNED, WARM) and not (
        isinstance(kind, tuple) and len(kind) == 2 and kind[0] == "restart"):
      raise ValueError(f"{cls.__name__}.{name}: kind must be OWNED, WARM "
                       f"or restart(value), got {kind!r}")
  _KINDS[cls] = dict(fields)
  return cls


def kinds(cls: type) -> dict[str, Any]:
  """The registered kinds of ``cls``'s fields (empty: averaged/copied)."""
  return _KINDS.get(cls, {})
