"""Claim: a change to the 8-bit CPU-Adam kernel is faster (or not) than the build before it,
with the same results: two builds of `infinity._cpu_adam`, loaded side by side, step their
own copies of the same state in alternation, and the states must end bit-identical.

On a shared machine one run of this script is the comparison to quote (with `uptime`): load
changes between runs, not between the alternating steps of one. Build the old kernel, copy
its .so aside, rebuild, then:

    python benchmarks/adam8_kernel_ab.py --numel 4M --threads 1 before=/tmp/old.so \\
        after=infinity/_cpu_adam.cpython-311-x86_64-linux-gnu.so

A build from before the coarse index takes quant8's first six tables; it is given those.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import torch

from infinity.cli.bench_adam import parse_count
from infinity.optim import AdamHyper
from infinity.optim.adam8 import native_tables
from infinity.optim.quant8 import ZERO_CODE_SIGNED, block_count


def load_build(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"{name}._cpu_adam", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="NAME=PATH of a _cpu_adam .so")
    parser.add_argument("--numel", type=parse_count, default=4_000_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--half", action="store_true", help="also write a bf16 copy")
    parser.add_argument("--grad", choices=["bf16", "fp32"], default="bf16", help="grad dtype")
    args = parser.parse_args(argv)
    builds = {b.split("=")[0]: load_build(*b.split("=", 1)) for b in args.builds}
    n, torch_gen = args.numel, torch.manual_seed(0)
    param = torch.randn(n, generator=torch_gen)
    grad_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.grad]
    grad = (torch.randn(n, generator=torch_gen) * 1e-2).to(grad_dtype)
    tables = [t.data_ptr() for t in native_tables()]
    states, times = {}, {name: [] for name in builds}
    for name, build in builds.items():
        build.set_num_threads(args.threads)
        states[name] = [param.clone(), torch.full((n,), ZERO_CODE_SIGNED, dtype=torch.uint8),
                        torch.zeros(n, dtype=torch.uint8), torch.zeros(block_count(n)),
                        torch.zeros(block_count(n))]  # fmt: skip
        if args.half:  # each build's own copy: compared with the rest of the state
            states[name].append(torch.zeros(n, dtype=torch.bfloat16))
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    for step in range(1, args.rounds + 3):
        for name, build in builds.items():
            p, mc, vc, ma, va, *half = states[name]
            call = [p.data_ptr(), grad.data_ptr(), mc.data_ptr(), vc.data_ptr(), ma.data_ptr(),
                    va.data_ptr(), n, args.grad, half[0].data_ptr() if args.half else 0,
                    "bf16" if args.half else "", step, hyper, 1.0]  # fmt: skip
            start = time.perf_counter()
            try:
                build.adam8_step(*call, tables, "auto", 1 << 16)
            except ValueError as exc:  # a build before the coarse index: six tables
                if "six" not in str(exc):
                    raise
                six = [t for i, t in enumerate(tables) if i % 4 != 3]
                start = time.perf_counter()
                build.adam8_step(*call, six, "auto", 1 << 16)
            if step > 2:  # two warm-up steps
                times[name].append((time.perf_counter() - start) * 1e3)
    print(os.popen("uptime").read().strip())
    print(f"numel {n:,}  threads {args.threads}  grad {args.grad}  half {args.half}  "
          f"rounds {args.rounds}")  # fmt: skip
    first = next(iter(states.values()))
    for name, ms in times.items():
        same = all(torch.equal(a, b) for a, b in zip(states[name], first, strict=True))
        print(f"{name:10s} median {statistics.median(ms):8.3f} ms  min {min(ms):8.3f} ms  "
              f"{statistics.median(ms) * 1e6 / n * args.threads:.3f} ns/param/thread  "
              f"state equal to {next(iter(states))}: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
