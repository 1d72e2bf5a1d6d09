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


@pytest.fixture
def four_gpus(monkeypatch):
    """torch.cuda as a host with four devices would answer, device 0 current; the calls to
    set_device recorded (no CUDA is touched: the accelerator only names its device here)."""
    made: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: made[-1] if made else 0)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    for var in ("LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return made


@pytest.mark.parametrize(
    "env, device, made",
    [
        ({}, 0, []),  # one process: the current device
        ({"LOCAL_RANK": "2", "WORLD_SIZE": "4"}, 2, [2]),  # torchrun, nothing set: the rank's
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "4"}, 0, []),
        ({"LOCAL_RANK": "5", "WORLD_SIZE": "8"}, 0, []),  # sees fewer: keeps its own
    ],
)
def test_a_launched_rank_trains_on_its_local_device(four_gpus, monkeypatch, env, device, made):
    from infinity.accelerator.cuda import CudaAccelerator

    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert CudaAccelerator().device == torch.device("cuda", device)
    assert four_gpus == made


def test_a_device_the_program_chose_is_kept_under_a_launcher(four_gpus, monkeypatch):
    from infinity.accelerator.cuda import CudaAccelerator

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    torch.cuda.set_device(3)
    assert CudaAccelerator().device == torch.device("cuda", 3)
    assert four_gpus == [3]


def test_use_local_device_takes_the_one_device_a_launcher_made_visible(four_gpus, monkeypatch):
    from infinity.accelerator import use_local_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="LOCAL_RANK is 1 but this host sees 1 CUDA"):
        use_local_device(1)  # two processes on one device: refused
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    use_local_device(1)
    assert four_gpus == [0]
