"""The swap store: where swapped tensors live on disk, and who owns the directory.

Owns, for one rank of one run, a private directory `nvme_path/infinity-<run id>/rank<r>/`
holding a few large pre-allocated files per tensor kind ("param", "optim"), the index that
maps a stable key (a parameter name, a sub-group) to a 4 KiB-aligned extent of one file, the
lock that keeps a second process out of the directory, and its removal at a clean exit. It
does no I/O of tensors itself: callers read and write extents through an `AioHandle`.

[Note: swap directory checks] Everything that can be known before training is checked before
the first byte is written: the path exists, is a writable directory, accepts O_DIRECT (a test
write; tmpfs does not, and the store then reports buffered I/O with a warning), and has room
for every file being laid out (`os.statvfs`). Files are laid out with `posix_fallocate`:
first writes into unallocated blocks run at about half the speed of overwrites.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ALIGN_BYTES = 4096
"""Extents start and end on this boundary (the O_DIRECT unit on every common file system)."""

DEFAULT_FILE_BYTES = 16 << 30
"""A kind's extents are spread over files of at most this size (a larger extent gets its own)."""

_GIB = float(1 << 30)
_RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    """`nbytes` rounded up to a multiple of `align`."""
    return -(-nbytes // align) * align


def reserved_nbytes(nbytes: int) -> int:
    """Disk bytes `reserve` lays out for a key of `nbytes` (an empty key still takes a page)."""
    return align_up(max(nbytes, 1))


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one tensor's bytes live: `nbytes` at `offset` of `path` (offset 4 KiB-aligned;
    `padded_nbytes` is the aligned length reserved)."""

    path: str
    offset: int
    nbytes: int
    padded_nbytes: int


class SwapStoreError(OSError):
    """The swap directory cannot be used; the message names the path and the fix."""


def default_run_id() -> str:
    """The launcher's run id when there is one (ranks of a run share a directory), else the
    process id."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"


