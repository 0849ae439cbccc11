"""A float64 numpy replay of DeepSpeed's ``ZeroOneAdam.step``
(deepspeed/runtime/fp16/onebit/zoadam.py) and of the NCCL backend's
``compressed_allreduce`` it calls (deepspeed/runtime/comm/nccl.py), written
from their published rule, independent of jaxcomm.

Per parameter tensor, ``n`` workers, DeepSpeed's ``state['step']``
counting every call (``step0``: its value before the first update; 1 in
DeepSpeed, whose first ``step()`` call only allocates the buffers and
discards that gradient):

* warm-up (``freeze_key`` False): at ``step % var_interval == 0`` the
  engine's allreduce gives the exact mean gradient, and ``v = b2 v + (1 -
  b2) gbar^2``, ``m = b1 m + (1 - b1) gbar``; at the other steps the local
  gradients go through ``compressed_allreduce`` (worker and server error)
  and only ``m`` is updated. ``var_counter`` counts variance updates;
  after ``var_update_scaler`` of them ``var_interval`` doubles.
* after the call in which ``step > var_freeze_step``: ``freeze_key`` is set
  and both error buffers are zeroed. Each worker: ``m_i = b1 m_i + (1 - b1)
  g_i``, ``lrs += lr``, ``x_i -= lr (m_i / (sqrt(v) + eps) + wd x_i)`` and
  the same amount into ``u_i`` (``momentum_accumulator``); at ``step %
  local_step_interval == 0``: ``x_i -= u_i``, ``u_i *= sqrt(v) + eps``,
  ``ubar = compressed_allreduce(u_i)``, ``m = -ubar / lrs``, ``x_i += ubar /
  (sqrt(v) + eps)``, ``u_i = 0``, ``lrs = 0``. ``local_step_counter``
  counts frozen steps; after ``local_step_scaler`` of them the interval
  doubles, up to ``local_step_clipper``.
* no bias correction; eps outside the square root.
"""

import math

import numpy as np


def _sign(x):
  return np.where(x >= 0, 1.0, -1.0)     # sign(0) = +1, as DeepSpeed


class CompressedAllreduce:
  """DeepSpeed's two-phase 1-bit allreduce of one tensor over ``n``
  workers: the tensor padded with zeros to a multiple of ``n * divider``,
  one worker scale ``||x||/sqrt(padded size)``, ``n`` server chunks each
  with its own scale and server error."""

  def __init__(self, size, n):
    divider = n * 8 // math.gcd(n, 8)
    self.n, self.size = n, size
    self.padded = size + (-size) % (n * divider)
    self.chunk = self.padded // n
    self.reset()

  def reset(self):
    self.worker = np.zeros((self.n, self.padded))
    self.server = np.zeros((self.n, self.chunk))

  def __call__(self, bufs):
    sent = []
    for i, b in enumerate(bufs):
      x = np.zeros(self.padded)
      x[:self.size] = np.ravel(b)
      x += self.worker[i]
      scale = np.linalg.norm(x) / np.sqrt(self.padded)
      self.worker[i] = x - scale * _sign(x)
      sent.append(scale * _sign(x))
    avg = np.sum(sent, axis=0) / self.n
    out = np.zeros(self.padded)
    for k in range(self.n):
      sl = slice(k * self.chunk, (k + 1) * self.chunk)
      y = avg[sl] + self.server[k]
      scale = np.linalg.norm(y) / np.sqrt(self.chunk)
      self.server[k] = y - scale * _sign(y)
      out[sl] = scale * _sign(y)
    return out[:self.size].reshape(np.shape(bufs[0]))


def deepspeed_zero_one_adam(grad_fn, params, batches, n, lr, *,
                            var_freeze_step, var_update_scaler=16,
                            local_step_scaler=32678, local_step_clipper=16,
                            b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                            step0=1, callback=None, keep=True):
  """Replays DeepSpeed's 0/1 Adam. ``params``: dict of arrays (the same on
  every worker); ``batches[t][i]``: worker ``i``'s batch at real step ``t``;
  ``grad_fn(params, batch)``: that worker's gradient dict; ``lr``: a number
  or a function of the real step index ``t`` (0-based). Returns the list of
  per-step params, each a dict of ``(n, *shape)`` arrays; ``callback(t,
  xs)`` (if given) sees the workers' params after each step; ``keep=False``
  returns the last step's params only."""
  lr_of = lr if callable(lr) else (lambda _: lr)
  keys = sorted(params)
  xs = [{k: np.asarray(params[k], np.float64).copy() for k in keys}
        for _ in range(n)]
  zeros = lambda: {k: np.zeros(np.shape(params[k])) for k in keys}
  m = [zeros() for _ in range(n)]
  v = zeros()
  u = [zeros() for _ in range(n)]
  ar = {k: CompressedAllreduce(np.size(params[k]), n) for k in keys}
  lrs = 0.0
  var_interval, var_counter = 1, 0
  local_interval, local_counter = 1, 0
  freeze = False
  step = step0
  out = []
  for t, batch in enumerate(batches):
    step += 1
    rate = float(lr_of(t))
    g = [grad_fn(xs[i], batch[i]) for i in range(n)]
    for k in keys:
      if not freeze:
        if step % var_interval == 0:
          gbar = np.mean([gi[k] for gi in g], axis=0)
          v[k] = b2 * v[k] + (1 - b2) * gbar * gbar
        else:
          gbar = ar[k]([gi[k] for gi in g])
        mk = b1 * m[0][k] + (1 - b1) * gbar
        for i in range(n):
          m[i][k] = mk
      else:
        for i in range(n):
          m[i][k] = b1 * m[i][k] + (1 - b1) * g[i][k]
      denom = np.sqrt(v[k]) + eps
      for i in range(n):
        upd = m[i][k] / denom
        if weight_decay > 0:
          upd = upd + weight_decay * xs[i][k]
        xs[i][k] = xs[i][k] - rate * upd
        if freeze:
          u[i][k] = u[i][k] - rate * upd
    if freeze:
      lrs += rate
      if step % local_interval == 0:
        for k in keys:
          denom = np.sqrt(v[k]) + eps
          for i in range(n):
            xs[i][k] = xs[i][k] - u[i][k]
          ubar = ar[k]([u[i][k] * denom for i in range(n)])
          for i in range(n):
            m[i][k] = -ubar / lrs
            xs[i][k] = xs[i][k] + ubar / denom
            u[i][k] = np.zeros_like(u[i][k])
        lrs = 0.0
      local_counter += 1
      if local_counter == local_step_scaler:
        local_counter = 0
        local_interval = min(local_step_clipper, local_interval * 2)
    else:
      if step % var_interval == 0:
        var_counter += 1
        if var_counter == var_update_scaler:
          var_counter, var_interval = 0, var_interval * 2
    if not freeze and step > var_freeze_step:
      freeze = True
      for k in keys:
        ar[k].reset()
    if callback is not None:
      callback(t, xs)
    if keep:
      out.append({k: np.stack([x[k] for x in xs]) for k in keys})
  return out if keep else {k: np.stack([x[k] for x in xs]) for k in keys}
