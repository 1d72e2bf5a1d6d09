"""Optimizers: CPU-Adam (native, with a torch twin), loss scaling, LR schedules."""

from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.functional import adam_step_flat, adam_step_flat_reference

__all__ = ["CPUAdam", "adam_step_flat", "adam_step_flat_reference"]
