"""Boundary of the async I/O handle: buffers, files and errors, before anything reaches an
engine. Owns the checks on buffers (type, device, contiguity, writability), opening files
(O_DIRECT with a buffered fallback), the choice of engine, and `AioError`, whose message names
the path, the offset, the errno text and a hint. It does not move any data.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from infinity.io.aio_posix import PosixEngine

try:
    from infinity import _aio as _native
except ImportError:  # built without a compiler: the POSIX twin takes over
    _native = None

log = logging.getLogger(__name__)

ALIGN = 4096
"""O_DIRECT alignment of file offsets, lengths and memory used here (a page: it covers the
512 B and 4 KiB logical blocks of common drives)."""
BACKENDS = ("auto", "io_uring", "aio", "posix")
BUILD_HINT = "build it with `python setup.py build_ext --inplace` (needs a C++17 compiler)"

HINTS = {
    errno.ENOENT: "the directory does not exist: create it first",
    errno.EACCES: "no permission: check the owner and mode of the file and its directory",
    errno.EPERM: "operation not permitted: check the owner and mode of the file",
    errno.ENOSPC: "the file system is full: free space or point the swap path at a larger disk",
    errno.EDQUOT: "disk quota exceeded: free space or raise the quota",
    errno.EFBIG: "the file would exceed the size limit (ulimit -f or the file system's limit)",
    errno.ENODATA: "the file ends before offset + nbytes: write that range before reading it",
    errno.EINVAL: "the file system or device refused the request: if it refuses O_DIRECT, "
    "pass strict=False to use buffered I/O, or put the file on ext4/xfs",
    errno.EROFS: "the file system is read-only: choose a writable path",
    errno.EISDIR: "the path is a directory: pass a file path",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg)",
}


class AioError(OSError):
    """An I/O request failed; `errno`, `filename` and `offset` say which and where."""

    def __init__(self, code: int, op: str, path: str, offset: int, nbytes: int, detail: str = ""):
        text = (
            f"{op} of {nbytes} bytes at offset {offset} of '{path}' failed: "
            f"{os.strerror(code)}{f' ({detail})' if detail else ''}"
        )
        hint = HINTS.get(code)
        super().__init__(code, f"{text}; {hint}" if hint else text)
        self.filename = path
        self.offset = offset

    def __str__(self) -> str:  # the message already names the path
        return f"[Errno {self.errno}] {self.strerror}"


@dataclass(frozen=True, slots=True)
class BufferSpan:
    """Where a buffer's bytes are: a raw address and a byte count."""

    address: int
    nbytes: int


def buffer_span(buf: object, *, writable: bool) -> BufferSpan:
    """The span of a contiguous CPU torch tensor or numpy array; TypeError/ValueError else."""
    if isinstance(buf, torch.Tensor):
        if buf.layout != torch.strided:
            raise TypeError(f"buf has layout {buf.layout}; pass a dense tensor")
        if buf.device.type != "cpu":
            raise ValueError(
                f"buf is on {buf.device}; file I/O goes through host memory: pass a CPU tensor "
                "(e.g. one from infinity.io.aligned_empty) and copy it to the device after"
            )
        if not buf.is_contiguous():
            raise ValueError(
                f"buf (shape {tuple(buf.shape)}, strides {buf.stride()}) is not contiguous; "
                "pass a contiguous tensor (a .contiguous() copy would not receive the data)"
            )
        return BufferSpan(buf.data_ptr(), buf.numel() * buf.element_size())
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(
                f"buf (shape {buf.shape}, strides {buf.strides}) is not C-contiguous; "
                "pass a contiguous array (np.ascontiguousarray would not receive the data)"
            )
        if writable and not buf.flags.writeable:
            raise ValueError("buf is read-only; reading into it needs a writable array")
        return BufferSpan(buf.ctypes.data, buf.nbytes)
    raise TypeError(f"buf must be a torch.Tensor or numpy.ndarray, got {type(buf).__name__}")


def check_offset(offset: object) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    return offset


def open_file(path: str, write: bool, direct: bool, op: str) -> int:
    """Opens `path` for one request (writes create it, never truncate); AioError on failure."""
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    flags |= os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        code = exc.errno or errno.EIO
        if code == errno.ENOENT and write:
            detail = f"directory '{os.path.dirname(os.path.abspath(path))}' is missing"
        elif code == errno.ENOENT:
            detail = "no such file"
        else:
            detail = "open" + (" with O_DIRECT" if direct else "")
        raise AioError(code, op, path, 0, 0, detail) from None


def probe(backend: str) -> str:
    """'' if `backend` can run here, else why not."""
    if backend == "posix":
        return ""
    if _native is None:
        return f"infinity._aio is not built; {BUILD_HINT}"
    return _native.probe(backend)


def available_backends() -> list[str]:
    """The backends that run on this machine, fastest first."""
    return [b for b in ("io_uring", "aio", "posix") if not probe(b)]


def chosen_backend(backend: str) -> str:
    """The backend `backend` names: "auto" is the fastest that runs here (a choice made
    when the engine starts; the config keeps "auto" for it)."""
    return available_backends()[0] if backend == "auto" else backend


def make_engine(
    backend: str,
    block_size: int,
    queue_depth: int,
    threads: int,
    single_submit: bool = False,
    overlap_events: bool = True,
):
    """The engine for `backend` ("auto": io_uring, else aio, else posix, as probed).
    `single_submit` and `overlap_events` shape the native engines' submissions (see
    AioHandle); the POSIX engine accepts them and has no queue they could apply to."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"block_size must be a positive multiple of {ALIGN}, got {block_size}")
    if not 1 <= queue_depth <= 4096:
        raise ValueError(f"queue_depth must be in 1..4096, got {queue_depth}")
    if not 1 <= threads <= 256:
        raise ValueError(f"threads must be in 1..256, got {threads}")
    name = chosen_backend(backend)
    if name == backend:
        reason = probe(backend)
        if reason:
            raise ValueError(
                f"backend={backend!r} is not available here: {reason}; "
                f"available: {', '.join(available_backends())} (or pass backend='auto')"
            )
    if name == "posix":
        return PosixEngine(block_size, queue_depth, threads, single_submit, overlap_events)
    return _native.Engine(name, block_size, queue_depth, threads, single_submit, overlap_events)
