"""Checksums of extents: what was written where, checked when it is read back.

Owns the CRC-32C of buffers (`chunk_sums`: the native kernels of `infinity._aio`, chosen at
run time; `crc32c_reference` is their Python twin) and `ExtentSums`, the record of each
written range of a file as CRCs of `CHUNK_BYTES` pieces. It reads no file itself: the extent
I/O (`extent.py`) hands it the buffers it writes and reads.

[Note: extent checksums] A write records its range's CRCs, one per chunk counted from the
write's first byte (the last chunk short). A later write that covers a recorded range whole
replaces it; one that covers part of it updates the chunks it covers whole and forgets those
it covers in part (they are checked again once a write covers them whole). A read takes the
sums of the chunks it touches when it is issued, and compares them with the bytes it got
once it has landed; a chunk it covers in part (a parameter smaller than a page, read into a
tensor of its size) is checked whole, its other bytes read from the file. The tiers never
issue a read beside a write still in flight in the same page, so the sums taken at issue are
those of the bytes on disk. Chunks are pages (extents and transfers start on pages), so
every byte a tier reads back is checked. Sums live in memory only and are never
compared across processes, so without the extension a slower CRC (zlib's CRC-32) stands in.

[Note: full sums] A chunk's sum covers every byte of it: one byte changed anywhere in a
live swap file is found when it is read back, before anything uses it. The sums of a write
and the check of a read run on checksum threads of the tier (extent.py), beside the disk
and the caller's optimizer step, with the fastest CRC-32C kernel the CPU runs: carry-less
multiplication folding 256 bytes a step (AVX-512 VPCLMULQDQ, 51-59 GB/s on one core of the
development machine over cached data, 36-37 GB/s from DRAM), else the crc32 instruction
three chunks at a time (SSE4.2 or the ARMv8 CRC extension, about half that), else tables.
They are a pass over memory beside the optimizer's: +4-12% of the NVMe optimizer sweep on
the loaded 2-core development machine (benchmarks/swap_checksum_bench.py, BENCHMARKS.md),
over the 3% they are allowed. The bench's stage split says where: the sweep waits on its
reads, and a read's wait includes its check (5-8 ms per 96 MiB sub-group on one thread), run
after the bytes land and before the caller may step them, so it adds to the critical path
whole; Adam sharing the cores with the checksum threads adds the rest, the write sums
almost nothing. What removes it: check each page inside the Adam pass that reads it (before
anything computed from the page is stored) and record the written pages' sums from the same
pass, so a read's wait is the disk's alone and no second pass over DRAM runs.
`ExtentSums.sample_bytes` below `PAGE_BYTES` sums only the first bytes of each 4 KiB page,
as releases before full sums did; it stays for that comparison only, since a change inside
the rest of a page then goes unseen.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from infinity.io.aio_checks import buffer_span

try:
    from infinity import _aio as _native
except ImportError:  # built without a compiler: zlib's CRC stands in (see the note)
    _native = None

PAGE_BYTES = 4096
SAMPLE_BYTES = 64
"""Bytes of each 4 KiB page a sampled sum covers (see [Note: full sums]): not the default."""
CHUNK_BYTES = 4 << 10
"""Bytes per checksum: a page, so the chunks of every extent are the pages a read covers
(16 KiB left the last partial chunk of a parameter unchecked). 5 bytes of RAM per page of
swap (the sum and whether it is known): 1.25 GiB per TiB."""

_NATIVE = _native is not None and hasattr(_native, "crc32c_kernels")
KERNELS: tuple[str, ...] = tuple(_native.crc32c_kernels()) if _NATIVE else ()
"""The native CRC-32C kernels this CPU runs, slowest first ("table", "instruction",
"fold"); the last is what "auto" takes."""
FAST_CRC32C = _NATIVE
"""Whether `crc32c` runs a native kernel (tens of GB/s) rather than the Python twin."""
NAME = "CRC-32C" if _NATIVE else "CRC-32"
"""The checksum in use, as error messages name it."""


def _table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _table()


def crc32c_reference(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC-32C of `data` continuing from `crc`, one byte at a time: the Python twin of
    `infinity._aio.crc32c` (slow; for tests and small inputs)."""
    c = crc ^ 0xFFFFFFFF
    for byte in bytes(data):
        c = _TABLE[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def crc32c(buf, crc: int = 0) -> int:
    """CRC-32C of a contiguous host buffer continuing from `crc`, by the fastest native kernel
    (GIL released); without the extension by `crc32c_reference` (slow: check `FAST_CRC32C`
    before summing gigabytes)."""
    span = buffer_span(buf, writable=False)
    if _NATIVE:
        return _native.crc32c(span.address, span.nbytes, crc)
    flat = _flat_bytes(buf)
    return crc32c_reference(memoryview(flat if isinstance(flat, np.ndarray) else flat.numpy()), crc)


def chunk_sums(
    buf, chunk_bytes: int = CHUNK_BYTES, sample_bytes: int = 0, kernel: str = "auto"
) -> np.ndarray:
    """The checksum (`NAME`) of each `chunk_bytes` of a contiguous host buffer (a torch
    tensor or numpy array of any dtype), the last chunk short: uint32[ceil(nbytes / chunk)].
    With 0 < `sample_bytes` < `PAGE_BYTES`, each sum covers only the first `sample_bytes`
    of every page of its chunk (see [Note: full sums]). `kernel` is "auto" or one of
    `KERNELS`. The native path releases the GIL."""
    span = buffer_span(buf, writable=False)
    out = np.empty(-(-span.nbytes // chunk_bytes), dtype=np.uint32)
    sampled = 0 < sample_bytes < PAGE_BYTES
    if _NATIVE:
        _native.crc32c_chunks(span.address, span.nbytes, chunk_bytes, out.ctypes.data, kernel,
                              sample_bytes if sampled else 0, PAGE_BYTES)  # fmt: skip
        return out
    flat = _flat_bytes(buf)
    data = flat if isinstance(flat, np.ndarray) else flat.numpy()
    for k, piece in enumerate(_sampled(data, chunk_bytes, sample_bytes if sampled else 0)):
        out[k] = zlib.crc32(piece)
    return out


def _sampled(data: np.ndarray, chunk_bytes: int, sample_bytes: int):
    """Each chunk's summed bytes, contiguous: the chunk, or the heads of its pages gathered
    (one numpy copy of the heads of all whole chunks, not a Python loop over pages)."""
    whole = data.size // chunk_bytes if sample_bytes and chunk_bytes % PAGE_BYTES == 0 else 0
    if whole:
        pages = data[: whole * chunk_bytes].reshape(whole, chunk_bytes // PAGE_BYTES, PAGE_BYTES)
        heads = np.ascontiguousarray(pages[:, :, :sample_bytes]).reshape(whole, -1)
        yield from heads
    for k in range(whole, -(-data.size // chunk_bytes)):
        chunk = data[k * chunk_bytes : (k + 1) * chunk_bytes]
        if not sample_bytes:
            yield chunk
            continue
        yield np.concatenate([chunk[at : at + sample_bytes]
                              for at in range(0, chunk.size, PAGE_BYTES)])  # fmt: skip


@dataclass(slots=True)
class _Record:
    """One written range of a file: `sums[k]` of chunk k, valid where `known[k]`."""

    offset: int
    nbytes: int
    sums: np.ndarray
    known: np.ndarray

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class Expected:
    """What a read must find: the sums of whole chunks of one record, from file offset
    `offset` (chunk-aligned in the record), `nbytes` long."""

    offset: int
    nbytes: int
    sums: np.ndarray
    known: np.ndarray


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first chunk a read found changed: file bytes [offset, offset + nbytes)."""

    offset: int
    nbytes: int
    got: int
    want: int


class ExtentSums:
    """The checksums of what was written to each file (see [Note: extent checksums]).
    Thread-safe."""

    def __init__(
        self, chunk_bytes: int = CHUNK_BYTES, sample_bytes: int = PAGE_BYTES, kernel: str = "auto"
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.sample_bytes = sample_bytes
        """Bytes of each page the sums cover (`PAGE_BYTES` or more: every byte, the default;
        fewer only to measure what sampling saved, see [Note: full sums])."""
        self.kernel = kernel
        """The native CRC-32C kernel: "auto" (the fastest) or one of `KERNELS`."""
        self._files: dict[str, list[_Record]] = {}  # by offset; records never overlap
        self._lock = threading.Lock()

    def written(self, path: str, offset: int, buf) -> None:
        """Record a write of `buf` at `offset` of `path` (call before the write is issued)."""
        nbytes = buffer_span(buf, writable=False).nbytes
        if nbytes == 0:
            return
        with self._lock:
            records = self._files.setdefault(path, [])
            hit = self._overlapping(records, offset, offset + nbytes)
            if any(r.offset < offset or r.end > offset + nbytes for r in hit):
                for r in hit:  # a write into recorded ranges updates them
                    self._update(r, offset, buf, nbytes)
                return  # its bytes outside every record stay unchecked
        # Outside the lock: the tiers never have two writes over one range in flight.
        sums = chunk_sums(buf, self.chunk_bytes, self.sample_bytes, self.kernel)
        with self._lock:
            records = self._files[path]
            for r in self._overlapping(records, offset, offset + nbytes):
                records.remove(r)  # whole records under this write
            bisect.insort(records, _Record(offset, nbytes, sums, np.ones(sums.size, bool)),
                          key=lambda r: r.offset)  # fmt: skip

    def forget(self, path: str, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of `path` are unknown (a write failed there)."""
        with self._lock:
            for r in self._overlapping(self._files.get(path, []), offset, offset + nbytes):
                first, stop = self._touched(r, offset, offset + nbytes)
                r.known[first:stop] = False

    def expected(self, path: str, offset: int, nbytes: int) -> list[Expected]:
        """The sums a read of [offset, offset + nbytes) of `path` must match, taken now: of
        the chunks it covers whole, and one entry for each chunk it covers in part (checked
        with the chunk's other bytes read from the file, see `verify`)."""
        out = []
        with self._lock:
            for r in self._overlapping(self._files.get(path, []), offset, offset + nbytes):
                first, stop = self._inside(r, offset, offset + nbytes)
                touched_first, touched_stop = self._touched(r, offset, offset + nbytes)
                if first >= stop:  # the read lies inside one chunk
                    first = stop = touched_stop
                for a, b in ((touched_first, min(first, touched_stop)), (first, stop),
                             (max(stop, touched_first), touched_stop)):  # fmt: skip
                    if a < b and r.known[a:b].any():
                        start = r.offset + a * self.chunk_bytes
                        end = min(r.offset + b * self.chunk_bytes, r.end)
                        out.append(Expected(start, end - start, r.sums[a:b].copy(),
                                            r.known[a:b].copy()))  # fmt: skip
        return out

    def verify(self, expected: list[Expected], offset: int, buf, outside=None) -> Mismatch | None:
        """The first changed chunk of `buf` (read from file offset `offset`), or None. A chunk
        the read covers in part is checked with its other bytes from `outside(at, nbytes)`
        (file bytes at file offset `at`); without `outside` it is left unchecked."""
        flat = _flat_bytes(buf)
        end = offset + flat.shape[0]
        for e in expected:
            lo, hi = e.offset - offset, e.offset + e.nbytes - offset
            if lo >= 0 and hi <= flat.shape[0]:
                piece = flat[lo:hi]
            elif outside is None:
                continue
            else:  # one chunk, partly outside the read: gather it
                piece = np.empty(e.nbytes, np.uint8)
                a, b = max(lo, 0), min(hi, flat.shape[0])
                piece[a - lo : b - lo] = np.asarray(flat[a:b])
                head = outside(e.offset, a - lo) if lo < a else b""
                tail = outside(end, hi - b) if b < hi else b""
                if len(head) != a - lo or len(tail) != hi - b:  # the file ends short of it
                    return Mismatch(e.offset, e.nbytes, 0, int(e.sums[0]))
                piece[: a - lo] = np.frombuffer(head, np.uint8)
                piece[b - lo :] = np.frombuffer(tail, np.uint8)
            got = chunk_sums(piece, self.chunk_bytes, self.sample_bytes, self.kernel)
            bad = np.flatnonzero((got != e.sums) & e.known)
            if bad.size:
                k = int(bad[0])
                start = e.offset + k * self.chunk_bytes
                stop = min(start + self.chunk_bytes, e.offset + e.nbytes)
                return Mismatch(start, stop - start, int(got[k]), int(e.sums[k]))
        return None

    def _update(self, r: _Record, offset: int, buf, nbytes: int) -> None:
        """A write of [offset, offset + nbytes) over part of record `r`."""
        first, stop = self._inside(r, offset, offset + nbytes)
        if first < stop:
            lo = r.offset + first * self.chunk_bytes - offset
            hi = min(r.offset + stop * self.chunk_bytes, r.end) - offset
            r.sums[first:stop] = chunk_sums(
                _flat_bytes(buf)[lo:hi], self.chunk_bytes, self.sample_bytes, self.kernel
            )
            r.known[first:stop] = True
        touched_first, touched_stop = self._touched(r, offset, offset + nbytes)
        for k in (touched_first, touched_stop - 1):
            if touched_first <= k < touched_stop and not first <= k < stop:
                r.known[k] = False

    def _inside(self, r: _Record, lo: int, hi: int) -> tuple[int, int]:
        """Chunks of `r` that [lo, hi) covers whole: [first, stop)."""
        c = self.chunk_bytes
        first = -(-(max(lo, r.offset) - r.offset) // c)
        stop = (min(hi, r.end) - r.offset) // c
        if hi >= r.end:
            stop = -(-r.nbytes // c)  # the short last chunk ends with the record
        return first, max(first, stop)

    def _touched(self, r: _Record, lo: int, hi: int) -> tuple[int, int]:
        """Chunks of `r` that [lo, hi) touches at all."""
        c = self.chunk_bytes
        first = (max(lo, r.offset) - r.offset) // c
        stop = -(-(min(hi, r.end) - r.offset) // c)
        return first, max(first, stop)

    @staticmethod
    def _overlapping(records: list[_Record], lo: int, hi: int) -> list[_Record]:
        i = bisect.bisect_right(records, lo, key=lambda r: r.offset) - 1
        i = max(i, 0)
        out = []
        while i < len(records) and records[i].offset < hi:
            if records[i].end > lo:
                out.append(records[i])
            i += 1
        return out


def _flat_bytes(buf):
    """A flat uint8 view of a contiguous torch tensor or numpy array (no copy)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return buf.reshape(-1).view(torch.uint8)
