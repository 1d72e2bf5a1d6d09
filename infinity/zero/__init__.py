"""Stage-3 partitioning: the partitioned optimizer over sub-groups of parameter partitions."""

from infinity.zero.optimizer import PartitionedOptimizer, StepResult
from infinity.zero.sub_groups import Slot

__all__ = ["PartitionedOptimizer", "Slot", "StepResult"]
