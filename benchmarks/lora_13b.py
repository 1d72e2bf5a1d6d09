"""Claim: a 13B Llama (the `llama-13b` preset, bf16) with LoRA r=16 on every linear layer of
its blocks and the frozen base on NVMe builds, trains 2 steps and checkpoints with peak RSS
under 6 GiB on a 24 GiB machine; the checkpoint holds only the adapters and their optimizer
state; the disk space the run needs is printed before it starts and covers what it uses.

The run is the real command line, in a child process:

    infinity train --model llama-13b --data CORPUS --nvme PATH --dtype bf16 --lora-r 16 \\
        --steps 2 --seq-len S --activation-checkpointing --config CONFIG --save-dir PATH/run

with CONFIG bounding the host buffers (live parameters, staging pool, optimizer sub-groups;
see `engine_config`). While it runs, this script samples the child's RSS and the bytes
allocated under PATH every 0.5 s; at the end it takes the child's peak RSS (`ru_maxrss` of
wait4), the step times from metrics.jsonl, the `disk:` line the run printed, and the
checkpoint's size and tensor names. Checks: peak RSS < 6 GiB, the checkpoint holds only
adapter weights and their optimizer state, the printed need >= the peak disk use.

    flock /work/bench.lock python benchmarks/lora_13b.py --path /tmp/lora13b \\
        --json benchmarks/results/lora_13b_2026-11-23.json

With `--ram-budget 16G` the run is planned instead (`--placement auto` within that budget:
the first frozen layers that fit stay in RAM), and the checks become: peak RSS within the
budget, and the last step's NVMe bytes equal to the plan's (SAVE_DIR/placement.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_record import machine, write_json

_GIB = 1 << 30
_GB = 1e9
ROOT = Path(__file__).resolve().parents[1]


def engine_config(args: argparse.Namespace) -> dict:
    """Host buffers bounded by the config: a live budget, a small staging pool, optimizer
    sub-groups of `sub_group_size` elements (the rest of the config is the CLI's)."""
    return {
        "zero_optimization": {
            "stage": 3,
            "stage3_max_live_parameters": int(args.live),
            "stage3_prefetch_bucket_size": int(args.live // 4),
            "stage3_param_persistence_threshold": 100_000,
            "sub_group_size": int(args.sub_group_size),
            "offload_param": {"buffer_count": 3},
        }
    }


def _disk_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def _rss(pid: int) -> int:
    with (
        contextlib.suppress(FileNotFoundError, ProcessLookupError),
        open(f"/proc/{pid}/status") as f,
    ):
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    """Peak RSS of the child and peak bytes allocated under the NVMe path."""

    def __init__(self, pid: int, path: Path) -> None:
        super().__init__(daemon=True)
        self.pid, self.path = pid, path
        self.peak_rss = self.peak_disk = 0
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.wait(0.5):
            rss, disk = _rss(self.pid), _disk_bytes(self.path)
            self.peak_rss, self.peak_disk = max(self.peak_rss, rss), max(self.peak_disk, disk)
            self.samples.append((round(time.perf_counter() - t0, 1), rss, disk))


def corpus(path: Path) -> Path:
    data = path / "corpus.txt"
    data.write_text("Offload training streams weights from NVMe. " * 400)
    return data


def run(args: argparse.Namespace) -> dict:
    path = Path(args.path)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    cfg = path / "config.json"
    cfg.write_text(json.dumps(engine_config(args)))
    save = path / "run"
    cmd = [
        sys.executable, "-m", "infinity.cli.main", "train", "--model", args.model,
        "--data", str(corpus(path)), "--nvme", str(path), "--dtype", "bf16",
        "--lora-r", str(args.r), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
        "--activation-checkpointing", "--config", str(cfg), "--save-dir", str(save),
        "--no-progress", "--byte-tokens",
    ]  # fmt: skip
    cmd += ["--ram-budget", args.ram_budget] if args.ram_budget else ["--placement", "nvme"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid, path)
    sampler.start()
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    code = os.waitstatus_to_exitcode(status)
    print(out, flush=True)
    if code != 0:
        raise SystemExit(f"the run failed with exit code {code}")
    return _record(args, cmd, out, usage.ru_maxrss * 1024, wall, sampler, save)


def _record(args, cmd, out: str, peak_rss: int, wall: float, sampler: Sampler, save: Path):
    from infinity.checkpoint import load_checkpoint

    ckpt = load_checkpoint(save)
    names = ckpt.tensor_names()
    params = [n for n in names if n.startswith("param/")]
    metrics = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    disk_line = next(x for x in out.splitlines() if x.startswith("disk: "))
    need = float(disk_line.split()[1]) * (_GB if disk_line.split()[2] == "GB" else 1e6)
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.path.iterdir())
    plan_file = save / "placement.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    limit = plan["budget"]["ram_bytes"] if plan else args.rss_limit_gib * _GIB
    checks = {
        f"peak RSS < {limit / _GIB:.1f} GiB": peak_rss < limit,
        "checkpoint holds only adapters and their optimizer state": bool(params)
        and all(".lora_" in n for n in names if n.startswith(("param/", "optim/"))),
        "printed disk need >= peak disk use (swap + checkpoint)": need >= sampler.peak_disk,
    }
    if plan:  # the last step's NVMe bytes are the plan's
        last = metrics[-1]
        checks["NVMe bytes of the last step equal the plan's"] = (
            last["nvme_read_bytes"],
            last["nvme_write_bytes"],
        ) == (plan["nvme_read_bytes_per_step"], plan["nvme_write_bytes_per_step"])
    return {
        "claim": f"{args.model} LoRA r={args.r}, frozen base on NVMe, peak RSS < 6 GiB"
        if plan is None
        else f"{args.model} LoRA r={args.r} within --ram-budget {args.ram_budget}: the plan's "
        "NVMe bytes, peak RSS within the budget",
        "plan": plan,
        "command": " ".join(cmd),
        "config": engine_config(args),
        "machine": machine(args.path),
        "peak_rss_bytes": peak_rss,
        "peak_disk_bytes": sampler.peak_disk,
        "disk_line": disk_line,
        "disk_need_bytes": need,
        "wall_s": wall,
        "step_s": [m["step_s"] for m in metrics],
        "nvme_bytes": [(m["nvme_read_bytes"], m["nvme_write_bytes"]) for m in metrics],
        "losses": [m["loss"] for m in metrics],
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_params": len(params),
        "checkpoint_tensors": len(names),
        "samples": sampler.samples,
        "checks": checks,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp/lora13b", help="NVMe directory (emptied first)")
    p.add_argument("--model", default="llama-13b", help="preset (a small one for a smoke run)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--live", type=float, default=3e8, help="stage3_max_live_parameters")
    p.add_argument("--sub-group-size", type=float, default=2e7)
    p.add_argument("--rss-limit-gib", type=float, default=6.0)
    p.add_argument("--ram-budget", help="plan within this --ram-budget (e.g. 16G) instead of "
                   "putting everything on NVMe; the RSS check is then the budget")  # fmt: skip
    p.add_argument("--json", default="lora_13b.json", help="output file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rec = run(args)
    write_json(rec, args.json, announce=False)
    print(
        f"peak RSS {rec['peak_rss_bytes'] / _GIB:.2f} GiB, peak disk "
        f"{rec['peak_disk_bytes'] / _GB:.1f} GB (printed need {rec['disk_need_bytes'] / _GB:.1f} "
        f"GB), steps {', '.join(f'{s:.0f} s' for s in rec['step_s'])}, wall {rec['wall_s']:.0f} "
        f"s, checkpoint {rec['checkpoint_bytes'] / _GB:.2f} GB"
    )
    for name, ok in rec["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    shutil.rmtree(args.path, ignore_errors=True)
    return 0 if all(rec["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
