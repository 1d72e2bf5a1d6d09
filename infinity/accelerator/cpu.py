"""The CPU as the device: separate host memory held to the same budgets as a GPU.

Streams and events are null objects (all work is synchronous), so callers never need an
`if stream is not None` branch. Device memory is counted by the callers that allocate it.
"""

from __future__ import annotations

import contextlib

import torch

from infinity.accelerator.base import Accelerator, Event, Stream


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

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")

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

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        pass
