"""0/1 Adam (Lu et al. 2022): a local-update optimizer with 1-bit syncs
at doubling intervals and a variance frozen after its warm-up."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm import _checks
from jaxcomm import _compressor
from jaxcomm import _registry
from jaxcomm._local_engine import LocalSpec
from jaxcomm._local_engine import LocalState
from jaxcomm._local_engine import _all_finite
from jaxcomm._local_engine import _where
from jaxcomm._local_engine import switch
from jaxcomm.collectives import _core
from jaxcomm.transforms.optimizers._onebit_common import _direction
from jaxcomm.transforms.quantize import _dense
from jaxcomm.transforms.quantize import _signs

# ------------------------------------------------------------- 0/1 Adam --

class ZeroOneAdamState(NamedTuple):
  """The moments and schedules of :func:`zero_one_adam`.

  The ``inner`` of its :class:`jaxcomm.LocalState` (whose ``compress``
  holds the three exchanges' states: dense, 1-bit gradient, 1-bit sync).

  Attributes:
    mu: the momentum (identical on every device while the variance is
      updated; each device's own between syncs after the freeze).
    nu: the variance (replicated; frozen after ``var_freeze_step``).
    accum: each device's accumulated local update since the last sync
      (``-sum lr * update``), the paper's ``u``.
    lrs: the sum of the learning rates of those local steps.
    var_interval: steps between variance updates (doubles every
      ``var_update_scaler`` updates).
    var_counter: variance updates since the interval last doubled.
    local_interval: steps between syncs after the freeze (doubles every
      ``local_step_scaler`` steps, up to ``local_step_clipper``).
    local_counter: steps since the local interval last doubled.
    var_count: variance updates taken (int32); while 0 (a fresh ``init``)
      every step is a dense variance-update step, whatever the schedule.
  """

  mu: Any
  nu: Any
  accum: Any
  lrs: jax.Array
  var_interval: jax.Array
  var_counter: jax.Array
  local_interval: jax.Array
  local_counter: jax.Array
  var_count: jax.Array


def zero_one_schedule(steps: int, var_freeze_step: int,
                      var_update_scaler: int, local_step_scaler: int,
                      local_step_clipper: int) -> list[int]:
  """The branch :func:`zero_one_adam` takes at each step ``0..steps-1``:
  0 a dense step (variance update), 1 a 1-bit gradient step, 2 a local
  step, 3 a local step ending in a 1-bit sync (plain Python, for wire
  accounting and documentation), from a fresh ``init``: with
  ``var_freeze_step=0`` its first step is a dense one too (the variance
  was never updated)."""
  out = []
  var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
  for s in range(steps):
    count = s + 1
    if s == 0 and var_freeze_step == 0:
      out.append(0)   # as var_freeze_step=1 (not a local step)
    elif count <= var_freeze_step:
      is_var = count % var_interval == 0
      out.append(0 if is_var else 1)
      if is_var:
        var_counter += 1
        if var_counter == var_update_scaler:
          var_counter, var_interval = 0, var_interval * 2
    else:
      out.append(3 if count % local_interval == 0 else 2)
      local_counter += 1
      if local_counter == local_step_scaler:
        local_counter = 0
        local_interval = min(local_step_clipper, local_interval * 2)
  return out


@dataclasses.dataclass(frozen=True)
class ZeroOneSpec(LocalSpec):
  """Wire accounting of :func:`zero_one_adam`: the collectives of the
  branch a step takes (``step=None``: all three exchanges, as the HLO
  holds them)."""

  exchanges: tuple = ()
  schedule_args: tuple = ()

  def wire(self, params, n: int, step: int | None = None,
           splits=None) -> list:
    del splits  # block semantics: no whole-leaf exchange
    dense, grad_ex, mom_ex = self.exchanges
    claim = lambda tx: list(_compressor.spec_of(tx).wire(params, n))
    if step is None:
      return claim(dense) + claim(grad_ex) + claim(mom_ex)
    branch = zero_one_schedule(step + 1, *self.schedule_args)[step]
    return {0: claim(dense), 1: claim(grad_ex), 2: [],
            3: claim(mom_ex)}[branch]


@_registry.method(
    paper="Lu et al. 2022",
    summary=(
      "warm-up: exact mean gradient on variance-update steps (their "
      "interval doubling), the 1-bit average (`onebit()` exchange) on the"
      " others; after: local Adam steps with each device's own momentum; "
      "every `local_interval` steps (doubling, clipped) a 1-bit sync of "
      "the accumulated updates; params per device in between (a "
      "local-update optimizer, below)"))
def zero_one_adam(learning_rate: float | Callable[[jax.Array], jax.Array],
                  b1: float = 0.9, b2: float = 0.999,
                  eps: float = 1e-8, weight_decay: float = 0.0, *,
                  var_freeze_step: int, var_update_scaler: int = 16,
                  local_step_scaler: int = 32678,
                  local_step_clipper: int = 16, axis_name="data",
                  policy=None) -> optax.GradientTransformationExtraArgs:
  """0/1 Adam: adaptive variance freezing and 1-bit syncs of local steps.

  (Lu et al. 2022, Algorithm 1, with DeepSpeed's published schedule.)
  Up to ``var_freeze_step`` every step exchanges the gradient: at the
  steps where the variance is updated (every ``var_interval`` steps, an
  interval that doubles after every ``var_update_scaler`` updates) the
  exact mean ``gbar`` (one fused psum) updates ``nu = b2 nu + (1 - b2)
  gbar^2`` and ``mu``; at the others the 1-bit average (worker and server
  error, :func:`jaxcomm.onebit`'s exchange) updates ``mu`` alone. After the
  freeze each device takes local steps with its own momentum
  ``mu_i = b1 mu_i + (1 - b1) g_i``, ``x_i -= lr (mu_i / (sqrt(nu) + eps) +
  wd x_i)``, accumulating ``u_i`` (the sum of those updates); every
  ``local_interval`` steps (doubling every ``local_step_scaler`` steps up
  to ``local_step_clipper``) the devices sync: ``ubar`` is the 1-bit
  average of ``u_i (sqrt(nu) + eps)`` (a second error-feedback state),
  ``mu = -ubar / sum(lr)`` and every device restarts from ``x = anchor +
  ubar / (sqrt(nu) + eps)``, ``anchor`` the params at the last sync. As
  in DeepSpeed's implementation there is no bias correction, and the
  gradient exchange's errors are not carried into the momentum exchange.

  Against DeepSpeed's ``ZeroOneAdam`` (``tests/test_optimizers.py``, to
  1e-5 on 8 workers): its first ``step()`` call only allocates buffers
  and still counts a step, so its ``state['step']`` runs one ahead of this
  step counter, and its last warm-up step is the first with ``step >
  var_freeze_step``. Its variance intervals and local-step intervals are
  therefore this schedule's with the counter shifted by one: DeepSpeed's
  ``var_freeze_step=k`` is ``var_freeze_step=k + 1`` here, and at counter
  ``t`` here DeepSpeed is at ``t + 1``.

  ``var_freeze_step=0`` continues a restored state with its variance
  frozen. On a state whose variance was never updated (``var_count ==
  0``: a fresh ``init``) the step is the dense variance-update step (the
  exact mean gradient, ``mu`` and ``nu`` updated), not a local step on a
  zero variance, which moved the params by about ``lr / eps``; the run
  is then the one ``var_freeze_step=1`` takes (that step does not count
  as a local step), and ``jaxcomm.wire.claimed(step=0)`` lists its psum.

  Params differ between devices between syncs: use it as the whole
  optimizer of a :class:`jaxcomm.parallel.DataParallel` step (params per
  device) or a hand-written step with :func:`jaxcomm.apply_updates`.

  Args:
    learning_rate: a number or an optax schedule.
    b1: Adam's momentum decay, in ``[0, 1]``.
    b2: Adam's variance decay, in ``[0, 1]``.
    eps: added to ``sqrt(nu)``, >= 0.
    weight_decay: added to the update as ``wd x`` (DeepSpeed's form).
    var_freeze_step: steps with a variance (static).
    var_update_scaler: variance updates before their interval doubles.
    local_step_scaler: steps before the sync interval doubles.
    local_step_clipper: the largest sync interval.
    axis_name: the data axis.
    policy: the exchanges' :class:`jaxcomm.LeafPolicy`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`jaxcomm.LocalState` with a :class:`ZeroOneAdamState` as its
    ``inner``; its updates move each device's own params.

  Raises:
    ValueError: naming the argument, when ``var_freeze_step`` is not an
      int >= 0, ``var_update_scaler``, ``local_step_scaler`` or
      ``local_step_clipper`` not an int >= 1, ``b1`` or ``b2`` not in
      ``[0, 1]``, ``eps`` or ``weight_decay`` negative or not finite,
      ``learning_rate`` (a number) negative or not finite, or
      ``axis_name`` / ``policy`` invalid. The update raises a ValueError
      without ``params``, for a state that is not the
      :class:`jaxcomm.LocalState` its ``init`` returned, and outside a
      context that binds ``axis_name``.

  Examples:
    The whole optimizer, with params per device:

    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomm
    >>> tx = jaxcomm.zero_one_adam(1e-3, var_freeze_step=1000)

    A :class:`jaxcomm.parallel.DataParallel` step on 8 devices: device
    ``i`` pulls the 16 x 16 ``w`` toward its own target ``t_i`` (loss
    ``|w - t_i|^2 / 2``), so the optimum is the mean target. With
    ``var_freeze_step=1`` and a sync interval that doubles every step up
    to 2, the steps are: a dense variance step, a local step ending in a
    1-bit sync, a local step (the devices' params part), a sync (they
    agree again). The params carry a leading device axis; the distance of
    their device mean to the optimum falls:

    >>> mesh = jaxcomm.parallel.make_mesh()           # 8 devices on "data"
    >>> signs = jnp.where(jnp.sin(jnp.arange(256.0)) < 0, -1.0, 1.0)
    >>> noise = 0.4 * jnp.sin(0.7 * jnp.arange(2048.0))
    >>> targets = (signs + noise.reshape(8, 256)).reshape(8, 16, 16)
    >>> best = targets.mean(0)
    >>> loss = lambda p, t: 0.5 * jnp.sum((p["w"] - t[0]) ** 2)
    >>> tx = jaxcomm.zero_one_adam(0.03, var_freeze_step=1,
    ...                            local_step_scaler=1, local_step_clipper=2)
    >>> dp = jaxcomm.parallel.DataParallel(loss, tx, mesh)
    >>> params, state = dp.init({"w": jnp.zeros((16, 16))})
    >>> params["w"].shape
    (8, 16, 16)
    >>> for _ in range(4):
    ...   params, state, _ = dp.step(params, state, targets)
    ...   w = np.asarray(params["w"])
    ...   apart = bool(np.ptp(w, axis=0).max() > 0)
    ...   print(apart, round(float(np.linalg.norm(w.mean(0) - best)), 2))
    False 14.46
    False 11.69
    True 8.09
    False 3.95

    What each step moves: the dense mean (256 float32 values), then
    packed signs (1 bit per value) and their scales in each of the two
    phases of a sync, nothing on the local step (the 4 bytes: the devices
    agreeing on non-finite values):

    >>> w0 = {"w": jnp.zeros((16, 16))}
    >>> for t in range(4):
    ...   print(jaxcomm.wire.claimed(tx, w0, 8, step=t))
    [('all-reduce', 1028)]
    [('all-to-all', 64), ('all-gather', 64), ('all-reduce', 4)]
    []
    [('all-to-all', 64), ('all-gather', 64), ('all-reduce', 4)]
  """
  var_freeze_step = _checks.step("var_freeze_step", var_freeze_step)
  var_update_scaler = _checks.integer("var_update_scaler",
                                      var_update_scaler, 1)
  local_step_scaler = _checks.integer("local_step_scaler",
                                      local_step_scaler, 1)
  local_step_clipper = _checks.integer("local_step_clipper",
                                       local_step_clipper, 1)
  for name, v, lo, hi in (("b1", b1, 0.0, 1.0), ("b2", b2, 0.0, 1.0),
                          ("eps", eps, 0.0, None),
                          ("weight_decay", weight_decay, 0.0, None)):
    _checks.number(name, v, lo, hi)
  if not callable(learning_rate):
    _checks.number("learning_rate", learning_rate, 0.0, None, finite=True)
  _checks.axis_name(axis_name)
  schedule = (learning_rate if callable(learning_rate)
              else (lambda _: learning_rate))
  dense = _dense.mean_gradients(axis_name)
  grad_ex = _signs.onebit(axis_name=axis_name, policy=policy)
  mom_ex = _signs.onebit(axis_name=axis_name, policy=policy)
  spec = ZeroOneSpec("zero_one_adam", 1, exchanges=(dense, grad_ex, mom_ex),
                     schedule_args=(var_freeze_step, var_update_scaler,
                                    local_step_scaler, local_step_clipper))
  f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)

  def init_fn(params):
    zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32),
                         params)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    inner = ZeroOneAdamState(
      mu=zeros, nu=zeros, accum=zeros, lrs=jnp.zeros([], jnp.float32),
      var_interval=i32(1), var_counter=i32(0), local_interval=i32(1),
      local_counter=i32(0), var_count=i32(0))
    return LocalState(
      count=i32(0), anchor=jax.tree.map(jnp.asarray, params),
      synced=jax.tree.map(lambda _: jnp.array(False), params),
      inner=inner, skipped=i32(0),
      compress=(dense.init(params), grad_ex.init(params),
                mom_ex.init(params)))

  def step_of(mu, nu, x):
    return jax.tree.map(
      lambda m, v, p: _direction(m, v, 1.0, 1.0, eps)
      + weight_decay * p.astype(jnp.float32), mu, nu, x)

  def skipped_by(old, new):
    return (_compressor.stats(new)[0].nonfinite_steps
            > _compressor.stats(old)[0].nonfinite_steps)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("jaxcomm.zero_one_adam needs params: call "
                       "tx.update(grads, state, params)")
    if not isinstance(state, LocalState) or not isinstance(
        state.inner, ZeroOneAdamState):
      raise ValueError("jaxcomm.zero_one_adam: state must be the "
                       "LocalState its init returned")
    _core.check_axis(axis_name, "jaxcomm.zero_one_adam", grads=updates)
    s = state.inner
    lr = jnp.asarray(schedule(state.count), jnp.float32)
    count = state.count + 1
    g = f32(updates)
    x = f32(params)
    anchor = f32(state.anchor)
    cs = state.compress

    def synchronous(exchange_index, variance):
      def branch(op):
        mu, nu, accum, lrs, cs = op
        ex = (dense, grad_ex)[exchange_index]
        mean, new_c = ex.update(g, cs[exchange_index], state.anchor)
        skip = skipped_by(cs[exchange_index], new_c)
        mean = f32(mean)
        new_nu = (jax.tree.map(lambda v, m: b2 * v + (1 - b2) * m * m, nu,
                               mean) if variance else nu)
        new_mu = jax.tree.map(lambda m, gb: b1 * m + (1 - b1) * gb, mu, mean)
        new_a = jax.tree.map(lambda a, u: a - lr * u, anchor,
                             step_of(new_mu, new_nu, anchor))
        keep = lambda new, old: _where(skip, old, new)
        cs = tuple(new_c if k == exchange_index else c
                   for k, c in enumerate(cs))
        varied = jnp.where(skip, 0, 1) if variance else 0
        return (keep(new_a, anchor), keep(new_a, anchor), keep(new_mu, mu),
                keep(new_nu, nu), accum, lrs, cs, jnp.array(True),
                jnp.zeros([], jnp.int32), jnp.asarray(varied, jnp.int32))
      return branch

    def local(sync):
      def branch(op):
        mu, nu, accum, lrs, cs = op
        new_mu = jax.tree.map(lambda m, gi: b1 * m + (1 - b1) * gi, mu, g)
        upd = step_of(new_mu, nu, x)
        new_x = jax.tree.map(lambda p, u: p - lr * u, x, upd)
        new_acc = jax.tree.map(lambda a, u: a - lr * u, accum, upd)
        ok = _all_finite(jax.tree.leaves(g)) & _all_finite(
          jax.tree.leaves(new_x))
        new_mu, new_x, new_acc = (_where(ok, new_mu, mu), _where(ok, new_x, x),
                                  _where(ok, new_acc, accum))
        new_lrs = lrs + lr
        bad = jnp.where(ok, 0, 1).astype(jnp.int32)
        if not sync:
          return (anchor, new_x, new_mu, nu, new_acc, new_lrs, cs,
                  jnp.array(False), bad, jnp.zeros([], jnp.int32))
        denom = jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)
        w = jax.tree.map(lambda a, d: a * d, new_acc, denom)
        ubar, c2 = mom_ex.update(w, cs[2], state.anchor)
        ubar = f32(ubar)
        mu_s = jax.tree.map(lambda u: -u / jnp.maximum(new_lrs, 1e-30), ubar)
        # ubar / denom, 0 where the variance is 0 (as in step_of).
        new_a = jax.tree.map(
          lambda a, u, v: a + _direction(u, v, 1.0, 1.0, eps), anchor, ubar,
          nu)
        zero = jax.tree.map(jnp.zeros_like, new_acc)
        return (new_a, new_a, mu_s, nu, zero, jnp.zeros_like(new_lrs),
                (cs[0], cs[1], c2), jnp.array(True), bad,
                jnp.zeros([], jnp.int32))
      return branch

    phase2 = count > var_freeze_step
    is_var = count % s.var_interval == 0
    sync = count % s.local_interval == 0
    index = jnp.where(phase2, jnp.where(sync, 3, 2),
                      jnp.where(is_var, 0, 1)).astype(jnp.int32)
    # A variance never updated (var_freeze_step=0 on a fresh init): the
    # dense variance-update step, not lr / eps steps on a zero variance.
    index = jnp.where(s.var_count == 0, 0, index).astype(jnp.int32)
    new_a, new_x, mu, nu, accum, lrs, cs, synced, bad, varied = switch(
      index, [synchronous(0, True), synchronous(1, False), local(False),
              local(True)], (s.mu, s.nu, s.accum, s.lrs, cs))
    # Schedules (replicated counters).
    var_counter = s.var_counter + jnp.where(~phase2 & is_var, 1, 0)
    double = var_counter == var_update_scaler
    var_interval = jnp.where(double, s.var_interval * 2, s.var_interval)
    var_counter = jnp.where(double, 0, var_counter)
    local_counter = s.local_counter + jnp.where(
      phase2 & (s.var_count > 0), 1, 0)
    widen = local_counter == local_step_scaler
    local_interval = jnp.where(
      widen, jnp.minimum(local_step_clipper, s.local_interval * 2),
      s.local_interval)
    local_counter = jnp.where(widen, 0, local_counter)
    inner = ZeroOneAdamState(
      mu=mu, nu=nu, accum=accum, lrs=lrs,
      var_interval=var_interval.astype(jnp.int32),
      var_counter=var_counter.astype(jnp.int32),
      local_interval=local_interval.astype(jnp.int32),
      local_counter=local_counter.astype(jnp.int32),
      var_count=(s.var_count + varied).astype(jnp.int32))
    out = jax.tree.map(lambda n_, p: (n_ - p).astype(p.dtype), new_x,
                       params)
    new_anchor = jax.tree.map(lambda a, p: a.astype(p.dtype), new_a,
                              state.anchor)
    # The step as it lands in the params' own dtypes: a float32 result
    # past float16's range (a local step, or the synchronised model) is
    # a skipped step, counted: its update zero, the per-device moments,
    # sums and anchor as they were. The decision is per device, so only
    # per-device state takes it (the variance, the rate sum, the exchange
    # states and ``synced`` keep their replicated type): a skipped sync
    # still marks the params synced, and jaxcomm.apply_updates sets them
    # to the anchor kept, the last model every device agreed on.
    fits = (_all_finite(jax.tree.leaves(jax.tree.map(
      lambda n_, p: n_.astype(p.dtype), new_x, params)))
            & _all_finite(jax.tree.leaves(new_anchor)))
    out = _where(fits, out, jax.tree.map(jnp.zeros_like, out))
    new_anchor = _where(fits, new_anchor, state.anchor)
    inner = inner._replace(mu=_where(fits, inner.mu, s.mu),
                           accum=_where(fits, inner.accum, s.accum))
    bad = jnp.maximum(bad, jnp.where(fits, 0, 1)).astype(jnp.int32)
    return out, LocalState(
      count=count, anchor=new_anchor,
      synced=jax.tree.map(lambda _: synced, params), inner=inner,
      skipped=state.skipped + bad, compress=cs)

  return optax.GradientTransformationExtraArgs(
    _compressor._Init(init_fn, spec), update_fn)


__all__ = [
  "zero_one_adam",
  "ZeroOneAdamState",
]
