"""Reading a safetensors file at the disk's speed: `read_file_into`.

Owns one pass over a safetensors file's data with the swap path's async I/O (`AioHandle`:
O_DIRECT, many requests in flight) through a few page-aligned blocks that are reused, each
tensor's bytes copied from the blocks straight into where it goes (a parameter's partition
when the dtypes agree) with its checksum (`DIGEST`) computed on the way. It does not check
names or shapes (`hf_load.check_names_and_shapes` does, before) nor decide where tensors go.

[Note: reading at the disk's speed] Reading tensor by tensor with `pread` into a fresh
buffer and copying that into the partition paid for the memory three times: the page cache,
a new buffer faulted in per tensor, and the partition; on the development machine that ran
at 4% of what the disk reads (benchmarks/hf_load_speed.py). Here the file is read in
`BLOCK_BYTES` blocks, `DEPTH` of them in flight while the landed one is copied out, into
buffers allocated once and never through the page cache: the only memory touched once per
byte is the destination. The checksums are CRC-32C by the native kernel where the extension
is built (tens of GB/s): zlib's CRC-32, 1.5-2.3 GB/s on one core there, was slower than the
disk (3.5 GB/s) and took one of the machine's two cores for the whole load.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from infinity.io import checksum
from infinity.io.aio import AioHandle, aligned_empty
from infinity.utils import tensor_digests

BLOCK_BYTES = 32 << 20
DEPTH = 3
_ALIGN = 4096
SPLIT_COPIES = True
"""Copy each piece of 1 MiB or more in two halves, one on a worker thread, so the copy and
the first touch of fresh partitions use two cores where one is idle. On the loaded 2-core
development machine it measured neither faster nor slower (BENCHMARKS.md, "The load's
checksums")."""
_SPLIT_MIN_BYTES = 1 << 20
DIGEST = tensor_digests.CRC32C if checksum.FAST_CRC32C else ""
"""The kind of checksum `Wanted.crc` holds (see infinity/utils/tensor_digests.py)."""


@dataclass(slots=True)
class Wanted:
    """One tensor to read: its bytes [start, stop) in the file, and where they go."""

    name: str
    start: int
    stop: int
    dest: torch.Tensor | Callable[[], torch.Tensor]
    """A contiguous CPU tensor of exactly stop - start bytes, or a function making one
    (called when the first of its bytes lands, so a pass holds one such tensor at a time)."""
    crc: int = 0
    digest: str = ""
    """The kind of `crc`: `DIGEST` when the read began (see infinity/utils/tensor_digests.py)."""


def read_file_into(
    path: str | os.PathLike,
    wanted: list[Wanted],
    done: Callable[[Wanted], None],
    aio: AioHandle,
) -> None:
    """Read the bytes of every `wanted` tensor of `path` into its `dest`, in one pass over
    the file, and call `done(w)` (its `crc` and `digest` set) as each one is complete."""
    for w in wanted:
        w.digest = DIGEST
    for w in wanted:
        if w.stop == w.start:  # nothing to read: complete already
            done(w)
    wanted = sorted((w for w in wanted if w.stop > w.start), key=lambda w: w.start)
    if not wanted:
        return
    size = os.path.getsize(path)
    first = wanted[0].start - wanted[0].start % _ALIGN
    last = max(w.stop for w in wanted)
    blocks = [(o, min(BLOCK_BYTES, size - o)) for o in range(first, last, BLOCK_BYTES)]
    ring = [aligned_empty(BLOCK_BYTES, torch.uint8) for _ in range(min(DEPTH, len(blocks)))]
    flights = [aio.pread(ring[k][: blocks[k][1]], path, blocks[k][0]) for k in range(len(ring))]
    # One thread per copy: torch's intra-op threads spin against the I/O engine's thread
    # (2 threads: 5.3 s for a warm 1B load, 1 thread: 1.7 s on the development machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The CRCs (and, with SPLIT_COPIES, the second half of each copy) run on threads of their
    # own beside the copies: the CRC kernels and torch's copy drop the GIL. A tensor's pieces
    # lie in successive blocks and a block's work ends before the next starts, so its CRC
    # still runs in file order.
    sums = ThreadPoolExecutor(2 if SPLIT_COPIES else 1, thread_name_prefix="infinity-hf-crc")
    try:
        nxt = 0  # the first tensor not yet complete (they end in file order)
        for k, (offset, nbytes) in enumerate(blocks):
            flights[k].wait()
            buf = ring[k % len(ring)]
            nxt = _copy_out(wanted, nxt, buf[:nbytes], offset, done, sums)
            if k + len(ring) < len(blocks):  # the buffer is free again: the next block into it
                o, n = blocks[k + len(ring)]
                flights.append(aio.pread(buf[:n], path, o))
    finally:
        sums.shutdown()
        torch.set_num_threads(threads)
        for f in flights:  # a failure leaves no read writing into a buffer being freed
            with contextlib.suppress(OSError):
                f.wait()


def _copy_out(
    wanted: list[Wanted],
    nxt: int,
    block: torch.Tensor,
    offset: int,
    done: Callable,
    sums: ThreadPoolExecutor,
) -> int:
    """Copy the landed `block` (file bytes from `offset`) into the tensors it overlaps, from
    `wanted[nxt]` on, their CRCs on `sums`; return the index of the first tensor still
    incomplete. Returns once every CRC of the block is done (its buffer is then free)."""
    end = offset + block.numel()
    i, pending, complete = nxt, [], []
    while i < len(wanted) and wanted[i].start < end:
        w = wanted[i]
        lo, hi = max(w.start, offset), min(w.stop, end)
        piece = block[lo - offset : hi - offset]
        if callable(w.dest):
            w.dest = w.dest()
        dest = w.dest.view(-1).view(torch.uint8)[lo - w.start : hi - w.start]
        cut = piece.numel()  # bytes copied here; the rest on a worker
        if SPLIT_COPIES and cut >= _SPLIT_MIN_BYTES:
            cut //= 2
            pending.append(sums.submit(dest[cut:].copy_, piece[cut:]))
        pending.append(sums.submit(_add_crc, w, piece))
        dest[:cut].copy_(piece[:cut])
        if w.stop > end:
            break
        complete.append(w)
        i += 1
    for f in pending:
        f.result()
    for w in complete:
        done(w)
    return i


def _add_crc(w: Wanted, piece: torch.Tensor) -> None:
    if w.digest == tensor_digests.CRC32C:
        w.crc = checksum.crc32c(piece, w.crc)
    else:
        w.crc = zlib.crc32(memoryview(piece.numpy()), w.crc)
