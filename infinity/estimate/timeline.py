"""One optimizer step as a schedule of the resources that work at once: what runs beside
what, and the step as the critical path of that schedule.

Owns `step_timeline`: from the busy seconds of each resource (the window's compute, copies
and disk, CPU-Adam, the norm, the state's NVMe transfers) and the sub-groups the overlapped
step may step early, the spans of each resource and when the step ends. It does not own the
busy seconds (`infinity.estimate.result.step_times` derives them from the sizes and rates).

[Note: the step's timeline] Four resources: the device (forward and backward kernels; on
the CPU device the cores, which also copy and run the hooks), the copy engines, the disk,
and the host CPU that runs CPU-Adam. During the accumulation window the device, the copies
and the disk run side by side, so the window ends when the slowest of them does (on the
CPU device with parameters on NVMe, when the gather-by-gather replay of `pipeline` says).
With `offload_optimizer.overlap_step` on a GPU, each sub-group the engine may step early
(`Sizes.ahead_numels`, in the order backward finishes them) is final once the last micro
batch's backward has passed its share of the flat space, and the worker steps it then
(CPU-Adam, with its state's transfers when it is on NVMe), one after another, until the
step begins at the end of backward; the step waits for the sub-group in progress. Then the
gradient norm, then the rest of the sweep: CPU-Adam beside the state's reads and writes.
The step ends when the last of these does: a chain, not a sum of every part nor the
largest one. On the CPU device backward takes the cores the worker would use, so nothing
hides there and the step is the serial one (the overlap measured no gain on two cores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """One resource busy with one thing from `start_s` to `end_s` in the step."""

    resource: str
    what: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """The step's spans, its length and the chain that sets it."""

    spans: tuple[Span, ...]
    step_s: float
    critical: tuple[str, ...]
    """What lies on the critical path, in order."""
    ahead_s: float
    """CPU-Adam (and its state's transfers) run beside the last backward."""

    def lines(self) -> list[str]:
        """The schedule as `infinity estimate` prints it."""
        out = ["timeline of one step (what runs beside what)"]
        for s in sorted(self.spans, key=lambda s: (s.start_s, s.resource)):
            out.append(
                f"  {s.start_s:8.2f} - {s.end_s:8.2f} s  {s.resource:<8}{s.what}"
                f" ({s.end_s - s.start_s:.2f} s)"
            )
        out.append("  critical path: " + " -> ".join(self.critical))
        return out


@dataclass(frozen=True, slots=True)
class Window:
    """The accumulation window's busy seconds by resource (forward and backward of every
    micro step), and its length with the three side by side."""

    device_s: float
    copies_s: float
    disk_s: float
    length_s: float
    last_backward_s: float
    """The last micro batch's backward, which ends the window."""
    device_label: str = "device"


def step_timeline(
    window: Window,
    *,
    adam_s: float,
    state_io_s: float,
    norm_s: float,
    flat_numel: int,
    ahead_numels: Sequence[int] = (),
    pipelined: bool = True,
) -> Timeline:
    """See [Note: the step's timeline]. `adam_s`, `state_io_s`: CPU-Adam and the state's
    NVMe transfers over every sub-group; `ahead_numels`: the sub-groups the worker may step
    early (empty: off, or the CPU device); `pipelined`: the sweep's transfers run beside
    CPU-Adam (else after it)."""
    w = window.length_s
    spans = [
        Span(window.device_label, "forward + backward of every micro batch", 0.0, window.device_s),
        Span("copies", "host <-> device copies", 0.0, window.copies_s),
        Span("NVMe", "parameter reads, spilled gradients, state read ahead", 0.0, window.disk_s),
    ]
    spans = [s for s in spans if s.end_s > 0]
    longest = max(spans, key=lambda s: s.end_s, default=None)
    critical = [f"{longest.resource} window" if longest else "window"]
    t, done, ahead = w, 0, 0.0  # the worker's clock, the elements it stepped
    flat = max(flat_numel, 1)
    per_elem = (adam_s / flat, state_io_s / flat)
    cursor, first = w - window.last_backward_s, None
    for n in ahead_numels:
        final = w - window.last_backward_s * (1 - (done + n) / flat)
        start = max(cursor, final)
        if start >= w:  # the step began: it steps this one serially
            break
        cost = _sweep_s(n * per_elem[0], n * per_elem[1], pipelined)
        first = start if first is None else first
        cursor, done, ahead = start + cost, done + n, ahead + cost
    if done:
        spans.append(Span("CPU", "CPU-Adam of sub-groups final in the last backward",
                          first, cursor))  # fmt: skip
        if cursor > w:
            critical.append("the early step in progress")
        t = max(w, cursor)
    rest_adam, rest_io = adam_s * (1 - done / flat), state_io_s * (1 - done / flat)
    spans.append(Span("CPU", "gradient norm", t, t + norm_s))
    critical.append("gradient norm")
    t += norm_s
    io_start = t if pipelined else t + rest_adam
    spans.append(Span("CPU", "CPU-Adam", t, t + rest_adam))
    if rest_io > 0:
        spans.append(Span("NVMe", "optimizer state reads / writes", io_start, io_start + rest_io))
    end = t + _sweep_s(rest_adam, rest_io, pipelined)
    critical.append("NVMe state sweep" if io_start + rest_io > t + rest_adam else "CPU-Adam")
    return Timeline(tuple(spans), end, tuple(critical), ahead)


def _sweep_s(adam_s: float, io_s: float, pipelined: bool) -> float:
    """A sweep: CPU-Adam beside its state's transfers, or one after the other."""
    return max(adam_s, io_s) if pipelined else adam_s + io_s
