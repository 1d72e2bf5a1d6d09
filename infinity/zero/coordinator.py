"""The coordinator: the iteration's lifecycle, and which parameters are gathered when.

It owns the phase of the iteration (only its verbs `begin_forward`, `end_forward`,
`begin_backward`, `end_backward` and `abort` change it; the engine drives them through the
`forward` and `backward` context managers, which abort on an exception, and whoever keeps
state per iteration subscribes to its end through `on_end`), the live set and its budget, the
traces and the prefetch cursor, and the counters behind `memory_stats()`. Hooks
(`infinity.zero.hooks`) tell it when a unit starts (`gather`) and ends (`done`); it never
touches modules.

[Note: the live budget] `max_live_parameters` is a hard bound on gathered elements, checked
at every fetch. A gather that does not fit first evicts resident parameters that no running
module needs (furthest next use first). Prefetch evicts only parameters whose next use comes
after the unit it fetches (so it never drops what is needed sooner to bring in what is
needed later); when that does not make room it stops, and resumes at the next gather. The
only excess allowed is what running forwards pin at once (the unit being gathered and the
modules enclosing it), which is why the bound is stated as budget + the largest unit;
anything beyond that is counted in `budget_overruns`. Backward pins nothing past the gather
itself: a module's weights are read back through the saved-tensor hooks, which gather again
whatever was evicted meanwhile.

[Note: the same order on every rank] Across ranks a parameter becomes LIVE through a
collective (the all-gather of its shards), so every rank must fetch, make LIVE and release
the same parameters in the same order, or the job hangs. Every such decision is therefore a
function of the gathers so far, the trace and the configured sizes only: prefetch fetches
the units of the next `prefetch_bucket_size` traced elements that fit the budget, a
parameter becomes LIVE only when a gather (or the step's quiesce) needs it, and evictions
follow the trace. What may depend on timing is local: when an NVMe read of the rank's own
shard is issued and when a finished one is copied to its device buffer (see [Note: the NVMe
pool]); so a collective belongs in `OffloadParam.wait` (or, for a shard in host memory, in
the fetch decided here: see [Note: early all-gathers] in gather.py), never in `finish_read`.
Observers (`observers`) see each decision as a `LiveEvent`.

[Note: the NVMe pool] A parameter whose home is on NVMe is read into a buffer of the param
store's fixed pool before it is copied to the device. A fetch decided for such a parameter
is queued until a buffer is free (`infinity.zero.reads.ReadQueue`); reads are issued in the
order decided, and whenever the coordinator runs (each gather) the reads that have finished
are copied to their device buffers, which frees their pool buffers for the next ones,
without waiting for the disk. A gather that needs a parameter whose read is still queued
first completes the oldest reads in flight (they were issued for units needed sooner) until
a buffer is free, so a unit with more parameters than buffers never deadlocks; only when no
read of ours holds a buffer does it block on the pool (which times out with the holders'
names).

[Note: reuse] After a unit ends, a parameter stays gathered if it is persistent (fewer
elements than `param_persistence_threshold`), if the trace says its next use comes within
`max_reuse_distance` gathered elements, or if the next use is already inside the prefetch
window (releasing it would only fetch it again).

[Note: frozen parameters stay gathered] A frozen parameter (no optimizer slot: a LoRA base)
never changes between iterations, so neither the end of its unit, nor of the iteration, nor
the optimizer step releases it; it counts against the live budget like any other and is
evicted (furthest next use first) only when a gather needs the room. A frozen base that fits
the budget is read from its home once, not at every micro-step; one that does not is read
as before. `abort` (after an error, or on close) still releases everything.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from infinity.accelerator import Accelerator
from infinity.config import ZeroConfig
from infinity.zero.gathered import GatheredIndex
from infinity.zero.home import HomeTier
from infinity.zero.param import OffloadParam, ParamState
from infinity.zero.reads import ReadQueue
from infinity.zero.trace import Trace
from infinity.zero.unit import ModuleUnit

logger = logging.getLogger(__name__)

_RESYNC_WINDOW = 16
"""How far ahead a unit that is not at the cursor is looked for before the trace is
considered off track for the rest of the iteration."""


class Phase(enum.Enum):
    """Where the iteration stands. Only the coordinator's verbs change it."""

    IDLE = "idle"
    """No iteration runs: a module called outside the engine gathers and releases its own
    parameters, untraced."""
    FORWARD = "forward"
    """The engine's forward runs; gathers are recorded in execution order."""
    BACKWARD_PENDING = "backward_pending"
    """The forward returned outputs that need gradients; their backward has not begun."""
    BACKWARD = "backward"
    """Gradients flow through the model; gathers continue the recording."""


