"""Claim: Infinity's I/O engine moves data as fast as fio on the same file with the same
settings (default: 1 MiB blocks, queue depth 32, 1 thread, 2 GiB, fio ioengine=libaio
direct=1), for reads and writes.

Each round runs every Infinity backend and fio once per op, in a rotating order, on one
laid-out file (writes overwrite it, as training does); the median over rounds is compared.
Infinity moves the file as one request from an `aligned_empty` buffer (huge pages, as the
swap store's buffers). To separate the engine from the buffer, the aio backend also runs
from a whole-file buffer on 4 KiB pages ("4k-pages") and through a reused queue_depth x
block_size buffer on 4 KiB pages ("fio-buffer"), fio's own memory pattern; and fio also runs
from huge pages ("libaio+hugepages", `--iomem=mmaphuge`) when a hugetlbfs mount with enough
free huge pages exists, or when `--fio-hugepages setup` (root) reserves them for the run.
Installs fio with apt-get if it is missing.

    flock /work/bench.lock python benchmarks/aio_vs_fio.py --path /mnt/ssd \\
        --json benchmarks/results/aio_vs_fio.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from bench_record import machine, write_json

from infinity.cli.bench_aio import BENCH_FILE, human
from infinity.io import AioHandle, aligned_empty, available_backends
from infinity.utils.sizes import parse_size


def ensure_fio() -> str | None:
    """Path of fio, installing the Debian package if needed; None (with a message) if not."""
    found = shutil.which("fio")
    if found:
        return found
    if shutil.which("apt-get") is None:
        print("fio is not installed and apt-get is not available: install fio "
              "(https://github.com/axboe/fio) and re-run", file=sys.stderr)  # fmt: skip
        return None
    print("fio is missing: running apt-get update && apt-get install -y fio", flush=True)
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "fio"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                  f"{proc.stderr.strip()[-500:]}\ninstall fio yourself (as root: apt-get "
                  "install fio) and re-run", file=sys.stderr)  # fmt: skip
            return None
    return shutil.which("fio")


def fio_gbps(
    fio: str, path: str, op: str, size: int, bs: int, qd: int, threads: int, iomem: str | None
) -> float:
    """fio's bandwidth for one sequential pass over the file, `threads` jobs on slices;
    `iomem` is fio's buffer source (None: its default, malloc)."""
    per = size // threads
    cmd = [fio, "--name=peer", f"--filename={path}", f"--rw={op}", f"--bs={bs}",
           f"--iodepth={qd}", "--ioengine=libaio", "--direct=1", f"--size={per}",
           f"--numjobs={threads}", f"--offset_increment={per}", "--group_reporting",
           "--overwrite=1", "--invalidate=1", "--output-format=json"]  # fmt: skip
    if iomem:
        cmd.append(f"--iomem={iomem}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed (exit {proc.returncode}): {proc.stderr.strip()}")
    job = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0]
    return job[op]["bw_bytes"] / 1e9


def ours_gbps(handle: AioHandle, buf, path: str, op: str, size: int) -> float:
    """Infinity's bandwidth for the same pass: the file as requests of buf's size, all in
    flight at once (one request when buf is as large as the file)."""
    submit = handle.pwrite if op == "write" else handle.pread
    t0 = time.perf_counter()
    futures = [submit(buf, path, offset) for offset in range(0, size, buf.numel())]
    for f in futures:
        f.wait()
    return size / (time.perf_counter() - t0) / 1e9


