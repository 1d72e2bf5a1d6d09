"""Claim: what a training step costs on a GPU for the runs Infinity exists for, each measured
beside `infinity estimate` for the same shape and disk.

Runs the real CLI for a few optimizer steps per case and reads its per-step telemetry
(metrics.jsonl). The default cases are the table of the GPU check: a Llama-1B full
fine-tune in bf16 with the optimizer state in RAM, the same with both tiers on NVMe, a
Llama-13B LoRA (r=16) placed by the planner (`--nvme` alone: the frozen base's home in RAM,
the base gathered on the GPU once and kept there), and a Llama-7B full fine-tune placed by
the planner within 100 GiB of RAM. Earlier rows stay as cases (a 1B LoRA and a 1B with
accumulation 8 placed by the planner, a 7B LoRA with the base on NVMe). The first step warms
up (traces the order, fills the pools); the figures are medians of the steps after it. Each
case has a wall-clock limit (the smaller of --timeout and its own), so one slow case cannot
take the others' time; a case stopped at its limit keeps the steps it finished.

    python benchmarks/gpu_throughput.py --nvme /mnt/ssd --bench-aio aio.json --json out.json

`--device cpu --cases tiny-ram,tiny-nvme,tiny-lora-planned,tiny-planned` is the dry run on a
machine without a GPU (one tiny case per row type).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
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
from gpu_smoke import _corpus, _device_name, _gpu_name, _value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    model: str
    nvme: bool
    lora_r: int = 0
    planned: bool = False
    """With `nvme`: the planner places the run (`--nvme` alone), not `--placement nvme`."""
    grad_accum: int | None = None
    """Micro batches per step for this case (default: --grad-accum)."""
    ram_budget: str | None = None
    """`--ram-budget` for the planner (planned cases; default: the planner's own)."""
    steps: int | None = None
    """Optimizer steps for this case, at most --steps (a slow case measures fewer)."""
    timeout: float | None = None
    """Seconds for this case's training run, at most --timeout (GPU sizes)."""


CASES = {
    "1b-ram": Case(name="llama-1b full fine-tune, state in RAM", model="llama-1b", nvme=False),
    "1b-nvme": Case(name="llama-1b full fine-tune, both tiers on NVMe", model="llama-1b",
                    nvme=True, steps=2, timeout=110),  # ~50 GB of NVMe traffic a step
    "1b-lora-planned": Case(name="llama-1b LoRA r=16, placed by the planner", model="llama-1b",
                            nvme=True, lora_r=16, planned=True),
    "1b-accum8-planned": Case(name="llama-1b full fine-tune, accumulation 8, placed by the "
                              "planner (gradient sums on the GPU)", model="llama-1b", nvme=True,
                              planned=True, grad_accum=8),
    "7b-lora": Case(name="llama-7b LoRA r=16, base on NVMe", model="llama-7b", nvme=True,
                    lora_r=16),
    # The planner keeps the frozen 24 GiB base gathered on a GPU with room for it (frozen
    # weights never change, so they are never released) and its home in RAM.
    "13b-lora-resident": Case(name="llama-13b LoRA r=16, placed by the planner (base resident "
                              "on the GPU)", model="llama-13b", nvme=True, lora_r=16,
                              planned=True, ram_budget="100G", timeout=130),
    # 100 GiB of the GPU machine's 125: the whole state fits (89.8 GiB planned), with room
    # for the CUDA context, the page cache and the estimate's own error.
    "7b-full": Case(name="llama-7b full fine-tune, placed by the planner within 100 GiB of "
                    "RAM", model="llama-7b", nvme=True, planned=True, ram_budget="100G",
                    timeout=160),
    "tiny-ram": Case(name="tiny full fine-tune, state in RAM", model="tiny", nvme=False),
    "tiny-nvme": Case(name="tiny full fine-tune, both tiers on NVMe", model="tiny", nvme=True),
    "tiny-lora": Case(name="tiny LoRA r=8, base on NVMe", model="tiny", nvme=True, lora_r=8),
    "tiny-lora-planned": Case(name="tiny LoRA r=8, placed by the planner", model="tiny",
                              nvme=True, lora_r=8, planned=True),
    "tiny-planned": Case(name="tiny full fine-tune, placed by the planner within 2 GiB of RAM",
                         model="tiny", nvme=True, planned=True, ram_budget="2G"),
}  # fmt: skip
# The table, in its order; the others stay for reruns of earlier rows.
GPU_CASES = "1b-ram,1b-nvme,13b-lora-resident,7b-full"
# metrics.jsonl keys whose per-step median the table shows.
MEDIANS = (
    "step_seconds", "tokens_per_s", "tflops", "forward_seconds", "backward_seconds",
    "optimizer_seconds", "optimizer_compute_seconds", "gather_wait_seconds",
    "nvme_param_wait_seconds", "nvme_optim_wait_seconds", "nvme_grad_wait_seconds",
    "copy_seconds", "nvme_read_bytes", "nvme_write_bytes", "host_to_device_bytes",
    "device_to_host_bytes",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    names = (args.cases or (GPU_CASES if args.device == "cuda" else "tiny-ram")).split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"gpu_throughput: unknown --cases {unknown}; choose from {sorted(CASES)}")
        return 1
    if not Path(args.nvme).is_dir():
        print(f"gpu_throughput: --nvme {args.nvme} is not a directory; create it")
        return 1
    work = Path(tempfile.mkdtemp(prefix="gpu_throughput-", dir=args.nvme))
    saves = Path(tempfile.mkdtemp(prefix="gpu_throughput-", dir=args.scratch or args.nvme))
    results = []
    try:
        corpus = _corpus(work)
        for name in names:
            results.append(_run_case(CASES[name], args, work, saves, corpus))
            _write(args, results)  # what finished survives a later case's crash
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(saves, ignore_errors=True)
    print("\n" + _table(results))
    return 0 if all(r["measured"] for r in results) else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--nvme", default=tempfile.gettempdir(), help="swap and work directory")
    p.add_argument("--scratch", help="where checkpoints go (default: --nvme); a tmpfs is fastest")
    p.add_argument("--cases", help=f"comma-separated, from {sorted(CASES)} (cuda: {GPU_CASES})")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per case (default 4)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--timeout", type=float, default=240, help="seconds per case's training run")
    p.add_argument("--gpu", help="the estimate's GPU name (default: from the device's name)")
    p.add_argument("--bench-aio", help="the estimate's disk rates (`infinity bench aio --json`)")
    p.add_argument("--json", help="write every case's telemetry and estimate here")
    p.add_argument(
        "--profile-to",
        metavar="DIR",
        help="record each case's second step with torch.profiler and keep its "
        "Chrome trace, gzipped, as DIR/profile-<model>[-nvme|-lora][-planned].json.gz",
    )
    p.add_argument("--profile-cases", help="only these cases, with --profile-to (default: all)")
    return p.parse_args(argv)


def _flags(case: Case, args: argparse.Namespace, swap: Path) -> list[str]:
    """The flags `infinity train` and `infinity estimate` share for this case."""
    flags = [
        "--model", case.model, "--seq-len", str(args.seq_len),
        "--micro-batch", str(args.micro_batch),
        "--grad-accum", str(case.grad_accum or args.grad_accum),
        "--dtype", args.dtype, "--activation-checkpointing",
    ]  # fmt: skip
    if case.lora_r:
        flags += ["--lora-r", str(case.lora_r)]
    if not case.nvme:
        return flags
    flags += ["--nvme", str(swap)]
    if case.ram_budget:
        flags += ["--ram-budget", case.ram_budget]
    return flags + ([] if case.planned else ["--placement", "nvme"])


def _run_case(case: Case, args, work: Path, saves: Path, corpus: Path) -> dict:
    swap = work / f"swap-{case.model}"
    swap.mkdir(exist_ok=True)
    flags = _flags(case, args, swap)
    # A profiled run records its second step (after the warm-up one) and runs one more.
    key = next(k for k, c in CASES.items() if c == case)
    profiled = bool(args.profile_to) and key in (args.profile_cases or key).split(",")
    steps = min(args.steps, case.steps or args.steps) + profiled
    train = [*flags, "--data", str(corpus), "--byte-tokens", "--steps", str(steps),
             "--seed", "0", "--no-progress", "--save-dir", str(saves / "run")]  # fmt: skip
    if profiled:
        train += ["--profile", "1"]
    run = _train(train, args.device, min(args.timeout, case.timeout or args.timeout))
    if profiled:
        run["profile"] = _keep_trace(saves / "run" / "profile", Path(args.profile_to), case)
    plan = saves / "run" / "placement.json"  # what the planner chose (planned cases)
    run["plan"] = json.loads(plan.read_text()) if plan.exists() else None
    shutil.rmtree(saves / "run", ignore_errors=True)  # a 1B checkpoint is ~15 GB
    shutil.rmtree(swap, ignore_errors=True)
    estimate = _estimate(flags, args, work / "estimate.json")
    # Step 1 traces the order and fills pools; a profiled step 2 is slowed by the profiler.
    warm = run["records"][2 if profiled else 1 :] or run["records"]
    measured = {k: statistics.median(r[k] for r in warm) for k in MEDIANS} if warm else {}
    if warm:
        measured["peak_device_bytes"] = max(r.get("peak_device_bytes", 0) for r in warm)
        measured["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in warm)
        measured["steps"] = [r["step"] for r in warm]
    accum = case.grad_accum or args.grad_accum
    result = {"case": dataclasses.asdict(case), "flags": flags, "grad_accum": accum,
              **run, "measured": measured, "estimate": estimate}  # fmt: skip
    _print_case(case, result)
    return result


def _train(flags: list[str], device: str, timeout: float) -> dict:
    """`infinity train` under a wall-clock limit; the steps it finished either way. The run
    is stopped once its last step's record is written: its final checkpoint (~15 GB for a
    1B model) measures the disk, not the step."""
    cmd = [sys.executable, "-m", "infinity.cli.main", "train", *flags]
    env = dict(os.environ, INFINITY_ACCELERATOR=device)
    metrics = Path(flags[flags.index("--save-dir") + 1]) / "metrics.jsonl"
    steps = int(flags[flags.index("--steps") + 1])
    log = metrics.parent.with_suffix(".log")
    t0 = time.monotonic()
    first_step_s = None
    with (
        log.open("w") as out,
        subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        ) as proc,
    ):
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            done = _records(metrics)
            if done and first_step_s is None:
                first_step_s = time.monotonic() - t0 - done[0].get("step_s", 0)
            if len(done) >= steps:
                break
            time.sleep(0.5)
        stopped = proc.poll() is None
        if stopped:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and anything it started
        proc.wait()
    records = _records(metrics)
    timed_out = stopped and len(records) < steps
    # A run stopped after its last step did all it was asked: rc 0, "stopped" says how.
    rc = 0 if stopped and not timed_out else proc.returncode
    lines = log.read_text(errors="replace").strip().splitlines()
    return {"rc": rc, "timed_out": timed_out, "stopped": stopped and not timed_out,
            "records": records, "setup_seconds": first_step_s,
            "log_tail": lines[-15:]}  # fmt: skip


def _records(metrics: Path) -> list[dict]:
    """The complete lines of metrics.jsonl (the last may be half-written)."""
    if not metrics.exists():
        return []
    lines = metrics.read_text().split("\n")[:-1]
    return [json.loads(x) for x in lines if x.strip()]


def _keep_trace(profile_dir: Path, to: Path, case: Case) -> str | None:
    traces = sorted(profile_dir.glob("*.json"))
    if not traces:
        return None
    tag = case.model + ("-lora" if case.lora_r else "-nvme" if case.nvme else "")
    tag += "-planned" if case.planned else ""
    to.mkdir(parents=True, exist_ok=True)
    dest = to / f"profile-{tag}.json.gz"
    with traces[-1].open("rb") as src, gzip.open(dest, "wb", compresslevel=6) as out:
        shutil.copyfileobj(src, out)
    return str(dest)


def _estimate(flags: list[str], args, out: Path) -> dict:
    device = "cpu" if args.device == "cpu" else args.gpu or _gpu_name(_device_name("cuda"))
    if device is None:
        return {"error": "unknown GPU: pass --gpu NAME"}
    cmd = [sys.executable, "-m", "infinity.cli.main", "estimate", *flags, "--device", device,
           "--json", str(out)]  # fmt: skip
    if args.bench_aio:
        cmd += ["--bench-aio", args.bench_aio]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-800:]}
    return json.loads(out.read_text())


