"""What every benchmark script writes besides its measurements: the machine record and the
JSON file.

`machine(path)` describes where a figure was measured (CPU, cores, RAM, versions, how busy
the machine was; with `path`, the disk's file system and the I/O backends) and
`write_json(record, dest)` writes a result. The scripts import this module as
`bench_record`: their own folder is on sys.path, both when run as files and as
`python -m benchmarks.<script>` (see benchmarks/__init__.py). `infinity bench` keeps its own
record (infinity.cli.bench_adam / bench_aio), which the wrappers of those commands pass on.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path


def machine(path: str | None = None) -> dict:
    """The machine as a JSON-able record; with `path`, also its file system and I/O backends."""
    import torch

    from infinity.cli.bench_adam import cpu_model
    from infinity.utils.host_memory import physical_ram

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cores": len(os.sched_getaffinity(0)),  # the ones this process may run on
        "ram_bytes": physical_ram(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "nice": os.nice(0),  # below 0: the run took the cores ahead of other work
        # The machine may be shared: the load says how busy it was around the run.
        "loadavg_1m_5m_15m": list(os.getloadavg()),
    }
    if path is not None:
        from infinity.io import available_backends

        st = os.statvfs(path)
        record["path"] = os.path.abspath(path)
        record["fs_free_bytes"] = st.f_bavail * st.f_frsize
        record["backends"] = available_backends()
    return record


def write_json(record: object, dest: str | os.PathLike, *, announce: bool = True) -> None:
    """Writes `record` as indented JSON to `dest` (its folder created if missing), and says
    so on stdout unless `announce` is false (for scripts whose stdout is itself a record)."""
    out = Path(dest)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    if announce:
        print(f"wrote {out}", file=sys.stdout, flush=True)
