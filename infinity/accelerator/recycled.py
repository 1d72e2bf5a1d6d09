"""New device buffers on the CPU device, made of memory freed by earlier ones.

[Note: recycled device buffers] A GPU's new buffers come from torch's caching allocator: a
gather's new buffer reuses memory an earlier release freed. On the CPU device a new buffer
comes from the C library, and a parameter-sized one is a fresh mapping (always above 32 MiB,
and above 4 MiB once `unmap_large_allocations` has run): the kernel zeroes each page on first
touch and unmaps it on free, which costs many times the copy that fills it (0.29 s per GiB
against 0.05 s on the VM this was measured on). `RecycledBuffers` plays the caching
allocator's part for such buffers:
- Each buffer it hands out is a tensor over memory it keeps, made through a lease (a numpy
  view of that memory) which torch holds for as long as anything refers to the buffer's
  storage: every view, every `.data`, every tensor autograd saved. When torch lets go of the
  lease, the memory is free to hand out again. So memory is never reused while anything can
  still read it, and nothing has to give a buffer back.
- It keeps at most the most its buffers have held at once (`peak_bytes`) plus one buffer of
  the largest size (`limit_bytes`): when a new buffer would exceed that, free buffers are
  let go, smallest first. Buffers of different sizes are held most at different times (a
  model's embedding at the ends of a step, its layers in between), so keeping only the
  peak made every step let go of and map again about 0.35 GB at 0.5B (its peak held is
  0.2 GB); the one largest buffer more stops that (at 0.5B, 100 MB on a 1.05 GiB peak
  RSS). Between steps the free buffers stay mapped instead of going back to the kernel.
- Buffers below `MIN_BYTES` are allocated as usual: the C library's heap already reuses such
  memory.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

MIN_BYTES = 4 << 20
"""Smaller buffers are allocated as usual (see the note above): the mmap threshold that
`infinity.utils.host_memory.unmap_large_allocations` sets."""


class RecycledBuffers:
    """Host buffers of at least `MIN_BYTES`, handed out again once nothing refers to them
    (see the note above)."""

    def __init__(self) -> None:
        self._free: dict[int, list] = {}
        """Free memory by size in bytes: the keeper arrays (numpy, uint8)."""
        self._leases: dict[int, weakref.ref] = {}
        """The lease of each buffer handed out, by id, until torch lets go of it."""
        self.kept_bytes = 0
        """Bytes of every buffer kept, handed out or free."""
        self.held_bytes = 0
        """Bytes of the buffers handed out and still referred to."""
        self.peak_bytes = 0
        """The most `held_bytes` has been."""
        self.largest_bytes = 0
        """The largest buffer asked for."""
        self.reused = 0
        """Buffers handed out from free memory instead of newly allocated."""
        self._lock = threading.RLock()  # a lease may come back on any thread, or mid-call

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` and `dtype` that nothing else refers to (uninitialized)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                keeper = free.pop()
                self.reused += 1
            else:
                self._make_room(nbytes)
                keeper = torch.empty(nbytes, dtype=torch.uint8).numpy()
                self.kept_bytes += nbytes
            return self._lend(keeper, nbytes).view(dtype).view(shape)

    def _lend(self, keeper, nbytes: int) -> torch.Tensor:
        lease = keeper[:]  # a view: torch holds it, and drops it with the last reference

        def returned(ref: weakref.ref) -> None:
            # Torch has freed the storage: every tensor over this memory is gone.
            with self._lock:
                self._leases.pop(id(ref), None)
                self.held_bytes -= nbytes
                self._free.setdefault(nbytes, []).append(keeper)

        ref = weakref.ref(lease, returned)
        self._leases[id(ref)] = ref
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return torch.from_numpy(lease)

    def _make_room(self, nbytes: int) -> None:
        """Before allocating `nbytes`: let free buffers go, smallest first, while keeping them
        all would exceed `limit_bytes` (counting the new buffer)."""
        self.largest_bytes = max(self.largest_bytes, nbytes)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + nbytes)
        for size in sorted(self._free):
            free = self._free[size]
            while free and self.kept_bytes + nbytes > self.limit_bytes:
                free.pop()
                self.kept_bytes -= size

    @property
    def limit_bytes(self) -> int:
        """The most memory kept: the most ever held at once, and one largest buffer more."""
        return self.peak_bytes + self.largest_bytes

    def clear(self) -> None:
        """Let go of the free buffers (those handed out are freed by their last user), and
        learn the peak anew from what is held now."""
        with self._lock:
            for size, free in self._free.items():
                self.kept_bytes -= size * len(free)
                free.clear()
            self.peak_bytes, self.largest_bytes = self.held_bytes, 0
