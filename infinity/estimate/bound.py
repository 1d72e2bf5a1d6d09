"""What limits a step: the record `result` computes (`bound_of`) and `advice` reads, apart
from both so that the advice, which reads a finished estimate, is not imported by it in turn."""

from __future__ import annotations

import enum


class Bound(enum.StrEnum):
    """What limits the step (the largest of the step's time components)."""

    COMPUTE = "compute"
    NVME = "nvme"
    CPU_ADAM = "cpu_adam"
    COPIES = "copies"
