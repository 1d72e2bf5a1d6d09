"""Where one parameter's weights live between uses: its home (host memory or NVMe).

Owns the `ParamHome` contract and its two tiers: `HostHome` (a flat host tensor: the
parameter's own host buffer, or a range of the optimizer's flat weight buffer) and `NvmeHome`
(an extent of the NVMe parameter tier: the parameter's own, or a range of the optimizer's
flat extent). It does not decide which tier a parameter gets (`infinity.zero.build` does,
once, before the optimizer exists), nor when to gather (the coordinator), nor the device
buffer (the record, `infinity.zero.param`).

[Note: the home contract] A home holds `numel` elements of `dtype`, flat. `read()` returns a
host copy of them, `write(src)` replaces them (durable on return), and `fetch(accel,
stream)` starts the transfer to a device buffer and returns a `Fetch` whose `land(accel)`
gives the buffer and the event recorded after its copy on `stream` (`out=` copies into an
existing buffer instead). Host homes copy at once (asynchronously where the memory is
pinned), or, on an accelerator whose device memory is host memory, hand out the home itself
(`aliases_home`, no bytes copied: see [Note: gathered means resident] in param.py); NVMe
homes first read into a buffer of the tier's pinned pool (`block=False` returns None
instead of waiting for a free one) and copy when landed, giving the buffer back once the
copy has read it. A fetch that is no longer wanted is `cancel()`ed: it lands and gives its
buffer back; a failed read is only logged then.

[Note: the home's numel] A home's `numel` is what this home holds, which is not always the
parameter's: with scale-out (world size W) a rank's home holds its shard, S = ceil(N / W)
elements of an N-element parameter (see the record's `numel` for N, and
`infinity.zero.shard`). Nothing here assumes the two are equal; with one rank they are.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Protocol

import torch

from infinity.accelerator import Accelerator, Event, Stream
from infinity.swap.param_tier import NvmeParamError
from infinity.swap.pool import aligned_host_bytes

if TYPE_CHECKING:
    from infinity.swap.param_tier import NvmeParamTier, SwapFuture

logger = logging.getLogger(__name__)


class HomeTier(enum.Enum):
    """Where a parameter's home is."""

    HOST = "host"
    """Host memory (pinned when the accelerator supports it and the config asks)."""
    NVME = "nvme"
    """The NVMe parameter tier."""


class Fetch(Protocol):
    """One transfer home -> device buffer in flight (see [Note: the home contract])."""

    reading: bool
    """An NVMe read holds a pool buffer until `land` or `cancel`."""
    aliases_home: bool
    """The landed buffer is the home's own memory (no copy was made)."""

    def done(self) -> bool:
        """Whether `land` would not wait for the disk (never blocks)."""
        ...

    def land(self, accel: Accelerator) -> tuple[torch.Tensor, Event]:
        """The device buffer and the event after its copy; raises the read's error."""
        ...

    def cancel(self) -> None:
        """Not wanted any more: let it finish and give its buffer back."""
        ...


class ParamHome(Protocol):
    """One parameter's weights between uses (see [Note: the home contract])."""

    tier: HomeTier
    numel: int
    """Elements this home holds (see [Note: the home's numel])."""
    dtype: torch.dtype

    @property
    def host_bytes(self) -> int:
        """Host memory this home keeps (0 on NVMe)."""
        ...

    @property
    def pinned_bytes(self) -> int:
        """Of `host_bytes`, those in pinned memory."""
        ...

    def read(self) -> torch.Tensor:
        """A flat host copy of the weights."""
        ...

    def write(self, src: torch.Tensor) -> None:
        """Replace the weights with `src` (`numel` elements, any float dtype); durable on
        return."""
        ...

    def fetch(
        self,
        accel: Accelerator,
        stream: Stream,
        *,
        block: bool = True,
        out: torch.Tensor | None = None,
    ) -> Fetch | None:
        """Start the copy to a new device buffer (or `out`) on `stream`; None only when
        `block` is False and no pool buffer is free (nothing issued)."""
        ...


def _check_write(home: ParamHome, src: torch.Tensor, what: str) -> torch.Tensor:
    if src.numel() != home.numel:
        raise ValueError(
            f"write to the home of {what}: {src.numel()} elements, the home holds {home.numel}"
        )
    return src.detach().reshape(-1)


