"""One record per partitioned parameter: where its weights live and whether they are gathered.

`OffloadParam` owns the host partition (the parameter's home copy, flat, model dtype) and the
device buffer while gathered. It never patches attributes onto the `nn.Parameter`: the
parameter object stays in its module, and only its `.data` is swapped between an empty tensor
(released) and the gathered device buffer. Policy (what to fetch, when to release, the budget)
lives in `infinity.zero.coordinator`.

[Note: gathered means copied] On every accelerator a gathered parameter is a copy of its
partition in a new device buffer (`Accelerator.to_device`), never an alias. On the CPU the
"device" is simply separate host memory, so the copy path and the live budget are exercised
exactly as on a GPU.

[Note: swapping .data] Autograd saves leaf parameters by reference. Replacing `param.data`
keeps the parameter's version counter, so a parameter released after forward and gathered
again before its module's backward gives backward the same values it saw in forward (the
engine gathers a module's parameters again before its backward runs).
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from infinity.accelerator import Accelerator, Event, Stream

_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def empty_like_released(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The shared zero-element tensor a released parameter's `.data` points to."""
    key = (dtype, device)
    t = _EMPTY.get(key)
    if t is None:
        t = _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return t


class HomeTier(enum.Enum):
    """Where a parameter's partition lives between uses."""

    HOST = "host"
    """Host memory (pinned when the accelerator supports it)."""
    NVME = "nvme"
    """The NVMe parameter store (a seam: `fetch` will first swap the partition in)."""


class ParamState(enum.Enum):
    """What is resident for one parameter."""

    RELEASED = "released"
    """Only the partition exists; `param.data` is an empty tensor."""
    INFLIGHT = "inflight"
    """A copy partition -> device buffer was issued on the copy stream and not yet waited."""
    LIVE = "live"
    """`param.data` is the gathered device buffer, ready for compute."""


class OffloadParam:
    """One parameter: its shape, dtype, home tier, partition and gathered state.

    A tied parameter (one `nn.Parameter` registered in several modules) has one record.
    """

    __slots__ = (
        "name",
        "param",
        "shape",
        "dtype",
        "numel",
        "home",
        "state",
        "partition",
        "device_tensor",
        "persistent",
        "slot",
        "pins",
        "device",
        "_event",
    )

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        partition: torch.Tensor,
        *,
        device: torch.device,
        home: HomeTier = HomeTier.HOST,
        persistent: bool = False,
    ) -> None:
        if partition.dim() != 1 or partition.numel() != param.numel():
            raise ValueError(
                f"partition of {name!r} must be 1-D with {param.numel()} elements, "
                f"got shape {tuple(partition.shape)}"
            )
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.dtype = partition.dtype
        self.numel = partition.numel()
        self.home = home
        self.state = ParamState.RELEASED
        self.partition = partition
        self.device_tensor: torch.Tensor | None = None
        self.persistent = persistent
        self.slot: int | None = None
        """Index of this parameter in the optimizer's slots; None when frozen."""
        self.pins = 0
        """How many running modules need this parameter now (never released while > 0)."""
        self.device = device
        """The accelerator's device (where gathered buffers and released stubs live)."""
        self._event: Event | None = None

    def __repr__(self) -> str:
        return f"OffloadParam({self.name!r}, {self.shape}, {self.dtype}, {self.state.name})"

    @property
    def trainable(self) -> bool:
        return self.slot is not None

    def _assert_state(self, *states: ParamState) -> None:
        if self.state not in states:
            raise RuntimeError(
                f"parameter {self.name!r} is {self.state.name}, expected one of "
                f"{[s.name for s in states]}"
            )

    def offload(self) -> None:
        """Drop the parameter's own values (they live in the partition): RELEASED stays."""
        self._assert_state(ParamState.RELEASED)
        self.param.data = empty_like_released(self.dtype, self.device)

    def fetch(self, accel: Accelerator, stream: Stream) -> None:
        """Start copying the partition into a new device buffer on `stream` (RELEASED ->
        INFLIGHT). The only path from the home tier to the device."""
        self._assert_state(ParamState.RELEASED)
        if self.home is not HomeTier.HOST:
            raise NotImplementedError(
                f"parameter {self.name!r} lives on {self.home.value}; the NVMe parameter tier "
                f"is not available yet: set zero_optimization.offload_param.device to 'cpu'"
            )
        self.device_tensor = accel.to_device(self.partition, stream)
        self._event = accel.new_event()
        self._event.record(stream)
        self.state = ParamState.INFLIGHT

    def wait(self, accel: Accelerator) -> None:
        """Make the compute stream wait for the copy and point `param.data` at the buffer
        (INFLIGHT -> LIVE)."""
        self._assert_state(ParamState.INFLIGHT)
        assert self.device_tensor is not None and self._event is not None
        compute = accel.current_stream()
        compute.wait_event(self._event)
        # The buffer was allocated on the copy stream and is used on the compute stream.
        accel.record_stream(self.device_tensor, compute)
        self._event = None
        self.param.data = self.device_tensor.view(self.shape)
        self.state = ParamState.LIVE

    def release(self) -> None:
        """Free the device buffer (LIVE/INFLIGHT -> RELEASED)."""
        self._assert_state(ParamState.LIVE, ParamState.INFLIGHT)
        if self.state is ParamState.INFLIGHT and self._event is not None:
            self._event.synchronize()
        self._event = None
        self.device_tensor = None
        self.param.data = empty_like_released(self.dtype, self.device)
        self.state = ParamState.RELEASED

    def refresh(self, accel: Accelerator) -> None:
        """Copy the partition into the live buffer again (after the optimizer rewrote it)."""
        self._assert_state(ParamState.LIVE)
        assert self.device_tensor is not None
        accel.to_device(self.partition, out=self.device_tensor)

    def repoint(self, partition: torch.Tensor) -> None:
        """Adopt `partition` as the home copy (the optimizer's flat buffer view)."""
        if partition.numel() != self.numel or partition.dtype != self.dtype:
            raise ValueError(
                f"new partition for {self.name!r}: {partition.numel()} x {partition.dtype}, "
                f"expected {self.numel} x {self.dtype}"
            )
        if partition.data_ptr() != self.partition.data_ptr():
            partition.copy_(self.partition)
        self.partition = partition
