"""How `infinity train` stops on SIGINT (Ctrl-C), SIGTERM (`kill`, batch schedulers) and SIGHUP
(the terminal or ssh connection went away).

Owns the signal handlers of one run and what a signal means in each phase of it
([Note: stopping on a signal]). It does not save or close anything itself: the run reads
`requested` between optimizer steps, and catches `StopNow` to clean up.

[Note: stopping on a signal] While the model and engine are being built there is nothing
worth keeping, so a signal stops at once (`StopNow`; the engine's start removes its swap
directory when it fails). During training the first signal only asks for a stop: the current
optimizer step finishes, a checkpoint is saved and the engine is closed, and the exit code is
0. A second signal, or one while that checkpoint is being saved, stops at once: a save in
progress is abandoned (saves are atomic: `latest` still names the previous, complete one)
and the engine is closed. Once a stop at once is under way, and while closing after any
stop, further signals are ignored so that the clean-up (abandoning a save, removing the swap
directory) always runs to its end. Once the last checkpoint is saved a signal changes
nothing either: the run is closing and exits 0 ([Note: late signals] in main.py covers the
moments after the command returns).

A stop at once raises `StopNow` wherever the main thread is, often inside I/O; the I/O layers
may wrap it in their own errors while cleaning up, so the run looks for it in the exception's
chain (`stop_in_chain`) before reporting a failure (a disk failure it is not).

SIGHUP means what SIGTERM means; when it arrives, standard output and error that are
terminals are pointed at /dev/null first, since writing to a hung-up terminal fails and would
turn a clean stop into an error. A process started with SIGHUP ignored (`nohup`) keeps
ignoring it.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import threading
from collections.abc import Callable

from tqdm import tqdm

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunPhase(enum.Enum):
    """What a signal does at each point of a run."""

    STARTING = "building the model, data and engine: a signal stops at once"
    TRAINING = "in the loop: the first signal asks for a stop after the current step"
    SAVING = "saving the final checkpoint: a signal abandons the save and stops at once"
    CLOSING = "stopping at once, or closing the engine: signals are ignored"


class StopNow(KeyboardInterrupt):
    """Raised by a signal that stops the run at once: `signum`, and the `phase` it came in."""

    def __init__(self, signum: int, phase: RunPhase) -> None:
        self.signum = int(signum)
        self.phase = phase
        super().__init__(signal.Signals(self.signum).name)

    @property
    def name(self) -> str:
        """'Ctrl-C' or the signal's name."""
        return _describe(self.signum)

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process killed by it."""
        return 128 + self.signum


def stop_in_chain(exc: BaseException | None) -> StopNow | None:
    """`exc` if it is a StopNow, else the first StopNow it was raised from or during."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StopNow):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _say(message: str) -> None:
    """A line from the handler; output that cannot be written must not raise in the middle
    of whatever the main thread was doing."""
    with contextlib.suppress(OSError, ValueError):
        tqdm.write(message)


def detach_from_terminal() -> None:
    """Point standard output and error at /dev/null where they are terminals (after SIGHUP
    the terminal is gone); files and pipes (nohup, a scheduler's log) keep their output."""
    ttys = [fd for fd in (1, 2) if _isatty(fd)]
    if not ttys:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in ttys:
            os.dup2(null, fd)
    finally:
        os.close(null)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _describe(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """The run's SIGINT/SIGTERM handlers (see [Note: stopping on a signal]).

    A context manager: the previous handlers come back on exit. Outside the main thread no
    handler can be installed, and signals keep their previous meaning.
    """

    def __init__(self) -> None:
        self.phase = RunPhase.STARTING
        self.requested: int | None = None
        """The signal that asked for a stop during training, if one did."""
        self.rank: int | None = None
        """This process's rank when the run has several (its lines then name it)."""
        self.gone_ranks: Callable[[], list[int]] = list
        """The other ranks whose process has ended: with one gone no checkpoint can be
        saved together, so a signal stops at once instead of promising one."""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started under nohup: a hang-up is meant not to stop the run
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def requested_by(self) -> str:
        """'Ctrl-C' or the name of the signal that asked for the stop ('' if none did)."""
        return _describe(self.requested) if self.requested is not None else ""

    # -- phases (verbs) ----------------------------------------------------------------------

    def start_training(self) -> None:
        self._move((RunPhase.STARTING,), RunPhase.TRAINING)

    def start_saving(self) -> None:
        self._move((RunPhase.TRAINING,), RunPhase.SAVING)

    def start_closing(self) -> None:
        """From any phase: what follows must run to its end."""
        self.phase = RunPhase.CLOSING

    def _move(self, sources: tuple[RunPhase, ...], to: RunPhase) -> None:
        assert self.phase in sources, f"{self.phase.name} -> {to.name}"
        self.phase = to

    # -- the handler -------------------------------------------------------------------------

    def _handle(self, signum: int, frame) -> None:
        what = _describe(signum)
        if signum == signal.SIGHUP:
            detach_from_terminal()
        who = f"infinity: rank {self.rank}:" if self.rank is not None else "infinity:"
        if self.phase is RunPhase.CLOSING:
            _say(
                f"{who} {what}: already stopping, removing the swap files first "
                "(SIGKILL ends it without cleaning up)"
            )
            return
        gone = self.gone_ranks() if self.phase is RunPhase.TRAINING else []
        if gone and self.requested is None:
            # The next collective fails (the peer is gone) and the run reports why.
            self.requested = signum
            _say(
                f"{who} {what}: rank {', '.join(map(str, gone))} has ended, so the ranks "
                "cannot save a checkpoint together; stopping"
            )
            return
        if self.phase is RunPhase.TRAINING and self.requested is None:
            self.requested = signum
            every = "all ranks save" if self.rank is not None else "saving"
            _say(
                f"{who} {what}: {every} a checkpoint after this step "
                f"(send it again to stop at once without one)"
            )
            return
        phase, self.phase = self.phase, RunPhase.CLOSING  # the clean-up runs to its end
        raise StopNow(signum, phase)


__all__ = ["RunPhase", "StopNow", "StopSignals", "stop_in_chain"]
