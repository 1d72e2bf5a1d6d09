"""`infinity.estimate.timeline`: the step is the critical path of what runs beside what;
without the overlapped step it is the serial chain the step model always had, with it on a
GPU the early CPU-Adam hides under the last backward and no more."""

from __future__ import annotations

import pytest
from test_estimate import SHAPE, _config, _rates

from infinity.config import Config
from infinity.estimate import GPUS, estimate, model_shape
from infinity.estimate.timeline import Window, step_timeline
from infinity.models import LlamaConfig

WINDOW = Window(device_s=10.0, copies_s=4.0, disk_s=2.0, length_s=10.0, last_backward_s=0.5)


@pytest.mark.parametrize("pipelined", [True, False])
def test_without_early_steps_the_step_is_the_serial_chain(pipelined):
    t = step_timeline(WINDOW, adam_s=3.0, state_io_s=5.0, norm_s=0.25, flat_numel=1000,
                      pipelined=pipelined)  # fmt: skip
    sweep = max(3.0, 5.0) if pipelined else 3.0 + 5.0
    assert t.step_s == pytest.approx(10.0 + 0.25 + sweep) and t.ahead_s == 0
    assert t.critical == ("device window", "gradient norm", "NVMe state sweep")
    assert any(s.resource == "copies" and s.end_s == 4.0 for s in t.spans)  # beside compute


def test_early_steps_hide_under_the_last_backward_and_no_more():
    # The last 10% of the flat space is final halfway through the last backward (0.5 s).
    kw = dict(adam_s=10.0, state_io_s=0.0, norm_s=0.25, flat_numel=1000)
    serial = step_timeline(WINDOW, **kw)
    small = step_timeline(WINDOW, **kw, ahead_numels=[10])  # 0.1 s of Adam, hidden
    assert small.step_s == pytest.approx(serial.step_s - 0.1) and small.ahead_s == 0.1
    assert "the early step in progress" not in small.critical
    # 5 s of Adam begun 0.5 s before the end of backward: the step waits for it.
    big = step_timeline(WINDOW, **kw, ahead_numels=[500])
    start = 10.0 - 0.5 * (1 - 500 / 1000)
    assert big.step_s == pytest.approx(start + 5.0 + 0.25 + 5.0)
    assert big.critical[1] == "the early step in progress"
    assert serial.step_s - big.step_s <= WINDOW.last_backward_s + 1e-9
    # Sub-groups behind one the worker could not begin before the step: stepped serially.
    many = step_timeline(WINDOW, **kw, ahead_numels=[500, 100, 100])
    assert many.ahead_s == big.ahead_s and many.step_s == pytest.approx(big.step_s)
    lines = many.lines()
    assert lines[0].startswith("timeline") and "critical path" in lines[-1]


def test_estimate_overlaps_the_step_on_a_gpu_only(tmp_path):
    shape = model_shape(LlamaConfig(**SHAPE))
    on = Config.load(_config(tmp_path, param="cpu", optim="cpu", overlap_numel=10**9))
    off = Config.load(_config(tmp_path, param="cpu", optim="cpu"))
    gpu = _rates(device="h100", gpu=GPUS["h100"], adam_numel_per_s=1e6)
    kw = dict(seq_len=64, runtime_bytes=0)
    a, b = estimate(shape, on, gpu, **kw).times, estimate(shape, off, gpu, **kw).times
    last_backward = a.micro_step_s * 2 / 3
    assert a.ahead_s > 0 and b.ahead_s == 0
    assert b.step_s - last_backward - 1e-9 <= a.step_s < b.step_s
    assert a.step_s >= a.compute_s  # a chain, never under its longest part
    # On the CPU device backward takes the cores: nothing hides.
    cpu = _rates()
    assert (
        estimate(shape, on, cpu, **kw).times.step_s == estimate(shape, off, cpu, **kw).times.step_s
    )
