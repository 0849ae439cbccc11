"""What a run of ``train.py`` depends on: :class:`Config` and its defaults.

:mod:`trainer.config` (the command line) fills it in;
:mod:`trainer.optimizers` and the rest of :mod:`trainer` read it. This
module imports nothing from :mod:`trainer`.
"""

from __future__ import annotations

import dataclasses

DEFAULT_COMPRESSOR = "powersgd"
DEFAULT_COMPRESSOR_ARGS = "rank=4"


@dataclasses.dataclass
class Config:
  """Everything a run depends on (all settable from the command line).

  The defaults are the default job: a compressed char-LSTM run on 8
  simulated CPU devices, about 3 minutes on 2 cores.
  """

  model: str = "charlm"
  model_args: str = "embed_dim=32,hidden_size=128,num_layers=1"
  dataset: str = "auto"        # auto | text | digits | cifar10
  data_dir: str | None = None  # CIFAR-10 batches
  text_file: str | None = None  # UTF-8 text (default: pydoc_data)
  seq_len: int = 64
  compressor: str = DEFAULT_COMPRESSOR
  compressor_args: str = DEFAULT_COMPRESSOR_ARGS
  optimizer: str = "adam"      # sgd | momentum | nesterov | adam | adamw
  #                              | lamb | onebit_adam | onebit_lamb
  #                              | zero_one_adam
  optimizer_args: str = ""     # e.g. freeze_step=200 (jaxcomm optimizers)
  local: str = "none"          # none | local_sgd | adacomm |
  #                              overlap_local_sgd | diloco
  local_args: str = ""         # e.g. period=50,outer_lr=0.7 (see --local)
  delay: str = "none"          # none | pipe_sgd | stale_sgd
  delay_args: str = ""         # e.g. width=2 (pipe_sgd), tau=1 (stale_sgd)
  lr: float = 3e-3
  momentum: float = 0.9
  weight_decay: float = 0.0
  schedule: str = "cosine"     # constant | cosine | warmup_cosine | step
  warmup_steps: int = 50
  num_devices: int = 8
  slices: int = 1              # > 1: a ("dcn", "ici") pod mesh
  sharded_exchange: bool = False  # with slices: one exchange per slice
  mesh: str | None = None      # e.g. dcn=2,fsdp=4: a sharded model
  batch_size: int = 64         # global; a multiple of num_devices
  steps: int = 1500
  stop_after: int | None = None  # stop (and checkpoint) at this step
  seed: int = 0
  out_dir: str | None = None   # default runs/<model>-<compressor>-<time>
  checkpoint_every: int = 500
  keep_checkpoints: int = 2
  resume: bool = False
  resume_from: str | None = None  # a checkpoint directory; implies resume
  overwrite: bool = False
  eval_every: int = 0          # 0: only at the end
  eval_examples: int = 512
  log_every: int = 1
  progress: bool = True
  plot: bool = True
  platform: str = "cpu"        # cpu | default (whatever JAX finds)
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None

  # Fields that must agree between a checkpoint and the run resuming it.
  RESUME_KEYS = ("model", "model_args", "dataset", "text_file", "seq_len",
                 "compressor", "compressor_args", "optimizer",
                 "optimizer_args", "local", "local_args", "lr",
                 "momentum", "weight_decay", "schedule", "warmup_steps",
                 "batch_size", "steps", "seed", "slices",
                 "sharded_exchange")
