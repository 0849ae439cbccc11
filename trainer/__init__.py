"""``train.py``'s code: a run's config (:mod:`trainer.settings`), the
command line that fills it in (:mod:`trainer.config`), compressors and
optimizers from the registry (:mod:`trainer.optimizers`), model and data
(:mod:`trainer.model`), checkpoints on orbax's ``CheckpointManager``
(:mod:`trainer.checkpoints`), the training loop (:mod:`trainer.loop`),
resuming a run (:mod:`trainer.resume`), the bytes its steps move
(:mod:`trainer.accounting`) and its reports (:mod:`trainer.reporting`)."""
