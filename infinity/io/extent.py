"""The transfers of one storage tier: what every NVMe tier shares, written once.

Owns `ExtentIO` (submit a read or write of a host buffer at an offset of a file, wait for it,
count its bytes, time the wait, check a read against the checksums of what was written there,
and remember the first failure), its futures (`Transfer`), `IOStats` and `ExtentError`,
whose message names the tier's data, the op, the file, the offset and the bytes. It does not
know where a tier keeps what (the swap store and the tiers do) nor what a failure means for
the tier's state (each tier decides, e.g. marks a sub-group torn).

[Note: counted bytes] Bytes are counted here only, by one rule: a write when it is issued
(its bytes have left the tier), a read when a wait finds it landed (its bytes reach the
tier); a write that fails is taken back, and a read dropped unused (`Transfer.drop`: a
read-ahead the state changed under) or failed is never counted. So a step's counters hold
the writes it issued and the reads it used, whatever the disk's timing. By default a
transfer counts the bytes the request moves; a tier may count its payload instead (a
parameter read into a page-padded buffer counts the parameter's bytes). These are the
counters the engine reports and `infinity estimate` predicts (tests/test_estimate.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from infinity.accelerator import profile_range
from infinity.config.sections import AioConfig
from infinity.io.aio import AioHandle
from infinity.io.aio_checks import buffer_span
from infinity.io.checksum import NAME, PAGE_BYTES, Expected, ExtentSums, Mismatch

SUM_THREADS = 4
"""Checksum threads per tier: each read being checked waits on one until it lands."""


class ExtentError(OSError):
    """A tier's transfer failed, read back other bytes than were written, or was refused
    after an earlier failure. `tier`, `op`, `path`, `offset` and `nbytes` say which (None
    where the refusal concerns no single transfer); `errno` is the cause's, if any."""

    tier: str | None = None
    op: str | None = None
    path: str | None = None
    offset: int | None = None
    nbytes: int | None = None

    @classmethod
    def transfer(
        cls, tier, op, what, path, offset, nbytes, problem: str, *, code=None
    ) -> ExtentError:
        """The error of one transfer: "`op` of `what` (`nbytes` bytes at offset `offset` of
        `path`) `problem`"."""
        err = cls(f"{op} of {what} ({nbytes} bytes at offset {offset} of {path}) {problem}")
        err.errno = code
        err.tier, err.op, err.path, err.offset, err.nbytes = tier, op, path, offset, nbytes
        return err


@dataclass(slots=True)
class IOStats:
    """Traffic and waiting of one tier since it was built (see [Note: counted bytes])."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_wait_s: float = 0.0
    """Time callers spent waiting for reads to land."""
    write_wait_s: float = 0.0
    """Time callers spent waiting for writes."""

    @property
    def wait_s(self) -> float:
        return self.read_wait_s + self.write_wait_s


class Transfer:
    """One request of a tier in flight. `wait()` returns once it has finished and, for a
    read, once its bytes match what was written there; it raises the tier's error otherwise
    (the same error on every call). Waiting from several threads is safe; the bytes are
    counted once. The buffer stays referenced until the transfer is waited or dropped.
    `job` is its checksum work, if any, on the tier's checksum threads or deferred to the
    first wait: the sums of a write's buffer, or a read's landing and check."""

    def __init__(self, io, write, op, what, path, offset, buf, nbytes, count, future, job):
        self._io, self.write, self.op, self.what = io, write, op, what
        self.path, self.offset, self.nbytes, self._count = path, offset, nbytes, count
        self.buf, self._future, self._job = buf, future, job
        self._lock = threading.Lock()
        self._finished = False
        self._error: ExtentError | None = None
        self.poison = True
        """Whether a failure is kept in the tier's `failed` (see `ExtentIO.read`)."""

    def done(self) -> bool:
        """True when the request has finished (successfully or not); never blocks. Its
        checksum work may still be running then (`wait` finishes it): that a read's bytes
        have landed is what callers schedule by, and a check on threads of its own must not
        make prefetching look slower than the disk."""
        return self._finished or self._future.done()

    def wait(self) -> None:
        with self._lock:
            if not self._finished:
                self._finish()
            elif self._error is not None:
                self._settle()  # a wait a signal interrupted is finished here
        if self._error is not None:
            raise self._error

    def drop(self) -> None:
        """Wait for a read nobody will use (its buffer may still be being filled): its
        error, its checksums and its bytes are ignored."""
        with self._lock:
            self._settle()
            self._finished, self.buf = True, None

    def _settle(self) -> None:
        """Let the request end, whatever its outcome (the handle's futures may be waited
        again: they raise their error again, or finish a wait that was interrupted)."""
        with contextlib.suppress(BaseException):  # the outcome is reported elsewhere or unused
            if self._job is not None and not isinstance(self._job, _Deferred):
                self._job.result()  # a thread may still be checking into the buffer
        with contextlib.suppress(BaseException):
            self._future.wait()

    def _finish(self) -> None:
        io = self._io
        start = time.perf_counter()
        try:
            with profile_range(io.profile_name):
                # A write's sums are recorded before its outcome is known (a failure then
                # forgets them); a read's job waits for it and checks it.
                found = self._job.result() if self._job is not None else None
                if self.write or self._job is None:
                    self._future.wait()
            if found is not None:
                self._check(found)
        except BaseException as e:
            corrupt = isinstance(e, ExtentError)  # raised by _check
            if corrupt:
                self._error = e
            else:
                self._error = io.error_for(self, f"failed: {e}", e)
                self._error.__cause__ = e
            io.failed_with(self._error, self, corrupt=corrupt)
            if self.write:
                io.count(True, -self._count)
        finally:
            io.waited(self.write, time.perf_counter() - start)
            self._finished, self.buf = True, None
        if self._error is None and not self.write:
            io.count(False, self._count)

    def _check(self, bad: Mismatch) -> None:
        raise self._io.error_for(
            self,
            f"read back other bytes than were written: file bytes [{bad.offset}, "
            f"{bad.offset + bad.nbytes}) have {NAME} {bad.got:#010x}, {bad.want:#010x} when "
            f"written. Something changed the swap file under the run (another process "
            f"writing in {os.path.dirname(self.path)}, or the disk): its state cannot be "
            f"trusted. Check the disk (dmesg) and that nothing else writes there, then resume "
            f"from the last checkpoint",
            None,
            code=errno.EIO,
            advice=False,
        )


