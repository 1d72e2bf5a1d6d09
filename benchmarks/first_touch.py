"""Claim: how memory is asked for decides what its first touch costs.

A start writes gigabytes into memory it has never touched (the weights' buffer, the fp32
masters, a loaded checkpoint's homes); on a virtual machine each first touch of a page
is slow, and that bounds the start. This copies `--gib` GiB of fp32 into fresh memory of
each kind, alternating the kinds in one run (`--repeats` rounds), and records GB/s for the
first copy and for a second one into the same (now touched) memory:

- `shared`: an anonymous `mmap.mmap(-1, n)`, Python's default MAP_SHARED (shmem);
- `private`: MAP_PRIVATE | MAP_ANONYMOUS, what `infinity.io.zeroed` gives;
- `private_huge`: the same, advised MADV_HUGEPAGE (transparent huge pages);
- `private_populate`: the same, faulted in by madvise(MADV_POPULATE_WRITE) before the copy
  (the time of both counted);
- `torch_empty`: `torch.empty` (the allocator's own mapping).

    PYTHONPATH=$PWD python benchmarks/first_touch.py --gib 1 --repeats 3 --json first_touch.json
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time

import torch
from bench_record import machine, write_json

KINDS = ("shared", "private", "private_huge", "private_populate", "torch_empty")
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_HUGE = 2 << 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB copied per kind and round")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the copies")
    p.add_argument("--json", default="first_touch.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    nbytes = max(int(args.gib * (1 << 30)) // _HUGE * _HUGE, _HUGE)
    src = torch.ones(nbytes // 4)
    rounds = [{k: _one(k, src) for k in KINDS} for _ in range(args.repeats)]
    medians = {k: statistics.median(r[k]["first_gbps"] for r in rounds) for k in KINDS}
    for k in KINDS:
        firsts = " ".join(f"{r[k]['first_gbps']:.2f}" for r in rounds)
        print(f"{k:17s} first touch {firsts} GB/s (median {medians[k]:.2f})", flush=True)
    record = {"claim": "first touch of fresh memory, by how it was asked for",
              "nbytes": nbytes, "threads": args.threads, "machine": machine(),
              "rounds": rounds, "median_first_gbps": medians}  # fmt: skip
    write_json(record, args.json)
    return 0


def _one(kind: str, src: torch.Tensor) -> dict:
    nbytes = src.numel() * 4
    t0 = time.perf_counter()
    raw, dest = _fresh(kind, nbytes)
    dest.copy_(src)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    dest.copy_(src)
    again = time.perf_counter() - t1
    del dest
    if isinstance(raw, mmap.mmap):
        raw.close()
    return {"first_gbps": nbytes / first / 1e9, "again_gbps": nbytes / again / 1e9}


def _fresh(kind: str, nbytes: int):
    """(the owner, an fp32 view of `nbytes` on a huge-page boundary) of fresh memory."""
    if kind == "torch_empty":
        raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
        t = raw
    else:
        flags = mmap.MAP_SHARED if kind == "shared" else mmap.MAP_PRIVATE
        raw = mmap.mmap(-1, nbytes + _HUGE, flags=flags | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(raw, dtype=torch.uint8)
    start = -t.data_ptr() % _HUGE
    advice = {"private_huge": _MADV_HUGEPAGE, "private_populate": _MADV_POPULATE_WRITE}
    if kind in advice:
        libc = ctypes.CDLL(None, use_errno=True)
        addr = ctypes.c_void_p(t.data_ptr() + start)
        if libc.madvise(addr, ctypes.c_size_t(nbytes), advice[kind]) != 0:
            raise OSError(ctypes.get_errno(), f"madvise for {kind} failed")
    return raw, t[start : start + nbytes].view(torch.float32)


if __name__ == "__main__":
    raise SystemExit(main())
