"""Per-optimizer-step telemetry: one `StepTelemetry` record per step, and the counter arithmetic
behind it.

Owns the record's stable names (the keys `infinity train` writes to metrics.jsonl, documented
in docs/telemetry.md), turning running counters (bytes moved, seconds waited, kept by the
swap stores, the coordinator and the accelerator) into per-step differences, and the text
forms of a record (the progress bar's compact line, the `wall_clock_breakdown` log line).
It does not measure anything itself: the engine hands it phase times and counters.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTelemetry:
    """Where one optimizer step's time went, and what it moved. Seconds are wall-clock on
    the host; device times are exact only when `synchronized` (`wall_clock_breakdown`).

    forward, backward and optimizer are disjoint parts of the step; gather wait lies within
    forward and backward; optimizer compute and the optimizer state's NVMe waits lie within
    optimizer; parameter and gradient NVMe waits fall where the reads and writes are waited
    for (gathers, gradient hooks, the step)."""

    step: int
    """The optimizer step this record is of (the engine's global_steps after it)."""
    step_seconds: float
    """From the start of the window's first forward to the end of the optimizer step (micro
    batches of the accumulation window included; what the loop does between them too)."""
    forward_seconds: float
    backward_seconds: float
    """`engine.backward` and plain `loss.backward()` alike, summed over the micro batches."""
    optimizer_seconds: float
    """The optimizer step: norm, clipping, the Adam sweep over sub-groups and its NVMe I/O."""
    optimizer_compute_seconds: float
    """The Adam kernels alone (CPU-Adam over each sub-group)."""
    gather_wait_seconds: float
    """Time forward and backward spent inside gathers: what compute waited for parameters."""
    nvme_param_wait_seconds: float
    nvme_optim_wait_seconds: float
    nvme_grad_wait_seconds: float
    copy_seconds: float
    """Host time in host-device copies (on a GPU with pinned buffers: issuing them)."""
    host_to_device_bytes: int
    device_to_host_bytes: int
    nvme_read_bytes: int
    nvme_write_bytes: int
    nvme_param_read_bytes: int
    """The NVMe bytes by tier: the 16-bit parameters (gathers, and the optimizer's writes
    of new weights), the optimizer state, the spilled fp32 gradients; each pair sums to
    the two totals above."""
    nvme_param_write_bytes: int
    nvme_optim_read_bytes: int
    nvme_optim_write_bytes: int
    nvme_grad_read_bytes: int
    nvme_grad_write_bytes: int
    prefetch_hits: int
    prefetch_misses: int
    peak_rss_bytes: int
    """The process's peak resident set size so far (not reset per step)."""
    peak_device_bytes: int
    """The device's peak allocated bytes so far (not reset per step); 0 on the CPU device,
    whose memory is host RAM and counted in peak_rss_bytes."""
    synchronized: bool
    """True when the device was synchronized around each timed part."""

    @property
    def nvme_wait_seconds(self) -> float:
        """All time waited for NVMe transfers (parameters, optimizer state, gradients)."""
        waits = (self.nvme_param_wait_seconds, self.nvme_optim_wait_seconds)
        return sum(waits) + self.nvme_grad_wait_seconds

    def to_dict(self) -> dict[str, int | float | bool]:
        return dataclasses.asdict(self)

    def seconds(self) -> dict[str, float]:
        """The `*_seconds` fields."""
        return {k: v for k, v in self.to_dict().items() if k.endswith("_seconds")}

    def compact(self) -> str:
        """The progress bar's line, in seconds: "fw 0.21 bw 0.40 opt 0.33 io 0.10" (io: every
        NVMe wait)."""
        parts = (
            ("fw", self.forward_seconds),
            ("bw", self.backward_seconds),
            ("opt", self.optimizer_seconds),
            ("io", self.nvme_wait_seconds),
        )
        return " ".join(f"{name} {_seconds(s)}" for name, s in parts)

    def describe(self) -> str:
        """The `wall_clock_breakdown` log line: every part in ms, bytes moved, peak RSS."""
        ms = _milliseconds
        text = (
            f"{ms(self.step_seconds)} | forward {ms(self.forward_seconds)} | backward "
            f"{ms(self.backward_seconds)} | optimizer {ms(self.optimizer_seconds)} (adam "
            f"{ms(self.optimizer_compute_seconds)}) | gather wait {ms(self.gather_wait_seconds)}"
            f" | copies {ms(self.copy_seconds)}, {_bytes(self.host_to_device_bytes)} to device, "
            f"{_bytes(self.device_to_host_bytes)} to host"
        )
        if self.nvme_read_bytes or self.nvme_write_bytes or self.nvme_wait_seconds:
            text += (
                f" | nvme wait: params {ms(self.nvme_param_wait_seconds)}, optimizer "
                f"{ms(self.nvme_optim_wait_seconds)}, grads {ms(self.nvme_grad_wait_seconds)}"
                f" | nvme {_bytes(self.nvme_read_bytes)} read, "
                f"{_bytes(self.nvme_write_bytes)} written"
            )
        return text + f" | peak rss {_bytes(self.peak_rss_bytes)}"


class CounterDeltas:
    """What running counters grew by since the last `take` (or `rebase`)."""

    def __init__(self, counters: Mapping[str, float]) -> None:
        self._last = dict(counters)

    def rebase(self, counters: Mapping[str, float]) -> None:
        """Start counting from `counters`: what grew before (checkpoint I/O between steps,
        the start's initial writes) belongs to no step."""
        self._last = dict(counters)

    def skip(self, before: Mapping[str, float], after: Mapping[str, float]) -> None:
        """Leave out of the next `take` what the counters grew by from `before` to `after`
        (work between steps that is no step's, such as an evaluation forward)."""
        for k, v in after.items():
            self._last[k] = self._last.get(k, 0) + v - before.get(k, 0)

    def take(self, counters: Mapping[str, float]) -> dict[str, float]:
        out = {k: v - self._last.get(k, 0) for k, v in counters.items()}
        self._last = dict(counters)
        return out


def step_telemetry(
    *,
    step: int,
    window_s: float,
    phases: Mapping[str, float],
    deltas: Mapping[str, float],
    optimizer_compute_s: float,
    peak_device_bytes: int,
    synchronized: bool,
) -> StepTelemetry:
    """One step's record from its phase sums ("forward", "backward", "optimizer") and the
    differences of the engine's counters (`Engine.memory_stats()` keys, plus the
    accelerator's copy counters: "host_to_device_bytes", "device_to_host_bytes",
    "copy_s"). Every NVMe tier's `nvme_<tier>_bytes_read/_written` counts."""

    def wait(key: str) -> float:
        return deltas.get(key, 0) / 1e6

    return StepTelemetry(
        step=step,
        step_seconds=window_s,
        forward_seconds=phases.get("forward", 0.0),
        backward_seconds=phases.get("backward", 0.0),
        optimizer_seconds=phases.get("optimizer", 0.0),
        optimizer_compute_seconds=optimizer_compute_s,
        gather_wait_seconds=wait("gather_wait_us"),
        nvme_param_wait_seconds=wait("nvme_param_wait_us"),
        nvme_optim_wait_seconds=wait("nvme_optim_wait_us"),
        nvme_grad_wait_seconds=wait("nvme_grad_wait_us"),
        copy_seconds=deltas.get("copy_s", 0.0),
        host_to_device_bytes=int(deltas.get("host_to_device_bytes", 0)),
        device_to_host_bytes=int(deltas.get("device_to_host_bytes", 0)),
        nvme_read_bytes=int(_sum_tiers(deltas, "_bytes_read")),
        nvme_write_bytes=int(_sum_tiers(deltas, "_bytes_written")),
        nvme_param_read_bytes=int(deltas.get("nvme_param_bytes_read", 0)),
        nvme_param_write_bytes=int(deltas.get("nvme_param_bytes_written", 0)),
        nvme_optim_read_bytes=int(deltas.get("nvme_optim_bytes_read", 0)),
        nvme_optim_write_bytes=int(deltas.get("nvme_optim_bytes_written", 0)),
        nvme_grad_read_bytes=int(deltas.get("nvme_grad_bytes_read", 0)),
        nvme_grad_write_bytes=int(deltas.get("nvme_grad_bytes_written", 0)),
        prefetch_hits=int(deltas.get("prefetch_hits", 0)),
        prefetch_misses=int(deltas.get("prefetch_misses", 0)),
        peak_rss_bytes=peak_rss_bytes(),
        peak_device_bytes=peak_device_bytes,
        synchronized=synchronized,
    )


def nvme_bytes(counters: Mapping[str, float]) -> tuple[int, int]:
    """(read, written) bytes over every NVMe tier of `Engine.memory_stats()`-style counters."""
    return int(_sum_tiers(counters, "_bytes_read")), int(_sum_tiers(counters, "_bytes_written"))


def _sum_tiers(counters: Mapping[str, float], suffix: str) -> float:
    return sum(v for k, v in counters.items() if k.startswith("nvme_") and k.endswith(suffix))


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far: Linux's VmHWM, the high-water mark of
    this process's own memory since its exec. getrusage's ru_maxrss is the fallback only: on
    Linux it survives exec, so a run started from a large process (a test runner, a
    notebook) would report that process's peak as its own."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 100 else f"{s:.1f}" if s >= 10 else f"{s:.2f}"


def _milliseconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
