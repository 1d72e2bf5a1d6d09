"""Swapping tensors between host memory and NVMe: async I/O, the swap store, buffer pools,
and the storage tiers of parameters and optimizer state."""