def _pread(path: str, offset: int, nbytes: int) -> bytes:
    """`nbytes` of `path` at `offset` (short at the end of the file), through the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


class _Deferred:
    """A read's check run by its first waiter, on the waiting thread."""

    def __init__(self, fn, *args) -> None:
        self._call: tuple | None = (fn, *args)
        self._outcome: tuple = ()

    def done(self) -> bool:
        return True  # nothing runs before a wait

    def result(self):
        if self._call is not None:
            fn, *args = self._call
            self._call = None
            try:
                self._outcome = (fn(*args), None)
            except BaseException as e:
                self._outcome = (None, e)
        value, error = self._outcome
        if error is not None:
            raise error
        return value


class ExtentIO:
    """The transfers of one tier (`tier`: "param", "optim", "grad"), through `aio`: an
    `AioHandle` (shared, not closed here) or an `AioConfig` (a handle is made and owned).

    Failures raise `error` (a subclass of `ExtentError`), whose message ends with `advice`;
    the first is kept in `failed` and `check_usable` refuses further use after it where the
    tier wants that (see `check_usable`). With `checksums`, every write records its sums and
    every read is checked against them (see [Note: extent checksums] and [Note: full sums]
    in checksum.py): sums of every byte on threads of the tier's own, so that the sums of
    one sub-group are computed while the caller steps the next and the disk moves a third
    (sampled sums, kept for comparison only, run on the caller's thread)."""

    def __init__(
        self,
        aio: Any,
        *,
        tier: str,
        error: type[ExtentError] = ExtentError,
        advice: str = "",
        checksums: bool = True,
    ) -> None:
        self._owns_aio = isinstance(aio, AioConfig)
        self.aio = AioHandle.from_config(aio) if self._owns_aio else aio
        self.tier, self.error, self.advice = tier, error, advice
        self.profile_name = f"infinity::swap::{tier}_wait"
        self.sums = ExtentSums() if checksums else None
        self._sums_pool: ThreadPoolExecutor | None = None
        self.stats = IOStats()
        self.failed: ExtentError | None = None
        self._lock = threading.Lock()

    def read(self, buf, path: str, offset: int, *, what: str, op: str = "read",
             count: int | None = None, poison: bool = True) -> Transfer:  # fmt: skip
        """Start reading `buf.nbytes` bytes of `path` at `offset` into `buf`; `count` is
        the bytes to count (the request's by default, see [Note: counted bytes]). With
        `poison` false a failed read is not kept in `failed` (it changed nothing); a read
        that finds other bytes than were written always is."""
        return self._submit(False, buf, path, offset, what, op, count, poison)

    def write(self, buf, path: str, offset: int, *, what: str, op: str = "write",
              count: int | None = None) -> Transfer:  # fmt: skip
        """Start writing `buf` to `path` at `offset`; `buf` must not change until waited."""
        return self._submit(True, buf, path, offset, what, op, count, True)

    def check_usable(self, op: str) -> None:
        """Raise the tier's error if a transfer failed before (for tiers whose state a
        failure tears: the optimizer state, the gradients)."""
        if self.failed is not None:
            raise self.error(f"{op}: refused, an earlier transfer failed") from self.failed

    def close(self) -> None:
        """Stop the checksum threads; close the handle if it is this tier's own."""
        if self._sums_pool is not None:
            self._sums_pool.shutdown(wait=True)
        if self._owns_aio and hasattr(self.aio, "close"):
            self.aio.close()

    def memory_stats(self, prefix: str) -> dict[str, int]:
        """`<prefix>_bytes_read`, `_bytes_written` and `_wait_us`."""
        s = self.stats
        return {
            f"{prefix}_bytes_read": s.bytes_read,
            f"{prefix}_bytes_written": s.bytes_written,
            f"{prefix}_wait_us": int(s.wait_s * 1e6),
        }

    # -- for Transfer ----------------------------------------------------------------------

    def _submit(self, write, buf, path, offset, what, op, count, poison) -> Transfer:
        nbytes = buffer_span(buf, writable=not write).nbytes
        expected: list[Expected] = []
        if self.sums is not None and not write:
            expected = self.sums.expected(path, offset, nbytes)  # before the read is issued
        try:
            future = (self.aio.pwrite if write else self.aio.pread)(buf, path, offset)
        except BaseException as e:  # refused before any I/O (a bad path, a short file...)
            if write and self.sums is not None:
                self.sums.forget(path, offset, nbytes)
            t = Transfer(self, write, op, what, path, offset, None, nbytes, 0, None, None)
            t.poison = poison
            err = self.error_for(t, f"failed: {e}", e)
            self.failed_with(err, t)
            raise err from e
        count = nbytes if count is None else count
        job: Future | _Deferred | None = None
        pool = self._pool()
        if self.sums is not None and write:  # the buffer does not change until waited
            if pool is None:  # after the issue: the disk moves it meanwhile
                self.sums.written(path, offset, buf)
            else:
                job = pool.submit(self.sums.written, path, offset, buf)
        elif expected:
            land = (self._land, future, expected, path, offset, buf)
            job = _Deferred(*land) if pool is None else pool.submit(*land)
        t = Transfer(self, write, op, what, path, offset, buf, nbytes, count, future, job)
        t.poison = poison
        if write:
            self.count(True, count)
        return t

    def _pool(self) -> ThreadPoolExecutor | None:
        """Threads for sums of every byte; None for sampled sums (cheap enough inline)."""
        if self.sums is None or self.sums.sample_bytes < PAGE_BYTES:
            return None
        if self._sums_pool is None:
            name = f"infinity-{self.tier}-sums"
            self._sums_pool = ThreadPoolExecutor(SUM_THREADS, thread_name_prefix=name)
        return self._sums_pool

    def _land(self, future, expected, path, offset: int, buf) -> Mismatch | None:
        """On a checksum thread: wait for a read, then check what it brought (a chunk it
        covers in part with the rest of that chunk read here: at most a chunk each end)."""
        future.wait()
        return self.sums.verify(expected, offset, buf, lambda at, n: _pread(path, at, n))

    def error_for(self, t: Transfer, problem: str, cause, *, code=None, advice=True):
        if code is None and isinstance(cause, OSError):
            code = cause.errno
        if advice and self.advice:
            problem = f"{problem.rstrip('.')}. {self.advice}"
        return self.error.transfer(
            self.tier, t.op, t.what, t.path, t.offset, t.nbytes, problem, code=code
        )

    def failed_with(self, err: ExtentError, t: Transfer, *, corrupt: bool = False) -> None:
        with self._lock:
            if self.failed is None and (t.poison or corrupt):
                self.failed = err
        if t.write and self.sums is not None:
            self.sums.forget(t.path, t.offset, t.nbytes)  # what landed is unknown

    def waited(self, write: bool, seconds: float) -> None:
        with self._lock:
            if write:
                self.stats.write_wait_s += seconds
            else:
                self.stats.read_wait_s += seconds

    def count(self, write: bool, nbytes: int) -> None:
        with self._lock:
            if write:
                self.stats.bytes_written += nbytes
            else:
                self.stats.bytes_read += nbytes
