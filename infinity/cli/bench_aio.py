"""`infinity bench aio`: read and write throughput of the swap path's I/O engine on a disk.

Sweeps backends x block sizes x queue depths x threads (x single_submit x overlap_events when
asked) over one file, as training uses it:
writes overwrite a laid-out file (the first writes into a fresh file are timed once and
reported apart), reads use O_DIRECT so the page cache does not flatter them. Prints a table,
the best read and write, and the `aio` config section that gave the best of both.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from tqdm import tqdm

from infinity.io import (
    AioFallbackWarning,
    AioHandle,
    aligned_empty,
    available_backends,
    chosen_backend,
)
from infinity.utils.fsio import check_output_file
from infinity.utils.sizes import parse_size

BENCH_FILE = "infinity_aio_bench.bin"
MAX_BUFFER = 1 << 30
"""Bytes of host memory the sweep uses at most: larger files are moved as several requests
in flight at once, all from (or into) one buffer."""


def parse_list(text: str, parse=int) -> list:
    """'128K,1M' -> [131072, 1048576] with `parse` per item."""
    return [parse(x) for x in text.split(",") if x.strip()]


def parse_bool(text: str) -> bool:
    """'true'/'1'/'yes' -> True, 'false'/'0'/'no' -> False."""
    t = text.strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"cannot read {text!r} as a boolean; write true or false")


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


@dataclass(kw_only=True, slots=True)
class AioBenchConfig:
    """What to measure."""

    path: str
    """Directory on the disk to measure (a file named infinity_aio_bench.bin is used)."""
    size: int = 4 << 30
    """Bytes per measurement (the file's size)."""
    block_sizes: list[int] = field(default_factory=lambda: [128 << 10, 1 << 20, 8 << 20])
    queue_depths: list[int] = field(default_factory=lambda: [8, 32])
    threads: list[int] = field(default_factory=lambda: [1, 2])
    backends: list[str] = field(default_factory=lambda: ["auto"])
    """Backends to sweep; "auto" is the one AioHandle picks, "all" every one that runs."""
    single_submit: list[bool] = field(default_factory=lambda: [False])
    """The `aio` section's single_submit values to sweep."""
    overlap_events: list[bool] = field(default_factory=lambda: [True])
    """The `aio` section's overlap_events values to sweep."""
    ops: list[str] = field(default_factory=lambda: ["read", "write"])
    repeats: int = 1
    """Timed runs per configuration and op; the median is reported."""
    keep_file: bool = False
    """Leave the file in place after the run (it is removed by default)."""

    def __post_init__(self) -> None:
        if not os.path.isdir(self.path):
            raise ValueError(f"--path {self.path!r} is not a directory; create it first")
        if self.size < 4096 or self.size % 4096:
            raise ValueError(f"size must be a positive multiple of 4096, got {self.size}")
        for bs in self.block_sizes:
            if bs <= 0 or bs % 4096:
                raise ValueError(f"block size {bs} is not a positive multiple of 4096")
        if any(q < 1 for q in self.queue_depths) or any(t < 1 for t in self.threads):
            raise ValueError("queue depths and thread counts must be >= 1")
        for op in self.ops:
            if op not in ("read", "write"):
                raise ValueError(f"op {op!r} is not 'read' or 'write'")
        if not self.single_submit or not self.overlap_events:
            raise ValueError("single_submit and overlap_events need at least one value each")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        have = available_backends()
        if self.backends in (["all"], []):
            self.backends = have
        self.backends = [chosen_backend(b) for b in self.backends]
        self.backends = list(dict.fromkeys(self.backends))
        for b in self.backends:
            if b not in have:
                raise ValueError(f"backend {b!r} does not run here; available: {', '.join(have)}")


def machine_info(path: str) -> dict:
    st = os.statvfs(path)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "cores": len(os.sched_getaffinity(0)),
        "backends": available_backends(),
        "path": os.path.abspath(path),
        "fs_free_bytes": st.f_bavail * st.f_frsize,
        "loadavg_1m_5m_15m": list(os.getloadavg()),
    }


