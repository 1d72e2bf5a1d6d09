"""The overlap is real: with a recording accelerator, the optimizer steps a sub-group while
the last micro batch's backward still runs, on another thread, and the NVMe reads of the
optimizer state run during that backward (see [Note: the overlapped step])."""

from __future__ import annotations

import contextlib
import threading
import time

from _overlap import overlap_config, train

from infinity.accelerator.cpu import CpuAccelerator

AHEAD = "infinity::zero::adam_ahead"
BACKWARD = "infinity::engine::backward"
ACCUMULATE = "infinity::zero::accumulate_grad"


class RecordingAccelerator(CpuAccelerator):
    """Records every named range (name, "enter"/"exit", time, thread, NVMe state bytes read
    so far). At the last gradient of the last micro batch's backward it waits (20 s at most)
    until the optimizer has stepped two sub-groups: with an overlapped step they go at
    once, with a serial one never, so the order checked below does not hang on thread
    timing."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str, float, int, int]] = []
        self.engine = None
        self.grads_per_backward = 0
        self._grads = self._stepped = 0
        self._cond = threading.Condition()

    def _log(self, name: str, what: str) -> None:
        read = 0
        if self.engine is not None:
            read = self.engine.parts.optimizer.state_tier.memory_stats()["nvme_optim_bytes_read"]
        with self._cond:
            self.events.append((name, what, time.perf_counter(), threading.get_ident(), read))
            self._stepped += name == AHEAD and what == "exit"
            self._cond.notify_all()

    @contextlib.contextmanager
    def range(self, name: str):
        self._log(name, "enter")
        if name == BACKWARD:
            self._grads = self._stepped = 0
        last = self.engine is not None and self.engine.is_gradient_accumulation_boundary()
        if name == ACCUMULATE:
            self._grads += 1
            if last and self._grads == self.grads_per_backward:
                with self._cond:
                    self._cond.wait_for(lambda: self._stepped >= 2, 20.0)
        try:
            yield
        finally:
            self._log(name, "exit")

    def attach(self, engine) -> None:
        self.engine = engine
        self.grads_per_backward = sum(r.trainable for r in engine.parts.records)


def test_the_optimizer_steps_sub_groups_during_backward_and_reads_state_beside_it(tmp_path):
    accel = RecordingAccelerator()
    cfg = overlap_config(
        dtype="bf16", clip="off", accum=2, tier="nvme", nvme_dir=str(tmp_path), overlap=True
    )
    run = train(cfg, accelerator=accel, on_engine=accel.attach)
    main = threading.get_ident()
    events = accel.events
    backwards = [i for i, e in enumerate(events) if e[0] == BACKWARD]
    assert len(backwards) == 2 * 2 * 4  # enter and exit, 2 micro batches, 4 steps
    for k in range(0, len(backwards), 2):
        enter, exit_ = backwards[k], backwards[k + 1]
        inside = events[enter : exit_ + 1]
        ahead = [e for e in inside if e[0] == AHEAD]
        if (k // 2) % 2 == 0:  # the first micro batch of a step: no step is under way
            assert not ahead
            continue
        # The last micro batch: sub-groups stepped on another thread before the last
        # gradient of the backward was added...
        grads = [e for e in inside if e[0] == ACCUMULATE and e[1] == "exit"]
        done = [e for e in ahead if e[1] == "exit" and e[2] < grads[-1][2]]
        assert len(done) >= 2 and all(e[3] != main for e in ahead)
        # ...and the optimizer state read from NVMe meanwhile.
        assert events[exit_][4] > events[enter][4]
    assert all(stepped > 0 for stepped, _ in run["ahead"])


def test_with_the_overlap_off_nothing_steps_during_backward(tmp_path):
    accel = RecordingAccelerator()
    cfg = overlap_config(
        dtype="bf16", clip="off", accum=1, tier="cpu", nvme_dir=str(tmp_path), overlap=False
    )
    train(cfg, accelerator=accel)  # not attached: nothing waits
    assert not [e for e in accel.events if e[0] == AHEAD]
    assert [e for e in accel.events if e[0] == BACKWARD]
