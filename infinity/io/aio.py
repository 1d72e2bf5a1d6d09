"""Asynchronous reads and writes of whole buffers to files: the one path every NVMe transfer
takes. Owns `AioHandle` (an engine plus the split of each request into an O_DIRECT middle
and buffered head/tail), `AioFuture`, page-aligned buffers and file pre-allocation. Engines
live in `infinity._aio` (io_uring, kernel AIO) and `aio_posix` (the Python twin); checks
and errors in `aio_checks`. It does not own what is stored where (the swap store does).

[Note: unaligned requests] O_DIRECT needs file offsets, lengths and memory aligned to the
device's logical block. A request is cut into an aligned middle, which goes O_DIRECT, and a
head and tail of less than 4 KiB each, which go through the page cache on a second, buffered
descriptor of the same file. The kernel then does the read-modify-write of the partial pages
under its page lock, so neighbouring bytes of the file are never touched and two in-flight
requests that share a 4 KiB block of the file (without overlapping) do not lose each other's
bytes. Linux keeps the two kinds of access coherent: a direct read or write first flushes
and invalidates cached pages in its range. Requests that overlap each other in the file are
the caller's race, as with pwrite. When the buffer's address and the file offset are aligned
differently (e.g. an odd offset into an aligned buffer), the middle cannot go O_DIRECT without
a copy, and the whole request goes buffered (strict=True raises instead).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from infinity.accelerator import get_accelerator
from infinity.config.sections import AioConfig
from infinity.io.aio_checks import (
    ALIGN,
    AioError,
    buffer_span,
    check_offset,
    make_engine,
    open_file,
)

log = logging.getLogger(__name__)


class AioFallbackWarning(RuntimeWarning):
    """A file system refused O_DIRECT, so I/O to that path goes through the page cache."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of a request: `nbytes` at `address` <-> the file at `offset`."""

    direct: bool
    address: int
    nbytes: int
    offset: int


