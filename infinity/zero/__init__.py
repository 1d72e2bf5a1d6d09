"""ZeRO stage 3: partitioned parameters, their gather/release hooks, the coordinator, and the
partitioned optimizer over sub-groups of the trainable slots.

Owns one record per parameter (`OffloadParam`) with its home (`infinity.zero.home`),
building partitioned models (`init`, `partition_model`), the hooks that gather a module's
parameters around its forward and backward, the coordinator that prefetches along the
traced order under the live budget, and the CPU-Adam step over fp32 masters and gradient
sums (`PartitionedOptimizer`). With several ranks each keeps its shard of every
parameter (`shard`), gathers the others' on use (`gather`) and reduce-scatters gradients
into its slots (`grad_reduce`).
"""

from infinity.zero.backward_entry import BackwardEntry
from infinity.zero.build import HomePlan, communication_dtype, init, model_dtype, partition_model
from infinity.zero.coordinator import Coordinator, LiveEvent
from infinity.zero.home import HomeTier, HostHome, NvmeHome, ParamHome
from infinity.zero.hooks import CallState, GatherOnUse, ModelHooks, install_grad_hooks
from infinity.zero.iteration import Phase
from infinity.zero.optimizer import PartitionedOptimizer, StepResult
from infinity.zero.param import OffloadParam, ParamState, frozen_on_nvme
from infinity.zero.sub_groups import Slot, optimizer_layout, sub_group_numels
from infinity.zero.trace import Trace
from infinity.zero.unit import ModuleUnit
from infinity.zero.weights import make_weights

__all__ = [
    "BackwardEntry",
    "CallState",
    "Coordinator",
    "GatherOnUse",
    "HomePlan",
    "HomeTier",
    "HostHome",
    "LiveEvent",
    "ModelHooks",
    "ModuleUnit",
    "NvmeHome",
    "OffloadParam",
    "ParamHome",
    "ParamState",
    "PartitionedOptimizer",
    "Phase",
    "Slot",
    "StepResult",
    "Trace",
    "communication_dtype",
    "frozen_on_nvme",
    "init",
    "install_grad_hooks",
    "make_weights",
    "model_dtype",
    "optimizer_layout",
    "partition_model",
    "sub_group_numels",
]
