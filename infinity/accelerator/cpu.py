"""The CPU as the device: host memory held to the same budgets as a GPU.

Streams and events are null objects (all work is synchronous), so callers never need an
`if stream is not None` branch. Device memory is counted by the callers that allocate it.
Device memory is host memory, so by default a gather from a host home aliases it instead of
copying (`alias_host`; see [Note: gathered means resident] in infinity/zero/param.py), and
new parameter-sized buffers reuse ones nothing refers to any more (see [Note: recycled device
buffers] in infinity/accelerator/recycled.py).
"""

from __future__ import annotations

import contextlib

import torch

from infinity.accelerator.base import Accelerator, Event, Stream
from infinity.accelerator.recycled import RecycledBuffers


class NullStream(Stream):
    def wait_stream(self, other: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class NullEvent(Event):
    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_NULL_STREAM = NullStream()


class CpuAccelerator(Accelerator):
    name = "cpu"

    def __init__(self, *, alias_host: bool = True) -> None:
        """`alias_host=False` makes every gather a copy into a new buffer, as on a GPU: the
        tests run the copy path on a machine without one."""
        super().__init__()
        self.device = torch.device("cpu")
        self.shares_host_memory = alias_host
        self.buffers = RecycledBuffers()

    def __repr__(self) -> str:
        return f"CpuAccelerator(alias_host={self.shares_host_memory})"

    def new_stream(self) -> Stream:
        return _NULL_STREAM

    def current_stream(self) -> Stream:
        return _NULL_STREAM

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_event(self) -> Event:
        return NullEvent()

    def synchronize(self) -> None:
        pass

    def pin_supported(self) -> bool:
        return False

    def empty_pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.buffers.empty(shape, dtype)

    def empty_cache(self) -> None:
        self.buffers.clear()

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        pass
