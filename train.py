"""Data-parallel training with jaxcomm's gradient compressors.

One command line selects the model, dataset, compressor and its
hyperparameters, optimizer, learning-rate schedule, number of devices
(simulated CPU devices by default), steps, seed and output directory::

  python train.py                                  # the default job
  python train.py --compressor topk --compressor-args ratio=0.01
  python train.py --model cnn --dataset digits --compressor powersgd \\
      --compressor-args rank=2,start_step=10 --num-devices 4 --steps 300
  python train.py --out-dir runs/a --resume        # continue runs/a
  python train.py --local diloco --local-args period=50 --optimizer adamw \
      --compressor topk --compressor-args ratio=0.02,value_bits=2

``--local local_sgd|adacomm|overlap_local_sgd|diloco`` trains with a
local-update optimizer around ``--optimizer`` (each device alone between
syncs; ``--compressor`` compresses DiLoCo's pseudo-gradients): params are
kept per device, checkpointed per device, evaluated as their device
average, and the bytes of a step are those of its sync (none between).
``--local hierarchical_sgd --slices S`` averages inside each slice every
``period`` steps and across slices every ``global_period`` steps. Flags a
method takes that ``--local-args`` / ``--delay-args`` leave out take the
defaults the method list of ``--help`` shows.

With no arguments it trains the character-level LSTM on Python's own help
text (``pydoc_data``) on 8 simulated CPU devices with PowerSGD rank 4 (or,
when this build of jaxcomm has no ``powersgd``, bfloat16 casting with error
feedback) and prints the held-out loss and accuracy next to the bytes each
device sends per step and the dense all-reduce it replaces.

What a run writes to ``--out-dir``: ``metrics.jsonl`` (one JSON object per
step), ``curves.png`` (loss against step and against bytes communicated),
``summary.md`` (the final table), ``config.json`` and ``checkpoints/``.

Checkpoints (orbax's ``CheckpointManager``) hold the parameters, the full
optimizer state as host arrays (every device's error-feedback residual:
per-device leaves keep their leading device axis; PowerSGD's Q, the
compressor's PRNG key and step counters), and the step, which is also the
data position because batches are a pure function of ``(seed, step)``. The
manager writes each ``checkpoints/step_<N>`` to a temporary directory and
renames it when complete, so the last good checkpoint is never overwritten;
it keeps the newest ``--keep-checkpoints`` and names the latest. Each step
also records a SHA-256 digest per array, checked on every read. ``--resume``
continues bit-identically; a checkpoint from ``n`` devices restores on ``m``
(``n`` and ``m`` dividing one another) with the error-feedback mass
preserved (:func:`jaxcomm.parallel.resize_state`). When the latest
checkpoint is corrupt, the error names the older ones that read cleanly, and
``--resume-from checkpoints/step_<N>`` continues from one of them (the newer
steps are moved to ``checkpoints/abandoned/``). Resuming a run that is
already complete trains nothing: it re-evaluates and reports the train loss
recorded in ``metrics.jsonl``.

The code is in the ``trainer`` package: ``trainer.config`` (the command
line, :class:`Config`), ``trainer.optimizers`` (compressors and optimizers
from ``jaxcomm.registry``), ``trainer.model`` (model and data),
``trainer.checkpoints``, ``trainer.loop`` (:func:`run`, evaluation),
``trainer.resume``, ``trainer.accounting`` (bytes) and
``trainer.reporting``. This file is the entry point and re-exports their
public names.

Multi-process: pass ``--coordinator host:port --num-processes P
--process-id i`` to every process (``--num-devices`` is the global count).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  # Before JAX starts: CPU collectives over many simulated devices on few
  # cores can wait longer than XLA's default timeouts.
  _FLAGS = ("--xla_cpu_collective_timeout_seconds=900",
            "--xla_cpu_collective_call_terminate_timeout_seconds=900")
  _old = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join(
    [_old] + [f for f in _FLAGS if f.split("=")[0] not in _old]).strip()

from typing import Any  # noqa: E402

import jax  # noqa: E402

from jaxcomm import parallel  # noqa: E402
from trainer.checkpoints import CheckpointError  # noqa: E402,F401
from trainer.checkpoints import Checkpoints  # noqa: E402,F401
from trainer.checkpoints import check_compatible  # noqa: E402,F401
from trainer.config import ALIASES  # noqa: E402,F401
from trainer.config import AXIS  # noqa: E402,F401
from trainer.config import COMM_OPTIMIZERS  # noqa: E402,F401
from trainer.config import COMPRESSORS  # noqa: E402,F401
from trainer.config import DEFAULT_COMPRESSOR  # noqa: E402,F401
from trainer.config import DEFAULT_COMPRESSOR_ARGS  # noqa: E402,F401
from trainer.config import FALLBACK  # noqa: E402,F401
from trainer.config import GOSSIP_METHODS  # noqa: E402,F401
from trainer.config import HIERARCHICAL_LOCAL  # noqa: E402,F401
from trainer.config import LOCAL_METHODS  # noqa: E402,F401
from trainer.config import MEASURED_LR_PATH  # noqa: E402,F401
from trainer.config import OPTIMIZERS  # noqa: E402,F401
from trainer.config import Config  # noqa: E402
from trainer.config import available_compressors  # noqa: E402,F401
from trainer.config import build_compressor  # noqa: E402,F401
from trainer.config import build_parser  # noqa: E402,F401
from trainer.config import make_comm_optimizer  # noqa: E402,F401
from trainer.config import make_local_optimizer  # noqa: E402,F401
from trainer.config import make_optimizer  # noqa: E402,F401
from trainer.config import make_schedule  # noqa: E402,F401
from trainer.config import measured_lr  # noqa: E402,F401
from trainer.config import methods_epilog  # noqa: E402,F401
from trainer.config import parse_args  # noqa: E402
from trainer.config import parse_kwargs  # noqa: E402,F401
from trainer.config import resolve_compressor  # noqa: E402,F401
from trainer.loop import default_out_dir  # noqa: E402,F401
from trainer.loop import evaluate  # noqa: E402,F401
from trainer.loop import os_error_text  # noqa: E402
from trainer.loop import plot_curves  # noqa: E402,F401
from trainer.loop import run  # noqa: E402
from trainer.loop import summary_line  # noqa: E402
from trainer.loop import summary_table  # noqa: E402
from trainer.model import build_model  # noqa: E402,F401
from trainer.model import check_model_args  # noqa: E402,F401
from trainer.model import load_data  # noqa: E402,F401
from trainer.model import model_arguments  # noqa: E402,F401


def configure_devices(cfg: Config) -> None:
  """Sets up JAX's devices for a script run (before the backend starts)."""
  if cfg.platform == "cpu":
    jax.config.update("jax_platforms", "cpu")
  if cfg.coordinator is not None or cfg.num_processes is not None:
    procs = cfg.num_processes or 1
    if cfg.num_devices % procs:
      raise ValueError(f"--num-devices {cfg.num_devices} must be a multiple "
                       f"of --num-processes {procs}")
    parallel.initialize(
      cfg.coordinator, cfg.num_processes, cfg.process_id,
      local_device_count=(cfg.num_devices // procs
                          if cfg.platform == "cpu" else None))
  elif cfg.platform == "cpu":
    jax.config.update("jax_num_cpu_devices", cfg.num_devices)


def main(argv=None, *, set_devices: bool = False) -> dict[str, Any]:
  """Parses ``argv``, trains, prints the summary table; returns the result.

  ``set_devices=True`` (the script) makes ``--num-devices`` simulated CPU
  devices and joins a multi-process job; in a process where JAX already
  runs, leave it False and the first ``--num-devices`` devices are used.
  """
  cfg = parse_args(argv)
  if set_devices:
    configure_devices(cfg)
  result = run(cfg)
  if jax.process_index() == 0:
    r = result
    print()
    print(summary_table([r]))
    print("\n" + summary_line(r))
  return result


if __name__ == "__main__":
  try:
    main(sys.argv[1:], set_devices=True)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except OSError as e:
    print(f"error: {os_error_text(e)}", file=sys.stderr)
    sys.exit(1)
