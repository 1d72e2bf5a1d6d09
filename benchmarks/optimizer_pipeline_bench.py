"""Claim: offload_optimizer.pipeline_read and pipeline_write (both on, the default) make the
NVMe optimizer sweep faster than with either off, and every setting gives bitwise the same
state.

One `NvmeStateTier` per setting (read on/off x write on/off) over the same sub-groups; each
round sweeps every store once with a real CPU-Adam step per sub-group, in an order that
rotates so the shared disk's swings hit every setting alike. Reading into the next sweep is
off for all (`prefetch_next_sweep=False`): it would overlap the other settings' sweeps. After
the rounds the stores' states are compared bitwise.

    flock /work/bench.lock python -m benchmarks.optimizer_pipeline_bench --path /tmp \\
        --state-gib 1 --rounds 3 --json benchmarks/results/optimizer_pipeline.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch
from bench_record import machine, write_json

from benchmarks.optimizer_swap_bench import open_aio, state_groups
from infinity.io.aio import AioHandle
from infinity.optim import adam_step_flat
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.store import SwapStore

_GB = 1e9
SETTINGS = [(True, True), (True, False), (False, True), (False, False)]


def _name(read: bool, write: bool) -> str:
    return f"read_{'on' if read else 'off'}_write_{'on' if write else 'off'}"


def sweep_pass(state: NvmeStateTier, grad: torch.Tensor, step: int) -> float:
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
    rows: dict[str, list[float]] = {_name(*s): [] for s in SETTINGS}
    with SwapStore(args.path, run_id=f"bench{os.getpid()}") as store:
        states = {}
        for read, write in SETTINGS:
            states[_name(read, write)] = NvmeStateTier(
                [numel] * groups,
                store=store,
                aio=aio,
                buffer_count=args.buffer_count,
                prefetch_next_sweep=False,
                pipeline_read=read,
                pipeline_write=write,
                kind=f"optim.{_name(read, write)}",
            )
        for state in states.values():
            for i in range(groups):
                state.initialize(i, master)
            sweep_pass(state, grad, step=1)  # warm-up; also settles the initial writes
        names = list(states)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rows[name].append(sweep_pass(states[name], grad, step=r + 2))
        first = states[names[0]]
        identical = all(
            all(torch.equal(a, b) for a, b in zip(state.read(i), first.read(i), strict=True))
            for state in states.values()
            for i in range(groups)
        )
        adam_s = _adam_seconds(grad, master)
        for state in states.values():
            state.close()
    return {"sweep_s": rows, "identical": identical, "adam_s_per_sub_group": adam_s}


def _adam_seconds(grad: torch.Tensor, master: torch.Tensor) -> float:
    """The median time of the Adam step alone on one sub-group (the compute to overlap)."""
    m, v, p = torch.zeros_like(master), torch.zeros_like(master), master.clone()
    times = []
    for step in range(1, 4):
        start = time.perf_counter()
        adam_step_flat(p, grad, m, v, step=step, lr=1e-3, weight_decay=0.01)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict:
    numel, groups, state_bytes = state_groups(args)
    with open_aio(args) as aio:
        result = measure(args, aio, numel, groups)
    med = {k: statistics.median(v) for k, v in result["sweep_s"].items()}
    both = med[_name(True, True)]
    return {
        "bench": "optimizer_pipeline",
        "path": os.path.abspath(args.path),
        "backend": aio.backend,
        "buffer_count": args.buffer_count,
        "sub_group_numel": numel,
        "sub_groups": groups,
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        "adam_s_per_sub_group": result["adam_s_per_sub_group"],
        "identical": result["identical"],
        "variants": [
            {
                "pipeline_read": read,
                "pipeline_write": write,
                "sweep_s": result["sweep_s"][_name(read, write)],
                "median_sweep_s": med[_name(read, write)],
                "sweep_gbps": 2 * state_bytes / med[_name(read, write)] / _GB,
                "time_vs_both_on": med[_name(read, write)] / both,
            }
            for read, write in SETTINGS
        ],
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp", help="directory on the disk to measure")
    p.add_argument("--state-gib", type=float, default=1.0, help="fp32 state (master, m, v)")
    p.add_argument("--sub-group-numel", type=int, default=16 << 20)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="optimizer_pipeline_bench.json", help="output file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    record = run(args)
    print(
        f"state {record['state_bytes'] / _GB:.2f} GB in {record['sub_groups']} sub-groups, "
        f"{record['backend']}, Adam {record['adam_s_per_sub_group'] * 1e3:.1f} ms per "
        f"sub-group; states identical: {record['identical']}"
    )
    for v in record["variants"]:
        print(
            f"  pipeline_read={v['pipeline_read']!s:5} pipeline_write={v['pipeline_write']!s:5}"
            f" sweep {v['median_sweep_s']:.3f} s ({v['sweep_gbps']:.2f} GB/s read+write), "
            f"{v['time_vs_both_on']:.2f}x the time with both on"
        )
    write_json(record, args.json)
    return 0 if record["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