class Target:
    """The bench file and the buffer every measurement moves."""

    def __init__(self, cfg: AioBenchConfig) -> None:
        self.path = os.path.join(cfg.path, BENCH_FILE)
        self.size = cfg.size
        self.buf = aligned_empty(min(cfg.size, MAX_BUFFER))
        self.buf.fill_(0x5A)
        self.buffered = False

    def move(self, handle: AioHandle, op: str) -> float:
        """Seconds to move the whole file once, every request in flight at once."""
        step = self.buf.numel()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AioFallbackWarning)
            t0 = time.perf_counter()
            submit = handle.pwrite if op == "write" else handle.pread
            futures = []
            for offset in range(0, self.size, step):
                n = min(step, self.size - offset)
                futures.append(submit(self.buf[:n], self.path, offset))
            for f in futures:
                f.wait()
            elapsed = time.perf_counter() - t0
        self.buffered |= any(issubclass(w.category, AioFallbackWarning) for w in caught)
        return elapsed

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


class Setting(NamedTuple):
    """One configuration of the sweep; its fields are AioHandle's arguments."""

    backend: str
    block_size: int
    queue_depth: int
    threads: int
    single_submit: bool
    overlap_events: bool


def _key(r: dict) -> Setting:
    """The setting of a record (records written before the last two fields existed had
    their defaults)."""
    return Setting(r["backend"], r["block_size"], r["queue_depth"], r["threads"],
                   r.get("single_submit", False), r.get("overlap_events", True))  # fmt: skip


def _record(op: str, setting: Setting, times: list[float], size: int) -> dict:
    t = statistics.median(times)
    return {"op": op, **setting._asdict(), "gbps": size / t / 1e9, "seconds": times}


def run(cfg: AioBenchConfig, progress: bool = True) -> dict:
    """Measures every configuration; returns {"config", "machine", "first_write", "records",
    "buffered"}. Records carry op, backend, block_size, queue_depth, threads and gbps."""
    target = Target(cfg)
    target.remove()
    out = {"config": asdict(cfg), "machine": machine_info(cfg.path), "records": []}
    combos = [
        Setting(*c)
        for c in itertools.product(
            cfg.backends,
            cfg.block_sizes,
            cfg.queue_depths,
            cfg.threads,
            cfg.single_submit,
            cfg.overlap_events,
        )  # fmt: skip
    ]
    try:
        # The file is laid out by the first write, timed apart: later writes overwrite it.
        with AioHandle(**combos[0]._asdict()) as h:
            first = target.move(h, "write")
        out["first_write"] = _record("write", combos[0], [first], cfg.size)
        bar = tqdm(combos, desc="aio sweep", unit="config", disable=not progress)
        for c in bar:
            bar.set_postfix_str(f"{c.backend} bs={human(c.block_size)} qd={c.queue_depth} "
                                f"t={c.threads} single={c.single_submit:d} "
                                f"overlap={c.overlap_events:d}")  # fmt: skip
            with AioHandle(**c._asdict()) as h:
                for op in cfg.ops:
                    times = [target.move(h, op) for _ in range(cfg.repeats)]
                    out["records"].append(_record(op, c, times, cfg.size))
    finally:
        if not cfg.keep_file:
            target.remove()
    out["buffered"] = target.buffered
    return out


def best(result: dict) -> dict:
    """Best read and write GB/s, and the config section with the best read + write."""
    recs = result["records"]
    by_op = {op: [r for r in recs if r["op"] == op] for op in ("read", "write")}
    top = {op: max((r["gbps"] for r in rs), default=0.0) for op, rs in by_op.items()}
    score: dict[Setting, float] = {}
    for r in recs:
        key = _key(r)
        score[key] = score.get(key, 0.0) + r["gbps"] / max(top[r["op"]], 1e-12)
    s = max(score, key=score.get)
    section = {"block_size": s.block_size, "queue_depth": s.queue_depth,
               "thread_count": s.threads, "single_submit": s.single_submit,
               "overlap_events": s.overlap_events, "backend": s.backend}  # fmt: skip
    return {"read": top["read"], "write": top["write"], "aio": section}


