"""Claim: with `--nvme`, the placement planner keeps in RAM what fits the budget, so a step
moves fewer bytes over the SSD and runs faster than with everything on NVMe, its NVMe bytes
equal to the plan's and its peak RSS within the budget.

One run of `infinity train --nvme` per placement, the same model, data and seed, in this
order: `--placement nvme` (every class on NVMe, the behaviour before the planner), the
default plan (no `--ram-budget`: 80% of the RAM available), then `--ram-budget B` for each
of `--budgets`. No config: the CLI's defaults, so the planner also sizes the buffers. Each
run takes `--steps` steps; the figures are medians of the steps after the first
(metrics.jsonl), beside the plan the run wrote (SAVE_DIR/placement.json). With `--config
FILE` every run uses that config instead (it must not name a device).

    python benchmarks/placement.py --path /tmp/placement --model llama-2b \\
        --budgets 4G,8G,16G --json benchmarks/results/placement.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_record import machine, write_json
from gpu_throughput import _records

ROOT = Path(__file__).resolve().parents[1]
MEDIANS = ("step_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds",
           "nvme_read_bytes", "nvme_write_bytes", "tokens_per_s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=tempfile.gettempdir(), help="swap and work directory")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--budgets", default="4G,8G,16G", help="comma-separated --ram-budget values")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lora-r", type=int, default=0)
    p.add_argument("--config", help="a config for every run (default: none)")
    p.add_argument("--no-default", action="store_true", help="skip the default-budget run")
    p.add_argument("--estimate", action="store_true",
                   help="also run `infinity estimate` with each run's flags (its probes run "
                   "between the runs) and record its step and peak RSS")  # fmt: skip
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="placement-", dir=args.path))
    runs = []
    try:
        corpus = work / "corpus.txt"
        words = ["offload", "gather", "release", "prefetch", "adam", "nvme", "pinned", "plan"]
        corpus.write_text(" ".join(words[(i * 7919) % len(words)] for i in range(200_000)))
        cfg = Path(args.config).resolve() if args.config else None
        placements = [("all on NVMe", ["--placement", "nvme"])]
        if not args.no_default:
            placements.append(("default budget", []))
        budgets = [b for b in args.budgets.split(",") if b]
        placements += [(f"--ram-budget {b}", ["--ram-budget", b]) for b in budgets]
        for name, flags in placements:
            runs.append(_run(name, flags, args, work, corpus, cfg))
            if args.estimate:
                runs[-1]["estimate"] = _estimate(flags, args, work, cfg)
            _print(runs[-1])
            if args.json:
                write_json({"machine": machine(args.path), "argv": sys.argv, "runs": runs},
                           args.json, announce=False)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + _table(runs))
    return 0 if all(r["measured"] for r in runs) else 1


def _run(name: str, flags: list[str], args, work: Path, corpus: Path, cfg: Path | None) -> dict:
    save, swap = work / "run", work / "swap"
    shutil.rmtree(save, ignore_errors=True)
    shutil.rmtree(swap, ignore_errors=True)
    swap.mkdir()
    cmd = [sys.executable, "-m", "infinity.cli.main", "train", *_shared(flags, args, swap, cfg),
           "--data", str(corpus), "--byte-tokens", "--steps", str(args.steps), "--seed", "0",
           "--save-dir", str(save), "--save-every", str(10**6), "--no-progress"]  # fmt: skip
    t0 = time.monotonic()
    metrics, log = save / "metrics.jsonl", work / "train.log"
    out = log.open("w")
    with (
        out,
        subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        ) as proc,
    ):
        # Stopped once the last step is recorded: the final checkpoint measures the disk.
        while proc.poll() is None and len(_records(metrics)) < args.steps:
            time.sleep(0.5)
        stopped = proc.poll() is None
        if stopped:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    records = _records(metrics)
    plan_file = save / "placement.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    warm = records[1:]
    measured = {k: statistics.median(r[k] for r in warm) for k in MEDIANS} if warm else {}
    if warm:
        measured["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in records)
    rc = 0 if stopped and len(records) >= args.steps else proc.returncode
    return {"name": name, "flags": flags, "rc": rc, "wall_s": time.monotonic() - t0,
            "plan": plan, "measured": measured, "records": records,
            "log_tail": log.read_text().strip().splitlines()[-20:]}  # fmt: skip


def _shared(flags: list[str], args, swap: Path, cfg: Path | None) -> list[str]:
    """The flags `infinity train` and `infinity estimate` share for one placement."""
    shared = ["--model", args.model, "--dtype", "bf16", "--seq-len", str(args.seq_len),
              "--micro-batch", "1", "--activation-checkpointing", "--nvme", str(swap),
              *flags]  # fmt: skip
    if cfg is not None:
        shared += ["--config", str(cfg)]
    return shared + (["--lora-r", str(args.lora_r)] if args.lora_r else [])


def _estimate(flags: list[str], args, work: Path, cfg: Path | None) -> dict:
    """`infinity estimate` for the run just made: the same flags, its swap directory probed."""
    swap = work / "swap"
    swap.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "infinity.cli.main", "estimate",
           *_shared(flags, args, swap, cfg), "--json", "-"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1:]}
    est = json.loads(out.stdout)
    keep = ("step_seconds", "peak_rss_bytes", "nvme_read_bytes_per_step",
            "nvme_write_bytes_per_step", "bound", "times")  # fmt: skip
    return {k: est[k] for k in keep}


def _print(r: dict) -> None:
    print(f"\n== {r['name']}: rc {r['rc']}, {len(r['records'])} steps, {r['wall_s']:.0f} s")
    if r["rc"]:
        print("  " + "\n  ".join(r["log_tail"]))
    m, plan = r["measured"], r["plan"]
    if m:
        print(f"  step {m['step_seconds']:.2f} s, NVMe {m['nvme_read_bytes'] / 1e9:.2f} GB read "
              f"{m['nvme_write_bytes'] / 1e9:.2f} GB written, peak RSS "
              f"{m['peak_rss_bytes'] / 2**30:.2f} GiB")  # fmt: skip
    est = r.get("estimate") or {}
    if "step_seconds" in est and m:
        print(f"  estimate: step {est['step_seconds']:.2f} s "
              f"({est['step_seconds'] / m['step_seconds']:.2f} of measured), peak RSS "
              f"{est['peak_rss_bytes'] / 2**30:.2f} GiB "
              f"({est['peak_rss_bytes'] / m['peak_rss_bytes']:.2f} of measured)")  # fmt: skip
    if plan:
        budget = plan["budget"]["ram_bytes"] / 2**30
        print(f"  plan: NVMe {plan['nvme_read_bytes_per_step'] / 1e9:.2f} GB read "
              f"{plan['nvme_write_bytes_per_step'] / 1e9:.2f} GB written, peak RSS "
              f"{plan['peak_rss_bytes'] / 2**30:.2f} GiB of {budget:.1f}")  # fmt: skip


def _table(runs: list[dict]) -> str:
    head = "| placement | step | NVMe read / written per step (plan) | peak RSS (plan; budget) |"
    lines = [head, "|---|---|---|---|"]
    base = next((r["measured"].get("step_seconds") for r in runs if r["measured"]), None)
    for r in runs:
        m, plan = r["measured"], r["plan"]
        if not m:
            lines.append(f"| {r['name']} | failed (rc {r['rc']}) | | |")
            continue
        speed = f" ({base / m['step_seconds']:.2f}x)" if base else ""
        moved = f"{m['nvme_read_bytes'] / 1e9:.2f} / {m['nvme_write_bytes'] / 1e9:.2f} GB"
        rss = f"{m['peak_rss_bytes'] / 2**30:.2f} GiB"
        if plan:
            moved += (f" ({plan['nvme_read_bytes_per_step'] / 1e9:.2f} / "
                      f"{plan['nvme_write_bytes_per_step'] / 1e9:.2f})")  # fmt: skip
            rss += (f" ({plan['peak_rss_bytes'] / 2**30:.2f}; "
                    f"{plan['budget']['ram_bytes'] / 2**30:.1f} GiB)")  # fmt: skip
        lines.append(f"| {r['name']} | {m['step_seconds']:.2f} s{speed} | {moved} | {rss} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
