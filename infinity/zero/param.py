"""One record per partitioned parameter: its home and whether it is gathered.

`OffloadParam` holds the parameter's one home (`infinity.zero.home`: host memory or NVMe,
never absent) and the device buffer while gathered. It never patches attributes onto the
`nn.Parameter`: the parameter object stays in its module, and only its `.data` is swapped
between an empty tensor (released) and the gathered device buffer. Policy (what to fetch,
when to release, the budget) lives in `infinity.zero.coordinator`.

[Note: gathered means resident] A gathered parameter is one whose weights are resident on
the device and counted against the live budget; its buffer is a copy of the home, except
where the device's memory is the host's (`Accelerator.shares_host_memory`: the CPU device by
default) and the home is in host memory: then the buffer *is* the home (`aliased`), and a
gather moves no bytes. Everything else is the same either way: the states, when parameters
are fetched and released, the live budget and `memory_stats()`. An alias is never stale:
whatever writes a home (the optimizer's step, `home.write`, a checkpoint load) writes the
live buffer with it, so `refresh` has nothing to copy; and nothing writes a gathered buffer
expecting it to be private (a step's new weights reach a copy only through `refresh`). A
home on NVMe is read into a pool buffer, which goes back to the pool, so it is still copied
(on the CPU device into memory an earlier release freed: see [Note: recycled device
buffers] in infinity/accelerator/recycled.py); with several ranks the aliased home is the
all-gather's input and the gathered buffer its output, a buffer of its own.
`CpuAccelerator(alias_host=False)` copies as a GPU does, so the copy path runs (and is
tested) on a machine without one.

[Note: fetching from NVMe] With an NVMe home, `fetch` issues a read of the home into a
buffer of the tier's pinned pool (INFLIGHT, no device buffer yet); `wait` waits for the read,
copies the buffer into a new device buffer on the copy stream, makes the compute stream wait
for that copy, and gives the pool buffer back only once the copy has read it (the host waits
for the copy's event; on the CPU the copy is synchronous). `finish_read` does the first part
early (the read and the copy, still INFLIGHT), to free the pool buffer for the next read. A
failed read leaves the record RELEASED with its buffer given back.

[Note: gathering shards] With W ranks the home holds the rank's shard (S = ceil(N / W)
elements, see `infinity.zero.shard`) and the record's `comm` is set: a fetch lands the shard
in a device buffer of S elements and all-gathers every rank's shard into the gathered
buffer (W*S elements, the parameter and its zero padding), of which `param.data` views the
first N (`infinity.zero.gather`; [Note: early all-gathers] says when the collective is
issued). An all-gather is a collective, so every rank fetches and lands the same parameters
in the same order (see [Note: the same order on every rank] in coordinator.py); the local
transfer of the shard (a host copy or an NVMe read) may finish whenever it does. `refresh` after a
step all-gathers the new shards the same way, and `read_full` gathers a host copy of the
whole parameter (a collective too: every rank calls it for the same parameters).

[Note: swapping .data] Autograd saves leaf parameters by reference. Replacing `param.data`
keeps the parameter's version counter, so a parameter released after forward and gathered
again before its module's backward gives backward the same values it saw in forward (the
engine gathers a module's parameters again before its backward runs).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from infinity.accelerator import Accelerator, Event, Stream
from infinity.comm import Comm
from infinity.zero.gather import ShardGather
from infinity.zero.home import Fetch, ParamHome
from infinity.zero.shard import Shard, shard_of

if TYPE_CHECKING:
    from infinity.config import OffloadParamConfig

logger = logging.getLogger(__name__)

_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def empty_like_released(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The shared zero-element tensor a released parameter's `.data` points to."""
    key = (dtype, device)
    t = _EMPTY.get(key)
    if t is None:
        t = _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return t


class ParamState(enum.Enum):
    """What is resident for one parameter."""

    RELEASED = "released"
    """Only the home exists; `param.data` is an empty tensor."""
    INFLIGHT = "inflight"
    """A copy home -> device buffer (or, from NVMe, a read into a pool buffer) was issued and
    not yet waited."""
    LIVE = "live"
    """`param.data` is the gathered device buffer, ready for compute."""


