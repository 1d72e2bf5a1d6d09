"""GradOffload: gradients leave a GPU through pinned buffers on a copy stream and are added
to their slots only after their copy has landed, in the order they came, with the bytes in
flight bounded (see [Note: staged gradient copies]). A recording accelerator stands in for
CUDA's streams and events, so the order of every wait, copy and add is checked on the CPU;
the engine trains bitwise the same with its gradients staged."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import Zoo, batches, config

import infinity
from infinity.accelerator import CpuAccelerator
from infinity.accelerator.base import Event, Stream
from infinity.zero.grad_offload import GradOffload


class _Stream(Stream):
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def synchronize(self) -> None:
        self.log.append(("sync_stream", self.name))


class _Event(Event):
    """Lands only when the test says so (`land`) or when synchronized."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.landed = name, log, False

    def record(self, stream=None) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("sync_event", self.name))
        self.landed = True

    def query(self) -> bool:
        return self.landed


class RecordingDevice(CpuAccelerator):
    """The CPU device with named streams and events that log what is done to them."""

    def __init__(self) -> None:
        super().__init__(alias_host=False)
        self.log: list = []
        self.events: list[_Event] = []
        self._compute = _Stream("compute", self.log)

    def pin_supported(self) -> bool:
        return True

    def empty_pinned(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def new_stream(self):
        return _Stream("copy", self.log)

    def current_stream(self):
        return self._compute

    def new_event(self):
        event = _Event(f"e{len(self.events)}", self.log)
        self.events.append(event)
        return event

    def to_host(self, dev, out, stream=None):
        self.log.append(("copy", stream.name, dev.numel()))
        return super().to_host(dev, out, stream)


def _offload(**kw):
    device = RecordingDevice()
    added: list[tuple[int, torch.Tensor]] = []

    def accumulate(slot, grad):
        device.log.append(("add", slot))
        added.append((slot, grad.clone()))

    return GradOffload(accumulate, device, **kw), device, added


def test_the_cpu_device_adds_at_once():
    added = []
    offload = GradOffload(lambda s, g: added.append(s), CpuAccelerator())
    assert not offload.staged
    offload.add(3, torch.ones(4))
    assert added == [3] and offload.in_flight == 0


def test_a_slot_whose_sums_are_on_the_device_is_added_there_at_once():
    """`offload_optimizer.gradients_on_device`: no copy, no stream, no event, while the
    other slots still go through the staged copies."""
    offload, device, added = _offload(on_device={1})
    grad = torch.randn(6, dtype=torch.bfloat16)
    offload.add(0, torch.zeros(4))  # staged
    offload.add(1, grad)
    assert [s for s, _ in added] == [1] and offload.in_flight == 1
    assert torch.equal(added[0][1], grad)
    assert [e for e in device.log if e[0] == "copy"] == [("copy", "copy", 4)]
    offload.flush()
    assert [s for s, _ in added] == [1, 0]


def test_a_copy_waits_for_the_compute_stream_and_is_added_only_after_it_lands():
    offload, device, added = _offload()
    grads = [torch.randn(10, dtype=torch.bfloat16), torch.randn(7, dtype=torch.bfloat16)]
    offload.add(0, grads[0])
    offload.add(1, grads[1])
    assert added == [] and offload.in_flight == 2  # nothing landed: nothing added
    assert device.log == [
        ("record", "e0", "compute"), ("wait_event", "copy", "e0"), ("copy", "copy", 10),
        ("record", "e1", "copy"),
        ("record", "e2", "compute"), ("wait_event", "copy", "e2"), ("copy", "copy", 7),
        ("record", "e3", "copy"),
    ]  # fmt: skip
    device.log.clear()
    offload.flush()
    assert device.log == [("sync_event", "e1"), ("add", 0), ("sync_event", "e3"), ("add", 1)]
    assert [s for s, _ in added] == [0, 1] and offload.in_flight == 0
    for (_, got), want in zip(added, grads, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)  # the same bits


def test_landed_copies_are_added_at_the_next_gradient_in_their_order():
    offload, device, added = _offload()
    for slot in range(3):
        offload.add(slot, torch.full((4,), float(slot)))
    device.events[3].landed = True  # the second copy landed first: it must still wait
    offload.add(3, torch.zeros(4))
    assert added == []
    device.events[1].landed = True
    offload.add(4, torch.zeros(4))
    assert [s for s, _ in added] == [0, 1]  # the first two, in order; not the third
    offload.flush()
    assert [s for s, _ in added] == [0, 1, 2, 3, 4]


def test_bytes_in_flight_stay_under_the_bound():
    grad = torch.zeros(256)  # 1 KiB
    offload, device, added = _offload(in_flight_bytes=3 * grad.nbytes)
    for slot in range(10):
        offload.add(slot, grad.clone())
        assert offload.in_flight <= 3
        assert [s for s, _ in added] == list(range(max(0, slot - 2)))  # the oldest waited
    assert offload.peak_in_flight_bytes == 3 * grad.nbytes
    offload.flush()
    assert len(added) == 10


def test_the_device_gradient_is_held_until_its_copy_lands():
    offload, device, added = _offload()
    grad = torch.ones(8)
    offload.add(0, grad)
    assert offload._pending[0].device_grad is grad
    staged = offload._pending[0]
    offload.flush()
    assert staged.device_grad is None


@pytest.mark.parametrize("accum", [1, 2])
def test_the_engine_trains_bitwise_the_same_with_staged_gradients(accum):
    torch.manual_seed(0)
    model = Zoo()
    runs = []
    for staged in (False, True):
        engine = infinity.initialize(
            copy.deepcopy(model), {**config(), "gradient_accumulation_steps": accum}
        )
        if staged:  # the GPU's path, with the CPU device's null streams and events
            engine.parts.grad_offload.staged = True
            engine.parts.grad_offload._stream = engine.accelerator.new_stream()
        losses = []
        for ids in batches(3 * accum):
            loss = engine(ids, ids)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        assert (engine.parts.grad_offload.peak_in_flight_bytes > 0) is staged
        runs.append((losses, [p.detach().clone() for p in engine.module.parameters()]))
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
