"""The device interface: the only seam between Infinity and a particular accelerator.

It owns streams, events, pinned host memory, device memory counters, the host-device copy
counters and the named profiler ranges. It does not own any policy (what to fetch, when to
release): that lives in `infinity.zero`.
"""

from __future__ import annotations

import abc
import contextlib
import time
from dataclasses import dataclass

import torch

_NO_RANGE = contextlib.nullcontext()


def profile_range(name: str) -> contextlib.AbstractContextManager:
    """A named profiler range, `infinity::<component>::<op>`, recorded only while a torch
    profiler runs: otherwise a shared null context (a flag check, where opening a
    `record_function` costs about 5 us on every gather, release and sub-group)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE


@dataclass(slots=True)
class CopyCounters:
    """Running totals of the host-device copies made through `to_device`/`to_host`.

    `seconds` is the time the host spent in the copy calls: the whole copy on the CPU device
    and for pageable memory; for pinned memory on a GPU only the time to issue it (the copy
    itself runs on a stream, overlapping compute: see it in a `--profile` trace)."""

    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    seconds: float = 0.0


class Stream(abc.ABC):
    """An ordered queue of device work. On CPU every operation is synchronous."""

    @abc.abstractmethod
    def wait_stream(self, other: Stream) -> None: ...

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...


class Event(abc.ABC):
    """A point in a stream that other streams or the host can wait on."""

    @abc.abstractmethod
    def record(self, stream: Stream | None = None) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def query(self) -> bool: ...


class Accelerator(abc.ABC):
    """One device kind. Callers never branch on the kind; they call these verbs."""

    name: str
    device: torch.device
    shares_host_memory: bool = False
    """Device memory is host memory: a host tensor already is a device buffer, so a gather
    from a host home may alias the home instead of copying it (see [Note: gathered means
    resident] in infinity/zero/param.py)."""

    def __init__(self) -> None:
        self.copies = CopyCounters()

    @abc.abstractmethod
    def new_stream(self) -> Stream: ...

    @abc.abstractmethod
    def current_stream(self) -> Stream: ...

    @abc.abstractmethod
    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager: ...

    @abc.abstractmethod
    def new_event(self) -> Event: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def pin_supported(self) -> bool:
        """Whether host memory can be page-locked for asynchronous copies."""

    @abc.abstractmethod
    def empty_pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory allocated pinned directly (never pinned by copying)."""

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new device buffer (uninitialized)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Give the device memory kept for reuse, and no longer referred to, back."""

    @abc.abstractmethod
    def memory_allocated(self) -> int: ...

    def memory_free(self) -> tuple[int, int]:
        """(free, total) device memory now, by the driver's count ((0, 0) where the device
        memory is host RAM)."""
        return 0, 0

    @abc.abstractmethod
    def max_memory_allocated(self) -> int: ...

    @abc.abstractmethod
    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tell the caching allocator that `tensor` is in use on `stream`."""

    def to_device(
        self, host: torch.Tensor, stream: Stream | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy a host tensor to the device on `stream` (non-blocking when pinned).

        The result is always a new buffer (or `out`), never an alias of `host`.
        """
        stream = stream or self.current_stream()
        start = time.perf_counter()
        with self.use_stream(stream):
            if out is None:
                out = self.empty(host.shape, host.dtype)
            out.copy_(host, non_blocking=host.is_pinned())
        self.copies.seconds += time.perf_counter() - start
        self.copies.host_to_device_bytes += host.nbytes
        return out

    def to_host(
        self, dev: torch.Tensor, out: torch.Tensor, stream: Stream | None = None
    ) -> torch.Tensor:
        """Copy a device tensor into host buffer `out` on `stream`."""
        stream = stream or self.current_stream()
        start = time.perf_counter()
        with self.use_stream(stream):
            out.copy_(dev, non_blocking=out.is_pinned())
        self.copies.seconds += time.perf_counter() - start
        self.copies.device_to_host_bytes += dev.nbytes
        return out

    def device_name(self) -> str:
        """The device's product name, for reports."""
        return self.name

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """What torch.profiler records on this device (the host's ops, and its kernels)."""
        return [torch.profiler.ProfilerActivity.CPU]

    def range(self, name: str) -> contextlib.AbstractContextManager:
        """A named profiler range, `infinity::<component>::<op>` (see `profile_range`)."""
        return profile_range(name)
