"""Claim: checking every byte of the swap files ([Note: full sums] in infinity/io/checksum.py)
costs at most 3% of an `infinity train --nvme` step against the sampled sums it replaced.

One `infinity train --placement nvme` run per variant and round (bf16, no activation
checkpointing, one sequence a micro-batch), the same model, data and seed, in an order that
rotates each round: "off" (no checksums), "sampled" (what releases before full sums ran: the
first 64 bytes of each 4 KiB page, a CRC per 16 KiB, the crc32 instruction, inline) and
"full" (the default). Each run is a child process that sets its variant's defaults of
`ExtentSums` before it calls the CLI. A run's figure is the median of its steps after the
first (metrics.jsonl); a variant's cost is the median over rounds of (its step / the sampled
run's step in the same round) - 1.

    PYTHONPATH=$PWD flock /work/bench.lock python -m benchmarks.swap_checksum_step_bench \\
        --path /tmp/stepbench --model llama-1b --steps 3 --rounds 3 --json r.json
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
import threading
import time
from pathlib import Path

from benchmarks.bench_record import machine, write_json
from benchmarks.gpu_throughput import _records

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("off", "sampled", "full")
FIELDS = ("step_seconds", "optimizer_seconds", "forward_seconds", "backward_seconds")


def _child(variant: str, argv: list[str]) -> int:
    """Run `infinity ARGV` with `variant`'s checksums, recording after each optimizer step
    the CPU seconds and bytes its checksums took so far (SAVE_DIR/sums.jsonl)."""
    from infinity.cli.main import main as cli
    from infinity.engine import Engine
    from infinity.io import checksum, extent

    if variant == "off":
        extent.ExtentSums = lambda: None  # what ExtentIO(checksums=False) holds
    elif variant == "sampled":
        checksum.ExtentSums.__init__.__defaults__ = (16 << 10, checksum.SAMPLE_BYTES, "instruction")
    total = {"sum_cpu_s": 0.0, "sum_bytes": 0}
    lock = threading.Lock()
    chunk_sums, step = checksum.chunk_sums, Engine.step

    def timed_sums(buf, *a, **kw):
        start = time.thread_time()  # this thread's CPU: what the sums cost, whatever the load
        out = chunk_sums(buf, *a, **kw)
        with lock:
            total["sum_cpu_s"] += time.thread_time() - start
            total["sum_bytes"] += buf.nbytes
        return out

    log = Path(argv[argv.index("--save-dir") + 1]) / "sums.jsonl"

    def logged_step(self, **kw):
        before = self.global_steps
        step(self, **kw)
        if self.global_steps != before:
            with lock, log.open("a") as f:
                f.write(json.dumps({"step": self.global_steps, **total}) + "\n")

    checksum.chunk_sums, Engine.step = timed_sums, logged_step
    return cli(argv)


def _run(variant: str, args, work: Path, corpus: Path) -> dict:
    save, swap = work / "run", work / "swap"
    shutil.rmtree(save, ignore_errors=True)
    shutil.rmtree(swap, ignore_errors=True)
    swap.mkdir()
    train = ["train", "--model", args.model, "--dtype", "bf16", "--seq-len", str(args.seq_len),
             "--micro-batch", "1", "--nvme", str(swap),
             "--placement", "nvme", "--data", str(corpus), "--byte-tokens", "--steps",
             str(args.steps), "--seed", "0", "--save-dir", str(save), "--save-every",
             str(10**6), "--no-progress"]  # fmt: skip
    cmd = [sys.executable, "-m", "benchmarks.swap_checksum_step_bench", "--child", variant,
           "--", *train]  # fmt: skip
    metrics, log = save / "metrics.jsonl", work / f"{variant}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with (
        log.open("w") as out,
        subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        ) as p,
    ):
        # Stopped once the last step is recorded: the final checkpoint measures the disk.
        while p.poll() is None and len(_records(metrics)) < args.steps:
            time.sleep(0.5)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    warm = _records(metrics)[1:]
    if not warm:
        raise RuntimeError(f"{variant}: no step after the first; see {log}:\n{log.read_text()}")
    out = {k: statistics.median(r[k] for r in warm) for k in FIELDS}
    sums = _records(save / "sums.jsonl")
    for k in ("sum_cpu_s", "sum_bytes"):  # per step after the first
        steps = [b[k] - a[k] for a, b in zip(sums, sums[1:], strict=False)]
        out[f"{k}_per_step"] = statistics.median(steps) if steps else None
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=tempfile.gettempdir(), help="swap and work directory")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="checksum-step-", dir=args.path))
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        corpus = work / "corpus.txt"
        words = ["offload", "gather", "release", "prefetch", "adam", "nvme", "pinned", "plan"]
        corpus.write_text(" ".join(words[(i * 7919) % len(words)] for i in range(100_000)))
        for r in range(args.rounds):
            for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                runs[v].append(_run(v, args, work, corpus))
                runs[v][-1]["load_average"] = os.getloadavg()[0]
                print(f"round {r} {v:8} " + " ".join(f"{k} {runs[v][-1][k]:.2f}" for k in FIELDS),
                      f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
                if args.json:  # kept after every run: a long bench leaves what it measured
                    write_json(_summary(runs, args), args.json, announce=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = _summary(runs, args)
    for v in VARIANTS:
        cpu = statistics.median(x["sum_cpu_s_per_step"] or 0.0 for x in runs[v])
        print(f"{v:8} checksums {cpu:.2f} CPU s a step; step "
              f"{record[f'{v}_median_step_seconds']:.2f} s (vs sampled "
              f"{record[f'{v}_step_seconds_cost_vs_sampled'] * 100:+.1f}%), optimizer "
              f"{record[f'{v}_median_optimizer_seconds']:.2f} s (vs sampled "
              f"{record[f'{v}_optimizer_seconds_cost_vs_sampled'] * 100:+.1f}%)")  # fmt: skip
    if args.json:
        write_json(record, args.json)
    return 0


def _summary(runs: dict[str, list[dict]], args) -> dict:
    """The record: every run, and per variant the medians and the paired costs over the
    rounds every variant completed."""
    record = {"bench": "swap_checksum_step", "argv": sys.argv, "runs": runs,
              "machine": machine(args.path)}  # fmt: skip
    done = min(len(x) for x in runs.values())
    for v in VARIANTS:
        for k in ("step_seconds", "optimizer_seconds"):
            ratios = [
                a[k] / b[k] for a, b in zip(runs[v][:done], runs["sampled"][:done], strict=True)
            ]
            record[f"{v}_{k}_cost_vs_sampled"] = statistics.median(ratios) - 1 if done else None
            record[f"{v}_median_{k}"] = statistics.median(x[k] for x in runs[v]) if done else None
    return record


if __name__ == "__main__":
    sys.exit(main())
