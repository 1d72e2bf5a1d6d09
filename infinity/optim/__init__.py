"""Optimizers: CPU-Adam (native, with a torch twin), loss scaling, LR schedules."""

from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.functional import adam_step_flat, adam_step_flat_reference
from infinity.optim.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    NoScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)
from infinity.optim.schedules import Schedule, build_schedule

__all__ = [
    "CPUAdam",
    "DynamicLossScaler",
    "LossScaler",
    "NoScaler",
    "Schedule",
    "StaticLossScaler",
    "adam_step_flat",
    "adam_step_flat_reference",
    "build_loss_scaler",
    "build_schedule",
    "has_overflow",
]
