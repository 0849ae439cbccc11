"""Shared test harness: run a transform on 8 devices, and its numpy twin.

``device_run`` runs ``tx.update`` for several steps inside ``jax.shard_map``
on the 8-device CPU mesh with each device's own gradients, blocking between
steps. ``numpy_run`` runs a registry entry's numpy reference with error
feedback and the leaf policy added by plain numpy code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import _buckets
from jaxcomm import parallel

N = 8
AXIS = "data"


def battery_params():
  """Parameters of the battery: two compressed leaves, a dense bias, an int.

  With the default policy (>= 256 elements) ``w`` and ``conv`` are
  compressed and ``b`` travels in the fused dense psum; ``step`` (int32)
  passes through.
  """
  return {
    "b": jnp.zeros((48,), jnp.float32),
    "conv": jnp.zeros((3, 3, 8, 16), jnp.float32),
    "step": jnp.zeros((), jnp.int32),
    "w": jnp.zeros((64, 48), jnp.float32),
  }


COMPRESSED = ("conv", "w")   # in jax.tree.leaves order of battery_params
DENSE = ("b",)


def make_grads(seed: int, steps: int, n: int = N, dtype=jnp.float32,
               params=None):
  """``grads[t]``: a pytree whose float leaves have a leading axis n."""
  params = battery_params() if params is None else params
  rng = np.random.RandomState(seed)
  out = []
  for t in range(steps):
    def leaf(x, t=t):
      if not jnp.issubdtype(x.dtype, jnp.floating):
        return np.zeros((n,) + x.shape, x.dtype)
      # Different scales per device and per step, plus a shared direction.
      shared = rng.randn(*x.shape)
      own = rng.randn(n, *x.shape) * (1.0 + np.arange(n)).reshape(
        (n,) + (1,) * x.ndim)
      return (0.5 * shared + own).astype(dtype)
    out.append(jax.tree.map(leaf, params))
  return out


@functools.lru_cache(maxsize=64)
def _stepper(tx, mesh, layout_key):
  layout = _LAYOUTS[layout_key]
  specs = parallel.state_specs(layout, AXIS)

  def step(params, state, grads):
    # Float gradients are per device; non-float leaves (which pass through
    # untouched) are taken from the replicated params.
    grads = jax.tree.map(
      lambda g, p: g[0] if jnp.issubdtype(g.dtype, jnp.floating) else p,
      grads, params)
    local = parallel.to_local(state, layout)
    upd, new = tx.update(grads, local, params)
    return upd, parallel.to_global(new, layout)

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                     out_specs=(P(), specs))
  return jax.jit(fn)


_LAYOUTS = {}


def device_run(tx, mesh, grads_seq, params=None, state=None):
  """Runs ``tx`` for ``len(grads_seq)`` steps on the mesh.

  Returns:
    (updates per step as host arrays, final state as host arrays, layout).
  """
  params = battery_params() if params is None else params
  layout = parallel.state_layout(tx, params, mesh, AXIS)
  key = (id(tx), str(jax.tree.structure(layout)),
         tuple(jax.tree.leaves(layout)))
  _LAYOUTS[key] = layout
  if state is None:
    state = parallel.init_state(tx, params, mesh, AXIS, layout)
  params_g = parallel.replicate(params, mesh)
  fn = _stepper(tx, mesh, key)
  updates = []
  for grads in grads_seq:
    grads = parallel.shard_batch(grads, mesh, AXIS)
    upd, state = fn(params_g, state, grads)
    jax.block_until_ready((upd, state))
    updates.append(jax.device_get(upd))
  return updates, jax.device_get(state), layout


def _f32(x):
  """Rounded to float32 (kept as float64): the transform keeps its error
  feedback memory, and forms ``x = g + e``, in float32; over many steps a
  float64 memory drifts far enough to move a value across a rounding tie
  of the integer quantizers."""
  return np.asarray(x, np.float32).astype(np.float64)


def numpy_run(entry, grads_seq, seed: int = 0, n: int = N, memory=None):
  """The registry entry's numpy reference with error feedback around it.

  ``memory[t]`` (optional, for ``t >= 1``): the residuals ``res[i][j]`` to
  start step ``t`` from instead of the twin's own: the transform's, each
  checked against the reference at the step before. For entries whose
  deterministic rounding turns an ulp of float32 drift into a whole code
  step a few steps later (``Entry.forced_memory``).

  Returns:
    (mean updates per step as dicts of float64 arrays, final residuals
    ``res[i][j]``, list of sent per step).
  """
  if entry.numpy_run is not None:
    return entry.numpy_run(grads_seq, n)
  first = grads_seq[0]
  names = sorted(first)
  comp = [k for k in names if k in COMPRESSED]
  dense = [k for k in names if k in DENSE]
  shapes = [first[k].shape[1:] for k in comp]
  ref_state = entry.ref_init(shapes)
  # Classic error feedback keeps the residual e_i; EF21 the estimate h_i
  # (and the aggregate h = mean_i h_i, which is the update); DIANA the
  # shift h_i and h = mean_i h_i, both moved by alpha (its shift_rate)
  # times what was sent, the update being h + mean_i C(g_i - h_i) before
  # they move (Mishchenko et al. 2019).
  res = [[np.zeros(s) for s in shapes] for _ in range(n)]
  agg = [np.zeros(s) for s in shapes]
  diana = entry.error_feedback == "diana"
  ef21 = entry.error_feedback == "ef21" or diana
  alpha = entry.kwargs["shift_rate"] if diana else 1.0
  key = jax.random.PRNGKey(seed)
  out, sent_all = [], []
  for t, grads in enumerate(grads_seq):
    key, sub = jax.random.split(key)
    if memory is not None and t > 0:
      for i, dev in enumerate(memory[t]):
        for j, r in enumerate(dev):
          np.testing.assert_allclose(
            r, res[i][j], rtol=entry.rtol, atol=entry.atol * 10,
            err_msg=f"{entry.name}: residual {j} of device {i} before "
            f"step {t}")
      res = [[np.asarray(r, np.float64) for r in dev] for dev in memory[t]]
    xs = []
    for i in range(n):
      g = [np.asarray(grads[k][i], np.float64) for k in comp]
      if ef21:
        xs.append([_f32(x - h) for h, x in zip(res[i], g)])
      elif entry.error_feedback:
        xs.append([_f32(r + x) for r, x in zip(res[i], g)])
      else:
        xs.append(g)
    mean, sent, ref_state = entry.ref_step(xs, ref_state, t, sub, n)
    if ef21:
      res = [[_f32(h + alpha * s) for h, s in zip(res[i], sent[i])]
             for i in range(n)]
      update = [a + m for a, m in zip(agg, mean)]
      agg = [a + alpha * m for a, m in zip(agg, mean)]
      mean = update
    elif entry.error_feedback:
      res = [[_f32(x - s) for x, s in zip(xs[i], sent[i])] for i in range(n)]
    upd = {k: np.asarray(m, np.float64) for k, m in zip(comp, mean)}
    for k in dense:
      upd[k] = np.asarray(grads[k], np.float64).mean(axis=0)
    out.append(upd)
    sent_all.append(sent)
  return out, res, sent_all


def residuals_of(state, params=None) -> list:
  """The per-device error-feedback memory per compressed leaf (host arrays,
  leading device axis): the CompressState's residuals, or EF21's estimates
  ``h_i``; split out of the flat buckets (one bucket, equal shapes side by
  side, as ``jaxcomm._buckets.plan`` lays them)."""
  params = battery_params() if params is None else params
  shapes = [tuple(params[k].shape) for k in COMPRESSED]
  found = jaxcomm.compress_states(state)
  assert found, "no CompressState in state"
  memory = found[0].residual or found[0].estimate
  return split_buckets(memory, shapes)


def split_buckets(buffers, shapes) -> list:
  """Per-bucket flat buffers ``[..., size]`` -> per leaf (tree order)."""
  out = {}
  for lay, buf in zip(_buckets.plan(shapes), buffers):
    for j, leaf in zip(lay.leaves, lay.split(np.asarray(buf))):
      out[j] = leaf
  return [out[j] for j in sorted(out)]


def chain_sgd(tx, lr=1.0):
  return optax.chain(tx, optax.sgd(lr))


__all__ = ["N", "AXIS", "battery_params", "make_grads", "device_run",
           "numpy_run", "residuals_of", "chain_sgd", "jnp"]


def lower_update(tx, mesh, params=None):
  """The lowered shard_map'd ``tx.update`` for wire accounting."""
  params = battery_params() if params is None else params
  layout = parallel.state_layout(tx, params, mesh, AXIS)
  key = (id(tx), str(jax.tree.structure(layout)),
         tuple(jax.tree.leaves(layout)))
  _LAYOUTS[key] = layout
  state = parallel.init_state(tx, params, mesh, AXIS, layout)
  grads = parallel.shard_batch(make_grads(0, 1, params=params)[0], mesh, AXIS)
  return _stepper(tx, mesh, key).lower(parallel.replicate(params, mesh),
                                       state, grads)


# Values for required parameters that the registry's defaults leave out,
# by parameter name (inner optimizers, rates, periods): what a test passes
# to build any registered method on one device.
REQUIRED_BY_NAME = {
  "learning_rate": 0.1, "freeze_step": 1, "var_freeze_step": 1,
  "period": 2, "gamma": 0.5,
}


def required_args(m) -> dict:
  """The arguments a call of registered method ``m`` must pass: its
  registry defaults for required parameters, else :data:`REQUIRED_BY_NAME`,
  and fresh optimizers for ``inner`` / ``outer`` / ``compressor``."""
  out = {}
  for k, p in m.parameters().items():
    if p.default is not p.empty or p.kind in (p.VAR_KEYWORD,
                                              p.VAR_POSITIONAL):
      continue
    if k in m.defaults:
      out[k] = m.defaults[k]
    elif k in ("inner", "outer"):
      out[k] = optax.sgd(0.1)
    elif k == "compressor":
      out[k] = jaxcomm.topk(0.25, axis_name=None)
    else:
      out[k] = REQUIRED_BY_NAME[k]
  return out
