"""Who holds a save directory: an exclusive `flock` on `SAVE_DIR/.lock`.

A training run holds its save directory for its whole life (`SaveDirLock`); a save made
outside such a run holds it for the save alone (see `writer`). The kernel drops a flock when
its process ends, however it ends, so a lock file left behind by a dead run never blocks: the
file stays, and only says who held it last (pid, host, start time, command), which is what a
second process is told when the directory is taken.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from infinity.checkpoint import layout

log = logging.getLogger(__name__)

# flock on a file system that has none (some network file systems): run unlocked, warned.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)
_UNLOCKED = -1

_HELD: dict[Path, int] = {}
"""Save directories this process holds with a `SaveDirLock`, and the lock file's descriptor."""


def held_here(save_dir: str | os.PathLike) -> bool:
    """Whether this process holds `save_dir` through a `SaveDirLock`."""
    try:
        return Path(save_dir).resolve() in _HELD
    except (OSError, RuntimeError):  # a symlink loop where the directory was: not the one held
        return False


def describe_holder(save_dir: str | os.PathLike) -> str:
    """The last holder recorded in `save_dir`'s lock file, for a message."""
    try:
        info = json.loads((Path(save_dir) / layout.LOCK).read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started_unix_s"]))
        return f"process {info['pid']} on {info['host']}, started {started}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it records no details: an API save, or it is starting)"


def try_lock(save_dir: Path) -> int | None:
    """An exclusive non-blocking flock on `save_dir/.lock`: its descriptor, or None when
    another process holds it."""
    fd = os.open(save_dir / layout.LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    return fd


def record_holder(fd: int, command: str) -> None:
    """Write this process's details into the lock file `fd` (held), for `describe_holder`."""
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_unix_s": time.time(),
        "command": command,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def plain_os_error(code: int | None, message: str) -> OSError:
    """An OSError that prints as `message` alone (no "[Errno N]") and keeps the errno."""
    err = OSError(message)
    err.errno = code
    return err


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


class SaveDirLock:
    """Hold SAVE_DIR (created if missing) from `acquire` to `release` (or the process's end).

    A context manager. `acquire` raises `OSError(EBUSY)` naming the other process when the
    directory is held. Saves by this process into SAVE_DIR meanwhile do not lock again.
    """

    def __init__(self, save_dir: str | os.PathLike, *, command: list[str] | None = None) -> None:
        self.save_dir = Path(save_dir)
        self.command = " ".join(command if command is not None else sys.argv)
        self._fd: int | None = None
        self._key: Path | None = None
        """`save_dir` resolved when acquired (it may not resolve later: replaced by a loop)."""

    def acquire(self) -> SaveDirLock:
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise plain_os_error(
                exc.errno,
                f"cannot create the save directory {self.save_dir}: {exc.strerror or exc}; "
                "choose a writable --save-dir",
            ) from None
        try:
            fd = try_lock(self.save_dir)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise plain_os_error(
                    exc.errno,
                    f"cannot lock the save directory {self.save_dir} ({exc.strerror or exc}); "
                    "choose a writable --save-dir",
                ) from None
            log.warning(
                "the file system of %s does not support locks (%s): a second run on the same "
                "directory would not be detected", self.save_dir, exc.strerror,
            )  # fmt: skip
            self._key = self.save_dir.resolve()
            _HELD[self._key] = self._fd = _UNLOCKED
            return self
        if fd is None:
            raise plain_os_error(
                errno.EBUSY,
                f"{self.save_dir} is in use by {describe_holder(self.save_dir)}; wait for that "
                "run to end (or stop it), or use another --save-dir",
            )
        record_holder(fd, self.command)
        self._fd = fd
        self._key = self.save_dir.resolve()
        _HELD[self._key] = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        _HELD.pop(self._key, None)
        if self._fd != _UNLOCKED:
            unlock(self._fd)
        self._fd = None

    def __enter__(self) -> SaveDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = [
    "SaveDirLock",
    "plain_os_error",
    "describe_holder",
    "held_here",
    "record_holder",
    "try_lock",
    "unlock",
]
