"""Claim: on the machines people train on, the placement planner's plan is faster than
everything on NVMe, and says where each class of tensor lives and what bounds the step.

For each row, `infinity estimate` twice: with the planner (`--ram-budget`, and on a GPU the
card's memory as the device budget) and with `--placement nvme` (the plan before budgets
existed). The machines: a 24 GiB GPU (4090) with 64 GiB of RAM, an 80 GiB GPU (H100) with
256 GiB of RAM (budget 250G) or 128 GiB (120G), and this CPU machine (`--device cpu`, its
probes; budget 18G, about 80% of a 24 GiB machine's available RAM). GPU rows are estimates
with compute at 50% of the card's published peak and an assumed PCIe 4.0 SSD (DIR is not
probed when absent); the CPU rows probe this machine and its disk under `--path`.

    python benchmarks/plan_table.py --path /tmp/plans --json benchmarks/results/plans.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_record import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
GPU_RUN = ["--dtype", "bf16", "--seq-len", "2048", "--micro-batch", "4",
           "--activation-checkpointing"]  # fmt: skip
CPU_RUN = ["--dtype", "bf16", "--seq-len", "512", "--micro-batch", "1",
           "--activation-checkpointing"]  # fmt: skip
ROWS = [  # (run, model, machine, flags)
    ("LoRA r=16", "llama-7b", "4090, 64 GiB RAM", ["--device", "4090", "--ram-budget", "60G",
                                                   "--lora-r", "16", *GPU_RUN]),
    ("full, accumulation 8", "llama-7b", "4090, 64 GiB RAM",
     ["--device", "4090", "--ram-budget", "60G", "--grad-accum", "8", *GPU_RUN]),
    ("LoRA r=16", "llama-13b", "4090, 64 GiB RAM", ["--device", "4090", "--ram-budget", "60G",
                                                    "--lora-r", "16", *GPU_RUN]),
    ("full, accumulation 8", "llama-13b", "4090, 64 GiB RAM",
     ["--device", "4090", "--ram-budget", "60G", "--grad-accum", "8", *GPU_RUN]),
    ("LoRA r=16", "llama-13b", "H100, 256 GiB RAM", ["--device", "h100", "--ram-budget", "250G",
                                                     "--lora-r", "16", *GPU_RUN]),
    ("full, accumulation 8", "llama-13b", "H100, 256 GiB RAM",
     ["--device", "h100", "--ram-budget", "250G", "--grad-accum", "8", *GPU_RUN]),
    ("full, accumulation 32", "llama-13b", "H100, 128 GiB RAM",
     ["--device", "h100", "--ram-budget", "120G", "--grad-accum", "32", *GPU_RUN]),
    ("full", "llama-2b", "this CPU machine", ["--device", "cpu", "--ram-budget", "18G",
                                              "--dtype", "bf16", "--seq-len", "128",
                                              "--micro-batch", "1", "--activation-checkpointing"]),
    ("LoRA r=16", "llama-7b", "this CPU machine", ["--device", "cpu", "--ram-budget", "18G",
                                                   "--lora-r", "16", *CPU_RUN]),
    ("LoRA r=16", "llama-13b", "this CPU machine", ["--device", "cpu", "--ram-budget", "18G",
                                                    "--lora-r", "16", *CPU_RUN]),
]  # fmt: skip


def estimate(model: str, flags: list[str], nvme: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "infinity.cli.main", "estimate", "--model", model,
           "--nvme", str(nvme), *flags, *extra, "--json", "-"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1:], "command": cmd}
    return {**json.loads(out.stdout), "command": cmd}


def summary(plan: dict | None) -> str:
    """Where the plan keeps each class, in a few words."""
    if not plan:
        return ""
    gib = 2**30
    parts = []
    for name, key in (("weights", "weights"), ("base", "frozen"), ("state", "state"),
                      ("gradients", "grads")):  # fmt: skip
        t = plan[key]
        device = t.get("device_bytes", 0)
        held = t["ram_bytes"] + t["nvme_bytes"] + device
        if device:
            parts.append(f"{name} {device / gib:.1f}/{held / gib:.1f} GiB on the GPU")
        elif held:
            parts.append(f"{name} {t['ram_bytes'] / gib:.1f}/{held / gib:.1f} GiB in RAM")
    if plan["budget"].get("device_bytes"):
        parts.append(f"live set {plan['live_parameters'] / 1e9:.1f}B elements")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=tempfile.gettempdir(), help="an NVMe directory to probe")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    absent = Path(args.path) / "absent-ssd"  # GPU rows: an assumed SSD, as on their machine
    rows = []
    print("| model, run | machine | where the plan keeps it | step (all on NVMe) | bound |")
    print("|---|---|---|---|---|")
    for run, model, where, flags in ROWS:
        nvme = Path(args.path) if "cpu" in flags else absent
        planned = estimate(model, flags, nvme)
        nvme_only = estimate(model, flags, nvme, "--placement", "nvme")
        rows.append({"run": run, "model": model, "machine": where, "planned": planned,
                     "all_nvme": nvme_only})  # fmt: skip
        if "error" in planned or "error" in nvme_only:
            print(f"| {model} {run} | {where} | {planned.get('error') or nvme_only['error']} |||")
            continue
        step = f"{planned['step_seconds']:.2f} s ({nvme_only['step_seconds']:.2f} s)"
        print(f"| {model} {run} | {where} | {summary(planned.get('placement'))} | {step} | "
              f"{planned['bound']} |", flush=True)  # fmt: skip
        if args.json:
            write_json({"machine": machine(args.path), "argv": sys.argv, "rows": rows},
                       args.json, announce=False)  # fmt: skip
    return 0 if all("error" not in r["planned"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
