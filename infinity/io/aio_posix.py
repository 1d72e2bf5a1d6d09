"""The POSIX I/O engine: the Python twin of `infinity._aio.Engine`, with the same methods.

A pool of `threads` workers, each doing `os.preadv`/`os.pwrite` over block_size chunks of its
slice of a request (the GIL is released inside each call). It is the reference the native
backends are tested against, and the fallback when the extension is not built or the kernel
refuses both io_uring and native AIO. It owns no files: callers pass open descriptors.
Each pread/pwrite is its own system call and each worker has one in flight, so there is no
submission queue: `single_submit` and `overlap_events` are accepted and do not apply here.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

# (errno, file offset, what failed), as the native engine reports it; None on success.
IoResult = tuple[int, int, str] | None


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` of memory at `address` (the caller keeps it alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _transfer(
    write: bool, fd: int, view: memoryview, offset: int, block_size: int, count
) -> IoResult:
    """Moves one slice chunk by chunk; short transfers continue where they stopped.
    `count()` is called once per system call."""
    done = 0
    while done < len(view):
        count()
        chunk = view[done : done + block_size]
        pos = offset + done
        try:
            n = os.pwrite(fd, chunk, pos) if write else os.preadv(fd, [chunk], pos)
        except OSError as exc:
            return (exc.errno or errno.EIO, pos, "write" if write else "read")
        if n == 0:
            if write:
                return (errno.EIO, pos, "write (0 bytes written)")
            return (errno.ENODATA, pos, "read (end of file)")
        done += n
    return None


class PosixEngine:
    """submit/wait/done/close/stats like the native engine. `queue_depth`, `single_submit`
    and `overlap_events` do not apply here: each worker has one request in flight, made by
    its own system call."""

    backend = "posix"

    def __init__(
        self,
        block_size: int,
        queue_depth: int,
        threads: int,
        single_submit: bool = False,
        overlap_events: bool = True,
    ) -> None:
        self.block_size, self.queue_depth, self.threads = block_size, queue_depth, threads
        self.single_submit, self.overlap_events = single_submit, overlap_events
        self._calls = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="infinity-aio")
        self._tickets: dict[int, list[Future]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def submit(self, write: bool, fd: int, address: int, nbytes: int, offset: int) -> int:
        view = memory_at(address, nbytes) if nbytes else memoryview(b"")
        # One slice per worker, cut at block_size boundaries, as the native engine does.
        per = -(-nbytes // self.threads)
        per = max(self.block_size, -(-per // self.block_size) * self.block_size)
        futures = [
            self._pool.submit(
                _transfer,
                write,
                fd,
                view[start : start + per],
                offset + start,
                self.block_size,
                self._count,
            )
            for start in range(0, nbytes, per)
        ]
        with self._lock:
            ticket = next(self._ids)
            self._tickets[ticket] = futures
        return ticket

    def _futures(self, ticket: int) -> list[Future]:
        with self._lock:
            if ticket not in self._tickets:
                raise ValueError(f"unknown or already waited I/O ticket {ticket}")
            return self._tickets[ticket]

    def wait(self, ticket: int) -> IoResult:
        results = [f.result() for f in self._futures(ticket)]
        with self._lock:
            del self._tickets[ticket]
        failed = [r for r in results if r is not None]
        return min(failed, key=lambda r: r[1]) if failed else None  # lowest offset, as native

    def done(self, ticket: int) -> bool:
        return all(f.done() for f in self._futures(ticket))

    def _count(self) -> None:
        with self._lock:
            self._calls += 1

    def stats(self) -> dict[str, int]:
        """As the native engine's: every pread/pwrite is one submission call and one op;
        there is no queue to refill, so max_in_flight_at_refill is 0."""
        with self._lock:
            calls = self._calls
        return {"submit_calls": calls, "ops": calls, "max_in_flight_at_refill": 0}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