def small_page_buffer(nbytes: int):
    """A page-aligned buffer left on 4 KiB pages, like fio's queue_depth x block_size one
    (aligned_empty asks for huge pages)."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    return raw[start : start + nbytes]


HUGE_PAGE = 2 << 20


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def hugetlbfs_mount() -> str | None:
    """A mounted hugetlbfs of 2 MiB pages, if any."""
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            if fstype == "hugetlbfs" and "pagesize=1024M" not in opts:
                return mnt
    return None


class FioHugePages:
    """Where fio's huge-page buffer comes from: an existing hugetlbfs with enough free pages
    ("auto"), or pages reserved and a hugetlbfs mounted for the run and undone after
    ("setup", root only). `iomem` is None when there are none."""

    def __init__(self, mode: str, nbytes: int) -> None:
        self.mode, self.iomem = mode, None
        self._undo: list[list[str]] = []
        self._pages_before: int | None = None
        pages = -(-nbytes // HUGE_PAGE) + 4
        if mode == "off":
            return
        mnt = hugetlbfs_mount()
        if mode == "setup" and (mnt is None or _meminfo("HugePages_Free") < pages):
            mnt = self._setup(pages, mnt)
        if mnt and _meminfo("HugePages_Free") >= pages:
            self.iomem = f"mmaphuge:{os.path.join(mnt, f'infinity-fio.{os.getpid()}')}"
        else:
            print(f"fio from huge pages skipped: needs a hugetlbfs mount and {pages} free 2 MiB "
                  "pages (as root: --fio-hugepages setup)", file=sys.stderr)  # fmt: skip

    def _setup(self, pages: int, mnt: str | None) -> str | None:
        nr = "/proc/sys/vm/nr_hugepages"
        with open(nr) as f:
            self._pages_before = int(f.read())
        with open(nr, "w") as f:
            f.write(str(self._pages_before + pages))
        if mnt is None:
            mnt = tempfile.mkdtemp(prefix="infinity-hugetlbfs-")
            subprocess.run(["mount", "-t", "hugetlbfs", "none", mnt], check=True)
            self._undo.append(["umount", mnt])
        return mnt

    def close(self) -> None:
        for cmd in self._undo:
            subprocess.run(cmd, check=False)
        if self._pages_before is not None:
            with open("/proc/sys/vm/nr_hugepages", "w") as f:
                f.write(str(self._pages_before))


# Runners that separate the engine from the buffer: the whole file from a buffer on 4 KiB
# pages, and through a small reused 4 KiB-page buffer, as fio does.
SMALL_PAGES = "4k-pages"
FIO_BUFFER = "fio-buffer"
FIO_HUGE = "fio-hugepages"


def run(args: argparse.Namespace, fio: str) -> dict:
    path = os.path.join(args.path, BENCH_FILE)
    cfg = dict(block_size=args.block_size, queue_depth=args.queue_depth, threads=args.threads)
    handles = {b: AioHandle(backend=b, **cfg) for b in args.backend}
    buf = aligned_empty(args.size)
    ring = small_page_buffer(args.block_size * args.queue_depth * args.threads)
    flat = small_page_buffer(args.size)
    flat.fill_(0x5A)
    buf.fill_(0x5A)
    ring.fill_(0x5A)
    out = {"settings": {**cfg, "size": args.size, "rounds": args.rounds},
           "machine": machine(args.path), "records": []}  # fmt: skip
    huge = FioHugePages(args.fio_hugepages, args.block_size * args.queue_depth * args.threads)
    out["settings"]["fio_iomem_hugepages"] = huge.iomem
    first = args.backend[0]
    # fio's libaio engine is kernel AIO: the like-for-like engine for the fio-buffer runner.
    peer_like = "aio" if "aio" in handles else first
    try:
        if os.path.exists(path):
            os.unlink(path)
        out["first_write"] = {"backend": first,
                              "gbps": ours_gbps(handles[first], buf, path, "write",
                                                args.size)}  # fmt: skip
        runners = [*args.backend, SMALL_PAGES, FIO_BUFFER, "fio"]
        if huge.iomem:
            runners.append(FIO_HUGE)
        for rnd in range(args.rounds):
            order = runners[rnd % len(runners) :] + runners[: rnd % len(runners)]
            for op in ("write", "read"):
                for name in order:
                    if name in ("fio", FIO_HUGE):
                        iomem = huge.iomem if name == FIO_HUGE else None
                        g = fio_gbps(fio, path, op, args.size, args.block_size,
                                     args.queue_depth, args.threads, iomem)  # fmt: skip
                    elif name in (FIO_BUFFER, SMALL_PAGES):
                        b = ring if name == FIO_BUFFER else flat
                        g = ours_gbps(handles[peer_like], b, path, op, args.size)
                    else:
                        g = ours_gbps(handles[name], buf, path, op, args.size)
                    backend = {"fio": "libaio", FIO_HUGE: "libaio+hugepages"}.get(name, name)
                    if name in (FIO_BUFFER, SMALL_PAGES):
                        backend = f"{peer_like}+{name}"
                    tool = "fio" if name in ("fio", FIO_HUGE) else "infinity"
                    out["records"].append({"tool": tool,
                                           "op": op, "backend": backend, **cfg, "gbps": g,
                                           "round": rnd})  # fmt: skip
                    print(f"round {rnd} {op:<5} {backend:<20} {g:6.2f} GB/s", flush=True)
    finally:
        huge.close()
        for h in handles.values():
            h.close()
        if os.path.exists(path) and not args.keep_file:
            os.unlink(path)
    out["summary"] = summarize(out["records"])
    return out


def summarize(records: list[dict]) -> dict:
    """Median GB/s per (tool backend, op), Infinity's best backend per op, and its ratio."""
    med: dict[str, dict[str, float]] = {}
    for op in ("read", "write"):
        names = {r["backend"] for r in records if r["op"] == op}
        for name in names:
            g = [r["gbps"] for r in records if r["op"] == op and r["backend"] == name]
            med.setdefault(op, {})[name] = statistics.median(g)
    summary = {}
    for op, m in med.items():
        ours = {k: v for k, v in m.items() if not k.startswith("libaio") and "+" not in k}
        best = max(ours, key=ours.get)
        same = next(v for k, v in m.items() if FIO_BUFFER in k)
        fio_best = max(v for k, v in m.items() if k.startswith("libaio"))
        summary[op] = {"median_gbps": m, "best_backend": best,
                       "ratio_best_to_fio": ours[best] / m["libaio"],
                       "ratio_best_to_best_fio": ours[best] / fio_best,
                       "ratio_fio_buffer_to_fio": same / m["libaio"]}  # fmt: skip
    return summary


