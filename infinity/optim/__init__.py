"""Optimizer math the engine runs: the flat Adam/AdamW step (native kernel with a torch twin)
and its hyperparameter record, loss scaling, LR schedules.

The engine's optimizer is `infinity.zero.PartitionedOptimizer`, which calls `adam_step_flat`
on its flat sub-groups. `CPUAdam` is a standalone torch.optim.Optimizer over the same step, for
code outside the engine; the engine does not use it.
"""

from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.functional import adam_step_flat, adam_step_flat_reference
from infinity.optim.groups import ParamGroup
from infinity.optim.hyper import AdamHyper
from infinity.optim.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    NoScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)
from infinity.optim.schedules import Schedule, build_schedule, step_lrs

__all__ = [
    # The step the engine runs, and its hyperparameters.
    "AdamHyper",
    "ParamGroup",
    "adam_step_flat",
    "adam_step_flat_reference",
    # Loss scaling and learning-rate schedules.
    "DynamicLossScaler",
    "LossScaler",
    "NoScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "has_overflow",
    "Schedule",
    "build_schedule",
    "step_lrs",
    # Standalone, outside the engine.
    "CPUAdam",
]