def _rows(r: dict) -> list[tuple[str, str, float | None, float | None]]:
    """(label, unit, estimate, measured) for one case."""
    e, m = r["estimate"], r["measured"]
    t = e.get("times", {})
    waits = sum(m.get(f"nvme_{k}_wait_seconds", 0) for k in ("param", "optim", "grad"))
    return [
        ("step time", "s", e.get("step_seconds"), m.get("step_seconds")),
        ("tokens/s", "n", e.get("tokens_per_second"), m.get("tokens_per_s")),
        ("achieved TFLOPS", "n", None, m.get("tflops")),
        ("forward + backward", "s", t.get("micro_step_s") and t["micro_step_s"] * r["grad_accum"],
         (m.get("forward_seconds", 0) + m.get("backward_seconds", 0)) if m else None),
        ("optimizer step", "s", t.get("optimizer_step_s"), m.get("optimizer_seconds")),
        ("Adam kernels", "s", t.get("cpu_adam_s"), m.get("optimizer_compute_seconds")),
        ("NVMe waits", "s", None, waits if m else None),
        ("gather wait", "s", None, m.get("gather_wait_seconds")),
        ("NVMe read", "B", e.get("nvme_read_bytes_per_step"), m.get("nvme_read_bytes")),
        ("NVMe written", "B", e.get("nvme_write_bytes_per_step"), m.get("nvme_write_bytes")),
        ("host <-> device", "B", e.get("host_device_bytes_per_step"),
         (m["host_to_device_bytes"] + m["device_to_host_bytes"]) if m else None),
        ("peak device memory", "B", e.get("device_bytes"), m.get("peak_device_bytes")),
        ("peak RSS", "B", e.get("peak_rss_bytes"), m.get("peak_rss_bytes")),
    ]  # fmt: skip


