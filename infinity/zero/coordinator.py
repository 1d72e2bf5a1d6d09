"""The coordinator: the iteration's lifecycle, and which parameters are gathered when.

It owns the phase of the iteration (only its verbs `begin_forward`, `end_forward`,
`begin_backward`, `end_backward` and `abort` change it; the engine drives them through the
`forward` and `backward` context managers, which abort on an exception, and whoever keeps
state per iteration subscribes to its end through `on_end`), the live set and its budget, the
traces and the prefetch cursor, and the counters behind `memory_stats()`. Hooks
(`infinity.zero.hooks`) tell it when a unit starts (`gather`) and ends (`done`); it never
touches modules.

The live-set policy itself (what to fetch, keep, evict and prefetch) is the planner of
`infinity.zero.live_plan`, over parameter indices; the coordinator applies its decisions to
the records (`_ApplyLive`) and owns the transfers, the pins and the phase. The policy's rules are
the notes in live_plan.py; the NVMe reads behind fetches are reads.py's.

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

"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from infinity.accelerator import Accelerator
from infinity.config import ResolvedZero
from infinity.zero.gathered import GatheredIndex
from infinity.zero.home import HomeTier
from infinity.zero.iteration import HINTS, Phase
from infinity.zero.live_plan import LivePlan, kept_mask
from infinity.zero.param import OffloadParam, ParamState
from infinity.zero.reads import ReadQueue
from infinity.zero.trace import Trace
from infinity.zero.unit import ModuleUnit

logger = logging.getLogger(__name__)

_RESYNC_WINDOW = 16
"""How far ahead a unit that is not at the cursor is looked for before the trace is
considered off track for the rest of the iteration."""


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


class Coordinator:
    """Owns the iteration's lifecycle; gathers, releases and prefetches parameters under the
    live budget."""

    def __init__(
        self, records: Iterable[OffloadParam], zero: ResolvedZero, *, accelerator: Accelerator
    ) -> None:
        self.records = list(records)
        self.accel = accelerator
        self.copy_stream = accelerator.new_stream()
        self.plan = LivePlan(
            budget=zero.max_live_parameters,
            window=zero.prefetch_bucket_size,
            reuse=zero.max_reuse_distance,
        )
        """The live-set policy; a record's index in it is `self.index(rec)`."""
        self._index: dict[OffloadParam, int] = {}
        self._by_index: list[OffloadParam] = []
        recs = self.records
        kept = kept_mask([r.numel for r in recs], [r.trainable for r in recs],
                         [r.persistent for r in recs], zero.keep_weights_numel)  # fmt: skip
        for rec, keep in zip(recs, kept, strict=True):
            self.index(rec, kept=keep)
        self._apply = _ApplyLive(self)
        self.phase = Phase.IDLE
        self.observers: list[Observer] = []
        """Called with each `LiveEvent` (see [Note: the same order on every rank])."""
        self.on_end: list[Callable[[], None]] = []
        """Called whenever an iteration ends, closed or aborted: what the hooks and the
        backward entry keep for one iteration is forgotten there."""
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.hits = 0
        self.misses = 0
        self.trace_updates = 0
        self.gather_wait_s = 0.0
        """Seconds forward and backward spent inside gathers (fetching, landing, issuing
        prefetch): what compute waited for its parameters."""
        self._pending: dict[OffloadParam, None] = {}  # fetched, not yet LIVE, in order decided
        self._reads = ReadQueue(accelerator, self.copy_stream)  # see [Note: the NVMe pool]
        self.gathered = GatheredIndex()
        """LIVE parameters by the memory of their buffers: tensors autograd saves are matched
        to their parameter through it (see [Note: saved weights] in hooks)."""
        self._traces: dict[object, Trace] = {}
        self._trace: Trace | None = None
        self._key: object = None
        self._recording: list[ModuleUnit] = []

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
        self.plan.begin(None if self._trace is None else self._trace.live)
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
        self.plan.end()
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
                f"{phase.name}; {HINTS[verb]}"
            )

    def _close(self) -> None:
        """End the iteration: keep its order as the trace, release what is not persistent."""
        trace = self._trace
        if trace is None or not trace.same_order(self._recording):
            if trace is not None:
                self.trace_updates += 1
                logger.debug("execution order changed: trace %r updated", self._key)
            self._traces[self._key] = Trace(self._recording, self.index, self.plan.numel)
        self._recording = []
        self._trace = None
        self.plan.end()
        self.phase = Phase.IDLE
        self._notify_end()
        for rec in self.records:
            rec.pins = 0  # every running call has ended with the iteration
        # Trainable weights change only at the step: kept ones stay for the next micro batch
        self.release_all(keep_frozen=True, keep_kept=True)

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
        for rec in unit.records:
            rec.pins += 1
        now = set(self.plan.gather(self._ids(unit), self._apply, self._pinned))
        # A miss is a parameter whose transfer had not started: fetched only now, or an NVMe
        # read still queued. The unit's own reads are issued together, ahead of prefetch's,
        # so that a miss waits for the disk once rather than once per parameter.
        missed = [
            rec for rec in unit.records if self._index[rec] in now or rec in self._reads.queued
        ]
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
        if self.plan.gather_one(self.index(rec), self._apply, self._pinned):
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
        if rec.pins == 0:
            self.plan.settle(self.index(rec), pos, self._apply)

    def release_all(self, *, keep_frozen: bool = False, keep_kept: bool = False) -> None:
        """Release every unpinned, non-persistent parameter; with `keep_frozen`, frozen ones
        stay gathered (see [Note: frozen parameters stay gathered]), with `keep_kept` the
        kept trainable ones (see [Note: weights kept across micro batches])."""
        self.plan.release_all(
            self._apply, self._pinned, keep_frozen=keep_frozen, keep_kept=keep_kept
        )

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
        trainable parameter, kept ones included, and land every read in flight (its copy
        would predate the change). Frozen parameters never change here: they stay
        gathered."""
        self.release_all(keep_frozen=True)
        for rec in self.records:
            if rec in self._pending:
                self._land(rec)

    # ---- internals --------------------------------------------------------------------

    def index(self, rec: OffloadParam, *, kept: bool = False) -> int:
        """`rec`'s index in the planner (registered at first sight, `kept` across the micro
        batches of a step or not)."""
        i = self._index.get(rec)
        if i is None:
            frozen = not rec.trainable
            i = self.plan.add(rec.numel, persistent=rec.persistent, frozen=frozen, kept=kept)
            self._index[rec] = i
            self._by_index.append(rec)
        return i

    def _ids(self, unit: ModuleUnit) -> list[int]:
        return [self.index(r) for r in unit.records]

    def _pinned(self, i: int) -> bool:
        return self._by_index[i].pins > 0

    def _advance(self, unit: ModuleUnit) -> int | None:
        trace = self._trace
        if trace is None or not self.plan.on_track:
            return None
        pos = trace.find(unit, self.plan.cursor, _RESYNC_WINDOW)
        self.plan.advance(pos)
        return pos

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
        self.plan.hold(self.index(rec))
        self.live_bytes += rec.numel * rec.itemsize
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
        self.plan.drop(self.index(rec))
        self.live_bytes -= rec.numel * rec.itemsize

    def _prefetch(self, running: ModuleUnit | None = None) -> None:
        """Fetch ahead along the trace (the planner's `prefetch`). The pool does not stop it:
        reads wait in the queue for buffers (see [Note: the same order on every rank])."""
        plan = self.plan
        if not plan.following or plan.window <= 0:
            return
        with self.accel.range("infinity::zero::prefetch"):
            ids = () if running is None else set(self._ids(running))
            plan.prefetch(ids, self._apply, self._pinned)
            self._reads.pump()

    @property
    def budget(self) -> int:
        """`max_live_parameters`: gathered elements the planner keeps to."""
        return self.plan.budget

    @property
    def live_numel(self) -> int:
        return self.plan.live_numel

    @property
    def peak_live_numel(self) -> int:
        return self.plan.peak_live_numel

    @property
    def largest_unit(self) -> int:
        """Elements of the largest unit gathered so far: the allowance over the budget."""
        return self.plan.largest_unit

    @property
    def budget_overruns(self) -> int:
        return self.plan.overruns

    def stats(self) -> dict[str, int]:
        return {
            "live_param_numel": self.live_numel,
            "peak_live_param_numel": self.peak_live_numel,
            "peak_kept_param_numel": self.plan.peak_kept_numel,
            "device_bytes": self.live_bytes,
            "peak_device_bytes": self.peak_live_bytes,
            "prefetch_hits": self.hits,
            "prefetch_misses": self.misses,
            "budget_overruns": self.budget_overruns,
            "trace_updates": self.trace_updates,
            "gather_wait_us": int(self.gather_wait_s * 1e6),
        }


class _ApplyLive:
    """Carries out the planner's decisions on the coordinator's records (a `Sink`)."""

    __slots__ = ("coord",)

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def fetch(self, i: int, needed: int | None) -> None:
        self.coord._fetch(self.coord._by_index[i])

    def release(self, i: int) -> None:
        self.coord._release(self.coord._by_index[i])