def plan(address: int, nbytes: int, offset: int, direct: bool) -> list[Segment]:
    """Cuts a request into an O_DIRECT middle and buffered head/tail (see the module note)."""
    if nbytes == 0:
        return []
    start = -(-offset // ALIGN) * ALIGN
    end = (offset + nbytes) // ALIGN * ALIGN
    if not direct or end <= start or (address + start - offset) % ALIGN:
        return [Segment(False, address, nbytes, offset)]
    segments = []
    if start > offset:
        segments.append(Segment(False, address, start - offset, offset))
    segments.append(Segment(True, address + start - offset, end - start, start))
    if offset + nbytes > end:
        segments.append(Segment(False, address + end - offset, offset + nbytes - end, end))
    return segments


class AioFuture:
    """One request in flight. Holds the buffer and the file descriptors until `wait()`,
    which raises the request's error (again on every call). Waiting from several threads is
    safe."""

    def __init__(self, handle, op, path, offset, nbytes, buf, tickets, fds) -> None:
        self._handle, self._engine = handle, handle._engine
        self.op, self.path, self.offset, self.nbytes = op, path, offset, nbytes
        self._buf, self._tickets, self._fds = buf, tickets, fds
        self._lock = threading.Lock()
        self._waited = False
        self._results: list[tuple[int, int, str] | None] = []
        self._error: AioError | None = None

    def done(self) -> bool:
        """True when the request has finished (successfully or not); never blocks."""
        if self._waited:
            return True
        try:
            return all(self._engine.done(t) for t in self._tickets)
        except ValueError:  # a concurrent wait() has just collected the tickets
            return True

    def wait(self) -> None:
        """Blocks until the request has finished; raises AioError if it failed."""
        with self._lock:
            if not self._waited:
                self._finish()
        if self._error is not None:
            raise self._error

    def _finish(self) -> None:
        # Every piece is waited, even after a failure: none may still be writing to `buf`.
        # Results are kept as they come: a wait interrupted by a signal handler's exception
        # is finished by the next wait() (the clean-up's), which must not wait a piece twice.
        while len(self._results) < len(self._tickets):
            ticket = self._tickets[len(self._results)]
            try:
                result = self._engine.wait(ticket)
            except ValueError:  # collected by the interrupted wait, its result then lost
                result = (errno.EINTR, self.offset, "the wait for it was interrupted")
            self._results.append(result)
        results = self._results
        for fd in self._fds:
            os.close(fd)
        failed = [r for r in results if r is not None]
        if failed:
            code, at, what = min(failed, key=lambda r: r[1])  # nearest the start
            self._error = AioError(code, self.op, self.path, at, self.nbytes, what)
        self._waited = True
        self._buf, self._fds = None, ()
        self._handle._forget(self)


class AioHandle:
    """Reads and writes whole buffers to files asynchronously.

    `block_size` bytes per I/O op (a multiple of 4096), `queue_depth` ops in flight per worker,
    `threads` workers, each on its slice of every request. `backend` is "io_uring", "aio"
    (kernel AIO), "posix" (thread pool, no extension needed) or "auto" (the first of those that
    runs here). On a file system that refuses O_DIRECT, I/O to that path is buffered after one
    AioFallbackWarning, or raises AioError if `strict`. `buf` is a contiguous CPU torch tensor
    or numpy array of any dtype; page-aligned ones (`aligned_empty`) go O_DIRECT.

    `single_submit` hands each op to the kernel with its own system call (by default one call
    submits a whole batch). With `overlap_events` (the default) a worker tops its queue up as
    completions arrive; without it, a worker submits a batch of up to `queue_depth` ops, waits
    until all of it is done (remainders of short transfers included), then submits the next.
    Both apply to the io_uring and aio backends; the posix backend accepts them and has no
    submission queue they could change. `stats()` shows their effect.

    Errors found before any I/O (bad buffer or offset, a missing file or directory, a read
    past the end of the file) raise from pread/pwrite; errors of the I/O itself from wait().
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        threads: int = 1,
        backend: str = "auto",
        strict: bool = False,
        single_submit: bool = False,
        overlap_events: bool = True,
    ) -> None:
        self._engine = make_engine(
            backend, block_size, queue_depth, threads, single_submit, overlap_events
        )
        self.backend: str = self._engine.backend
        self.block_size, self.queue_depth, self.threads = block_size, queue_depth, threads
        self.single_submit, self.overlap_events = single_submit, overlap_events
        self.strict = strict
        self._buffered_paths: set[str] = set()
        self._warned_unaligned = False
        self._pending: set[AioFuture] = set()
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, config: AioConfig, *, strict: bool = False) -> AioHandle:
        """A handle with every setting of the config's `aio` section."""
        return cls(
            block_size=config.block_size,
            queue_depth=config.queue_depth,
            threads=config.thread_count,
            backend=config.backend,
            strict=strict,
            single_submit=config.single_submit,
            overlap_events=config.overlap_events,
        )

    def __repr__(self) -> str:
        return (
            f"AioHandle(backend={self.backend!r}, block_size={self.block_size}, "
            f"queue_depth={self.queue_depth}, threads={self.threads}, strict={self.strict}, "
            f"single_submit={self.single_submit}, overlap_events={self.overlap_events})"
        )

    def stats(self) -> dict[str, int]:
        """Counters of the engine since the handle was made: `submit_calls` (system calls
        that handed ops to the kernel), `ops` (ops handed over, resubmissions of short
        transfers included) and `max_in_flight_at_refill` (the most ops still in flight when
        a worker added new ones; 0 when overlap_events is off)."""
        return dict(self._engine.stats())

    def pread(self, buf, path: str | os.PathLike, offset: int = 0) -> AioFuture:
        """Starts reading `buf.nbytes` bytes of `path` at `offset` into `buf`."""
        return self._submit(False, buf, path, offset)

    def pwrite(self, buf, path: str | os.PathLike, offset: int = 0) -> AioFuture:
        """Starts writing `buf` to `path` at `offset` (created if missing, never truncated)."""
        return self._submit(True, buf, path, offset)

    def read(self, buf, path: str | os.PathLike, offset: int = 0) -> None:
        self.pread(buf, path, offset).wait()

    def write(self, buf, path: str | os.PathLike, offset: int = 0) -> None:
        self.pwrite(buf, path, offset).wait()

    def _submit(self, write: bool, buf, path, offset) -> AioFuture:
        if self._closed:
            raise ValueError("this AioHandle is closed; create a new one")
        span = buffer_span(buf, writable=not write)
        offset = check_offset(offset)
        path = os.fspath(path)
        op = "pwrite" if write else "pread"
        fds: list[int] = []
        tickets: list[int] = []
        try:
            direct_fd = self._open_direct(path, write, op, offset, span.nbytes)
            if direct_fd is not None:
                fds.append(direct_fd)
                self._check_alignment(span.address, span.nbytes, path, op, offset)
            segments = plan(span.address, span.nbytes, offset, direct_fd is not None)
            if any(not s.direct for s in segments) or not fds:
                fds.append(open_file(path, write, False, op))
            if not write:
                size = os.fstat(fds[0]).st_size
                if offset + span.nbytes > size:
                    raise AioError(errno.ENODATA, op, path, offset, span.nbytes,
                                   f"the file holds {size} bytes")  # fmt: skip
            for s in segments:
                fd = direct_fd if s.direct else fds[-1]
                tickets.append(self._engine.submit(write, fd, s.address, s.nbytes, s.offset))
        except BaseException:
            for t in tickets:  # pieces already in flight must finish before their fds close
                self._engine.wait(t)
            for fd in fds:
                os.close(fd)
            raise
        future = AioFuture(self, op, path, offset, span.nbytes, buf, tickets, fds)
        with self._lock:
            self._pending.add(future)
        return future

    def _open_direct(self, path: str, write: bool, op: str, offset: int, nbytes: int):
        """An O_DIRECT descriptor, or None where the file system refuses O_DIRECT."""
        if path in self._buffered_paths:
            return None
        try:
            return open_file(path, write, True, op)
        except AioError as exc:
            if exc.errno != errno.EINVAL:
                raise
        if self.strict:
            raise AioError(errno.EINVAL, op, path, offset, nbytes,
                           "the file system refuses O_DIRECT and strict=True")  # fmt: skip
        self._buffered_paths.add(path)
        warnings.warn(
            f"'{path}': the file system refuses O_DIRECT, so I/O to it goes through the page "
            "cache (slower, and it uses RAM); put swap files on ext4 or xfs for direct I/O",
            AioFallbackWarning,
            stacklevel=4,
        )
        return None

    def _check_alignment(self, address, nbytes, path, op, offset) -> None:
        start = -(-offset // ALIGN) * ALIGN
        if (offset + nbytes) // ALIGN * ALIGN <= start or (address + start - offset) % ALIGN == 0:
            return
        if self.strict:
            raise ValueError(
                f"{op} of '{path}' at offset {offset}: the buffer's address and the offset "
                f"differ modulo {ALIGN}, so the transfer cannot use O_DIRECT; allocate with "
                "infinity.io.aligned_empty and use offsets with the same alignment, or "
                "pass strict=False to go through the page cache"
            )
        if not self._warned_unaligned:
            self._warned_unaligned = True
            log.info(
                "%s of '%s' at offset %d goes through the page cache: buffer and offset are "
                "aligned differently (further cases are not logged)", op, path, offset,
            )  # fmt: skip

    def _forget(self, future: AioFuture) -> None:
        with self._lock:
            self._pending.discard(future)

    def close(self) -> None:
        """Waits for every request not yet waited (errors are logged), stops the engine."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            try:
                future.wait()
            except AioError as exc:
                # A request whose wait a signal interrupted (the run is stopping) is no failure.
                report = log.debug if exc.errno == errno.EINTR else log.error
                report("unwaited request failed at close: %s", exc)
        self._engine.close()

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Buffers of unwaited requests must outlive the I/O: wait before the engine goes.
        with contextlib.suppress(Exception):  # nothing useful to do in a finalizer
            self.close()


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <linux/mman.h>


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """Asks Linux to back [address, address + nbytes) with transparent huge pages. Direct I/O
    pins every page of its buffer, so 2 MiB pages make large transfers cheaper (1.3-1.5x the
    throughput of 4 KiB pages in benchmarks/aio_vs_fio.py, see BENCHMARKS.md). Best effort:
    failures are ignored (THP disabled, not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def aligned_empty(shape, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized CPU tensor whose data starts on a page boundary (O_DIRECT-ready),
    pinned through the accelerator when it supports pinning (CUDA). Without pinning,
    buffers of 2 MiB or more start on a 2 MiB boundary and ask for huge pages (see
    `_advise_huge_pages`)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    accel = get_accelerator()
    if accel.pin_supported() or nbytes < HUGE_PAGE:
        raw = accel.empty_pinned((nbytes + ALIGN,), torch.uint8)
        start = -raw.data_ptr() % ALIGN
    else:
        span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # not touched yet
        start = -raw.data_ptr() % HUGE_PAGE
        _advise_huge_pages(raw.data_ptr() + start, span)
    return raw[start : start + nbytes].view(dtype).view(shape)


def zeroed(
    numel: int, dtype: torch.dtype = torch.float32, *, written_first: bool = False
) -> torch.Tensor:
    """A flat CPU tensor of zeros that costs nothing until touched: an anonymous mapping, whose
    pages are the kernel's zeros until first written (a promise of mmap(2), not of malloc).
    A multi-GiB `torch.zeros` faults in and writes every page up front: about a second per
    GiB on the development machine, several when it is loaded, for memory (Adam's moments,
    gradient sums) that the first step would overwrite or read as zeros anyway. Unpinned:
    pin what a device copies from.

    `written_first`: every page is written before it is read (the weights and masters a
    start copies in, a checkpoint's homes), so the mapping is private: its first touch
    went 1.3-2.8 GB/s against 1.0-1.8 for mmap's default shared one (shmem) on the
    development machine (benchmarks/first_touch.py). Memory read before it is written (the
    moments, the gradient sums: Adam and the accumulation read the zeros first) stays
    shared: a private page read first maps the zero page and faults again, copy on write,
    when written; and with all of it private the first step took 26-45 s against 14-15
    (llama-1b --nvme, load 2, alternating)."""
    nbytes = numel * dtype.itemsize
    flags = (mmap.MAP_PRIVATE if written_first else mmap.MAP_SHARED) | mmap.MAP_ANONYMOUS
    raw = mmap.mmap(-1, max(nbytes, 1), flags=flags)
    return torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(dtype)


def preallocate(path: str | os.PathLike, nbytes: int) -> None:
    """Reserves `nbytes` of disk for `path` (created if missing; never shrunk), so that later
    writes overwrite allocated blocks: first writes into a fresh file are much slower."""
    path = os.fspath(path)
    fd = open_file(path, True, False, "preallocate")
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise AioError(exc.errno or errno.EIO, "preallocate", path, 0, nbytes) from None
    finally:
        os.close(fd)
