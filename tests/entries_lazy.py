"""Registry entries for lazy aggregation (``jaxcomm.lag``), with a numpy
reference written from Richtárik et al. 2022 (3PC, "LAG"): each device keeps
``h_i``, its last sent gradient, and the previous gradient ``y_i``; at step
``t`` it sends ``g_i - h_i`` iff ``||g_i - h_i||^2 > zeta ||g_i - y_i||^2``
(every device sends at the first step); ``h_i`` moves by what it sent,
``h = mean_i h_i`` is the update. The trigger is taken over the compressed
leaves together (one bucket), float32 where the transform stores.
"""

import numpy as np

import jaxcomm
from tests import registry

_COMP = ("conv", "w")     # the battery's compressed leaves, in tree order


def _f32(x):
  return np.asarray(x, np.float32).astype(np.float64)


def _lag_run(zeta):
  def run(grads_seq, n):
    shapes = [grads_seq[0][k].shape[1:] for k in _COMP]
    h = [[np.zeros(s) for s in shapes] for _ in range(n)]
    prev = [[np.zeros(s) for s in shapes] for _ in range(n)]
    agg = [np.zeros(s) for s in shapes]
    out, sent_all = [], []
    for t, grads in enumerate(grads_seq):
      sent = []
      for i in range(n):
        g = [np.asarray(grads[k][i], np.float64) for k in _COMP]
        x = [_f32(gj - hj) for gj, hj in zip(g, h[i])]
        moved = sum(np.sum((gj - pj) ** 2) for gj, pj in zip(g, prev[i]))
        send = t == 0 or sum(np.sum(xj ** 2) for xj in x) > zeta * moved
        sent.append([xj if send else np.zeros_like(xj) for xj in x])
        prev[i] = g
      mean = [sum(sent[i][j] for i in range(n)) / n for j in range(len(_COMP))]
      h = [[_f32(hj + sj) for hj, sj in zip(h[i], sent[i])] for i in range(n)]
      agg = [a + m for a, m in zip(agg, mean)]
      upd = {k: agg[j] for j, k in enumerate(_COMP)}
      upd["b"] = np.asarray(grads["b"], np.float64).mean(axis=0)
      out.append(upd)
      sent_all.append(sent)
    return out, h, sent_all
  return run


def _no_ref_step(xs, state, t, key, n):
  raise AssertionError("lag's reference is its numpy_run (it needs g)")


# zeta = 0.98, not 1: right after a send h_i = y_i, so both sides of the
# trigger are the same number and zeta = 1 would leave the decision to
# float32 rounding; the battery's i.i.d. gradients put the later ratios
# between 0.94 and 1.03 (mixed decisions, margins far above rounding).
registry.register(registry.Entry(
  name="lag",
  ref_init=lambda shapes: None,
  ref_step=_no_ref_step,
  numpy_run=_lag_run(0.98),
  error_feedback="ef21",
  factory=jaxcomm.lag,
  kwargs={"zeta": 0.98},
  bad_args=[({"zeta": -1.0}, "zeta"), ({"zeta": float("nan")}, "zeta"),
            ({"error_feedback": True}, "error_feedback")],
))
