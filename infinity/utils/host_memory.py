"""The machine's host memory: its size (`physical_ram`, `available_ram`), and giving freed
memory back to the operating system (`unmap_large_allocations`).

[Note: glibc and large buffers] glibc's malloc serves a request from its heap unless it is at
least the mmap threshold, which starts at 128 KiB and rises (up to 32 MiB) each time a mapped
block is freed. After a model is built, every parameter-sized buffer (13-35 MB in a 2B model:
gathered weights, activations) comes from the heap, and a freed one stays in the process's
resident set for as long as any later allocation sits above it: in a 2B-parameter run with
parameters on NVMe that held about 1 GiB more RSS than the data alive at any moment. Fixing the
threshold at a few MiB gives every large buffer its own mapping, unmapped when freed; the cost
is page faults on each such allocation (microseconds per MiB).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
DEFAULT_THRESHOLD = 4 << 20


def physical_ram() -> int:
    """Bytes of RAM this machine has (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def available_ram() -> int:
    """Bytes of RAM available to a new process now (the kernel's MemAvailable: free memory
    plus what it can reclaim), or `physical_ram()` where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_ram()


def unmap_large_allocations(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Make glibc map every allocation of `threshold` bytes or more on its own (see the note
    above). Process-wide: call it from a program's entry point, not from library code. Returns
    False (changing nothing) where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return ok
