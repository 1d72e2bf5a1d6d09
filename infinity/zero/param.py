"""One record per partitioned parameter: where its weights live and whether they are gathered.

`OffloadParam` owns the parameter's home copy (flat, model dtype: a host partition, or a
layout in the NVMe parameter store) and the device buffer while gathered. It never patches
attributes onto the `nn.Parameter`: the parameter object stays in its module, and only its
`.data` is swapped between an empty tensor (released) and the gathered device buffer. Policy
(what to fetch, when to release, the budget) lives in `infinity.zero.coordinator`.

[Note: gathered means copied] On every accelerator a gathered parameter is a copy of its
partition in a new device buffer (`Accelerator.to_device`), never an alias. On the CPU the
"device" is simply separate host memory, so the copy path and the live budget are exercised
exactly as on a GPU.

[Note: fetching from NVMe] With an NVMe home, `fetch` issues a read of the partition into a
buffer of the store's pinned pool (INFLIGHT, no device buffer yet); `wait` waits for the read,
copies the buffer into a new device buffer on the copy stream, makes the compute stream wait
for that copy, and gives the pool buffer back only once the copy has read it (the host waits
for the copy's event; on the CPU the copy is synchronous). A failed read leaves the record
RELEASED with its buffer given back.

[Note: swapping .data] Autograd saves leaf parameters by reference. Replacing `param.data`
keeps the parameter's version counter, so a parameter released after forward and gathered
again before its module's backward gives backward the same values it saw in forward (the
engine gathers a module's parameters again before its backward runs).
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from infinity.accelerator import Accelerator, Event, Stream
from infinity.config import OffloadParamConfig
from infinity.swap.param_store import NvmeParamError
from infinity.swap.pool import aligned_host_bytes

if TYPE_CHECKING:
    from infinity.swap.param_store import NvmeParamStore, SwapFuture

logger = logging.getLogger(__name__)

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
    """The NVMe parameter store (see [Note: fetching from NVMe])."""


class ParamState(enum.Enum):
    """What is resident for one parameter."""

    RELEASED = "released"
    """Only the partition exists; `param.data` is an empty tensor."""
    INFLIGHT = "inflight"
    """A copy home -> device buffer (or, from NVMe, a read into a pool buffer) was issued and
    not yet waited."""
    LIVE = "live"
    """`param.data` is the gathered device buffer, ready for compute."""


class OffloadParam:
    """One parameter: its shape, dtype, home tier, home copy and gathered state.

    A tied parameter (one `nn.Parameter` registered in several modules) has one record. A
    HOST home keeps `partition`; an NVMe home has `partition` None and `store` set, and the
    parameter's name is its key in the store.
    """

    __slots__ = (
        "name",
        "param",
        "shape",
        "dtype",
        "itemsize",
        "numel",
        "home",
        "state",
        "partition",
        "store",
        "device_tensor",
        "persistent",
        "slot",
        "pins",
        "device",
        "_event",
        "_read",
        "_stream",
    )

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        partition: torch.Tensor | None,
        *,
        device: torch.device,
        home: HomeTier = HomeTier.HOST,
        persistent: bool = False,
        store: NvmeParamStore | None = None,
    ) -> None:
        if home is HomeTier.NVME:
            if store is None or partition is not None:
                raise ValueError(
                    f"parameter {name!r}: an NVMe home takes store=<NvmeParamStore> and "
                    f"partition=None (got store={store!r}, partition "
                    f"{'given' if partition is not None else 'None'}); to move a host "
                    f"partition there, build it HOST and call move_home_to_nvme(store, write=True)"
                )
            layout = store.layout(name)
            dtype, numel = layout.dtype, layout.numel
        else:
            if partition is None:
                raise ValueError(f"parameter {name!r}: a HOST home needs its partition")
            dtype, numel = partition.dtype, partition.numel()
        if (partition is not None and partition.dim() != 1) or numel != param.numel():
            shape = tuple(partition.shape) if partition is not None else (numel,)
            raise ValueError(
                f"partition of {name!r} must be 1-D with {param.numel()} elements, "
                f"got shape {shape}"
            )
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        """Bytes per element of the home copy and of the gathered buffer."""
        self.numel = numel
        self.home = home
        self.state = ParamState.RELEASED
        self.partition = partition
        self.store = store
        self.device_tensor: torch.Tensor | None = None
        self.persistent = persistent
        self.slot: int | None = None
        """Index of this parameter in the optimizer's slots; None when frozen."""
        self.pins = 0
        """How many running modules need this parameter now (never released while > 0)."""
        self.device = device
        """The accelerator's device (where gathered buffers and released stubs live)."""
        self._event: Event | None = None
        self._read: SwapFuture | None = None
        """The NVMe read in flight (INFLIGHT from an NVMe home)."""
        self._stream: Stream | None = None

    def __repr__(self) -> str:
        return f"OffloadParam({self.name!r}, {self.shape}, {self.dtype}, {self.state.name})"

    @property
    def trainable(self) -> bool:
        return self.slot is not None

    @property
    def reading(self) -> bool:
        """INFLIGHT with an NVMe read holding a pool buffer."""
        return self._read is not None

    def read_done(self) -> bool:
        """Whether an NVMe read in flight has finished (never blocks)."""
        return self._read is not None and self._read.done()

    def _assert_state(self, *states: ParamState) -> None:
        if self.state not in states:
            raise RuntimeError(
                f"parameter {self.name!r} is {self.state.name}, expected one of "
                f"{[s.name for s in states]}"
            )

    def offload(self) -> None:
        """Drop the parameter's own values (they live in the home copy): RELEASED stays."""
        self._assert_state(ParamState.RELEASED)
        self.param.data = empty_like_released(self.dtype, self.device)

    # ---- the home tier ---------------------------------------------------------------

    def move_home_to_nvme(self, store: NvmeParamStore, *, write: bool) -> None:
        """Make `store` (where this parameter's name is reserved) the home. `write=True`
        swaps the current partition out and waits; `write=False` when the owner of the flat
        space (the optimizer) writes it. The host partition is dropped either way."""
        self._assert_state(ParamState.RELEASED, ParamState.LIVE)
        if self.home is not HomeTier.HOST:
            raise RuntimeError(f"parameter {self.name!r} already lives on {self.home.value}")
        layout = store.layout(self.name)
        if layout.numel != self.numel or layout.dtype != self.dtype:
            raise ValueError(
                f"NVMe home of {self.name!r} holds {layout.numel} x {layout.dtype}, the "
                f"parameter is {self.numel} x {self.dtype}; reserve it with its own size"
            )
        if write:
            assert self.partition is not None
            store.swap_out(self.name, self.partition).wait()
        self.home, self.store, self.partition = HomeTier.NVME, store, None

    def read_home(self) -> torch.Tensor:
        """A flat host copy of the weights in their home (model dtype)."""
        if self.home is HomeTier.HOST:
            assert self.partition is not None
            return self.partition.clone()
        assert self.store is not None
        nbytes = self.numel * self.itemsize
        raw, _ = aligned_host_bytes(max(nbytes, 1), pin=False)  # page-aligned: O_DIRECT
        out = raw[:nbytes].view(self.dtype)
        return self.store.swap_in(self.name, out).wait()

    def write_home(self, src: torch.Tensor) -> None:
        """Replace the weights in their home with `src` (numel elements); durable on return.
        A LIVE buffer keeps the old values until `refresh`."""
        if src.numel() != self.numel:
            raise ValueError(
                f"write_home of {self.name!r}: {src.numel()} elements, expected {self.numel}"
            )
        if self.home is HomeTier.HOST:
            assert self.partition is not None
            self.partition.copy_(src.reshape(-1))
            return
        assert self.store is not None
        flat = src.detach().to(device="cpu", dtype=self.dtype).reshape(-1).contiguous()
        self.store.swap_out(self.name, flat).wait()

    # ---- gathering -------------------------------------------------------------------

    def fetch(self, accel: Accelerator, stream: Stream, *, block: bool = True) -> bool:
        """Start bringing the home copy to a new device buffer (RELEASED -> INFLIGHT): a copy
        on `stream` from the host, or a read into a pool buffer from NVMe. The only path from
        the home tier to the device. False (still RELEASED, nothing issued) when `block` is
        False and the NVMe pool has no free buffer."""
        self._assert_state(ParamState.RELEASED)
        if self.home is HomeTier.NVME:
            assert self.store is not None
            read = self.store.swap_in(self.name, block=block)
            if read is None:
                return False
            self._read, self._stream = read, stream
        else:
            self.device_tensor = accel.to_device(self.partition, stream)
            self._event = accel.new_event()
            self._event.record(stream)
        self.state = ParamState.INFLIGHT
        return True

    def wait(self, accel: Accelerator) -> None:
        """Make the compute stream wait for the copy and point `param.data` at the buffer
        (INFLIGHT -> LIVE). From NVMe, first wait for the read and copy it (see [Note:
        fetching from NVMe]); a failed read raises NvmeParamError, leaving RELEASED."""
        self._assert_state(ParamState.INFLIGHT)
        if self._read is not None:
            self._land(accel)
        assert self.device_tensor is not None and self._event is not None
        compute = accel.current_stream()
        compute.wait_event(self._event)
        # The buffer was allocated on the copy stream and is used on the compute stream.
        accel.record_stream(self.device_tensor, compute)
        self._event = None
        self.param.data = self.device_tensor.view(self.shape)
        self.state = ParamState.LIVE

    def finish_read(self, accel: Accelerator) -> None:
        """From NVMe: wait for the read and copy it to the new device buffer, giving the pool
        buffer back. The parameter stays INFLIGHT: only `wait` makes it LIVE, so reads can
        finish in any order without changing what is gathered."""
        self._assert_state(ParamState.INFLIGHT)
        if self._read is not None:
            self._land(accel)

    def _land(self, accel: Accelerator) -> None:
        """The NVMe read: wait, copy the pool buffer to a new device buffer, give it back."""
        read, self._read = self._read, None
        assert read is not None and self._stream is not None
        try:
            host = read.wait()
            self.device_tensor = self._from_staging(accel, host, self._stream)
            self._event = accel.new_event()
            self._event.record(self._stream)
        except BaseException:
            self._drop()
            raise
        finally:
            assert self.store is not None
            self.store.release(read)
        self._stream = None

    def _from_staging(
        self,
        accel: Accelerator,
        host: torch.Tensor,
        stream: Stream,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Copy a landed pool buffer to the device on `stream`; returns once the copy has
        read the buffer, so the caller may give it back."""
        dev = accel.to_device(host, stream, out=out)
        done = accel.new_event()
        done.record(stream)
        done.synchronize()
        return dev

    def release(self) -> None:
        """Free the device buffer (LIVE/INFLIGHT -> RELEASED). An NVMe read in flight lands
        first and its pool buffer is given back (its failure, if any, is only logged: its
        data is no longer wanted)."""
        self._assert_state(ParamState.LIVE, ParamState.INFLIGHT)
        if self._read is not None:
            read, self._read = self._read, None
            try:
                read.wait()
            except NvmeParamError as e:
                logger.warning("dropped NVMe read of %s failed: %s", self.name, e)
            finally:
                assert self.store is not None
                self.store.release(read)
        elif self.state is ParamState.INFLIGHT and self._event is not None:
            self._event.synchronize()
        self._drop()

    def _drop(self) -> None:
        self._event = None
        self._stream = None
        self.device_tensor = None
        self.param.data = empty_like_released(self.dtype, self.device)
        self.state = ParamState.RELEASED

    def refresh(self, accel: Accelerator) -> None:
        """Copy the home copy into the live buffer again (after the optimizer rewrote it);
        from NVMe through a pool buffer (waits for one)."""
        self._assert_state(ParamState.LIVE)
        assert self.device_tensor is not None
        if self.home is HomeTier.HOST:
            accel.to_device(self.partition, out=self.device_tensor)
            return
        assert self.store is not None
        read = self.store.swap_in(self.name)
        assert read is not None
        try:
            host = read.wait()
            self._from_staging(accel, host, accel.current_stream(), out=self.device_tensor)
        finally:
            self.store.release(read)

    def update_live(self, accel: Accelerator, start: int, src: torch.Tensor) -> None:
        """Copy new weights into the live buffer: `src` (host, model dtype) holds elements
        [start, start + src.numel()) of this parameter. Returns once the copy has read `src`
        (the caller may reuse it)."""
        self._assert_state(ParamState.LIVE)
        assert self.device_tensor is not None
        dst = self.device_tensor.view(-1)[start : start + src.numel()]
        self._from_staging(accel, src, accel.current_stream(), out=dst)

    def repoint(self, partition: torch.Tensor) -> None:
        """Adopt `partition` as the home copy (the optimizer's flat buffer view)."""
        if self.home is not HomeTier.HOST or self.partition is None:
            raise RuntimeError(
                f"repoint of {self.name!r}: it lives on {self.home.value}; only a host "
                f"partition can be re-pointed"
            )
        if partition.numel() != self.numel or partition.dtype != self.dtype:
            raise ValueError(
                f"new partition for {self.name!r}: {partition.numel()} x {partition.dtype}, "
                f"expected {self.numel} x {self.dtype}"
            )
        if partition.data_ptr() != self.partition.data_ptr():
            partition.copy_(self.partition)
        self.partition = partition


def frozen_on_nvme(records: list[OffloadParam], offload: OffloadParamConfig) -> list[OffloadParam]:
    """With parameters on NVMe, the frozen ones that go there: all but the first
    `offload.max_in_cpu` elements' worth (in model order), whose homes stay in host memory."""
    room = int(offload.max_in_cpu)
    out = []
    for rec in records:
        if rec.param.requires_grad:
            continue
        if rec.numel <= room:
            room -= rec.numel
        else:
            out.append(rec)
            room = 0  # a prefix in model order: what forward reads first stays in RAM
    return out
