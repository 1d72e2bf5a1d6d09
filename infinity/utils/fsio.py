"""Durable file operations: fsync of files and directories, atomic replacement, fault points.

Owns the rules that make "written" mean "on disk": a file is fsynced before it is renamed,
and the directory holding a rename is fsynced after it. It does not own any file format.

Fault points let tests kill a process at a chosen moment of a save: set
`INFINITY_FAULT_AT=N` and the N-th `fault_point()` reached in the process sends SIGKILL to
itself (`INFINITY_FAULT_LOG=PATH` appends each point's name to PATH first, to count them).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

_FAULT_COUNT = 0


def fault_point(name: str) -> None:
    """A place where a crash must be survivable. No-op unless INFINITY_FAULT_AT is set."""
    global _FAULT_COUNT
    at = os.environ.get("INFINITY_FAULT_AT")
    log = os.environ.get("INFINITY_FAULT_LOG")
    if at is None and log is None:
        return
    _FAULT_COUNT += 1
    if log:
        with open(log, "a") as f:
            f.write(f"{_FAULT_COUNT} {name}\n")
    if at is not None and int(at) == _FAULT_COUNT:
        os.kill(os.getpid(), signal.SIGKILL)


def reset_fault_points() -> None:
    """Restart the fault-point count (tests arm a fault for one operation)."""
    global _FAULT_COUNT
    _FAULT_COUNT = 0


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` so a reader sees the old or the new content, never a mix.

    Writes a temporary sibling, fsyncs it, renames it over `path` and fsyncs the directory.
    """
    path = os.fspath(path)
    parent = os.path.dirname(path) or "."
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fault_point(f"write_file_atomic:{os.path.basename(path)}:before_replace")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def check_output_file(flag: str, dest: str) -> None:
    """Refuse an output file `flag` names that cannot be written (a directory, or a folder
    that is missing or read-only), before the work whose result it would hold; '-' is
    stdout."""
    if dest == "-":
        return
    path = Path(dest).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {dest} is a directory; give a file name in it")
    parent = path.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        why = "does not exist" if not parent.exists() else "is not a writable directory"
        raise ValueError(
            f"{flag} {dest}: {parent} {why}; create it or give another path ('-' writes to stdout)"
        )


def write_json(out: dict, dest: str) -> None:
    """`out` to `dest` ('-': stdout), through a temporary file renamed into place so an
    interrupted write never leaves half a file under the name."""
    text = json.dumps(out, indent=2) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        return
    path = Path(dest).expanduser()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
