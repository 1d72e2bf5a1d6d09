"""Claim: what DeepSpeed ZeRO-3 with offload costs a step on the same GPU, for the same model
and shape as benchmarks/gpu_throughput.py's rows (the peer beside Infinity's figures).

The model is the preset's transformers Llama, as `infinity train --model PRESET` builds it,
created under ZeRO-3's partitioned init (`HfDeepSpeedConfig`), with transformers' activation
checkpointing (non-reentrant, as Infinity turns it on); the batch is micro-batch x seq-len
tokens below 256 (what `--byte-tokens` draws), accumulation 1, AdamW at lr 1e-4 without
weight decay or clipping (Infinity's defaults), bf16. ZeRO-3 offloads the parameters and the
optimizer state to `--offload` (cpu or nvme), with DeepSpeed's own defaults otherwise: what a
DeepSpeed user gets. Step 1 warms up; the figures are medians of the steps after it. The
JSON is rewritten after every step, so a run stopped at its time limit keeps what it did.

    python benchmarks/gpu_deepspeed.py --model llama-1b --offload cpu --json ds.json
    python benchmarks/gpu_deepspeed.py --build-only --offload nvme   # the ops alone

`--build-only` builds (or loads) DeepSpeed's CPU-Adam, and its async I/O with `--offload
nvme`, and says for each how long it took or exactly what failed. DeepSpeed is not a
dependency of Infinity: benchmarks/gpu_wheels.sh gathers it for an install without network.
`DS_ACCELERATOR=cpu ... --device cpu --model tiny` is the dry run on a machine without a GPU
(DeepSpeed's CPU accelerator).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

T0 = time.monotonic()
OPS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder"}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.offload == "nvme" and not Path(args.nvme or "").is_dir():
        print(f"gpu_deepspeed: --nvme {args.nvme!r} is not a directory; create it")
        return 1
    _single_rank_env()
    needed = ["cpu_adam"] + (["async_io"] if args.offload == "nvme" else [])
    ops = _build_ops(needed)
    record = {"argv": sys.argv[1:], "ops": ops}
    if args.build_only or not all(op["ok"] for op in ops.values()):
        _write(args, record)
        return 0 if all(op["ok"] for op in ops.values()) else 1
    record["config"] = _ds_config(args)
    _write(args, record)  # what was built survives a failure of the run
    record.update(_run(args, record))
    _write(args, record)
    return 0 if record.get("measured") else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--model", default="llama-1b", help="an Infinity preset (default llama-1b)")
    p.add_argument("--offload", choices=["cpu", "nvme"], default="cpu")
    p.add_argument("--nvme", help="ZeRO-3's nvme_path (with --offload nvme)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--build-only", action="store_true", help="build DeepSpeed's ops, no run")
    p.add_argument("--json", help="write the ops, the config and every step here")
    return p.parse_args(argv)


def _single_rank_env() -> None:
    """One process without a launcher: the rendezvous env DeepSpeed's init reads."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):  # fmt: skip
        os.environ.setdefault(key, value)


def _build_ops(names: list[str]) -> dict:
    """Each op built (JIT, with ninja) or loaded, with its seconds, or exactly what failed."""
    try:
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # the install itself is what failed
        return {n: {"ok": False, "error": f"import deepspeed: {_error(exc)}"} for n in names}
    out = {}
    for name in names:
        t0 = time.monotonic()
        builder = get_accelerator().create_op_builder(OPS[name])
        try:
            if builder is None:
                raise RuntimeError(f"no {OPS[name]} for the {get_accelerator()._name} accelerator")
            if not builder.is_compatible(verbose=True):
                raise RuntimeError(f"not compatible here: {builder.error_log or 'see above'}")
            builder.load(verbose=True)
            out[name] = {"ok": True, "seconds": round(time.monotonic() - t0, 1)}
            print(f"deepspeed op {name}: ready in {out[name]['seconds']} s", flush=True)
        except Exception as exc:
            out[name] = {"ok": False, "seconds": round(time.monotonic() - t0, 1),
                         "error": _error(exc)}  # fmt: skip
            print(f"deepspeed op {name}: FAILED: {out[name]['error']}", flush=True)
    return out


