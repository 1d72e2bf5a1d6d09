"""Claim: `infinity train` works end to end on a CUDA device, with the same losses as on the
CPU, and its telemetry can be read against `infinity estimate` in one command.

Runs the real CLI, two optimizer steps per case: a tiny Llama with the optimizer state in RAM
and then on NVMe (parameters too), each checked against plain PyTorch (torch.optim.AdamW,
same weights, same batches) on the CPU; then a Llama-1B shape with parameters and optimizer
state on NVMe, checked against the same command on the CPU device. For every case it prints
the last step's telemetry (metrics.jsonl) beside `infinity estimate` for the same shape,
and writes everything to one JSON file. Exit code 0: every loss matched and every case's
NVMe bytes equal the estimate's; 1: a check failed; 2: no CUDA device (nothing was run).

    python benchmarks/gpu_smoke.py --nvme /mnt/ssd --json benchmarks/results/gpu_smoke_DATE.json

`--device cpu` is the dry run: the same cases on the CPU device (the tiny ones by default;
`--cases tiny,1b` adds the 1B), so the script itself is tested on a machine without a GPU.
The 1B case writes a checkpoint of about 18 GB (fp32 weights and Adam state) into --nvme, or
into --scratch (a tmpfs such as /dev/shm saves the disk the time) when given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_record import machine, write_json

from infinity.accelerator import cuda_available

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
SEED = 5
LR = 1e-3
# Relative loss difference allowed against the reference, by training precision: fp32 differs
# only in summation order (CPU-Adam vs AdamW, GPU vs CPU kernels).
RTOL = {"fp32": 1e-3, "bf16": 3e-2, "fp16": 3e-2}
GPU_NAMES = ("h200", "h100", "a100", "l40s", "4090", "3090", "v100")  # `infinity estimate --device`


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    model: str
    """A preset name, or "tiny-dir": the tiny shape exported as a model directory."""
    nvme: bool
    seq_len: int
    micro_batch: int
    grad_accum: int
    reference: str
    """"torch": plain PyTorch on the CPU; "cpu-device": the same command on the CPU device."""


CASES = {
    "tiny": [
        Case(name="tiny, state in RAM", model="tiny-dir", nvme=False, seq_len=64,
             micro_batch=2, grad_accum=2, reference="torch"),
        Case(name="tiny, both tiers on NVMe", model="tiny-dir", nvme=True, seq_len=64,
             micro_batch=2, grad_accum=2, reference="torch"),
    ],
    "1b": [
        Case(name="llama-1b, both tiers on NVMe", model="llama-1b", nvme=True, seq_len=256,
             micro_batch=1, grad_accum=2, reference="cpu-device"),
    ],
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cuda" and not cuda_available():
        print(
            f"gpu_smoke: no CUDA device: torch {torch.__version__} sees none, so nothing was "
            "run. On a GPU machine install a CUDA build of torch; `--device cpu` runs the "
            "same checks on the CPU device.",
            file=sys.stderr,
        )
        return 2
    if not Path(args.nvme).is_dir():
        print(f"gpu_smoke: --nvme {args.nvme} is not a directory; create it", file=sys.stderr)
        return 1
    names = (
        args.cases.split(",")
        if args.cases
        else (["tiny", "1b"] if args.device == "cuda" else ["tiny"])
    )
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"gpu_smoke: unknown --cases {unknown}; choose from {sorted(CASES)}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="gpu_smoke-", dir=args.nvme))
    saves = Path(tempfile.mkdtemp(prefix="gpu_smoke-", dir=args.scratch)) if args.scratch else work
    try:
        results = [_run_case(c, args, work, saves) for n in names for c in CASES[n]]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(saves, ignore_errors=True)
    record = {
        "device": args.device,
        "device_name": _device_name(args.device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "machine": machine(),
        "cases": results,
    }
    if args.json:
        write_json(record, args.json, announce=False)
    ok = all(r["ok"] for r in results)
    print(f"\ngpu_smoke: {'every loss matched' if ok else 'a check FAILED'} on {args.device}")
    return 0 if ok else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--nvme", default=tempfile.gettempdir(), help="swap and work directory")
    p.add_argument("--scratch", help="where the runs' checkpoints go (default: --nvme)")
    p.add_argument("--cases", help="comma-separated: tiny, 1b (default: both on cuda, tiny on cpu)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--gpu", choices=GPU_NAMES, help="the estimate's GPU (default: from its name)")
    p.add_argument("--bench-aio", help="the estimate's disk rates (`infinity bench aio --json`)")
    p.add_argument("--json", help="write every case's losses, telemetry and estimate here")
    return p.parse_args(argv)


def _run_case(case: Case, args: argparse.Namespace, work: Path, saves: Path) -> dict:
    name = f"{case.model}-{'nvme' if case.nvme else 'ram'}"
    here = work / name
    here.mkdir()
    saves = saves / name if saves != work else here
    saves.mkdir(exist_ok=True)
    corpus = _corpus(here)
    model = _tiny_dir(here) if case.model == "tiny-dir" else case.model
    swap = here / "swap"
    swap.mkdir()
    flags = _train_flags(case, args.dtype, model, corpus, swap)
    run = _train(flags, saves / "run", args.device)
    if not run["ok"]:
        return _report(case, args, run, None, None)
    if case.reference == "torch":
        ref = {"ok": True, "losses": _torch_losses(case, model, corpus, here / "ref")}
    else:
        ref = _train(flags, saves / "ref", "cpu")
    estimate = _estimate(case, args, model, swap, here / "estimate.json")
    return _report(case, args, run, ref, estimate)


def _train_flags(case: Case, dtype: str, model: str, corpus: Path, swap: Path) -> list[str]:
    flags = [
        "--model", model, "--data", str(corpus), "--byte-tokens", "--steps", str(STEPS),
        "--seq-len", str(case.seq_len), "--micro-batch", str(case.micro_batch),
        "--grad-accum", str(case.grad_accum), "--lr", str(LR), "--seed", str(SEED),
        "--dtype", dtype, "--no-progress",
    ]  # fmt: skip
    return flags + (["--nvme", str(swap), "--placement", "nvme"] if case.nvme else [])


def _train(flags: list[str], save_dir: Path, device: str) -> dict:
    """`infinity train` on `device`; its metrics.jsonl records."""
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "train", *flags, "--save-dir", str(save_dir)],
        env=dict(os.environ, INFINITY_ACCELERATOR=device),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr.strip().splitlines()[-5:]}
    lines = (save_dir / "metrics.jsonl").read_text().splitlines()
    shutil.rmtree(save_dir)  # the checkpoint is not needed (the 1B's is ~18 GB)
    records = [json.loads(line) for line in lines]
    return {"ok": True, "losses": [r["loss"] for r in records], "records": records}


def _torch_losses(case: Case, model_dir: str, corpus: Path, cache: Path) -> list[float]:
    """The same steps in plain PyTorch on the CPU: the weights of `model_dir`, the batches
    `infinity train` draws (same data pipeline and seed), AdamW with its settings."""
    from transformers import AutoModelForCausalLM

    from infinity.data import open_dataset
    from infinity.run.step import causal_lm_loss

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    data = open_dataset(corpus, seq_len=case.seq_len, seed=SEED, cache_dir=cache)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(case.grad_accum):
            ids, labels = data.next_batch(case.micro_batch)
            loss = causal_lm_loss(model(input_ids=ids).logits, labels)
            (loss / case.grad_accum).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total / case.grad_accum)
    return losses


def _estimate(case: Case, args, model: str, swap: Path, out: Path) -> dict | None:
    device = "cpu" if args.device == "cpu" else args.gpu or _gpu_name(_device_name("cuda"))
    if device is None:
        return None
    flags = [
        "--model", model, "--seq-len", str(case.seq_len), "--micro-batch", str(case.micro_batch),
        "--grad-accum", str(case.grad_accum), "--dtype", args.dtype, "--device", device,
        "--json", str(out),
    ]  # fmt: skip
    if case.nvme:
        flags += ["--nvme", str(swap), "--placement", "nvme"]
    if args.bench_aio:
        flags += ["--bench-aio", args.bench_aio]
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "estimate", *flags],
        capture_output=True,
        text=True,
    )
    return json.loads(out.read_text()) if proc.returncode == 0 else {"error": proc.stderr[-500:]}


def _report(case: Case, args, run: dict, ref: dict | None, estimate: dict | None) -> dict:
    print(f"\n== {case.name} on {args.device} ({args.dtype}, {STEPS} steps)")
    result = {"case": dataclasses.asdict(case), "run": run, "reference": ref, "estimate": estimate}
    if not run["ok"] or ref is None or not ref["ok"]:
        failed = run if not run["ok"] else ref
        print("  FAILED: " + "\n  ".join((failed or {}).get("error", ["no reference"])))
        return {**result, "ok": False}
    diff = max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run["losses"], ref["losses"], strict=True)
    )
    losses_ok = diff <= RTOL[args.dtype]
    against = "plain PyTorch on the CPU" if case.reference == "torch" else "the CPU device"
    print(f"  losses   {_losses(run['losses'])}")
    print(f"  against  {_losses(ref['losses'])} ({against})")
    verdict = "ok" if losses_ok else "FAILED"
    print(f"  max relative difference {diff:.2e} (allowed {RTOL[args.dtype]:.0e}): {verdict}")
    _side_by_side(run["records"][-1], estimate)
    bytes_ok = _nvme_bytes_match(run["records"][-1], estimate)
    return {**result, "ok": losses_ok and bytes_ok, "max_rel_diff": diff, "bytes_ok": bytes_ok}


def _nvme_bytes_match(m: dict, estimate: dict | None) -> bool:
    """The last step's NVMe bytes equal the estimate's (the engine's own sizing rules), read
    and written. No estimate (an unknown GPU) is not a failure; a failed estimate is."""
    if estimate is None:
        return True
    want = (estimate.get("nvme_read_bytes_per_step"), estimate.get("nvme_write_bytes_per_step"))
    got = (m["nvme_read_bytes"], m["nvme_write_bytes"])
    ok = got == want
    print(f"  NVMe bytes read/written {got} against the estimate's {want}: "
          f"{'equal' if ok else 'FAILED'}")  # fmt: skip
    return ok


def _side_by_side(m: dict, estimate: dict | None) -> None:
    """The last step's telemetry `m` beside the estimate of the same shape."""
    e = estimate if estimate and "error" not in estimate else {}
    t = e.get("times", {})
    waits = m["nvme_param_wait_seconds"] + m["nvme_optim_wait_seconds"]
    compute = m["forward_seconds"] + m["backward_seconds"]
    rows = [
        ("step time", "s", t.get("step_s"), m["step_seconds"]),
        ("compute | fw + bw", "s", t.get("compute_s"), compute),
        ("CPU-Adam | Adam kernels", "s", t.get("cpu_adam_s"), m["optimizer_compute_seconds"]),
        ("NVMe transfers | waits", "s", t.get("nvme_s"), waits + m["nvme_grad_wait_seconds"]),
        ("host-device copies", "s", t.get("copies_s"), m["copy_seconds"]),
        ("gather wait", "s", None, m["gather_wait_seconds"]),
        ("NVMe read per step", "B", e.get("nvme_read_bytes_per_step"), m["nvme_read_bytes"]),
        ("NVMe written per step", "B", e.get("nvme_write_bytes_per_step"), m["nvme_write_bytes"]),
        ("host <-> device bytes", "B", e.get("host_device_bytes_per_step"),
         m["host_to_device_bytes"] + m["device_to_host_bytes"]),
        ("peak RSS", "B", e.get("peak_rss_bytes"), m["peak_rss_bytes"]),
    ]  # fmt: skip
    if estimate is None:
        print("  (no estimate: unknown GPU; pass --gpu NAME)")
    elif not e:
        print(f"  (the estimate failed: {estimate['error'].strip().splitlines()[-1]})")
    print(f"  {'step ' + str(m['step']):<28}{'estimate':>14}{'measured':>14}")
    for label, unit, est, measured in rows:
        print(f"  {label:<28}{_value(est, unit):>14}{_value(measured, unit):>14}")


def _value(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= size:
            return f"{v / size:.2f} {name}"
    return f"{int(v)} B"


def _losses(losses: list[float]) -> str:
    return " ".join(f"{x:.6f}" for x in losses)


def _corpus(where: Path) -> Path:
    path = where / "corpus.txt"
    words = ["offload", "gather", "release", "prefetch", "adam", "nvme", "pinned", "stream"]
    rng = torch.Generator().manual_seed(SEED)
    picks = torch.randint(len(words), (40_000,), generator=rng).tolist()
    path.write_text(" ".join(words[i] for i in picks))
    return path


def _tiny_dir(where: Path) -> str:
    """The tiny preset's shape with random weights, as a model directory both runs load."""
    from infinity.models import LlamaForCausalLM, export_hf, preset

    cfg = preset("tiny")
    torch.manual_seed(SEED)
    out = where / "tiny"
    export_hf(LlamaForCausalLM(cfg).named_parameters(), cfg, out, dtype="fp32")
    return str(out)


def _device_name(device: str) -> str:
    if device != "cuda":
        return platform.processor() or platform.machine()
    from infinity.accelerator import get_accelerator

    return get_accelerator("cuda").device_name()


def _gpu_name(name: str) -> str | None:
    """The estimate's name for a GPU from its marketing name, e.g. "NVIDIA H100 80GB HBM3"."""
    low = name.lower()
    for gpu in GPU_NAMES:
        if gpu in low:
            return "a100-40" if gpu == "a100" and "40gb" in low else gpu
    return None


if __name__ == "__main__":
    sys.exit(main())
