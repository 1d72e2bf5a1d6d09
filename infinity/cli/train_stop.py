"""How `infinity train` stops on SIGINT (Ctrl-C) and SIGTERM (`kill`, batch schedulers).

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
directory) always runs to its end.
"""

from __future__ import annotations

import enum
import signal
import threading

from tqdm import tqdm

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Phase(enum.Enum):
    """What a signal does at each point of a run."""

    STARTING = "building the model, data and engine: a signal stops at once"
    TRAINING = "in the loop: the first signal asks for a stop after the current step"
    SAVING = "saving the final checkpoint: a signal abandons the save and stops at once"
    CLOSING = "stopping at once, or closing the engine: signals are ignored"


class StopNow(KeyboardInterrupt):
    """Raised by a signal that stops the run at once: `signum`, and the `phase` it came in."""

    def __init__(self, signum: int, phase: Phase) -> None:
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


def _describe(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """The run's SIGINT/SIGTERM handlers (see [Note: stopping on a signal]).

    A context manager: the previous handlers come back on exit. Outside the main thread no
    handler can be installed, and signals keep their previous meaning.
    """

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.requested: int | None = None
        """The signal that asked for a stop during training, if one did."""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
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
        self._move((Phase.STARTING,), Phase.TRAINING)

    def start_saving(self) -> None:
        self._move((Phase.TRAINING,), Phase.SAVING)

    def start_closing(self) -> None:
        """From any phase: what follows must run to its end."""
        self.phase = Phase.CLOSING

    def _move(self, sources: tuple[Phase, ...], to: Phase) -> None:
        assert self.phase in sources, f"{self.phase.name} -> {to.name}"
        self.phase = to

    # -- the handler -------------------------------------------------------------------------

    def _handle(self, signum: int, frame) -> None:
        what = _describe(signum)
        if self.phase is Phase.CLOSING:
            tqdm.write(
                f"infinity: {what}: already stopping, removing the swap files first "
                "(SIGKILL ends it without cleaning up)"
            )
            return
        if self.phase is Phase.TRAINING and self.requested is None:
            self.requested = signum
            tqdm.write(
                f"infinity: {what}: saving a checkpoint after this step "
                f"(send it again to stop at once without one)"
            )
            return
        phase, self.phase = self.phase, Phase.CLOSING  # the clean-up runs to its end
        raise StopNow(signum, phase)


__all__ = ["Phase", "StopNow", "StopSignals"]
