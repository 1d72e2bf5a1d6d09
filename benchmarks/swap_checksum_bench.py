"""Claim: checking swap extents (a CRC-32C per 16 KiB written, checked on every read; see
[Note: extent checksums] in infinity/io/checksum.py) costs under 3% of the NVMe optimizer
sweep with the default sums, which cover every byte ([Note: full sums]).

Four `NvmeStateTier`s over the same sub-groups in one swap directory: without checksums
("off"), with the sums releases before full sums made (the first `SAMPLE_BYTES` of every
page, "sampled"), with sums of every byte by the crc32 instruction ("full-instruction",
what summing every byte cost before) and the default, sums of every byte by the fastest
kernel ("full"; the same as full-instruction where the CPU has no faster one). Each round
sweeps all four with a real CPU-Adam step per
sub-group, in an order that rotates so the shared disk's swings hit each alike. Reading into
the next sweep is off (`prefetch_next_sweep=False`): it would overlap the other stores'
sweeps. A variant's cost is the median over rounds of (its sweep / the sweep without
checksums in the same round) - 1. The states are compared bitwise at the end, and each
variant's summing rate on one core is measured on a sub-group's buffer. Each variant also
prints the median of its sweeps split into `STAGES` (read wait, Adam, write wait, the rest,
and the checksum threads' CPU seconds): where the sums' cost goes. The quiet rerun:

    python -m benchmarks.swap_checksum_bench --path DIR --state-gib 1 --rounds 7

    flock /work/bench.lock python -m benchmarks.swap_checksum_bench --path /tmp \\
        --state-gib 2 --rounds 9 --json benchmarks/results/swap_checksum.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time

import torch

from benchmarks.optimizer_swap_bench import machine, open_aio, state_groups
from infinity.io import checksum, extent
from infinity.io.aio import AioHandle, aligned_empty
from infinity.optim import adam_step_flat
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.store import SwapStore

_GB = 1e9
_BEST = checksum.KERNELS[-1] if checksum.KERNELS else "auto"
_INSTRUCTION = "instruction" if "instruction" in checksum.KERNELS else _BEST
VARIANTS = {
    "off": (None, None),
    "sampled": (checksum.SAMPLE_BYTES, _INSTRUCTION),
    "full-instruction": (checksum.PAGE_BYTES, _INSTRUCTION),
    "full": (checksum.PAGE_BYTES, "auto"),
}
"""Name -> (bytes of each page the sums cover (None: no checksums), CRC-32C kernel)."""
STAGES = ("read_wait_s", "adam_s", "write_wait_s", "other_s", "sum_cpu_s")
"""Where a sweep's time goes: the caller waiting for reads (and, with sums, their checks),
its Adam steps, waiting for write-backs (and their sums), the rest; and the CPU seconds the
checksum threads spent summing (`time.thread_time`, whatever the load)."""
_SUM_CPU = [0.0]
_SUM_LOCK = threading.Lock()


def _timed_chunk_sums(fn):
    def timed(buf, *a, **kw):
        start = time.thread_time()
        out = fn(buf, *a, **kw)
        with _SUM_LOCK:
            _SUM_CPU[0] += time.thread_time() - start
        return out

    return timed


def sweep_stages(state: NvmeStateTier, grad: torch.Tensor, step: int) -> dict[str, float]:
    """One sweep with an Adam step on each sub-group, split into `STAGES`."""
    stats, adam = state.io.stats, 0.0
    waits = (stats.read_wait_s, stats.write_wait_s, _SUM_CPU[0])
    start = time.perf_counter()
    for _, s in state.sweep():
        t = time.perf_counter()
        adam_step_flat(
            s.master, grad, s.exp_avg, s.exp_avg_sq, step=step, lr=1e-3, weight_decay=0.01
        )
        adam += time.perf_counter() - t
    total = time.perf_counter() - start
    read, write = stats.read_wait_s - waits[0], stats.write_wait_s - waits[1]
    other = total - read - write - adam
    return {"sweep_s": total, "read_wait_s": read, "adam_s": adam, "write_wait_s": write,
            "other_s": other, "sum_cpu_s": _SUM_CPU[0] - waits[2]}  # fmt: skip


def measure(args: argparse.Namespace, aio: AioHandle, numel: int, groups: int) -> dict:
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=g)
    master = torch.randn(numel, generator=g)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with SwapStore(args.path, run_id=f"bench{os.getpid()}") as store:
        states = {}
        for name, (sample, kernel) in VARIANTS.items():
            states[name] = NvmeStateTier(
                [numel] * groups,
                store=store,
                aio=aio,
                buffer_count=args.buffer_count,
                prefetch_next_sweep=False,
                kind=f"optim.checksums_{name}",
                checksums=sample is not None,
            )
            if sample is not None:
                states[name].io.sums.sample_bytes = sample
                states[name].io.sums.kernel = kernel
        for state in states.values():
            for i in range(groups):
                state.initialize(i, master)
            sweep_stages(state, grad, step=1)  # warm-up; also settles the initial writes
        names = list(states)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rows[name].append(sweep_stages(states[name], grad, step=r + 2))
        off = [states["off"].read(i) for i in range(groups)]
        identical = all(
            torch.equal(a, b)
            for state in states.values()
            for i in range(groups)
            for a, b in zip(state.read(i), off[i], strict=True)
        )
        for state in states.values():
            state.close()
    return {"sweep_s": rows, "identical": identical}


def sum_gbps(nbytes: int, sample: int, kernel: str) -> float:
    """Bytes summed per second on one core (median of 3), on an aligned host buffer."""
    buf = aligned_empty(nbytes, torch.uint8)
    buf.random_(0, 256)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        checksum.chunk_sums(buf, checksum.CHUNK_BYTES, sample, kernel)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / _GB


def run(args: argparse.Namespace) -> dict:
    numel, groups, state_bytes = state_groups(args)
    with open_aio(args) as aio:
        result = measure(args, aio, numel, groups)
    stages = result["sweep_s"]
    rows = {name: [r["sweep_s"] for r in runs] for name, runs in stages.items()}
    variants = []
    for name, (sample, kernel) in VARIANTS.items():
        ratios = [t / off for t, off in zip(rows[name], rows["off"], strict=True)]
        median = statistics.median(rows[name])
        v = {
            "name": name,
            "sample_bytes": sample,
            "kernel": (_BEST if kernel == "auto" else kernel) if sample else None,
            "sweep_s": rows[name],
            "median_sweep_s": median,
            "sweep_gbps": 2 * state_bytes / median / _GB,
            "paired_ratios": ratios,
            "cost": statistics.median(ratios) - 1,
            "median_stage_s": {k: statistics.median(r[k] for r in stages[name]) for k in STAGES},
        }
        if sample is not None:
            v["sum_gbps_one_core"] = sum_gbps(12 * numel, sample, kernel)
        variants.append(v)
    return {
        "bench": "swap_checksum",
        "path": os.path.abspath(args.path),
        "backend": aio.backend,
        "checksum": checksum.NAME,
        "chunk_bytes": checksum.CHUNK_BYTES,
        "buffer_count": args.buffer_count,
        "sub_group_numel": numel,
        "sub_groups": groups,
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        "sum_threads": args.sum_threads,
        "variants": variants,
        "identical": result["identical"],
        "load_average": os.getloadavg(),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp", help="directory on the disk to measure")
    p.add_argument("--state-gib", type=float, default=1.0, help="fp32 state (master, m, v)")
    p.add_argument("--sub-group-numel", type=int, default=8 << 20)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--sum-threads", type=int, default=extent.SUM_THREADS,
                   help="checksum threads per tier (default: the tiers' own)")  # fmt: skip
    p.add_argument("--json", default="swap_checksum_bench.json", help="output file")
    args = p.parse_args(argv)
    extent.SUM_THREADS = args.sum_threads
    checksum.chunk_sums = _timed_chunk_sums(checksum.chunk_sums)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    record = run(args)
    print(
        f"state {record['state_bytes'] / _GB:.2f} GB in {record['sub_groups']} sub-groups, "
        f"{record['backend']}, {record['checksum']}; states identical: {record['identical']}; "
        f"load average {record['load_average'][0]:.1f}"
    )
    for v in record["variants"]:
        rate = f", sums at {v['sum_gbps_one_core']:.1f} GB/s" if "sum_gbps_one_core" in v else ""
        print(
            f"  {v['name']:16} sweep {v['median_sweep_s']:.3f} s ({v['sweep_gbps']:.2f} GB/s "
            f"read+write), cost {v['cost'] * 100:+.1f}% (median of paired rounds){rate}"
        )
        st = v["median_stage_s"]
        print("    " + ", ".join(f"{k} {st[k] * 1e3:.1f} ms" for k in STAGES))
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.json}")
    return 0 if record["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
