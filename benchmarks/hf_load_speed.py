"""Claim: a Hugging Face checkpoint loads at the disk's read speed.

Makes (once) a Hugging Face checkpoint of a preset's shape in `--dir` with transformers
(`save_pretrained`, safetensors, bf16), then, alternating in one run, `--repeats` times:
`infinity bench aio`'s O_DIRECT read throughput on the same disk (1 MiB blocks, queue depth
32, the file size of the checkpoint), and `hf_auto.from_pretrained(dir, config)` with the
checkpoint's pages dropped from the page cache first (so the disk is read, not memory). The
load's rate is the safetensors bytes over the seconds `load_weights` takes (names and shapes
checked, every tensor read into its partition); the build before it is timed apart. The
same model is then loaded again, the disk cold again, into partitions whose memory is already
touched ("warm"), and the rate at which this machine faults in fresh memory is measured: on a
virtual machine whose first touch of a page is slow, the cold load is bound by that, not by
the disk, and the warm one shows what the read path itself does. Each round loads with each
of the loader's variants (`--paths`, in a rotating order): today's (CRC-32C by the native
kernel, each copy split over two threads), and the one before (zlib's CRC-32, copies on one
thread), the rest of the path the same. The loader reads with
O_DIRECT, so the page cache holds none of the data it reads either way.

    PYTHONPATH=$PWD INFINITY_ACCELERATOR=cpu python benchmarks/hf_load_speed.py \\
        --preset llama-1b --dir /tmp/hf-1b --json benchmarks/results/hf_load_speed.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_record import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from infinity.cli.bench_aio import AioBenchConfig, run  # noqa: E402
from infinity.io import checksum  # noqa: E402
from infinity.io.aio import zeroed  # noqa: E402
from infinity.models import hf_auto, hf_read  # noqa: E402
from infinity.models.hf_load import weight_map  # noqa: E402
from infinity.utils.tensor_digests import CRC32C  # noqa: E402
from infinity.zero import init  # noqa: E402

PATHS = {"new": (CRC32C, True), "crc32c": (CRC32C, False), "old": ("", False)}
"""`--paths` names -> (`hf_read.DIGEST`, `hf_read.SPLIT_COPIES`): today's loader, it with
every copy on one thread, and the loader before (zlib's CRC-32, copies on one thread)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--dir", required=True, help="the checkpoint (made here when missing)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default="hf_load_speed.json")
    p.add_argument("--paths", nargs="+", default=["new", "old"], choices=PATHS,
                   help="the loader's variants to compare, alternating (see PATHS)")  # fmt: skip
    args = p.parse_args(argv)
    slow = [v for v in args.paths if PATHS[v][0] == CRC32C and not checksum.FAST_CRC32C]
    if slow:
        p.error(f"--paths {' '.join(slow)} need the native CRC-32C of infinity._aio, which is "
                "not built here (the Python twin would take hours); build it with "
                "`python setup.py build_ext --inplace` or pass --paths old")  # fmt: skip
    model_dir = Path(args.dir)
    if not (model_dir / "config.json").is_file():
        _make_checkpoint(args.preset, model_dir)
    files = sorted(set(weight_map(model_dir).values()))
    nbytes = sum(f.stat().st_size for f in files)
    runs = []
    for k in range(args.repeats):
        for path in args.paths[k % len(args.paths) :] + args.paths[: k % len(args.paths)]:
            runs.append(_round(model_dir, files, nbytes, path))
    record = {
        "claim": "a Hugging Face checkpoint loads at the disk's read speed",
        "preset": args.preset,
        "checkpoint_bytes": nbytes,
        "machine": machine(str(model_dir)),
        "runs": runs,
        "median_ratio": {d: statistics.median(r["ratio"] for r in runs if r["path"] == d)
                         for d in args.paths},
        "median_warm_ratio": {d: statistics.median(r["warm_ratio"] for r in runs
                                                   if r["path"] == d) for d in args.paths},
    }  # fmt: skip
    write_json(record, args.json)
    return 0


def _round(model_dir: Path, files: list[Path], nbytes: int, path: str) -> dict:
    """One disk read, a cold load into fresh and into touched partitions by the loader's
    variant `path`, and the first-touch rate, as one record."""
    disk = _disk_read_gbps(model_dir, nbytes)
    hf_read.DIGEST, hf_read.SPLIT_COPIES = PATHS[path]
    build_s, load_s, warm_s = _load(model_dir, files)
    gbps, warm = nbytes / load_s / 1e9, nbytes / warm_s / 1e9
    touch = _first_touch_gbps(min(1 << 30, max(nbytes, 16 << 20)))
    print(f"{path}: disk read {disk:.2f} GB/s; load {nbytes / 1e9:.2f} GB in {load_s:.2f} s "
          f"= {gbps:.2f} GB/s ({gbps / disk:.0%} of the disk), into touched memory "
          f"{warm:.2f} GB/s ({warm / disk:.0%}); fresh memory faults in at {touch:.2f} "
          f"GB/s; build {build_s:.2f} s; load average {os.getloadavg()[0]:.1f}",
          flush=True)  # fmt: skip
    return {"path": path, "disk_read_gbps": disk, "build_s": build_s, "load_s": load_s,
            "load_gbps": gbps, "ratio": gbps / disk, "warm_load_s": warm_s,
            "warm_load_gbps": warm, "warm_ratio": warm / disk, "first_touch_gbps": touch,
            "load_avg": os.getloadavg()[0]}  # fmt: skip


def _make_checkpoint(preset: str, model_dir: Path) -> None:
    """A transformers checkpoint of the preset's shape, bf16, with random weights."""
    spec = hf_auto.describe(preset)
    model = hf_auto.from_pretrained(spec, {"zero_optimization": {"stage": 3}}, seed=0)
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    del model


def _disk_read_gbps(where: Path, nbytes: int) -> float:
    size = max(16 << 20, nbytes - nbytes % (1 << 20))
    cfg = AioBenchConfig(path=str(where), size=size, block_sizes=[1 << 20], queue_depths=[32],
                         threads=[1], ops=["read"])  # fmt: skip
    result = run(cfg, progress=False)
    return max(r["gbps"] for r in result["records"] if r["op"] == "read")


def _drop_cache(files: list[Path]) -> None:
    """Drop the checkpoint's clean pages from the page cache (what a cold start reads)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _first_touch_gbps(nbytes: int = 1 << 30) -> float:
    """GB/s at which this process writes memory it never touched before, of the kind the
    partitions are (`zeroed`: private anonymous)."""
    fresh = zeroed(nbytes, torch.uint8)
    t0 = time.perf_counter()
    fresh.fill_(1)
    return nbytes / (time.perf_counter() - t0) / 1e9


def _load(model_dir: Path, files: list[Path]) -> tuple[float, float, float]:
    """(build, load, load again into the same partitions) seconds of
    `hf_auto.from_pretrained`'s parts, the disk cold each time."""
    _drop_cache(files)
    spec = hf_auto.describe(model_dir)
    cfg = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    t0 = time.perf_counter()
    with init(cfg, values=False):
        model = hf_auto.build(spec.hf_config, init_weights=False)
    t1 = time.perf_counter()
    hf_auto.load_weights(model, model_dir)
    t2 = time.perf_counter()
    _drop_cache(files)
    t3 = time.perf_counter()
    hf_auto.load_weights(model, model_dir)
    t4 = time.perf_counter()
    del model
    return t1 - t0, t2 - t1, t4 - t3


if __name__ == "__main__":
    sys.exit(main())