def _error(exc: BaseException) -> str:
    """The exception and its causes on one line: the compiler's or ninja's words included."""
    parts = []
    while exc is not None:
        parts.append(f"{type(exc).__name__}: {str(exc).strip()[-1500:]}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def _ds_config(args: argparse.Namespace) -> dict:
    """ZeRO-3 with both offloads; nothing else set that DeepSpeed would choose itself."""
    zero = {
        "stage": 3,
        "offload_optimizer": {"device": args.offload, "pin_memory": True},
        "offload_param": {"device": args.offload, "pin_memory": True},
    }
    if args.offload == "nvme":
        for key in ("offload_optimizer", "offload_param"):
            zero[key]["nvme_path"] = str(args.nvme)
        # The parameter swap buffers must hold the largest tensor (the embedding).
        zero["offload_param"]["buffer_size"] = _largest_param(args.model)
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
    }


def _largest_param(model: str) -> int:
    from infinity.models.config import preset

    c = preset(model)
    return max(c.vocab_size * c.hidden_size, c.hidden_size * c.intermediate_size)


def _run(args: argparse.Namespace, record: dict) -> dict:
    """Build, initialize and train `--steps` steps, timing each phase of each step."""
    import deepspeed

    from infinity.models.config import preset

    engine = _engine(args, record["config"])
    record["deepspeed"] = deepspeed.__version__
    record["setup_seconds"] = round(time.monotonic() - T0, 1)
    print(f"gpu_deepspeed: {args.model}, {record['setup_seconds']} s before step 1", flush=True)
    flops = preset(args.model).train_flops_per_token(args.seq_len)
    gen = torch.Generator().manual_seed(0)
    record["records"] = []
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, 256, (args.micro_batch, args.seq_len), generator=gen)
        rec = _step(engine, ids.to(engine.device), args.device)
        rec.update(step=step, tflops=flops * rec["tokens_per_s"] / 1e12)
        record["records"].append(rec)
        print(json.dumps(rec), flush=True)
        record["measured"] = _medians(record["records"])
        _write(args, record)
    return record


def _engine(args: argparse.Namespace, config: dict):
    import deepspeed
    import transformers

    from infinity.models.config import preset
    from infinity.models.hf_auto import enable_activation_checkpointing

    deepspeed.init_distributed()
    hf_config = transformers.LlamaConfig(**preset(args.model).to_hf_dict())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # Each module's parameters are partitioned (and offloaded) as it is built, as ZeRO-3
    # builds a model larger than the device. (transformers' HfDeepSpeedConfig would do the
    # same and needs accelerate, which the GPU machine may lack.)
    # The class (and torch._dynamo, which it imports) is loaded first: zero.Init patches
    # tensor construction, which dynamo's import-time checks reject.
    llama = transformers.LlamaForCausalLM
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype):
        model = llama._from_config(hf_config, dtype=dtype)
    enable_activation_checkpointing(model)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)  # fmt: skip
    return engine


def _step(engine, ids: torch.Tensor, device: str) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    sync()
    t1 = time.perf_counter()
    engine.backward(loss)
    sync()
    t2 = time.perf_counter()
    engine.step()
    sync()
    t3 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {
        "loss": float(loss.detach()), "step_seconds": t3 - t0,
        "tokens_per_s": ids.numel() / (t3 - t0), "forward_seconds": t1 - t0,
        "backward_seconds": t2 - t1, "optimizer_seconds": t3 - t2,
        "peak_device_bytes": peak,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }  # fmt: skip


def _medians(records: list[dict]) -> dict:
    warm = records[1:] or records
    keys = ("step_seconds", "tokens_per_s", "tflops", "forward_seconds", "backward_seconds",
            "optimizer_seconds")  # fmt: skip
    out = {k: statistics.median(r[k] for r in warm) for k in keys}
    out["peak_device_bytes"] = max(r["peak_device_bytes"] for r in records)
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in records)
    out["steps"] = [r["step"] for r in warm]
    return out


def _write(args: argparse.Namespace, record: dict) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
