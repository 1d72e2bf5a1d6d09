"""File-backed partitions for building a model whose parameters live on NVMe.

Owns the shared mappings `init` creates partitions in when `offload_param.device` is "nvme"
(see [Note: building on NVMe] in build.py): one unlinked file per partition in
`offload_param.nvme_path`, and dropping their pages from the process between parameters. It
does not decide where the weights live after the build (the engine's parameter tier does).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading

import torch

_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PREFIX = ".infinity-build-"
RELEASE_PERIOD_S = 0.05
"""How often the pages of the partitions are dropped while a model is built: what init code
can touch in this time is what a build keeps mapped (a whole-model init pass after
construction, like Hugging Face's post_init, registers nothing that could trigger a drop)."""
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
        self._lock = threading.Lock()  # the list is appended here and read by the dropper
        self._stop = threading.Event()
        self._error: BaseException | None = None
        # Drops pages on a timer: see RELEASE_PERIOD_S. Safe while init code writes: a
        # dropped page of a shared file mapping keeps its data and is faulted back in.
        self._dropper = threading.Thread(
            target=self._drop_loop, name="infinity-build-pages", daemon=True
        )
        self._dropper.start()

    def new_partition(
        self, src: torch.Tensor, dtype: torch.dtype, *, values: bool = True
    ) -> torch.Tensor:
        """A flat partition of `src`'s values in `dtype` (`values` False: of its shape only,
        zeros), in a shared mapping of a new file."""
        path = os.path.join(self.directory, f"{_PREFIX}{os.getpid()}-{next(_counter)}")
        numel = max(src.numel(), 1)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            # Allocated before mapping: a full disk is this error, not a SIGBUS at first touch.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            part = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        except (OSError, RuntimeError) as e:
            raise OSError(
                f"could not create a build partition of {nbytes} bytes at {path}: {e}; free "
                f"space in offload_param.nvme_path (building needs the model in its dtype "
                f"there once) or fix its permissions"
            ) from e
        finally:
            if os.path.exists(path):
                os.unlink(path)  # the mapping keeps the file alive, nothing outlives it
        part = part[: src.numel()]
        if values:
            with torch.no_grad():
                part.copy_(src.detach().reshape(-1))
        with self._lock:
            self._parts.append(part)
            self._ptrs.add(part.data_ptr())
        return part

    def owns(self, param: torch.Tensor) -> bool:
        """Is `param` (a view of) one of these partitions?"""
        return param.device.type == "cpu" and param.data_ptr() in self._ptrs

    def release_pages(self) -> None:
        """Drop every partition's pages from the process; their contents stay in the file
        (through the page cache) and come back on the next touch."""
        with self._lock:
            parts = list(self._parts)
        for part in parts:
            _dont_need(self._madvise, part)

    def _drop_loop(self) -> None:
        try:
            while not self._stop.wait(RELEASE_PERIOD_S):
                self.release_pages()
        except BaseException as e:  # reported by close()
            self._error = e

    def close(self) -> None:
        """Stop the timer, drop the pages once more and forget the partitions (the model
        holds them now)."""
        self._stop.set()
        self._dropper.join()
        try:
            self.release_pages()
        finally:
            self._parts, self._ptrs = [], set()
        if self._error is not None:
            raise OSError(f"dropping the pages of build partitions failed: {self._error}")


def _dont_need(madvise, part: torch.Tensor) -> None:
    storage = part.untyped_storage()
    nbytes = -(-storage.nbytes() // _PAGE) * _PAGE
    if madvise(storage.data_ptr(), nbytes, _MADV_DONTNEED):
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of a build partition")


class BuildPages:
    """The build partitions among `tensors`, found once, whose pages a reader drops as it
    finishes with each (the optimizer loading its first masters, a loader writing weights),
    so the model is never mapped in at once.

    A partition is recognized by the mapping its storage starts in (a file named by
    `BuildFiles`, in /proc/self/maps), never by an address remembered from an earlier
    lifetime: advising anonymous memory would zero it. This object holds the tensors, so
    their mappings outlive it."""

    def __init__(self, tensors) -> None:
        tensors = [t for t in tensors if t.device.type == "cpu"]
        starts = set()
        if tensors and os.path.exists("/proc/self/maps"):
            with open("/proc/self/maps") as f:
                starts = {int(line.split("-", 1)[0], 16) for line in f if _PREFIX in line}
        self._parts = {
            id(t): t for t in tensors if t.untyped_storage().data_ptr() in starts
        }  # fmt: skip
        self._madvise = _madvise() if self._parts else None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is one of the build partitions found."""
        return id(tensor) in self._parts

    def release(self, tensor: torch.Tensor) -> None:
        """Drop `tensor`'s pages if it is one of the build partitions found; else nothing."""
        part = self._parts.get(id(tensor))
        if part is not None:
            _dont_need(self._madvise, part)


def release_build_pages(tensors) -> None:
    """Drop the pages of those `tensors` that are build partitions (see `BuildPages`)."""
    tensors = list(tensors)
    pages = BuildPages(tensors)
    for t in tensors:
        pages.release(t)