class OffloadParam:
    """One parameter: its shape, dtype, home and gathered state.

    A tied parameter (one `nn.Parameter` registered in several modules) has one record.
    `numel` is the parameter's; `home.numel` what its home holds (see [Note: the home's
    numel] in home.py): the rank's `shard` of it when `comm` joins several ranks (see [Note:
    gathering shards]).
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
        "device_tensor",
        "persistent",
        "slot",
        "pins",
        "device",
        "shard",
        "comm",
        "aliased",
        "_event",
        "_fetch",
    )

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        home: ParamHome,
        *,
        device: torch.device,
        persistent: bool = False,
        comm: Comm | None = None,
        align: int = 1,
    ) -> None:
        world, rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
        shard = shard_of(param.numel(), world, rank, align)
        if home.numel != shard.numel:
            what = "the parameter has" if world == 1 else f"rank {rank} of {world} keeps"
            raise ValueError(
                f"the home of {name!r} holds {home.numel} elements, {what} {shard.numel}; "
                "build the home from the parameter's flattened weights (its shard with "
                "several ranks)"
            )
        self.name = name
        self.param = param
        self.shard = shard
        """This rank's shard of the parameter (see `infinity.zero.shard`)."""
        self.shape = tuple(param.shape)
        self.dtype = home.dtype
        self.itemsize = home.dtype.itemsize
        """Bytes per element of the home and of the gathered buffer."""
        self.numel = param.numel()
        """Elements of the whole parameter (the gathered buffer)."""
        self.home = home
        self.state = ParamState.RELEASED
        self.device_tensor: torch.Tensor | None = None
        self.persistent = persistent
        self.slot: int | None = None
        """Index of this parameter in the optimizer's slots; None when frozen."""
        self.pins = 0
        """How many running modules need this parameter now (never released while > 0)."""
        self.device = device
        """The accelerator's device (where gathered buffers and released stubs live)."""
        self.shard: Shard = shard
        """This rank's part of the parameter (all of it with one rank)."""
        self.comm = comm if world > 1 else None
        """The ranks the shards are gathered from; None with one rank."""
        self.aliased = False
        """LIVE with the home's own memory as its buffer (see [Note: gathered means
        resident])."""
        self._event: Event | None = None
        self._fetch: Fetch | None = None
        """The transfer from the home in flight (INFLIGHT)."""

    def __repr__(self) -> str:
        return f"OffloadParam({self.name!r}, {self.shape}, {self.dtype}, {self.state.name})"

    @property
    def span(self) -> tuple[int, int]:
        """The elements of the flattened parameter this rank's home holds (unpadded)."""
        return self.shard.span

    @property
    def trainable(self) -> bool:
        return self.slot is not None

    @property
    def reading(self) -> bool:
        """INFLIGHT with an NVMe read holding a pool buffer."""
        return self._fetch is not None and self._fetch.reading

    def read_done(self) -> bool:
        """Whether an NVMe read in flight has finished (never blocks)."""
        return self.reading and self._fetch.done()  # type: ignore[union-attr]

    def _assert_state(self, *states: ParamState) -> None:
        if self.state not in states:
            raise RuntimeError(
                f"parameter {self.name!r} is {self.state.name}, expected one of "
                f"{[s.name for s in states]}"
            )

    def offload(self) -> None:
        """Drop the parameter's own values (they live in the home): RELEASED stays."""
        self._assert_state(ParamState.RELEASED)
        self.param.data = empty_like_released(self.dtype, self.device)

    # ---- gathering -------------------------------------------------------------------

    def fetch(self, accel: Accelerator, stream: Stream, *, block: bool = True) -> bool:
        """Start bringing the home to the device (RELEASED -> INFLIGHT): a copy on `stream`
        from the host into a new buffer (or the home itself, see [Note: gathered means
        resident]), or a read into a pool buffer from NVMe. The only path from
        the home to the device. False (still RELEASED, nothing issued) when `block` is
        False and the NVMe pool has no free buffer."""
        self._assert_state(ParamState.RELEASED)
        fetch = self.home.fetch(accel, stream, block=block)
        if fetch is None:
            return False
        if self.comm is not None:  # see [Note: gathering shards]
            fetch = ShardGather(fetch, self.comm, accel, stream)
        self._fetch = fetch
        self.state = ParamState.INFLIGHT
        return True

    def wait(self, accel: Accelerator) -> None:
        """Make the compute stream wait for the copy and point `param.data` at the buffer
        (INFLIGHT -> LIVE). From NVMe, first wait for the read and copy it (see [Note:
        fetching from NVMe]); a failed read raises NvmeParamError, leaving RELEASED."""
        self._assert_state(ParamState.INFLIGHT)
        self._land(accel)
        assert self.device_tensor is not None and self._event is not None
        compute = accel.current_stream()
        compute.wait_event(self._event)
        # The buffer was allocated on the copy stream and is used on the compute stream.
        accel.record_stream(self.device_tensor, compute)
        self._event = None
        self.param.data = self.device_tensor[: self.numel].view(self.shape)
        self.state = ParamState.LIVE

    def finish_read(self, accel: Accelerator) -> bool:
        """From NVMe: wait for the read and copy it to the new device buffer, giving the pool
        buffer back. The parameter stays INFLIGHT: only `wait` makes it LIVE, so reads may
        finish in any order without changing what is gathered (a failed read raises
        NvmeParamError, leaving RELEASED). False when there is no read to finish early. A
        sharded parameter lands only its shard here: the all-gather, a collective, waits for
        `wait` (see [Note: gathering shards])."""
        self._assert_state(ParamState.INFLIGHT)
        if not self.reading:
            return False
        if isinstance(self._fetch, ShardGather):
            try:
                self._fetch.finish_read(accel)
            except BaseException:
                self._drop()
                raise
            return True
        self._land(accel)
        return True

    def _land(self, accel: Accelerator) -> None:
        """The transfer in flight (if not landed yet): its device buffer and copy event."""
        fetch, self._fetch = self._fetch, None
        if fetch is None:
            return
        try:
            self.device_tensor, self._event = fetch.land(accel)
        except BaseException:
            self._drop()
            raise
        self.aliased = fetch.aliases_home

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's shard (`local` here, on the device) in a new gathered buffer."""
        assert self.comm is not None
        full = torch.empty(self.comm.world_size * self.shard.numel, dtype=self.dtype,
                           device=local.device)  # fmt: skip
        self.comm.all_gather_into(full, local)
        return full

    def release(self) -> None:
        """Free the device buffer (LIVE/INFLIGHT -> RELEASED). A transfer in flight finishes
        first (an NVMe read gives its pool buffer back; its failure, if any, is only logged:
        its data is no longer wanted)."""
        self._assert_state(ParamState.LIVE, ParamState.INFLIGHT)
        if self._fetch is not None:
            fetch, self._fetch = self._fetch, None
            fetch.cancel()
        self._drop()

    def _drop(self) -> None:
        self._event = None
        self._fetch = None
        self.device_tensor = None
        self.aliased = False
        self.param.data = empty_like_released(self.dtype, self.device)
        self.state = ParamState.RELEASED

    def refresh(
        self, accel: Accelerator, values: torch.Tensor | None = None, start: int = 0
    ) -> None:
        """Make the live buffer match the home after it changed: `values` (host, model
        dtype) are the new elements [start, start + values.numel()), or, without them, the
        whole home is copied again (from NVMe through a pool buffer, waiting for one).
        Returns once the copy has read its source (the caller may reuse `values`). Nothing
        to do for an alias of the home, which changed with it (the home is written first)."""
        self._assert_state(ParamState.LIVE)
        assert self.device_tensor is not None
        if self.aliased:
            return
        stream = accel.current_stream()
        if self.comm is not None:
            self._refresh_shards(accel, values, start)
            return
        if values is None:
            self.home.fetch(accel, stream, out=self.device_tensor).land(accel)  # type: ignore[union-attr]
            return
        dst = self.device_tensor.view(-1)[start : start + values.numel()]
        accel.to_device(values, stream, out=dst)
        copied = accel.new_event()
        copied.record(stream)
        copied.synchronize()

    def _refresh_shards(self, accel: Accelerator, values: torch.Tensor | None, start: int):
        """`refresh` with several ranks: every rank's new elements [start, start + k) of its
        shard (all of it without `values`) gathered into the live buffer (a collective)."""
        assert self.comm is not None and self.device_tensor is not None
        if values is None:
            values, start = self.home.read(), 0
        k = values.numel()
        local = accel.to_device(values, accel.current_stream())
        pieces = torch.empty(self.comm.world_size * k, dtype=self.dtype, device=local.device)
        self.comm.all_gather_into(pieces, local)
        rows = self.device_tensor.view(self.comm.world_size, self.shard.numel)
        rows[:, start : start + k].copy_(pieces.view(self.comm.world_size, k))

    def read_full(self) -> torch.Tensor:
        """A flat host copy of the whole parameter (N elements): the home itself with one
        rank, every rank's shard gathered with several (a collective, see [Note: gathering
        shards])."""
        local = self.home.read()
        if self.comm is None:
            return local
        local = local.to(self.device, self.dtype)  # NCCL gathers device memory only
        full = self._all_gather(local)
        return full[: self.numel].cpu()


def frozen_on_nvme(params: list[tuple[str, nn.Parameter]], offload: OffloadParamConfig) -> set[str]:
    """With parameters on NVMe, the names of the frozen ones that go there: all but the
    first `offload.max_in_cpu` elements' worth (in model order), whose homes stay in host
    memory."""
    mask = frozen_nvme_mask(
        [p.numel() for _, p in params], [p.requires_grad for _, p in params], offload.max_in_cpu
    )
    return {name for (name, _), on in zip(params, mask, strict=True) if on}


def frozen_nvme_mask(
    numels: Sequence[int], trainable: Sequence[bool], max_in_cpu: int
) -> list[bool]:
    """The rule of `frozen_on_nvme` over plain sizes (in model order): True for each frozen
    parameter past the first `max_in_cpu` elements' worth."""
    room = int(max_in_cpu)
    out = []
    for numel, trains in zip(numels, trainable, strict=True):
        if trains:
            out.append(False)
        elif numel <= room:
            room -= numel
            out.append(False)
        else:
            out.append(True)
            room = 0  # a prefix in model order: what forward reads first stays in RAM
    return out