class LiveEvent(enum.Enum):
    """A decision about one parameter's device copy, as observers see it (see [Note: the
    same order on every rank])."""

    FETCH = "fetch"
    """Its transfer to the device was decided; it counts against the budget from here."""
    LIVE = "live"
    """It became LIVE: `param.data` is the gathered buffer."""
    RELEASE = "release"
    """Its device buffer (or its decided transfer) was dropped."""


Observer = Callable[[LiveEvent, OffloadParam], None]

# What each verb expects, and what to do about it when the phase is another one.
_HINTS = {
    "begin_forward": "the engine's forward is not reentrant; run one forward at a time",
    "end_forward": "end_forward closes the forward that begin_forward started",
    "begin_backward": (
        "a gradient reached the model with no engine forward waiting for it: compute the "
        "loss from the outputs of engine(...) and run one backward per forward"
    ),
    "end_backward": "end_backward closes the backward that begin_backward started",
}


class Coordinator:
    """Owns the iteration's lifecycle; gathers, releases and prefetches parameters under the
    live budget."""

    def __init__(
        self, records: Iterable[OffloadParam], zero: ZeroConfig, *, accelerator: Accelerator
    ) -> None:
        self.records = list(records)
        self.accel = accelerator
        self.copy_stream = accelerator.new_stream()
        self.budget = int(zero.max_live_parameters)
        self.prefetch_numel = int(zero.prefetch_bucket_size)
        self.reuse_distance = int(zero.max_reuse_distance)
        self.phase = Phase.IDLE
        self.observers: list[Observer] = []
        """Called with each `LiveEvent` (see [Note: the same order on every rank])."""
        self.on_end: list[Callable[[], None]] = []
        """Called whenever an iteration ends, closed or aborted: what the hooks and the
        backward entry keep for one iteration is forgotten there."""
        self.live_numel = 0
        self.peak_live_numel = 0
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.hits = 0
        self.misses = 0
        self.budget_overruns = 0
        self.largest_unit = 0
        """Elements of the largest unit gathered so far: the allowance over the budget."""
        self.trace_updates = 0
        self.gather_wait_s = 0.0
        """Seconds forward and backward spent inside gathers (fetching, landing, issuing
        prefetch): what compute waited for its parameters."""
        self._resident: dict[OffloadParam, None] = {}  # non-persistent, LIVE or pending
        self._pending: dict[OffloadParam, None] = {}  # fetched, not yet LIVE, in order decided
        self._reads = ReadQueue(accelerator, self.copy_stream)  # see [Note: the NVMe pool]
        self.gathered = GatheredIndex()
        """LIVE parameters by the memory of their buffers: tensors autograd saves are matched
        to their parameter through it (see [Note: saved weights] in hooks)."""
        self._traces: dict[object, Trace] = {}
        self._trace: Trace | None = None
        self._key: object = None
        self._recording: list[ModuleUnit] = []
        self._cursor = 0
        self._prefetch_upto = 0
        self._on_track = True

    # ---- the iteration's lifecycle ----------------------------------------------------

    @contextlib.contextmanager
    def forward(self, key: object, *, backward: bool) -> Iterator[None]:
        """The engine's forward of an iteration of kind `key`, run inside: begins it, ends
        it (`end_forward(backward=...)`) when the body returns, aborts it when the body
        raises."""
        self.begin_forward(key)
        with self._aborting():
            yield
        self.end_forward(backward=backward)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """`engine.backward`'s autograd run inside. The first gradient to reach the model
        begins the backward (`BackwardEntry`) and autograd's end ends it; an exception
        aborts the iteration; a loss whose gradient reached no output of the forward ends it
        when the body returns (its order still becomes the trace). Refused when no forward
        waits for its backward."""
        if self.phase is Phase.IDLE:
            raise RuntimeError(
                "backward: no forward is waiting for its backward (its backward already ran, "
                "or the loss was not computed from engine(...)); run one backward per forward"
            )
        with self._aborting():
            yield
        if self.phase is not Phase.IDLE:
            self._close()

    @contextlib.contextmanager
    def _aborting(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def begin_forward(self, key: object) -> None:
        """The engine's forward starts an iteration of kind `key` (training / inference):
        the one place an iteration begins. A previous forward whose backward never came is
        closed first (its order still becomes the trace); a backward that raised out of
        autograd (a plain `loss.backward()`, which no context manager wraps) is aborted."""
        if self.phase is Phase.BACKWARD_PENDING:
            self._close()
        elif self.phase is Phase.BACKWARD:
            self.abort()
        self._expect("begin_forward", Phase.IDLE)
        self._key = key
        self._trace = self._traces.get(key)
        self._recording = []
        self._cursor = 0
        self._prefetch_upto = 0
        self._on_track = self._trace is not None
        self.phase = Phase.FORWARD
        self._prefetch()

    def end_forward(self, *, backward: bool) -> None:
        """The forward returned. With `backward` its outputs need gradients and the
        iteration waits for them; otherwise (no grad) the iteration ends here."""
        self._expect("end_forward", Phase.FORWARD)
        if backward:
            self.phase = Phase.BACKWARD_PENDING
        else:
            self._close()

    def begin_backward(self) -> bool:
        """The first gradient reached the model (an output of the engine's forward or of a
        module in it): called by `BackwardEntry.enter` only. False when the backward had
        begun."""
        if self.phase is Phase.BACKWARD:
            return False
        self._expect("begin_backward", Phase.BACKWARD_PENDING)
        self.phase = Phase.BACKWARD
        return True

    def end_backward(self) -> None:
        """Autograd finished the backward: the iteration ends."""
        self._expect("end_backward", Phase.BACKWARD)
        self._close()

    def abort(self) -> None:
        """After an exception (or on close), from any phase: drop pins and the recording,
        release everything."""
        for rec in self.records:
            rec.pins = 0
        self._recording = []
        self._trace = None
        self.phase = Phase.IDLE
        self._notify_end()
        self.release_all()

    def _notify_end(self) -> None:
        for callback in self.on_end:
            callback()

    def check_between_iterations(self, what: str) -> None:
        """Refuse `what` (a checkpoint's save or load) while a forward with gradients waits
        for its backward."""
        if self.phase is not Phase.IDLE and torch.is_grad_enabled():
            raise RuntimeError(
                f"{what}: a forward is waiting for its backward (phase {self.phase.name}); "
                "call it between steps"
            )

    def _expect(self, verb: str, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(
                f"{verb}: the iteration is in phase {self.phase.name}, expected "
                f"{phase.name}; {_HINTS[verb]}"
            )

    def _close(self) -> None:
        """End the iteration: keep its order as the trace, release what is not persistent."""
        trace = self._trace
        if trace is None or not trace.same_order(self._recording):
            if trace is not None:
                self.trace_updates += 1
                logger.debug("execution order changed: trace %r updated", self._key)
            self._traces[self._key] = Trace(self._recording)
        self._recording = []
        self._trace = None
        self.phase = Phase.IDLE
        self._notify_end()
        for rec in self.records:
            rec.pins = 0  # every running call has ended with the iteration
        self.release_all(keep_frozen=True)

    # ---- gather / done ----------------------------------------------------------------

    def gather(self, unit: ModuleUnit, *, pin: bool = True) -> int | None:
        """Make every parameter of `unit` LIVE (and keep it pinned with `pin`, for a forward
        that reads `param.data` directly); returns its trace position."""
        start = time.perf_counter()
        with self.accel.range("infinity::zero::gather"):
            pos = self._gather(unit, pin)
        self.gather_wait_s += time.perf_counter() - start
        return pos

    def _gather(self, unit: ModuleUnit, pin: bool) -> int | None:
        pos = self._advance(unit)
        if self.phase is not Phase.IDLE:
            self._recording.append(unit)
        if unit.numel > self.largest_unit:
            self.largest_unit = unit.numel
        need = 0
        for rec in unit.records:
            rec.pins += 1
            if self._unfetched(rec):
                need += rec.numel
        if need:
            self._make_room(need, unit)
        # A miss is a parameter whose transfer had not started: fetched only now, or an NVMe
        # read still queued. The unit's own reads are issued together, ahead of prefetch's,
        # so that a miss waits for the disk once rather than once per parameter.
        missed = []
        for rec in unit.records:
            if self._unfetched(rec):
                self._fetch(rec)
                missed.append(rec)
            elif rec in self._reads.queued:
                missed.append(rec)
        self._reads.pump(first=missed)
        for rec in unit.records:
            count = not rec.persistent
            if rec in missed:
                self.misses += count
                if count and logger.isEnabledFor(logging.DEBUG):
                    logger.debug("gather miss: %s (phase %s)", rec.name, self.phase.value)
            else:
                self.hits += count
            if rec.state is not ParamState.LIVE:
                self._land(rec)
            if not pin:
                rec.pins -= 1
        if pos is not None:
            self._prefetch(unit)
        return pos

    def gather_one(self, rec: OffloadParam) -> None:
        """Gather a parameter used outside the unit that owns it (counted as a miss)."""
        start = time.perf_counter()
        with self.accel.range("infinity::zero::gather"):
            self._gather_one(rec)
        self.gather_wait_s += time.perf_counter() - start

    def _gather_one(self, rec: OffloadParam) -> None:
        if rec.state is ParamState.LIVE:
            self.hits += not rec.persistent
            return
        if self._unfetched(rec):
            self._make_room(rec.numel, None)
            self._fetch(rec)
            self.misses += not rec.persistent
        else:
            self.hits += not rec.persistent
        self._land(rec)

    def done(
        self, unit: ModuleUnit, pos: int | None, *, release: bool = True, unpin: bool = True
    ) -> None:
        """`unit` finished (forward, or its backward): unpin, release what is not reused."""
        for rec in unit.records:
            if unpin and rec.pins > 0:
                rec.pins -= 1
            if release:
                self.settle(rec, pos)

    def settle(self, rec: OffloadParam, pos: int | None) -> None:
        """Release `rec` unless it is pinned or reused soon after trace position `pos`."""
        if rec.pins == 0 and not self._keep(rec, pos):
            self._release(rec)

    def release_all(self, *, keep_frozen: bool = False) -> None:
        """Release every unpinned, non-persistent parameter; with `keep_frozen`, frozen ones
        stay gathered (see [Note: frozen parameters stay gathered])."""
        for rec in list(self._resident):
            if rec.pins == 0 and not (keep_frozen and not rec.trainable):
                self._release(rec)

    def refresh(
        self, rec: OffloadParam, values: torch.Tensor | None = None, *, start: int = 0
    ) -> None:
        """`rec`'s home changed: make a gathered copy match. `values` (host, model dtype)
        are its new elements [start, start + values.numel()) when the caller holds them
        (the optimizer's sweep, see [Note: gathered weights after a step] in assemble.py);
        without them the whole home is copied again. A released parameter needs nothing
        (its next fetch reads the new home); one in flight lands first (its copy may predate
        the change)."""
        if self._unfetched(rec):
            return
        if rec.state is not ParamState.LIVE:  # queued or in flight: the same on every rank
            self._land(rec)
        rec.refresh(self.accel, values, start)

    def quiesce(self) -> None:
        """Before the trainable weights change: release every unpinned non-persistent
        trainable parameter and land every read in flight (its copy would predate the
        change). Frozen parameters never change here: they stay gathered."""
        self.release_all(keep_frozen=True)
        for rec in self.records:
            if rec in self._pending:
                self._land(rec)

    # ---- internals --------------------------------------------------------------------

    def _advance(self, unit: ModuleUnit) -> int | None:
        trace = self._trace
        if trace is None or not self._on_track:
            return None
        pos = trace.find(unit, self._cursor, _RESYNC_WINDOW)
        if pos is None:
            self._on_track = False
            return None
        self._cursor = pos + 1
        return pos

    def _keep(self, rec: OffloadParam, pos: int | None) -> bool:
        if rec.persistent or not rec.trainable:  # see [Note: frozen parameters stay gathered]
            return True
        trace = self._trace
        if trace is None or pos is None or not self._on_track:
            return False
        nxt = trace.next_use(rec, pos)
        if nxt is None:
            return False
        return nxt < self._prefetch_upto or trace.distance(pos + 1, nxt) <= self.reuse_distance

    def _unfetched(self, rec: OffloadParam) -> bool:
        """No transfer of `rec` is decided (RELEASED, and not queued for a pool buffer)."""
        return rec.state is ParamState.RELEASED and rec not in self._pending

    def _emit(self, event: LiveEvent, rec: OffloadParam) -> None:
        for observer in self.observers:
            observer(event, rec)

    def _fetch(self, rec: OffloadParam) -> None:
        """Decide `rec`'s transfer (RELEASED -> pending): a host copy starts now, an NVMe
        read is queued for a pool buffer (see [Note: the NVMe pool])."""
        if rec.home.tier is HomeTier.NVME:
            self._reads.add(rec)
        else:
            rec.fetch(self.accel, self.copy_stream)
        self._pending[rec] = None
        if not rec.persistent:
            self._resident[rec] = None
        self.live_numel += rec.numel
        self.live_bytes += rec.numel * rec.itemsize
        if self.live_numel > self.peak_live_numel:
            self.peak_live_numel = self.live_numel
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
        self._emit(LiveEvent.FETCH, rec)

    def _land(self, rec: OffloadParam) -> None:
        """pending -> LIVE; a failed NVMe read leaves `rec` RELEASED and uncounted."""
        self._reads.issue_now(rec, self._land)
        error = self._reads.forget(rec)
        self._pending.pop(rec, None)
        try:
            if error is not None:
                raise error
            rec.wait(self.accel)
        except BaseException:
            if rec.state is ParamState.RELEASED:
                self._uncount(rec)
            raise
        self.gathered.add(rec)
        self._emit(LiveEvent.LIVE, rec)

    def _release(self, rec: OffloadParam) -> None:
        if rec.persistent or self._unfetched(rec):
            return
        self.gathered.remove(rec)
        self._reads.forget(rec)  # a failed read's error: its data is no longer wanted
        self._pending.pop(rec, None)
        if rec.state is not ParamState.RELEASED:  # not a queued read or a failed one
            with self.accel.range("infinity::zero::release"):
                rec.release()
        self._uncount(rec)
        self._emit(LiveEvent.RELEASE, rec)

    def _uncount(self, rec: OffloadParam) -> None:
        self._resident.pop(rec, None)
        self.live_numel -= rec.numel
        self.live_bytes -= rec.numel * rec.itemsize

    def _make_room(self, need: int, unit: ModuleUnit | None) -> None:
        """Evict unpinned parameters (furthest next use first) until `need` more fit."""
        if self.live_numel + need > self.budget:
            self._evict(need, unit, used_before=None)
            if self.live_numel + need > self.budget + self.largest_unit:
                self.budget_overruns += 1

    def _evict(self, need: int, unit: ModuleUnit | None, used_before: int | None) -> None:
        """Release unpinned resident parameters, furthest next use first, until `need` more
        elements fit. With `used_before`, only those not needed before that trace position."""
        trace, here = self._trace, self._cursor
        far = 1 << 62
        on_track = trace is not None and self._on_track

        def next_use(r: OffloadParam) -> int:
            nxt = trace.next_use(r, here - 1) if on_track else None  # type: ignore[union-attr]
            return far if nxt is None else nxt

        victims = [
            (next_use(r), r)
            for r in self._resident
            if r.pins == 0 and (unit is None or r not in unit)
        ]
        victims.sort(key=lambda v: v[0], reverse=True)
        for nxt, rec in victims:
            if self.live_numel + need <= self.budget:
                break
            if used_before is not None and nxt <= used_before:
                break
            self._release(rec)

    def _prefetch(self, running: ModuleUnit | None = None) -> None:
        """Fetch ahead along the trace: the units within `prefetch_numel` elements of the
        cursor, in order, while they fit the budget. The pool does not stop it: reads wait
        in the queue for buffers (see [Note: the same order on every rank])."""
        trace = self._trace
        if trace is None or not self._on_track or self.prefetch_numel <= 0:
            return
        with self.accel.range("infinity::zero::prefetch"):
            self._prefetch_along(trace, running)

    def _prefetch_along(self, trace: Trace, running: ModuleUnit | None) -> None:
        pos = max(self._prefetch_upto, self._cursor)
        while pos < len(trace):
            if trace.distance(self._cursor, pos) >= self.prefetch_numel:
                break
            recs = trace.records[pos]
            need = sum(r.numel for r in recs if self._unfetched(r))
            if self.live_numel + need > self.budget:
                # Only parameters needed later than this unit make way for it.
                self._evict(need, running, used_before=pos)
                if self.live_numel + need > self.budget:
                    break  # prefetch waits for room
            for r in recs:
                if self._unfetched(r):
                    self._fetch(r)
            pos += 1
        self._prefetch_upto = pos
        self._reads.pump()

    def stats(self) -> dict[str, int]:
        return {
            "live_param_numel": self.live_numel,
            "peak_live_param_numel": self.peak_live_numel,
            "device_bytes": self.live_bytes,
            "peak_device_bytes": self.peak_live_bytes,
            "prefetch_hits": self.hits,
            "prefetch_misses": self.misses,
            "budget_overruns": self.budget_overruns,
            "trace_updates": self.trace_updates,
            "gather_wait_us": int(self.gather_wait_s * 1e6),
        }
