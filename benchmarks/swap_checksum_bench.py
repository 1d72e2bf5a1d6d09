"""Claim: checking swap extents (a CRC-32C per 16 KiB written and verified on every read,
see [Note: extent checksums] in infinity/io/checksum.py) costs under 3% of the NVMe
optimizer sweep.

Two `NvmeStateStore`s over the same sub-groups in one swap directory, one with checksums and
one without; each round sweeps both with a real CPU-Adam step per sub-group, in an order that
alternates so the shared disk's swings hit both alike. Reading into the next sweep is off
(`prefetch_next_sweep=False`): it would overlap the other store's sweep. The cost is the
median over rounds of (sweep with checksums / sweep without, same round) - 1; the medians
of each are reported too. The states are compared bitwise at the end, and the CRC's own
throughput on one core is measured on a sub-group's buffer.

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
import time

import torch

from benchmarks.optimizer_swap_bench import machine, open_aio, state_groups
from infinity.io import checksum
from infinity.io.aio import AioHandle, aligned_empty
from infinity.optim import adam_step_flat
from infinity.swap.nvme_state import NvmeStateStore
from infinity.swap.store import SwapStore

_GB = 1e9
VARIANTS = {"off": False, "on": True}


def sweep_pass(state: NvmeStateStore, grad: torch.Tensor, step: int) -> float:
    """Seconds for one sweep with an Adam step on each sub-group."""
    start = time.perf_counter()
    for _, s in state.sweep():
        adam_step_flat(
            s.master, grad, s.exp_avg, s.exp_avg_sq, step=step, lr=1e-3, weight_decay=0.01
        )
    return time.perf_counter() - start


def measure(args: argparse.Namespace, aio: AioHandle, numel: int, groups: int) -> dict:
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=g)
    master = torch.randn(numel, generator=g)
    rows: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with SwapStore(args.path, run_id=f"bench{os.getpid()}") as store:
        states = {
            name: NvmeStateStore(
                [numel] * groups,
                store=store,
                aio=aio,
                buffer_count=args.buffer_count,
                prefetch_next_sweep=False,
                kind=f"optim.checksums_{name}",
                checksums=on,
            )
            for name, on in VARIANTS.items()
        }
        for state in states.values():
            for i in range(groups):
                state.initialize(i, master)
            sweep_pass(state, grad, step=1)  # warm-up; also settles the initial writes
        names = list(states)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                rows[name].append(sweep_pass(states[name], grad, step=r + 2))
        identical = all(
            all(
                torch.equal(a, b)
                for a, b in zip(states["on"].read(i), states["off"].read(i), strict=True)
            )  # fmt: skip
            for i in range(groups)
        )
        for state in states.values():
            state.close()
    return {"sweep_s": rows, "identical": identical}


def crc_gbps(nbytes: int) -> float:
    """The checksum's throughput on one core (median of 3), on an aligned host buffer."""
    buf = aligned_empty(nbytes, torch.uint8)
    buf.random_(0, 256)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        checksum.chunk_sums(buf)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / _GB


def run(args: argparse.Namespace) -> dict:
    numel, groups, state_bytes = state_groups(args)
    with open_aio(args) as aio:
        result = measure(args, aio, numel, groups)
    rows = result["sweep_s"]
    ratios = [on / off for on, off in zip(rows["on"], rows["off"], strict=True)]
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "bench": "swap_checksum",
        "path": os.path.abspath(args.path),
        "backend": aio.backend,
        "checksum": checksum.NAME,
        "chunk_bytes": checksum.CHUNK_BYTES,
        "checksum_gbps_one_core": crc_gbps(12 * numel),
        "buffer_count": args.buffer_count,
        "sub_group_numel": numel,
        "sub_groups": groups,
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        "sweep_s_checksums_off": rows["off"],
        "sweep_s_checksums_on": rows["on"],
        "median_sweep_s_off": med["off"],
        "median_sweep_s_on": med["on"],
        "sweep_gbps_off": 2 * state_bytes / med["off"] / _GB,
        "sweep_gbps_on": 2 * state_bytes / med["on"] / _GB,
        "paired_ratios": ratios,
        "cost": statistics.median(ratios) - 1,
        "identical": result["identical"],
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
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="swap_checksum_bench.json", help="output file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    record = run(args)
    print(
        f"state {record['state_bytes'] / _GB:.2f} GB in {record['sub_groups']} sub-groups, "
        f"{record['backend']}; {record['checksum']} at {record['checksum_gbps_one_core']:.1f} "
        f"GB/s on one core; states identical: {record['identical']}"
    )
    print(
        f"  sweep without checksums {record['median_sweep_s_off']:.3f} s "
        f"({record['sweep_gbps_off']:.2f} GB/s read+write), with "
        f"{record['median_sweep_s_on']:.3f} s ({record['sweep_gbps_on']:.2f} GB/s); "
        f"cost (median of paired rounds) {record['cost'] * 100:+.1f}%"
    )
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.json}")
    return 0 if record["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
