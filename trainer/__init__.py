"""``train.py``'s code: the command line and config (:mod:`trainer.config`),
model and data (:mod:`trainer.model`), checkpoints on orbax's
``CheckpointManager`` (:mod:`trainer.checkpoints`) and the training loop with
its reports (:mod:`trainer.loop`)."""
