"""File-backed partitions for building a model whose parameters live on NVMe.

Owns the shared mappings `init` creates partitions in when `offload_param.device` is "nvme"
(see [Note: building on NVMe] in build.py): one unlinked file per partition in
`offload_param.nvme_path`, and dropping their pages from the process between parameters. It
does not decide where the weights live after the build (the engine's parameter store does).
"""

from __future__ import annotations

import ctypes
import itertools
import os

import torch

_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PREFIX = ".infinity-build-"
_counter = itertools.count()


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


class BuildFiles:
    """Partitions mapped from unlinked files under `directory`, alive while referenced."""

    def __init__(self, directory: str | None) -> None:
        if not directory or not os.path.isdir(directory):
            raise ValueError(
                f"offload_param.nvme_path {directory!r} is not a directory: building a model "
                f"with parameters on NVMe creates them there; create it or fix the path"
            )
        self.directory = directory
        self._madvise = _madvise()
        self._parts: list[torch.Tensor] = []  # mapped partitions, page-aligned each
        self._ptrs: set[int] = set()

    def new_partition(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A flat partition of `src`'s values in `dtype`, in a shared mapping of a new file."""
        path = os.path.join(self.directory, f"{_PREFIX}{os.getpid()}-{next(_counter)}")
        try:
            part = torch.from_file(path, shared=True, size=max(src.numel(), 1), dtype=dtype)
        except RuntimeError as e:
            raise OSError(
                f"could not map a {src.numel()}-element build partition at {path}: {e}; check "
                f"free space and write access in offload_param.nvme_path"
            ) from e
        finally:
            if os.path.exists(path):
                os.unlink(path)  # the mapping keeps the file alive, nothing outlives it
        part = part[: src.numel()]
        with torch.no_grad():
            part.copy_(src.detach().reshape(-1))
        self._parts.append(part)
        self._ptrs.add(part.data_ptr())
        return part

    def owns(self, param: torch.Tensor) -> bool:
        """Is `param` (a view of) one of these partitions?"""
        return param.device.type == "cpu" and param.data_ptr() in self._ptrs

    def release_pages(self) -> None:
        """Drop every partition's pages from the process; their contents stay in the file
        (through the page cache) and come back on the next touch."""
        for part in self._parts:
            _dont_need(self._madvise, part)

    def close(self) -> None:
        """Drop the pages once more and forget the partitions (the model holds them now)."""
        try:
            self.release_pages()
        finally:
            self._parts, self._ptrs = [], set()


def _dont_need(madvise, part: torch.Tensor) -> None:
    storage = part.untyped_storage()
    nbytes = -(-storage.nbytes() // _PAGE) * _PAGE
    if madvise(storage.data_ptr(), nbytes, _MADV_DONTNEED):
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of a build partition")


def release_build_pages(tensors) -> None:
    """Drop the pages of those `tensors` that are build partitions (their contents stay in
    the file); any other tensor is left alone. For a reader that walks many partitions once
    (the optimizer loading its first masters), so the model is not mapped in at once.

    A partition is recognized by the mapping its storage starts in (a file named by
    `BuildFiles`, in /proc/self/maps), never by an address remembered from earlier: advising
    anonymous memory would zero it."""
    candidates = {t.untyped_storage().data_ptr(): t for t in tensors if t.device.type == "cpu"}
    if not candidates or not os.path.exists("/proc/self/maps"):
        return
    madvise = None
    with open("/proc/self/maps") as f:
        for line in f:
            if _PREFIX not in line:
                continue
            lo = int(line.split("-", 1)[0], 16)
            part = candidates.get(lo)
            if part is not None:
                madvise = madvise or _madvise()
                _dont_need(madvise, part)