def format_summary(out: dict) -> str:
    s = out["settings"]
    lines = [
        f"median of {s['rounds']} interleaved rounds; {human(s['size'])} file, block "
        f"{human(s['block_size'])}, queue depth {s['queue_depth']}, {s['threads']} thread(s); "
        f"fio ioengine=libaio direct=1",
        f"first write into the fresh file ({out['first_write']['backend']}): "
        f"{out['first_write']['gbps']:.2f} GB/s",
    ]
    for op, v in out["summary"].items():
        cols = ", ".join(f"{k} {g:.2f}" for k, g in sorted(v["median_gbps"].items()))
        lines.append(f"{op:<5} GB/s: {cols}; best ({v['best_backend']}) / fio = "
                     f"{v['ratio_best_to_fio']:.2f}x; best / fio's best (any buffer) = "
                     f"{v['ratio_best_to_best_fio']:.2f}x; with fio's buffer / fio = "
                     f"{v['ratio_fio_buffer_to_fio']:.2f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=".", help="directory on the disk to measure")
    parser.add_argument("--size", type=parse_size, default=2 << 30)
    parser.add_argument("--block-size", type=parse_size, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", action="append", choices=["io_uring", "aio", "posix"],
                        help="Infinity backend (repeatable; default: the native ones)")  # fmt: skip
    parser.add_argument("--keep-file", action="store_true")
    parser.add_argument(
        "--fio-hugepages",
        choices=["auto", "off", "setup"],
        default="auto",
        help="also run fio from huge pages: if a hugetlbfs has room (auto), never (off), or "
        "reserve and mount them for the run (setup, root)",
    )
    parser.add_argument("--json", default="aio_vs_fio.json", help="output file")
    args = parser.parse_args(argv)
    if args.size % (args.threads * args.block_size):
        parser.error("--size must be a multiple of --threads x --block-size")
    native = [b for b in available_backends() if b != "posix"]
    args.backend = args.backend or native or ["posix"]
    fio = ensure_fio()
    if fio is None:
        return 2
    out = run(args, fio)
    print(format_summary(out))
    write_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
