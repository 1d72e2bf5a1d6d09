"""The NVMe state tier's sizes, as plain integers: one sub-group's state on disk, the sweep's
pipeline buffers and the tier's footprint. The estimate and the tier both size from here."""

from __future__ import annotations

from collections.abc import Sequence

from infinity.swap.footprint import Footprint
from infinity.swap.state_format import StateFormat
from infinity.swap.store import align_up, reserved_nbytes


def state_nbytes(numel: int, fmt: StateFormat = StateFormat.ADAMW) -> int:
    """Bytes of one sub-group's state on disk: master, exp_avg and exp_avg_sq in fp32, or
    the 8-bit layout ([Note: the 8-bit state layout] in state_format.py)."""
    return fmt.nbytes(numel)


def pipeline_buffer_count(buffer_count: int, num_sub_groups: int) -> int:
    """Host buffers the sweep allocates: `buffer_count`, but no more than there are
    sub-groups, since a sub-group sits in one buffer at a time and the rest would never be
    used (LoRA adapters in one sub-group need one buffer, not four)."""
    return max(1, min(buffer_count, num_sub_groups))


def state_buffers(
    numels: Sequence[int], buffer_count: int, fmt: StateFormat = StateFormat.ADAMW
) -> tuple[int, int]:
    """`NvmeStateTier`'s pipeline buffers: (count, bytes of each: the largest sub-group's
    extent, page-aligned)."""
    slot = max((reserved_nbytes(state_nbytes(n, fmt)) for n in numels), default=4096)
    return pipeline_buffer_count(buffer_count, len(numels)), align_up(slot)


def nvme_state_footprint(
    numels: Sequence[int], buffer_count: int, fmt: StateFormat = StateFormat.ADAMW
) -> Footprint:
    """`NvmeStateTier`'s pipeline buffers and its extents (one sub-group's state each)."""
    count, nbytes = state_buffers(numels, buffer_count, fmt)
    return Footprint(count * nbytes, sum(reserved_nbytes(state_nbytes(n, fmt)) for n in numels))
