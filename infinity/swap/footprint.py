"""What a storage tier holds, in bytes: the `Footprint` record.

Owns the record only. Each tier states its own footprint through one function beside it,
which its constructor sizes its allocations with: `grad_footprint` (grad_plan.py),
`nvme_state_footprint` (nvme_state.py), `host_state_footprint` (state_tier.py),
`param_pool_nbytes` (pool.py), `weights_footprint` (infinity/zero/weights.py). The estimate
(`infinity.estimate.sizing`) calls those same functions instead of restating their rules.
"""

from __future__ import annotations

from typing import NamedTuple


class Footprint(NamedTuple):
    """One tier's bytes for one rank."""

    host: int
    """Host memory it allocates (buffers, resident state)."""
    disk: int = 0
    """Bytes it lays out on NVMe (extents padded as the swap store reserves them)."""
