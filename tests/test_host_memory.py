"""unmap_large_allocations: freed large buffers leave the resident set at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import sys, torch
    from infinity.utils.host_memory import unmap_large_allocations

    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    if sys.argv[1] == "fixed":
        assert unmap_large_allocations()
    big = torch.ones(30 << 18)  # 30 MiB mapped and freed: glibc's threshold rises to it
    del big
    base = rss_mib()
    kept, small = [], []
    for _ in range(40):  # 320 MiB in 8 MiB buffers, a small live block after each
        kept.append(torch.ones(2 << 20))
        small.append(torch.ones(64))
    kept.clear()
    print(rss_mib() - base)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux only")
def test_freed_large_buffers_leave_the_resident_set():
    def retained(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
        return float(out.stdout.strip().splitlines()[-1])

    assert retained("fixed") < 32  # MiB: the 320 MiB went back to the system
    assert retained("default") > 160  # without it, most of it stays resident
