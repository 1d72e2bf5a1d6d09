"""`infinity estimate` with its CPU probes fixed: a before/after of the model, not of the load.

The estimate probes CPU-Adam and the gradient-norm pass on this machine at every call, and on
the shared dev VM those probes swing 2-3x with the load (the 13B headline's CPU-Adam read 5.96
s at load 0.6 and 14.0 s at load 6 on 2026-11-28). This runs the `infinity estimate` command
line given after `--` with those two rates set to the values given here, so two versions of
the code (or two configs) can be compared on the same rates. The disk's rates come from the
command line as usual (`--bench-aio FILE` for a recorded `bench aio`, else the probe).

    PYTHONPATH=$PWD python benchmarks/estimate_fixed_probes.py -- --model llama-13b \\
        --device h100 --ram-budget 120G --dtype bf16 --seq-len 2048 --micro-batch 4 \\
        --grad-accum 32 --activation-checkpointing --nvme DIR \\
        --bench-aio benchmarks/results/aio_modes_2026-11-22.json --json OUT.json
"""

from __future__ import annotations

import argparse
import sys

import infinity.estimate.hardware as hardware
from infinity.cli.main import main as infinity_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Defaults: the quiet probes of 2026-11-28 (load 0.6): 13.02B elements in 5.96 s; 52 GB
    # in 1.13 s. 8-bit at 0.97x of it since the VBMI kernel's coarse index (20M with the bf16
    # copy, two threads: 10.8 against 10.5 ms in one `bench adam` run, BENCHMARKS.md run 6;
    # 0.44x with the tree before, --adam8-numel-per-s 0.96e9).
    p.add_argument("--adam-numel-per-s", type=float, default=2.18e9)
    p.add_argument("--adam8-numel-per-s", type=float, default=2.12e9)
    p.add_argument("--norm-bytes-per-s", type=float, default=46e9)
    args = p.parse_args(argv[:split])

    def adam_rate(*_, eight_bit: bool = False, **__) -> float:
        return args.adam8_numel_per_s if eight_bit else args.adam_numel_per_s

    hardware.probe_adam_numel_per_s = adam_rate
    hardware.probe_norm_bytes_per_s = lambda *_, **__: args.norm_bytes_per_s
    return infinity_main(["estimate", *argv[split + 1 :]])


if __name__ == "__main__":
    sys.exit(main())