def _print_case(case: Case, r: dict) -> None:
    state = f"rc {r['rc']}"
    if r["timed_out"] or r["stopped"]:
        state = "timed out" if r["timed_out"] else "stopped after it"
    setup = r.get("setup_seconds")
    setup = f", {setup:.0f} s before step 1" if setup is not None else ""
    print(f"\n== {case.name}: {len(r['records'])} steps{setup}, {state}")
    if r.get("profile"):
        print(f"  profile of step 2: {r['profile']}")
    if r["rc"] not in (0, None) and not r["timed_out"]:
        print("  " + "\n  ".join(r["log_tail"]))
    if "error" in r["estimate"]:
        print("  (the estimate failed: " + r["estimate"]["error"].strip()[-300:] + ")")
    print(f"  {'':<22}{'estimate':>14}{'measured':>14}")
    for label, unit, est, got in _rows(r):
        print(f"  {label:<22}{_fmt(est, unit):>14}{_fmt(got, unit):>14}")


def _fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}" if unit == "n" else _value(v, unit)


def _table(results: list[dict]) -> str:
    """One markdown row per case: measured (estimate) for the figures BENCHMARKS.md keeps."""
    keep = ("step time", "tokens/s", "achieved TFLOPS", "forward + backward", "optimizer step",
            "NVMe waits", "peak device memory", "peak RSS")  # fmt: skip
    lines = ["| case | " + " | ".join(keep) + " |", "|---" * (len(keep) + 1) + "|"]
    for r in results:
        cells = {label: (est, got, unit) for label, unit, est, got in _rows(r)}
        row = [r["case"]["name"]]
        for k in keep:
            est, got, unit = cells[k]
            row.append(_fmt(got, unit) + (f" ({_fmt(est, unit)})" if est is not None else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _write(args, results: list[dict]) -> None:
    if not args.json:
        return
    record = {"device": args.device, "device_name": _device_name(args.device),
              "machine": machine(args.nvme), "argv": sys.argv[1:], "cases": results}  # fmt: skip
    write_json(record, args.json, announce=False)


if __name__ == "__main__":
    sys.exit(main())
