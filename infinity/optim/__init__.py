"""Optimizers: CPU-Adam (native, with a torch twin), loss scaling, LR schedules."""

from infinity.optim.functional import adam_step_flat
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
    "DynamicLossScaler",
    "LossScaler",
    "NoScaler",
    "Schedule",
    "StaticLossScaler",
    "adam_step_flat",
    "build_loss_scaler",
    "build_schedule",
    "has_overflow",
]
