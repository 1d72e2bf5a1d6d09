"""ZeRO stage 3: partitioned parameters, their gather/release hooks and the coordinator.

Owns one record per parameter (`OffloadParam`), building partitioned models (`init`,
`partition_model`), the hooks that gather a module's parameters around its forward and
backward, and the coordinator that prefetches along the traced order under the live budget.
"""

from infinity.zero.build import init, model_dtype, partition_model
from infinity.zero.coordinator import Coordinator, Phase
from infinity.zero.hooks import GatherOnUse, ModelHooks, install_grad_hooks
from infinity.zero.param import HomeTier, OffloadParam, ParamState
from infinity.zero.trace import Trace
from infinity.zero.unit import ModuleUnit

__all__ = [
    "Coordinator",
    "GatherOnUse",
    "HomeTier",
    "ModelHooks",
    "ModuleUnit",
    "OffloadParam",
    "ParamState",
    "Phase",
    "Trace",
    "init",
    "install_grad_hooks",
    "model_dtype",
    "partition_model",
]
