"""Claim: on a virtual machine whose balloon reports free pages to its host, memory left free
for a while costs a host fault on its next first touch, and that is the slow first start.

virtio-balloon's free page reporting (feature bit 5, VIRTIO_BALLOON_F_REPORTING) hands free
blocks of 2 MiB and more back to the host a few seconds after they are freed; the host drops
them, and the guest's next write to such a page waits for the host to find and zero one.
This copies `--gib` GiB of fp32 into fresh private anonymous memory (what `infinity.io.zeroed`
gives the start's weights and masters) with torch's threads, twice per round, alternating:
(a) after `--idle` seconds in which nothing ran, (b) right after (a)'s memory was freed. Each
record has the GB/s of the first copy, of a second copy into the same (now backed) memory,
and the load; the machine record says whether the balloon reports free pages.

    PYTHONPATH=$PWD python benchmarks/reported_pages.py --gib 4 --idle 90 --rounds 2 \\
        --json benchmarks/results/reported_pages.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from pathlib import Path

import torch
from bench_record import machine, write_json

_REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING, <linux/virtio_balloon.h>
_BALLOON_ID = 5  # the virtio device id of a memory balloon


def balloon_reports_free_pages(devices: Path = Path("/sys/bus/virtio/devices")) -> bool | None:
    """Whether a virtio balloon among `devices` negotiated free page reporting (None: no
    balloon)."""
    found = None
    for dev in devices.glob("*"):
        try:
            if int((dev / "device").read_text(), 16) != _BALLOON_ID:
                continue
            bits = (dev / "features").read_text().strip()  # bit 0 first
        except (OSError, ValueError):
            continue
        found = found or (len(bits) > _REPORTING_BIT and bits[_REPORTING_BIT] == "1")
    return found


def _copy_twice(gib: float) -> dict:
    nbytes = int(gib * (1 << 30)) // 4 * 4
    src = torch.ones(nbytes // 4)
    raw = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dst = torch.frombuffer(raw, dtype=torch.float32)
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        dst.copy_(src)
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
    del dst, src
    raw.close()
    return {"first_gb_s": round(rates[0], 3), "again_gb_s": round(rates[1], 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="GiB copied per record")
    p.add_argument("--idle", type=float, default=90.0, help="seconds idle before (a)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="reported_pages.json")
    args = p.parse_args(argv)
    records = []
    for k in range(args.rounds):
        for tag in (f"after_{args.idle:g}s_idle", "right_after_a_free"):
            if tag != "right_after_a_free":
                time.sleep(args.idle)
            load = os.getloadavg()[0]
            rec = {"tag": tag, "round": k, "load_1m": load, **_copy_twice(args.gib)}
            records.append(rec)
            print(rec, flush=True)
    mach = {**machine(None), "balloon_reports_free_pages": balloon_reports_free_pages()}
    mach["torch_threads"] = torch.get_num_threads()
    write_json({"claim": __doc__.split("\n\n")[0], "gib": args.gib, "machine": mach,
                "records": records}, args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