class HostHome:
    """Weights in a flat host tensor (the home's own, or a view of the optimizer's)."""

    tier = HomeTier.HOST
    __slots__ = ("flat", "numel", "dtype", "name")

    def __init__(self, flat: torch.Tensor, *, name: str = "?") -> None:
        if flat.dim() != 1 or flat.device.type != "cpu":
            raise ValueError(
                f"host home of {name!r}: needs a flat host tensor, got shape "
                f"{tuple(flat.shape)} on {flat.device}; pass partition.reshape(-1)"
            )
        self.flat, self.numel, self.dtype, self.name = flat, flat.numel(), flat.dtype, name

    def __repr__(self) -> str:
        return f"HostHome({self.name!r}, {self.numel} x {self.dtype})"

    @property
    def host_bytes(self) -> int:
        return self.flat.nbytes

    @property
    def pinned_bytes(self) -> int:
        return self.flat.nbytes if self.flat.is_pinned() else 0

    def read(self) -> torch.Tensor:
        return self.flat.clone()

    def write(self, src: torch.Tensor) -> None:
        with torch.no_grad():
            self.flat.copy_(_check_write(self, src, repr(self.name)))

    def fetch(self, accel, stream, *, block=True, out=None) -> _HostFetch:
        if out is None and accel.shares_host_memory:
            return _HostFetch(self.flat, accel.new_event(), aliases_home=True)
        dev = accel.to_device(self.flat, stream, out=out)
        event = accel.new_event()
        event.record(stream)
        return _HostFetch(dev, event, aliases_home=False)


class _HostFetch:
    reading = False
    __slots__ = ("_dev", "_event", "aliases_home")

    def __init__(self, dev: torch.Tensor, event: Event, *, aliases_home: bool) -> None:
        self._dev, self._event, self.aliases_home = dev, event, aliases_home

    def done(self) -> bool:
        return True

    def land(self, accel: Accelerator) -> tuple[torch.Tensor, Event]:
        return self._dev, self._event

    def cancel(self) -> None:
        self._event.synchronize()  # the copy still reads the host memory


class NvmeHome:
    """Weights in the NVMe parameter tier under `key` (its own extent, or a range of the
    optimizer's flat extent: see [Note: the flat extent] in param_tier.py)."""

    tier = HomeTier.NVME
    host_bytes = pinned_bytes = 0
    __slots__ = ("param_tier", "key", "numel", "dtype")

    def __init__(self, param_tier: NvmeParamTier, key: str) -> None:
        layout = param_tier.layout(key)  # KeyError naming the key when it was never reserved
        self.param_tier, self.key = param_tier, key
        self.numel, self.dtype = layout.numel, layout.dtype

    def __repr__(self) -> str:
        return f"NvmeHome({self.key!r}, {self.numel} x {self.dtype})"

    def read(self) -> torch.Tensor:
        nbytes = self.numel * self.dtype.itemsize
        raw, _ = aligned_host_bytes(max(nbytes, 1), pin=False)  # page-aligned: O_DIRECT
        return self.param_tier.swap_in(self.key, raw[:nbytes].view(self.dtype)).wait()

    def write(self, src: torch.Tensor) -> None:
        flat = _check_write(self, src, repr(self.key)).to(device="cpu", dtype=self.dtype)
        self.param_tier.swap_out(self.key, flat.contiguous()).wait()

    def fetch(self, accel, stream, *, block=True, out=None) -> _NvmeFetch | None:
        read = self.param_tier.swap_in(self.key, block=block)
        if read is None:
            return None
        return _NvmeFetch(self.param_tier, self.key, read, stream, out)


class _NvmeFetch:
    reading = True
    aliases_home = False  # the pool buffer goes back to the pool: always copied
    __slots__ = ("_param_tier", "_key", "_read", "_stream", "_out")

    def __init__(
        self,
        param_tier: NvmeParamTier,
        key: str,
        read: SwapFuture,
        stream: Stream,
        out: torch.Tensor | None,
    ) -> None:
        self._param_tier, self._key, self._read = param_tier, key, read
        self._stream, self._out = stream, out

    def done(self) -> bool:
        return self._read.done()

    def land(self, accel: Accelerator) -> tuple[torch.Tensor, Event]:
        try:
            host = self._read.wait()
            dev = accel.to_device(host, self._stream, out=self._out)
            # The pool buffer goes back only once the copy has read it.
            copied = accel.new_event()
            copied.record(self._stream)
            copied.synchronize()
        finally:
            self._param_tier.release(self._read)
        event = accel.new_event()
        event.record(self._stream)
        return dev, event

    def cancel(self) -> None:
        try:
            self._read.wait()
        except NvmeParamError as e:  # its data is no longer wanted
            logger.warning("dropped NVMe read of %s failed: %s", self._key, e)
        finally:
            self._param_tier.release(self._read)
