"""Gradients leaving a GPU without stopping it: one rank's device gradients copied to pinned
host memory on a copy stream and added into their fp32 slots once each copy has landed.

Owns the copies in flight (a FIFO of staged gradients, bounded in bytes) and when each is
added; not the slots (the optimizer's `accumulate_grad`) nor the hooks that call `add`
(`install_grad_hooks`). With several ranks `GradReducer` takes the gradients instead.

[Note: staged gradient copies]
A blocking copy of a device gradient into pageable memory makes the host wait for every
kernel queued before it, at every parameter of backward, so the host can never run ahead of
the device and backward costs the sum of the two (seen on an H200: a 1B model's backward
3.2 s where its kernels need a fraction of that). Here the hook only queues: the copy stream
waits for an event on the compute stream, copies into a pinned buffer (torch's caching host
allocator reuses them), and records a landing event. Landed copies are added in the order
they were queued (a slot's pieces in order) whenever the hook runs again, the oldest is
waited for when the bytes in flight pass the bound, and `flush` (queued by autograd at the
end of the backward, and called before each optimizer step) adds the rest. The device
gradient is kept referenced until its copy has landed, so its memory is not reused early.
On the CPU device there is nothing to copy: `add` adds at once; so it does for a slot whose
sums are kept on the device (`offload_optimizer.gradients_on_device`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from infinity.accelerator import Accelerator, Event
from infinity.zero.backward_end import OnceAtBackwardEnd

DEFAULT_IN_FLIGHT_BYTES = 256 << 20
"""Bytes of gradients in flight at most (pinned staging and the device gradients they copy)
before `add` waits for the oldest: a few layers' worth, enough to keep the copy stream busy."""


@dataclass(slots=True)
class _Staged:
    slot: int
    device_grad: torch.Tensor | None
    """Kept referenced until the copy has landed (its memory must not be reused before)."""
    host: torch.Tensor
    landed: Event
    nbytes: int


class GradOffload:
    """Takes each trainable parameter's flat device gradient (`add`) into its slot
    (`accumulate(slot, flat_host_grad)`), asynchronously when the gradient is on a device
    (see [Note: staged gradient copies])."""

    def __init__(
        self,
        accumulate: Callable[[int, torch.Tensor], None],
        accelerator: Accelerator,
        *,
        staged: bool | None = None,
        in_flight_bytes: int = DEFAULT_IN_FLIGHT_BYTES,
        on_device: Collection[int] = (),
    ) -> None:
        self.accumulate = accumulate
        self.on_device = frozenset(on_device)
        """Slots whose sums are on the device (the optimizer's `device_slots`): added there
        at once, never copied."""
        self.accel = accelerator
        self.staged = accelerator.pin_supported() if staged is None else staged
        """Whether device gradients are copied through pinned buffers on a copy stream
        (default: where the device can pin, i.e. a GPU)."""
        self.in_flight_bytes = in_flight_bytes
        self._pending: deque[_Staged] = deque()
        self._pending_bytes = 0
        self._stream = accelerator.new_stream() if self.staged else None
        self._at_end = OnceAtBackwardEnd(self.flush)
        self.peak_in_flight_bytes = 0

    def add(self, slot: int, grad: torch.Tensor) -> None:
        """Slot `slot` += `grad` (flat, the slot's numel): now on the host, else once the
        copy lands (by the next `flush` at the latest); a slot `on_device` adds it where it
        is, at once."""
        if slot in self.on_device:
            self.accumulate(slot, grad)
            return
        if not self.staged:
            if grad.device.type != "cpu":  # a device that cannot pin: a blocking copy
                grad = self.accel.to_host(grad, out=torch.empty(grad.shape, dtype=grad.dtype))
            self.accumulate(slot, grad)
            return
        self._at_end.arm()  # inside a backward, its end adds what is still in flight
        self._add_landed()
        while self._pending and self._pending_bytes + grad.nbytes > self.in_flight_bytes:
            self._add_oldest()
        self._pending.append(self._copy(slot, grad))
        self._pending_bytes += grad.nbytes
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self._pending_bytes)

    def flush(self) -> None:
        """Wait for every copy in flight and add it: all gradients of the backward are in
        their slots on return."""
        self._at_end.disarm()
        while self._pending:
            self._add_oldest()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # -- internals ----------------------------------------------------------------------
    def _copy(self, slot: int, grad: torch.Tensor) -> _Staged:
        assert self._stream is not None
        ready = self.accel.new_event()
        ready.record(self.accel.current_stream())  # the gradient is complete there
        host = self.accel.empty_pinned(grad.shape, grad.dtype)
        self._stream.wait_event(ready)
        self.accel.to_host(grad, out=host, stream=self._stream)  # non-blocking: pinned
        landed = self.accel.new_event()
        landed.record(self._stream)
        return _Staged(slot, grad, host, landed, grad.nbytes)

    def _add_landed(self) -> None:
        while self._pending and self._pending[0].landed.query():
            self._add_oldest()

    def _add_oldest(self) -> None:
        staged = self._pending.popleft()
        staged.landed.synchronize()
        self._pending_bytes -= staged.nbytes
        staged.device_grad = None  # landed: the device memory may be reused
        self.accumulate(staged.slot, staged.host)
