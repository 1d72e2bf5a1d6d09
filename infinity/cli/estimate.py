"""`infinity estimate`: what a training run will need and how fast it will go, before it runs.

Owns the command line: the flags (the same as `infinity train`'s where they mean the same),
reading the model's shape, and printing the estimate or writing it as JSON. The model itself
is `infinity.estimate`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infinity.cli.train import _positive_int, config_from_args
from infinity.config import Config
from infinity.models import PRESETS, load_config, preset

_GIB = float(1 << 30)
_GB = 1e9


def register(subparsers: argparse._SubParsersAction) -> None:
    from infinity.estimate import DEVICES

    parser = subparsers.add_parser(
        "estimate",
        help="host RAM, pinned and device memory, disk, and step time of a run, before it runs",
        description=(
            "Estimate a training run of a Llama-style model: peak host RAM, pinned memory, "
            "device memory and NVMe space, the bytes each step moves, the time of compute, "
            "NVMe, CPU-Adam and copies, which of them bounds the step and what to change. "
            "Bytes come from the engine's own sizing rules; times from published GPU figures "
            "or short probes on this machine. Flags mean what they mean for `infinity train`."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR|PRESET",
        help=f"a Hugging Face model directory (config.json), or a preset ({', '.join(PRESETS)})",
    )
    parser.add_argument("--config", metavar="FILE", help="DeepSpeed-style JSON config")
    parser.add_argument(
        "--nvme",
        metavar="PATH",
        help="swap directory, as for `infinity train` (optimizer state and parameters on NVMe); "
        "probed for its speed when it exists and no --bench-aio is given",
    )
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="training precision")
    parser.add_argument(
        "--seq-len", type=_positive_int, default=512, help="tokens per sequence (default 512)"
    )
    parser.add_argument("--micro-batch", type=_positive_int, help="sequences per forward")
    parser.add_argument("--grad-accum", type=_positive_int, help="micro batches per step")
    parser.add_argument(
        "--lora-r",
        type=_positive_int,
        metavar="R",
        help="LoRA rank: adapters on every linear layer of the blocks, the rest frozen",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer's activations in backward (as `infinity train`)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="the accelerator: 'cpu' (this machine, probed) or a GPU by name (published "
        "figures; default cpu)",
    )
    parser.add_argument(
        "--bench-aio",
        metavar="FILE",
        help="disk rates from `infinity bench aio --json FILE` (default: a quick probe of "
        "--nvme, or an assumed PCIe 4.0 SSD)",
    )
    parser.add_argument(
        "--world-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="ranks of the run (torchrun's processes): the batch figures count all of them "
        "(train_batch_size = micro batch x accumulation x N); memory and time are one rank's "
        "(default 1)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the estimate as JSON")
    parser.set_defaults(func=run)


def model_config(name: str):
    """A preset's shape, or a model directory's config.json."""
    if name in PRESETS:
        return preset(name)
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(
            f"--model {name}: no such directory and not a preset; give a Hugging Face model "
            f"directory (with config.json) or one of {', '.join(PRESETS)}"
        )
    return load_config(path)


def run(args: argparse.Namespace) -> int:
    from infinity.estimate import estimate, measure_rates, model_shape

    if args.bench_aio and not Path(args.bench_aio).is_file():
        raise ValueError(
            f"--bench-aio {args.bench_aio}: no such file; run `infinity bench aio --path DIR "
            "--json FILE` first and pass FILE"
        )
    shape = model_shape(model_config(args.model), lora_r=args.lora_r or 0)
    config = config_from_args(
        argparse.Namespace(**{**vars(args), "lr": None, "seed": None}), args.world_size
    )
    # The estimate is one rank's: its micro batch and accumulation, the global batch checked.
    config = Config.load({**config.to_dict(), "train_batch_size": "auto"}).for_local_rank(0)
    overhead = 0.0
    if args.device == "cpu":  # the engine's hooks take the cores that compute
        from infinity.cli.estimate_probe import probe_module_overhead_s
        from infinity.zero import model_dtype

        overhead = probe_module_overhead_s(
            model_dtype(config),
            lora_r=shape.lora_r,
            checkpointing=args.activation_checkpointing,
        )
    rates = measure_rates(
        shape,
        config,
        device=args.device,
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
        nvme_path=args.nvme,
        bench_aio=args.bench_aio,
        module_overhead_s=overhead,
    )
    est = estimate(
        shape,
        config,
        rates,
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
    )
    print(render(est, args.model, args.world_size))
    if args.json:
        out = est.as_json()
        out["inputs"]["model"] = args.model
        out["inputs"]["world_size"] = args.world_size
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def render(est, model: str, world_size: int = 1) -> str:
    """The estimate as the terminal shows it (one rank's, with `world_size` ranks)."""
    s, t, i = est.sizes, est.times, est.inputs
    lora = f", LoRA r={i['lora_r']}" if i["lora_r"] else ""
    ranks = (
        f" per rank, x {world_size} ranks = {est.tokens_per_step * world_size} tokens per "
        "optimizer step"
        if world_size > 1
        else " per step"
    )
    lines = [
        f"{model}: {est.params / 1e9:.2f}B parameters ({est.trainable_params / 1e9:.3f}B "
        f"trainable{lora}), {i['dtype']}, {i['seq_len']} tokens x {i['micro_batch']} x "
        f"{i['gradient_accumulation_steps']} = {est.tokens_per_step} tokens{ranks}, "
        f"device {i['device']}",
        f"offload: parameters to {i['offload_param']}, optimizer state to "
        f"{i['offload_optimizer']}; {s.num_sub_groups} sub-group{_plural(s.num_sub_groups)} "
        f"of at most {i['sub_group_size']:,} elements",
        "",
        "memory",
        _row("host RAM, peak", est.peak_rss_bytes, f"steady {est.steady_rss_bytes / _GIB:.1f} GiB"),
        _row("  fp32 gradients", s.grad_host_bytes),
        _row("  optimizer state / buffers", s.state_host_bytes),
        _row("  weights (model dtype)", s.weights_host_bytes + s.frozen_host_bytes),
        _row("  parameter staging pool", s.param_pool_bytes),
        _row("pinned", s.pinned_bytes),
        _row(
            "device",
            est.device_bytes,
            f"parameters {s.peak_live_numel * s.itemsize / _GIB:.1f} GiB, activations "
            f"{est.activation_bytes / _GIB:.1f} GiB",
        ),
        _row(
            "NVMe",
            s.nvme_bytes,
            f"optimizer state {s.optim_nvme_bytes / _GIB:.1f} GiB, parameters "
            f"{s.param_nvme_bytes / _GIB:.1f} GiB, gradients {s.grad_nvme_bytes / _GIB:.1f} GiB",
        ),
        "",
        "per step",
        f"  {'NVMe read / written':<28}{est.nvme_read_bytes_per_step / _GB:9.1f} GB "
        f"/ {est.nvme_write_bytes_per_step / _GB:.1f} GB",
        f"  {'  of which gradients':<28}{s.grad_read_bytes_per_step / _GB:9.1f} GB "
        f"/ {s.grad_write_bytes_per_step / _GB:.1f} GB",
        f"  {'host <-> device':<28}{est.host_device_bytes_per_step / _GB:9.1f} GB",
        "",
        f"time per step {t.step_s:.2f} s ({est.tokens_per_step / t.step_s:,.0f} tokens/s"
        f"{' per rank' if world_size > 1 else ''}); "
        f"bound: {est.bound}",
        f"  {'compute':<28}{t.compute_s:9.2f} s",
        f"  {'NVMe transfers':<28}{t.nvme_s:9.2f} s",
        f"  {'CPU-Adam (+ norm)':<28}{t.cpu_adam_s:9.2f} s",
        f"  {'host-device copies':<28}{t.copies_s:9.2f} s",
        *([f"  {'engine hooks':<28}{t.hooks_s:9.2f} s"] if t.hooks_s else []),
        *(
            [f"  {'waiting for parameter reads':<28}{t.read_wait_s:9.2f} s"]
            if t.read_wait_s > 0.005
            else []
        ),
        "",
        *(f"- {a}" for a in est.advice),
        "",
        "rates: " + "; ".join(f"{k}: {v}" for k, v in est.rates.sources.items()),
    ]
    return "\n".join(lines)


def _plural(n: int) -> str:
    return "" if n == 1 else "s"


def _row(label: str, nbytes: int, note: str = "") -> str:
    return f"  {label:<28}{nbytes / _GIB:9.1f} GiB" + (f"   ({note})" if note else "")
