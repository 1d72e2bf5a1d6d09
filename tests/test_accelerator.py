import pytest
import torch

from infinity.accelerator import get_accelerator
from infinity.accelerator.cpu import NullEvent, NullStream


def test_cpu_streams_and_events_are_null_objects():
    acc = get_accelerator("cpu")
    stream = acc.new_stream()
    event = acc.new_event()
    assert isinstance(stream, NullStream) and isinstance(event, NullEvent)
    event.record(stream)
    stream.wait_event(event)
    stream.wait_stream(acc.current_stream())
    assert event.query()
    with acc.use_stream(stream):
        pass
    acc.synchronize()


def test_round_trip_copies_are_not_aliases(accel):
    host = torch.arange(1000, dtype=torch.float16)
    if accel.pin_supported():
        pinned = accel.empty_pinned(host.shape, host.dtype)
        pinned.copy_(host)
        host = pinned
    stream = accel.new_stream()
    dev = accel.to_device(host, stream)
    done = accel.new_event()
    done.record(stream)
    done.synchronize()
    assert dev.device.type == accel.device.type
    assert dev.data_ptr() != host.data_ptr()
    back = torch.empty_like(host)
    accel.to_host(dev, back, stream)
    stream.synchronize()
    assert torch.equal(back, host)


def test_unknown_accelerator_names_the_choices():
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'auto'"):
        get_accelerator("tpu")


def test_cuda_requested_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: nothing to refuse")
    from infinity.accelerator.cuda import CudaAccelerator

    with pytest.raises(RuntimeError, match="INFINITY_ACCELERATOR=cpu"):
        CudaAccelerator()


def test_copies_are_counted(accel):
    before = (accel.copies.host_to_device_bytes, accel.copies.device_to_host_bytes)
    seconds = accel.copies.seconds
    host = torch.ones(1000, dtype=torch.float32)
    dev = accel.to_device(host)
    accel.to_host(dev[:100], torch.empty(100))
    accel.synchronize()
    assert accel.copies.host_to_device_bytes - before[0] == 4000
    assert accel.copies.device_to_host_bytes - before[1] == 400
    assert accel.copies.seconds > seconds


def test_ranges_cost_nothing_without_a_profiler(accel, monkeypatch):
    def fail(name):
        raise AssertionError(f"record_function({name!r}) opened with no profiler running")

    monkeypatch.setattr(torch.profiler, "record_function", fail)
    assert accel.range("infinity::test::a") is accel.range("infinity::test::b")
    with accel.range("infinity::test::a"):
        pass


def test_ranges_are_recorded_while_a_profiler_runs(accel):
    activities = accel.profiler_activities()
    with torch.profiler.profile(activities=activities) as prof, accel.range("infinity::test::op"):
        torch.ones(4).sum()
    assert "infinity::test::op" in {e.key for e in prof.key_averages()}
