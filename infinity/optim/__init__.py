"""Optimizers: CPU-Adam (native, with a torch twin), loss scaling, LR schedules."""

from infinity.optim.functional import adam_step_flat

__all__ = ["adam_step_flat"]
