"""Claim: the time before a run's first step is small beside the steps it prepares.

Runs the real `infinity train` on a preset (random weights; `--layers N` keeps the first N
layers of its shape, for machines whose RAM holds no whole preset) for one step and stops it
once that step's record is written (its final checkpoint measures the disk, not the start).
Records the seconds before step 1 from outside (process start to the step's beginning) and
the run's own breakdown (its "ready to train" log line: data, placement, disk_check, model,
engine, and the engine's check, tiers, partition, optimizer, runtime),
the parameters built per second, the first step's seconds and the peak RSS. `--repeats`
runs it again; each run is one record, and the medians sit beside them.

    PYTHONPATH=$PWD INFINITY_ACCELERATOR=cpu python benchmarks/startup.py --preset llama-1b \\
        --layers 2 --dtype bf16 --json benchmarks/results/startup_cpu.json
    ... --lora-r 16 --nvme /mnt/ssd/swap     # the frozen base written to NVMe

`--profile FILE` keeps a cProfile of the (last) run for a closer look (python -m pstats).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_record import machine, write_json

# The run registers the shrunk preset in its own process, then is the CLI.
_RUNNER = """
import sys
from infinity.models.config import PRESETS
name, layers = sys.argv[1], int(sys.argv[2])
if layers:
    PRESETS[name + f"-{layers}l"] = {**PRESETS[name], "num_hidden_layers": layers}
from infinity.cli.main import main
sys.exit(main(sys.argv[3:]))
"""
_READY = re.compile(r"ready to train in ([\d.]+) s \((.*)\); engine: (.*)")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    work = Path(tempfile.mkdtemp(prefix="startup-", dir=args.workdir))
    try:
        corpus = work / "corpus.txt"
        corpus.write_text(" ".join(f"word{i % 97}" for i in range(20000)))
        last = args.repeats - 1
        runs = [_run(args, work / f"run{k}", corpus, k == last) for k in range(args.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in runs if r["before_step1_s"] is not None]
    record = {
        "claim": "seconds before the first training step, by phase",
        "preset": args.preset,
        "layers": args.layers,
        "flags": _flags(args, Path("SAVE"), Path("CORPUS")),
        "machine": machine(args.nvme),
        "runs": runs,
        "median": {
            k: statistics.median(r[k] for r in ok)
            for k in ("before_step1_s", "ready_s", "step1_s")
            if ok and all(r.get(k) is not None for r in ok)
        },
    }
    for r in runs:
        print(_line(r), flush=True)
    write_json(record, args.json)
    return 0 if len(ok) == len(runs) else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--lora-r", type=int, default=0)
    p.add_argument("--nvme", default=None, help="--nvme DIR for the run (default: RAM)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--workdir", default=None, help="where the save dir goes (default: $TMPDIR)")
    p.add_argument("--profile", default=None, help="cProfile output of the last run")
    p.add_argument("--json", default="startup.json")
    return p.parse_args(argv)


def _flags(args, save: Path, corpus: Path) -> list[str]:
    model = args.preset + (f"-{args.layers}l" if args.layers else "")
    flags = ["train", "--model", model, "--data", str(corpus), "--byte-tokens",
             "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
             "--dtype", args.dtype, "--steps", "2", "--save-dir", str(save),
             "--no-progress"]  # fmt: skip
    if args.lora_r:
        flags += ["--lora-r", str(args.lora_r)]
    if args.nvme:
        flags += ["--nvme", args.nvme]
    if args.activation_checkpointing:
        flags.append("--activation-checkpointing")
    return flags


def _run(args, save: Path, corpus: Path, last: bool) -> dict:
    """One run, killed once step 1's record is written (or at the limit)."""
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile and last else []
    cmd = [sys.executable, *prof, "-c", _RUNNER] if not prof else [sys.executable, *prof]
    if prof:  # cProfile runs a file, not -c
        runner = save.parent / "runner.py"
        runner.write_text(_RUNNER)
        cmd.append(str(runner))
    cmd += [args.preset, str(args.layers), *_flags(args, save, corpus)]
    metrics, log = save / "metrics.jsonl", save.with_suffix(".log")
    t0 = time.monotonic()
    before = None
    with (
        log.open("w") as out,
        subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True) as proc,
    ):
        while proc.poll() is None and time.monotonic() - t0 < args.timeout:
            done = _records(metrics)
            if done:
                before = time.monotonic() - t0 - done[0]["step_s"]
                break
            time.sleep(0.2)
        if proc.poll() is None:
            # cProfile writes its file on exit: a stop at once (two signals) lets it.
            sig = signal.SIGTERM if prof else signal.SIGKILL
            for _ in range(2 if prof else 1):
                os.killpg(proc.pid, sig)
                time.sleep(0.5)
        proc.wait()
    if args.nvme:  # a killed run leaves its swap store behind: gigabytes per run
        shutil.rmtree(Path(args.nvme) / f"infinity-pid{proc.pid}", ignore_errors=True)
    text = log.read_text(errors="replace")
    ready = _READY.search(text)
    done = _records(metrics)
    return {
        "before_step1_s": before,
        "ready_s": float(ready.group(1)) if ready else None,
        "phases_s": _phases(ready.group(2)) if ready else {},
        "engine_phases_s": _phases(ready.group(3)) if ready else {},
        "step1_s": done[0]["step_s"] if done else None,
        "num_params": _num_params(args),
        "peak_rss_bytes": done[0].get("peak_rss_bytes") if done else None,
        "log_tail": text.strip().splitlines()[-6:],
    }


def _phases(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", text)}


def _num_params(args) -> int:
    from infinity.models.config import preset

    cfg = preset(args.preset, **({"num_hidden_layers": args.layers} if args.layers else {}))
    return cfg.num_params


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().split("\n")[:-1]
    return [json.loads(x) for x in lines if x.strip()]


def _line(r: dict) -> str:
    if r["before_step1_s"] is None:
        return "no step 1: " + " | ".join(r["log_tail"])
    phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items())
    engine = ", ".join(f"{k} {v:.1f}" for k, v in r["engine_phases_s"].items())
    built = r["phases_s"].get("model", 0) + r["phases_s"].get("engine", 0)
    rate = ""
    if built and r["num_params"]:
        rate = f", {r['num_params'] / built / 1e6:.0f} M params/s built"
    return (f"before step 1: {r['before_step1_s']:.1f} s (ready {r['ready_s']:.1f} s: {phases}"
            f"{rate}; engine: {engine}); step 1 {r['step1_s']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
