"""CUDA as the device: real streams and events, pinned host memory, non-blocking copies.

This is the only module (with its package) allowed to touch `torch.cuda`; a test checks it.
"""

from __future__ import annotations

import contextlib
import os

import torch

from infinity.accelerator.base import Accelerator, Event, Stream


class CudaStream(Stream):
    def __init__(self, raw: torch.cuda.Stream) -> None:
        self.raw = raw

    def wait_stream(self, other: Stream) -> None:
        self.raw.wait_stream(other.raw)  # type: ignore[attr-defined]

    def wait_event(self, event: Event) -> None:
        self.raw.wait_event(event.raw)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaEvent(Event):
    def __init__(self) -> None:
        self.raw = torch.cuda.Event()

    def record(self, stream: Stream | None = None) -> None:
        self.raw.record(stream.raw if stream is not None else None)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return self.raw.query()


def launched_index() -> int:
    """The device this process trains on: the current one; or, when a launcher (torchrun)
    started several processes (WORLD_SIZE > 1) and the current device is still the default
    0, the device of LOCAL_RANK, made current, as DeepSpeed's engine picks it. Without this
    a script calling `infinity.initialize` under torchrun would put every local rank on
    device 0. A process that sees fewer devices than its LOCAL_RANK (CUDA_VISIBLE_DEVICES
    set per rank) keeps the current one."""
    current = torch.cuda.current_device()
    local = int(os.environ.get("LOCAL_RANK") or 0)
    if current != 0 or int(os.environ.get("WORLD_SIZE") or 1) <= 1:
        return current
    if 0 < local < torch.cuda.device_count():
        torch.cuda.set_device(local)
        return local
    return current


class CudaAccelerator(Accelerator):
    name = "cuda"

    def __init__(self, index: int | None = None) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the CUDA accelerator was requested but torch sees no CUDA device; "
                "install a CUDA build of torch or set INFINITY_ACCELERATOR=cpu"
            )
        index = launched_index() if index is None else index
        self.device = torch.device("cuda", index)

    def new_stream(self) -> Stream:
        return CudaStream(torch.cuda.Stream(device=self.device))

    def current_stream(self) -> Stream:
        return CudaStream(torch.cuda.current_stream(self.device))

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream.raw)  # type: ignore[attr-defined]

    def new_event(self) -> Event:
        return CudaEvent()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def pin_supported(self) -> bool:
        return True

    def empty_pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def memory_free(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream.raw)  # type: ignore[attr-defined]
