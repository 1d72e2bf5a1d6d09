"""Swapping tensors between host memory and NVMe: the swap store, buffer pools, and the
storage tiers of parameters, gradients and optimizer state. The I/O itself is
`infinity.io`'s."""

from infinity.swap.grad_store import HostGradStore, NvmeGradError, NvmeGradStore
from infinity.swap.nvme_state import NvmeStateError, NvmeStateStore
from infinity.swap.param_store import NvmeParamError, NvmeParamStore
from infinity.swap.pool import PinnedBufferPool
from infinity.swap.state_store import HostStateStore, StateStore, SubGroupState
from infinity.swap.store import SwapStore, SwapStoreError
from infinity.swap.tiers import SwapStores, make_grad_store, make_param_store, make_state_store

__all__ = [
    "HostGradStore",
    "HostStateStore",
    "NvmeGradError",
    "NvmeGradStore",
    "NvmeParamError",
    "NvmeParamStore",
    "NvmeStateError",
    "NvmeStateStore",
    "PinnedBufferPool",
    "StateStore",
    "SubGroupState",
    "SwapStore",
    "SwapStoreError",
    "SwapStores",
    "make_grad_store",
    "make_param_store",
    "make_state_store",
]
