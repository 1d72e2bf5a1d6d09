"""Stage-3 partitioning: the partitioned optimizer over sub-groups of parameter partitions."""

from infinity.zero.optimizer import PartitionedOptimizer, StepResult, sub_group_numels
from infinity.zero.sub_groups import Slot

__all__ = ["PartitionedOptimizer", "Slot", "StepResult", "sub_group_numels"]