def format_table(result: dict) -> str:
    rows: dict[Setting, dict] = {}
    for r in result["records"]:
        rows.setdefault(_key(r), {})[r["op"]] = r["gbps"]
    lines = [
        f"{'backend':<10}{'block':>7}{'qd':>5}{'threads':>8}{'single':>8}{'overlap':>8}"
        f"{'read GB/s':>11}{'write GB/s':>12}"
    ]
    yes_no = {True: "yes", False: "no"}
    for s, v in rows.items():
        rd = f"{v['read']:.2f}" if "read" in v else "-"
        wr = f"{v['write']:.2f}" if "write" in v else "-"
        lines.append(
            f"{s.backend:<10}{human(s.block_size):>7}{s.queue_depth:>5}{s.threads:>8}"
            f"{yes_no[s.single_submit]:>8}{yes_no[s.overlap_events]:>8}{rd:>11}{wr:>12}"
        )
    fw = result["first_write"]
    lines.append(
        f"first write into a fresh file ({fw['backend']}, block {human(fw['block_size'])}, "
        f"qd {fw['queue_depth']}, {fw['threads']} thread(s)): {fw['gbps']:.2f} GB/s "
        "(not in the table: training overwrites laid-out files)"
    )
    if result["buffered"]:
        lines.append(
            "NOTE: the file system refused O_DIRECT, so these figures went through the page "
            "cache and do not measure the disk"
        )
    b = best(result)
    lines.append(f"Best performance (GB/sec): read = {b['read']:.2f}, write = {b['write']:.2f}")
    lines.append("Config section for the best read + write:")
    lines.append(json.dumps({"aio": b["aio"]}, indent=2))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="directory on the disk to measure")
    parser.add_argument("--size", type=parse_size, default=4 << 30, help="file size (4G)")
    parser.add_argument("--block-size", type=lambda s: parse_list(s, parse_size),
                        default=[128 << 10, 1 << 20, 8 << 20], help="e.g. 128K,1M,8M")  # fmt: skip
    parser.add_argument("--queue-depth", type=parse_list, default=[8, 32], help="e.g. 8,32")
    parser.add_argument("--threads", type=parse_list, default=[1, 2], help="e.g. 1,2")
    parser.add_argument("--backend", type=lambda s: parse_list(s, str), default=["auto"],
                        help="auto, all, or a list of io_uring,aio,posix")  # fmt: skip
    parser.add_argument("--single-submit", type=lambda s: parse_list(s, parse_bool),
                        default=[False], help="the aio section's single_submit: "
                        "false (default), true, or false,true to compare")  # fmt: skip
    parser.add_argument("--overlap-events", type=lambda s: parse_list(s, parse_bool),
                        default=[True], help="the aio section's overlap_events: "
                        "true (default), false, or true,false to compare")  # fmt: skip
    ops = parser.add_mutually_exclusive_group()
    ops.add_argument("--read", action="store_true", help="measure reads only")
    ops.add_argument("--write", action="store_true", help="measure writes only")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per config")
    parser.add_argument("--json", metavar="FILE", help="write the records as a JSON list")


def config_from_args(args: argparse.Namespace) -> AioBenchConfig:
    ops = ["read"] if args.read else ["write"] if args.write else ["read", "write"]
    return AioBenchConfig(path=args.path, size=args.size, block_sizes=args.block_size,
                          queue_depths=args.queue_depth, threads=args.threads,
                          backends=args.backend, single_submit=args.single_submit,
                          overlap_events=args.overlap_events, ops=ops,
                          repeats=args.repeats)  # fmt: skip


def json_records(result: dict) -> list[dict]:
    """The --json list: one record per (op, configuration) with the machine info, then the
    first write into the fresh file, marked "fresh_file": true."""
    extra = {"machine": result["machine"], "size": result["config"]["size"],
             "buffered": result["buffered"]}  # fmt: skip
    return [{**r, **extra, "fresh_file": False} for r in result["records"]] + [
        {**result["first_write"], **extra, "fresh_file": True}
    ]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("aio", help="NVMe read/write throughput sweep")
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.json:
        check_output_file("--json", args.json)  # before the sweep, not after it
    result = run(config_from_args(args))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_records(result), f, indent=1)
        print(f"wrote {args.json}")
    return 0
