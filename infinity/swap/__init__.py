"""Swapping tensors between host memory and NVMe: the swap store, buffer pools, and the
storage tiers of parameters, gradients and optimizer state. The I/O itself is
`infinity.io`'s."""

from infinity.swap.grad_tier import GradTier, HostGradTier, NvmeGradError, NvmeGradTier
from infinity.swap.nvme_state import NvmeStateError, NvmeStateTier
from infinity.swap.param_tier import NvmeParamError, NvmeParamTier
from infinity.swap.pool import PinnedBufferPool
from infinity.swap.state_tier import (
    HostStateTier,
    StateFormat,
    StateTier,
    SubGroupState,
    SubGroupState8,
)
from infinity.swap.store import SwapStore, SwapStoreError
from infinity.swap.tiers import SwapStores, make_grad_tier, make_param_tier, make_state_tier

__all__ = [
    "GradTier",
    "HostGradTier",
    "HostStateTier",
    "NvmeGradError",
    "NvmeGradTier",
    "NvmeParamError",
    "NvmeParamTier",
    "NvmeStateError",
    "NvmeStateTier",
    "PinnedBufferPool",
    "StateFormat",
    "StateTier",
    "SubGroupState",
    "SubGroupState8",
    "SwapStore",
    "SwapStoreError",
    "SwapStores",
    "make_grad_tier",
    "make_param_tier",
    "make_state_tier",
]