class SwapStore:
    """Pre-allocated swap files of one rank, their index, and the directory lock.

    Use as a context manager or call `close()`; an `atexit` hook closes it at a clean exit.
    Lay out a kind's keys with `reserve(kind, {key: nbytes})` (checks free space first), then
    find them with `extent(kind, key)`.
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        *,
        rank: int = 0,
        run_id: str | None = None,
        file_bytes: int = DEFAULT_FILE_BYTES,
    ) -> None:
        self.nvme_path = os.path.abspath(os.fspath(nvme_path))
        self.rank = rank
        self.run_id = run_id or default_run_id()
        if file_bytes < ALIGN_BYTES or file_bytes % ALIGN_BYTES:
            raise ValueError(f"file_bytes={file_bytes} must be a positive multiple of 4096")
        self.file_bytes = file_bytes
        check_base_dir(self.nvme_path)
        self.run_dir = os.path.join(self.nvme_path, f"infinity-{self.run_id}")
        self.dir = os.path.join(self.run_dir, f"rank{rank}")
        self._lock_fd: int | None = None
        self._index: dict[str, dict[str, Extent]] = {}
        self._files: dict[str, list[str]] = {}
        self.reserved_bytes = 0
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._lock()
        self._remove_leftovers()
        try:
            self.direct = probe_direct(self.dir)
        except BaseException:
            self._release_dir()
            raise
        atexit.register(self.close)
        self.fs_type = filesystem_type(self.dir)
        if self.fs_type in _RAM_FILESYSTEMS:
            logger.warning(
                "nvme_path %s is on %s: swapped tensors stay in RAM, so offloading there saves "
                "no memory; point nvme_path at a directory on an SSD",
                self.nvme_path,
                self.fs_type,
            )
        logger.info(
            "swap store at %s (%s, O_DIRECT %s)",
            self.dir,
            self.fs_type,
            "on" if self.direct else "off: buffered",
        )

    # -- the directory lock ----------------------------------------------------------------

    def _lock(self) -> None:
        path = os.path.join(self.dir, "lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise SwapStoreError(
                f"swap directory {self.dir} is in use by another run (pid {other}); two runs "
                f"cannot share swap files: give this run another run_id or nvme_path, or stop "
                f"process {other}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _remove_leftovers(self) -> None:
        # The lock is ours, so swap files found here belong to a run of this id that died.
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".swp"):
                logger.warning("removing swap file %s left by a run that is gone", entry.path)
                _unlink_quiet(entry.path)

    # -- layout ----------------------------------------------------------------------------

    def reserve(self, kind: str, sizes: Mapping[str, int]) -> dict[str, Extent]:
        """Lay out `sizes` (key -> bytes) for `kind` in new pre-allocated files.

        Keys must be stable names (a parameter's qualified name, "subgroup.12"), unique within
        the kind. Free space for the whole layout is checked before anything is written.
        """
        self._check_open()
        if not kind or os.sep in kind:
            raise ValueError(f"kind {kind!r} must be a non-empty name without {os.sep!r}")
        index = self._index.setdefault(kind, {})
        dup = [k for k in sizes if k in index]
        if dup:
            raise ValueError(f"{kind} keys already reserved in {self.dir}: {dup[:5]}")
        plan = self._plan(kind, sizes)
        check_free_space(self.nvme_path, sum(size for _, size, _ in plan), self._stale_dirs())
        files = self._files.setdefault(kind, [])
        for path, size, extents in plan:
            _create_file(path, size)
            files.append(path)
            self.reserved_bytes += size
            index.update(extents)
        return {k: index[k] for k in sizes}

    def _plan(self, kind: str, sizes: Mapping[str, int]) -> list[tuple[str, int, dict]]:
        """Files to create: (path, bytes, {key: Extent}) in key order."""
        plan: list[tuple[str, int, dict]] = []
        n = len(self._files.get(kind, []))
        used, extents = 0, {}
        path = os.path.join(self.dir, f"{kind}.{n}.swp")
        for key, nbytes in sizes.items():
            if nbytes < 0:
                raise ValueError(f"{kind} key {key!r}: nbytes must be >= 0, got {nbytes}")
            padded = reserved_nbytes(nbytes)
            if extents and used + padded > self.file_bytes:
                plan.append((path, used, extents))
                n += 1
                used, extents = 0, {}
                path = os.path.join(self.dir, f"{kind}.{n}.swp")
            extents[key] = Extent(path, used, nbytes, padded)
            used += padded
        if extents:
            plan.append((path, used, extents))
        return plan

    def extent(self, kind: str, key: str) -> Extent:
        """Where `key` of `kind` lives (KeyError naming what is reserved otherwise)."""
        try:
            return self._index[kind][key]
        except KeyError:
            known = list(self._index.get(kind, {}))[:5]
            raise KeyError(
                f"no {kind} extent {key!r} in swap store {self.dir} (reserved: {known}...); "
                f"call reserve({kind!r}, ...) with it first"
            ) from None

    def keys(self, kind: str) -> list[str]:
        return list(self._index.get(kind, {}))

    def files(self, kind: str | None = None) -> list[str]:
        """The swap files of `kind` (all kinds when None)."""
        if kind is not None:
            return list(self._files.get(kind, []))
        return [p for paths in self._files.values() for p in paths]

    # -- lifetime --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._lock_fd is None

    def _check_open(self) -> None:
        if self.closed:
            raise SwapStoreError(f"swap store {self.dir} is closed")

    def close(self) -> None:
        """Remove this rank's files and directory, then release the lock. Idempotent."""
        if self.closed:
            return
        atexit.unregister(self.close)
        for path in self.files():
            _unlink_quiet(path)
        self._index.clear()
        self._files.clear()
        self._release_dir()

    def _release_dir(self) -> None:
        _unlink_quiet(os.path.join(self.dir, "lock"))
        for d in (self.dir, self.run_dir):
            with contextlib.suppress(OSError):  # not empty: another rank's, or not ours
                os.rmdir(d)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stale_dirs(self) -> list[str]:
        return [d for d in find_stale_dirs(self.nvme_path) if d != self.dir]


# -- checks (see [Note: swap directory checks]) ----------------------------------------------


def check_base_dir(path: str) -> None:
    hint = "set offload_param/offload_optimizer.nvme_path to a directory on a fast local SSD"
    if not os.path.exists(path):
        raise SwapStoreError(f"nvme_path {path} does not exist; create it (mkdir -p) or {hint}")
    if not os.path.isdir(path):
        raise SwapStoreError(f"nvme_path {path} is not a directory; {hint}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SwapStoreError(
            f"nvme_path {path} is not writable by this user (uid {os.getuid()}); fix its "
            f"permissions (chown/chmod) or {hint}"
        )


def probe_direct(directory: str) -> bool:
    """Whether `directory` accepts O_DIRECT: one aligned test write. False (with a warning) on
    file systems that refuse it (tmpfs); other errors raise naming the path."""
    path = os.path.join(directory, ".probe")
    buf = mmap.mmap(-1, ALIGN_BYTES)  # page-aligned
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise _probe_error(path, e) from e
            return _no_direct(directory)
        try:
            os.pwrite(fd, buf, 0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise _probe_error(path, e) from e
            return _no_direct(directory)
        finally:
            os.close(fd)
        return True
    finally:
        buf.close()
        _unlink_quiet(path)


def _no_direct(directory: str) -> bool:
    logger.warning(
        "swap directory %s does not support O_DIRECT (tmpfs, overlayfs?): swapping uses "
        "buffered I/O, which goes through the page cache and is slower; point nvme_path at a "
        "local SSD file system (ext4, xfs) for full speed",
        directory,
    )
    return False


def _probe_error(path: str, e: OSError) -> SwapStoreError:
    return SwapStoreError(
        f"test write to {path} failed: {os.strerror(e.errno)}; check that nvme_path is a "
        f"writable local file system with free space"
    )


def filesystem_type(path: str) -> str:
    """The type of the file system holding `path` ("ext4", "tmpfs"...; "" if unknown)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def check_free_space(path: str, needed: int, stale: list[str] = ()) -> None:
    """Raise naming the bytes needed and available unless `path`'s file system has room."""
    st = os.statvfs(path)
    available = st.f_bavail * st.f_frsize
    if needed <= available:
        return
    msg = (
        f"swap store under {path} needs {needed} bytes ({needed / _GIB:.2f} GiB) but the file "
        f"system has {available} bytes ({available / _GIB:.2f} GiB) available; free space, "
        f"point nvme_path at a larger disk, or keep more state in host memory "
        f'(offload_*.device = "cpu")'
    )
    if stale:
        msg += f". Swap directories left by runs that are gone (safe to remove): {stale}"
    raise SwapStoreError(msg)


def find_stale_dirs(nvme_path: str) -> list[str]:
    """Rank directories under `nvme_path` whose lock no process holds (a crashed run's)."""
    stale = []
    try:
        runs = [e.path for e in os.scandir(nvme_path) if e.name.startswith("infinity-")]
    except OSError:
        return stale
    for run in runs:
        try:
            ranks = [e.path for e in os.scandir(run) if e.name.startswith("rank")]
        except OSError:
            continue
        for d in ranks:
            if _lock_is_free(os.path.join(d, "lock")):
                stale.append(d)
    return stale


def _lock_is_free(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_stale_dirs(nvme_path: str) -> list[str]:
    """Delete rank directories of runs that are gone; returns what was removed."""
    removed = find_stale_dirs(nvme_path)
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(d))
    return removed


def _create_file(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise SwapStoreError(
                        f"laying out {nbytes} bytes in {path} failed: {os.strerror(e.errno)}; "
                        f"free space or point nvme_path at a larger disk"
                    ) from e
                # no fallocate on this file system: a sparse file still works, more slowly
                os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        _unlink_quiet(path)
        raise
    os.close(fd)


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
