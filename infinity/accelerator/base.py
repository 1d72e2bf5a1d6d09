"""The device interface: the only seam between Infinity and a particular accelerator.

It owns streams, events, pinned host memory and device memory counters. It does not own
any policy (what to fetch, when to release): that lives in `infinity.zero`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch


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

    @abc.abstractmethod
    def memory_allocated(self) -> int: ...

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
        with self.use_stream(stream):
            if out is None:
                out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=host.is_pinned())
        return out

    def to_host(
        self, dev: torch.Tensor, out: torch.Tensor, stream: Stream | None = None
    ) -> torch.Tensor:
        """Copy a device tensor into host buffer `out` on `stream`."""
        stream = stream or self.current_stream()
        with self.use_stream(stream):
            out.copy_(dev, non_blocking=out.is_pinned())
        return out

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        """A named profiler range, `infinity::<component>::<op>`."""
        with torch.profiler.record_function(name):
            yield
