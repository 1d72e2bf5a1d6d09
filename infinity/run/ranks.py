"""The ranks of one `infinity train` run under torchrun: who decides, who speaks, who failed.

Owns what the CLI does differently with several ranks ([Note: one run, several ranks]):
decisions taken once on rank 0 and shared (`decide`, `main_first`), the per-step agreement
on a stop and on the logged loss (`any_stop`, `mean`), log lines of other ranks (warnings and errors
only, prefixed with the rank), and the failure reports that let rank 0 name the rank that
failed and why (`SAVE_DIR/rank-N.error`, `RankFailures`). With one rank every method is the
plain single-process behaviour and no collective is issued.

[Note: one run, several ranks] Rank 0 holds the save directory's lock, checks and prepares
the save directory, tokenizes the data into its cache, draws the progress bar and writes
metrics.jsonl; the other ranks wait for its decisions (an error on rank 0 stops them too,
without repeating it). Every rank checks the inputs (flags, files, config) and rank 0 says
what failed once: a bare error when every rank gave it, else each with the ranks it came
from. A signal asks for a stop on the rank that got it; before each optimizer step the ranks
all-reduce the request, so all of them stop after the same step and save one checkpoint
together. A rank that fails later writes its error to SAVE_DIR/rank-N.error before it exits;
the others then fail in their next collective (the peer is gone) or, if it hangs, when the
collective timeout expires, and torchrun stops the rest when a worker exits with an error.
Rank 0 then reports the rank and the cause: its error file, or that its process is gone
without one (killed), or that it did not answer within the timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from infinity.accelerator import get_accelerator, use_local_device
from infinity.comm import CommError, from_env

T = TypeVar("T")
log = logging.getLogger(__name__)

ERROR_FILE = "rank-{rank}.error"
# How long rank 0 waits for a failed rank's report after a collective broke: the failing
# rank writes it before exiting, but rank 0 sees the broken connection at about that moment.
REPORT_WAIT_S = 5.0
# How long another rank looks whether rank 0's process has ended after a collective broke.
RANK_ZERO_WAIT_S = 1.0


class FollowedRankZero(Exception):
    """Raised on ranks other than 0 when rank 0 refused to go on (its error is rank 0's to
    report): the rank exits with an error and says nothing more."""


class InputsRefused(Exception):
    """Raised on every rank when the checks of the inputs failed on any rank: rank 0 has said
    which and why (`Ranks.check_inputs`), so the rank exits with an error and says no more."""


# Errors that carry their fix in the message: one line, no traceback (as in cli.main).
USER_ERRORS = (ValueError, OSError, NotImplementedError, ImportError, CommError)


@contextlib.contextmanager
def join(save_dir: Path, timeout_s: float | None) -> Iterator[Ranks]:
    """This process's `Ranks`: under torchrun it joins the process group (its device picked
    by LOCAL_RANK before any collective, the group's backends by that device) and leaves it
    on exit; otherwise a world of one."""
    use_local_device(int(os.environ.get("LOCAL_RANK", "0") or 0))
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun
        follow_launcher()
    comm = from_env(timeout_s, device=get_accelerator().device)
    try:
        ranks = Ranks(comm, save_dir)
        ranks.configure_logging()
        yield ranks
    finally:
        comm.close()


# How often the watchdog looks whether the launcher is still this process's parent.
LAUNCHER_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
# The parent-death signal: its handler turns one or several into one SIGTERM.
LAUNCHER_GONE = getattr(signal, "SIGUSR1", signal.SIGTERM)


def follow_launcher(stop: int = signal.SIGTERM) -> None:
    """Stop when the launcher (torchrun, this process's parent) dies, however it dies.

    torchrun starts each worker in its own session, so a `kill -9` of torchrun or of its
    process group never reaches the workers, which would train on to the end. The kernel
    sends LAUNCHER_GONE when the parent dies (PR_SET_PDEATHSIG, Linux; once per thread of
    the parent, so maybe several times); elsewhere a watchdog thread notices the parent pid
    change. Either way this process then sends itself `stop` once (a second would mean "stop
    at once"): SIGTERM, what torchrun itself sends on a stop, so the ranks agree on a stop
    after the current step and save a checkpoint ([Note: stopping on a signal]). Call it
    from the main thread."""
    launcher = os.getppid()
    told: list[bool] = []

    def gone(*_: Any) -> None:
        if not told:
            told.append(True)
            log.warning("the launcher (pid %d) is gone: stopping this rank", launcher)
            os.kill(os.getpid(), stop)

    if sys.platform.startswith("linux"):
        signal.signal(LAUNCHER_GONE, gone)
        armed = False
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(LAUNCHER_GONE), 0, 0, 0) == 0
        if armed:
            if os.getppid() != launcher:  # it died before the request was made
                gone()
            return

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(LAUNCHER_POLL_S)
        gone()

    threading.Thread(target=watch, name="infinity-launcher-watch", daemon=True).start()


class Ranks:
    """This process's place in the run (from the run's communicator) and the agreements."""

    def __init__(self, comm: Any, save_dir: Path) -> None:
        self.comm = comm
        self.rank: int = comm.rank
        self.world_size: int = comm.world_size
        self.local_rank: int = getattr(comm, "local_rank", self.rank)
        self.save_dir = save_dir
        self.started = time.time()
        self._peers: list[dict] = []

    @property
    def is_main(self) -> bool:
        """Rank 0: it decides, draws the progress bar and writes metrics.jsonl."""
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world_size > 1

    # -- decisions -------------------------------------------------------------------------

    def decide(self, fn: Callable[[], T]) -> T:
        """`fn()` on rank 0 only; its (picklable) result on every rank. An error in `fn`
        is raised on rank 0 and stops the others (`FollowedRankZero`)."""
        if not self.many:
            return fn()
        result: Any = None
        error: Exception | None = None
        if self.is_main:
            try:
                result = fn()
            except Exception as exc:
                error = exc
        shared = self.comm.broadcast_object(
            (result, None if error is None else f"{type(error).__name__}: {error}"), src=0
        )
        if error is not None:
            raise error
        if shared[1] is not None:
            _tell_launcher(f"rank 0: {shared[1]}")
            raise FollowedRankZero(shared[1])
        return shared[0]

    def check_inputs(self, fn: Callable[[], T]) -> T:
        """`fn()`, the checks of the flags, files and config, on every rank, then agreed: if
        it failed on any rank, rank 0 says each distinct error once (naming the ranks unless
        all of them gave it) and every rank raises `InputsRefused`. A bug (not one of
        USER_ERRORS) is raised again on its rank, with its traceback."""
        if not self.many:
            return fn()
        result: Any = None
        error: Exception | None = None
        try:
            result = fn()
        except Exception as exc:
            error = exc
        said = None if error is None else _error_text(error)
        errors: list[str | None] = self.comm.all_gather_object(said)
        if all(e is None for e in errors):
            return result
        lines = _error_lines(errors)
        if self.is_main:
            for line in lines:
                print(line, file=sys.stderr, flush=True)
        _tell_launcher("; ".join(line.removeprefix("infinity: ") for line in lines))
        # No rank exits before rank 0 has said it: torchrun stops the rest at the first exit.
        self.comm.barrier()
        if error is not None and not isinstance(error, USER_ERRORS):
            raise error
        raise InputsRefused(f"the inputs were refused on rank(s) {_failed_ranks(errors)}")

    def main_first(self, fn: Callable[[], T]) -> T:
        """`fn()` on rank 0, then, once it succeeded, on the others (a cache rank 0 fills
        that the others then read)."""
        if not self.many:
            return fn()
        mine: list[T] = []
        self.decide(lambda: mine.append(fn()))
        return mine[0] if mine else fn()

    def mean(self, value: float) -> float:
        """`value` averaged over the ranks (the loss: each rank saw its own micro batches)."""
        if not self.many:
            return value
        box = torch.tensor([value], dtype=torch.float64)
        self.comm.all_reduce_(box, op="sum")
        return float(box[0]) / self.world_size

    def any_stop(self, requested: object) -> bool:
        """Whether a signal asked any rank to stop (`requested`: this rank's signal or
        None). Called by every rank before each optimizer step."""
        if not self.many:
            return requested is not None
        flag = torch.tensor([0.0 if requested is None else 1.0])
        self.comm.all_reduce_(flag, op="max")
        return bool(flag[0] > 0)

    # -- output ----------------------------------------------------------------------------

    def configure_logging(self) -> None:
        """Ranks other than 0 log warnings and errors only, each line prefixed with the rank."""
        if not self.many:
            return
        root = logging.getLogger()
        for handler in root.handlers:
            handler.setFormatter(
                logging.Formatter(f"rank {self.rank}: %(levelname)s %(name)s: %(message)s")
            )
        if not self.is_main:
            root.setLevel(max(root.level, logging.WARNING))

    def say(self, message: str, *, err: bool = False) -> None:
        """A line for the user: from rank 0 only (errors from any rank, with its number)."""
        if err:
            prefix = f"infinity: rank {self.rank}: " if self.many else "infinity: "
            print(prefix + message, file=sys.stderr, flush=True)
        elif self.is_main:
            print(message, flush=True)

    # -- failures --------------------------------------------------------------------------

    def failed(self, exc: Exception) -> int:
        """This rank of a multi-rank run failed with `exc`: write its report for rank 0,
        say it (with the rank), return the exit code. A bug keeps its traceback."""
        reported = self.report(exc)
        if not isinstance(exc, USER_ERRORS):
            raise exc
        speaks = self.speaks()
        if speaks and isinstance(exc, CommError):  # the cause is another rank's
            exc = CommError(f"the run stopped: {self.explain(self.comm.timeout_s)}")
        if speaks or reported is None or not _launcher_reports():
            self.say(f"error: {exc}", err=True)
        # Else rank 0 says it, naming this rank, and torchrun's summary shows it: once.
        _tell_launcher(f"{exc}")
        return 1

    def speaks(self) -> bool:
        """Whether this rank reports the run's failure: rank 0, or, when rank 0's process
        has ended (killed), the lowest rank still running."""
        if self.is_main:
            return True
        # A killed process's connections break a moment before it has ended.
        deadline = time.monotonic() + RANK_ZERO_WAIT_S
        while 0 not in (gone := set(self.gone_ranks())) and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0 in gone and self.rank == min(set(range(self.world_size)) - gone)

    def start(self) -> None:
        """Remove this rank's report of an earlier run; learn the other ranks' processes."""
        (self.save_dir / ERROR_FILE.format(rank=self.rank)).unlink(missing_ok=True)
        if self.many:
            me = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}
            self._peers = self.comm.all_gather_object(me)

    def gone_ranks(self) -> list[int]:
        """The other ranks whose process (on this host) has ended."""
        return [p["rank"] for p in self._peers if p["rank"] != self.rank and not self._alive(p)]

    def report(self, exc: BaseException) -> Path | None:
        """Write this rank's failure to SAVE_DIR/rank-N.error (best effort: a failed disk
        may be the cause)."""
        if not self.many:
            return None
        path = self.save_dir / ERROR_FILE.format(rank=self.rank)
        text = f"{type(exc).__name__}: {exc}\n\n" + "".join(traceback.format_exception(exc))
        try:
            path.write_text(text)
        except OSError:
            return None
        return path

    def explain(self, timeout_s: float | None) -> str:
        """Rank 0, after a collective failed: which other rank failed, and why."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            gone = [p for p in self._peers if p["rank"] in self.gone_ranks()]
            reports = self._reports()  # after `gone`: a report is written before its exit
            if reports or gone or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if reports:
            rank = min(reports)
            where = self.save_dir / ERROR_FILE.format(rank=rank)
            return f"rank {rank} failed: {reports[rank]} (details in {where})"
        if gone:
            p = gone[0]
            return (
                f"rank {p['rank']} (pid {p['pid']}) ended without an error report: it was killed "
                "(by a signal, or the out-of-memory killer: see dmesg) or crashed; torchrun's "
                "summary gives its exit code"
            )
        limit = f"{timeout_s:g} s" if timeout_s else "the collective timeout"
        return (
            f"a collective did not complete within {limit}: another rank is stuck or much "
            "slower (its disk?); see the other ranks' output, and raise --comm-timeout if "
            "they only needed longer"
        )

    def _reports(self) -> dict[int, str]:
        out = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            path = self.save_dir / ERROR_FILE.format(rank=rank)
            try:
                if path.stat().st_mtime < self.started - 1:
                    continue  # an earlier run's
                out[rank] = path.read_text().split("\n", 1)[0]
            except OSError:
                continue
        return out

    def _alive(self, peer: dict) -> bool:
        if peer["host"] != socket.gethostname():
            return True  # cannot tell from here
        try:
            os.kill(peer["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a process that has ended but is not yet reaped (by torchrun) is a zombie
            return Path(f"/proc/{peer['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return True


# Where torchrun's agent reads a worker's error for its summary ("traceback :" line).
ELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def _launcher_reports() -> bool:
    return bool(os.environ.get(ELASTIC_ERROR_FILE))


def _tell_launcher(message: str) -> None:
    """Give torchrun this rank's error for its summary, which otherwise says only "To
    enable traceback see: ..." (best effort)."""
    path = os.environ.get(ELASTIC_ERROR_FILE)
    if not path:
        return
    extra = {"timestamp": str(int(time.time()))}  # no py_callstack: the summary shows the message
    record = {"message": {"message": f"infinity: {message}", "extraInfo": extra}}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(record))


def _error_text(exc: Exception) -> str:
    if isinstance(exc, USER_ERRORS):
        return str(exc)
    return f"{type(exc).__name__}: {exc} (a bug: the traceback is in that rank's output)"


def _failed_ranks(errors: list[str | None]) -> str:
    return ", ".join(str(rank) for rank, e in enumerate(errors) if e is not None)


def _error_lines(errors: list[str | None]) -> list[str]:
    """The ranks' errors (None: that rank passed), one line per distinct one: without rank
    numbers when every rank gave the same error, else with the ranks that gave it."""
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(errors):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    if len(by_text) == 1 and None not in errors:
        return [f"infinity: error: {errors[0]}"]
    lines = []
    for text, ranks in by_text.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"infinity: {who}: error: {text}")
    return lines


__all__ = [
    "ERROR_FILE",
    "FollowedRankZero",
    "InputsRefused",
    "Ranks",
    "follow_launcher",
    "join",
]
