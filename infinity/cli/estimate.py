"""`infinity estimate`: what a training run will need and how fast it will go, before it runs.

Owns the command line: the flags (the same as `infinity train`'s where they mean the same),
reading the model's shape, and printing the estimate or writing it as JSON. The model itself
is `infinity.estimate`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from infinity.cli.train_flags import positive_int
from infinity.config import Config, ResolvedConfig, resolve_run
from infinity.estimate.hardware import PROCESS_FLOOR_BYTES
from infinity.models import PRESETS
from infinity.run.inputs import check_lora_rank, check_seq_len
from infinity.run.options import config_from_args, read_config_file
from infinity.run.placement import add_placement_flags, plan_run
from infinity.run.schedule import add_optim_flag
from infinity.utils.fsio import check_output_file, write_json

_GIB = float(1 << 30)
_GB = 1e9


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="host RAM, pinned and device memory, disk, and step time of a run, before it runs",
        description=(
            "Estimate a training run of any causal LM `infinity train` takes (Llama, Qwen2, "
            "Mistral, Gemma, Phi3, GPT-2, ...): peak host RAM, pinned memory, "
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
        help="a Hugging Face model directory (config.json; any family `infinity train` takes), "
        f"or a preset ({', '.join(PRESETS)})",
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
        "--seq-len", type=positive_int, default=512, help="tokens per sequence (default 512)"
    )
    parser.add_argument("--micro-batch", type=positive_int, help="sequences per forward")
    parser.add_argument("--grad-accum", type=positive_int, help="micro batches per step")
    parser.add_argument(
        "--lora-r",
        type=positive_int,
        metavar="R",
        help="LoRA rank: adapters on every linear layer of the blocks, the rest frozen",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer's activations in backward (as `infinity train`)",
    )
    _add_machine_flags(parser)
    add_placement_flags(parser)
    parser.set_defaults(func=run)


def _add_machine_flags(parser: argparse.ArgumentParser) -> None:
    """The machine and the output: accelerator, disk rates, ranks, JSON."""
    from infinity.estimate import DEVICES

    parser.add_argument(
        "--device",
        type=str.lower,  # H100 and h100 are the same GPU
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
        type=positive_int,
        default=1,
        metavar="N",
        help="ranks of the run (torchrun's processes): the batch figures count all of them "
        "(train_batch_size = micro batch x accumulation x N); memory and time are one rank's, "
        "with the parameters, optimizer state and gradients sharded across the N (default 1)",
    )
    add_optim_flag(parser)
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="also write the estimate as JSON; '-' writes it to stdout (the report then "
        "goes to stderr)",
    )


def model_config(name: str):
    """The transformers config of a preset or a model directory (any family): the class
    `infinity train` builds, so the estimate partitions exactly the parameters a run does
    and replays the order of gathers its blocks give."""
    return model_spec(name).hf_config


def model_spec(name: str):
    """The model's description as `infinity train` reads it (`hf_auto.describe`)."""
    from infinity.models import hf_auto

    if name not in PRESETS:
        path = Path(name).expanduser()
        if not path.is_dir():
            what = "a file, not a model directory" if path.exists() else "no such directory"
            raise ValueError(
                f"--model {name}: {what}, and not a preset; give a Hugging Face model "
                f"directory (with config.json) or one of {', '.join(PRESETS)}"
            )
    return hf_auto.describe(name)


def check_paths(args: argparse.Namespace) -> None:
    """Refuse paths that cannot work before any probe runs: an --nvme that is a file, a
    --bench-aio that is missing, a --json that cannot be written."""
    nvme = Path(args.nvme).expanduser() if args.nvme else None
    if nvme and nvme.exists() and not nvme.is_dir():
        raise ValueError(
            f"--nvme {args.nvme} is a file, not a directory; give the swap directory "
            "(it need not exist on this machine: the estimate then assumes its speed)"
        )
    if args.bench_aio and not Path(args.bench_aio).is_file():
        raise ValueError(
            f"--bench-aio {args.bench_aio}: no such file; run `infinity bench aio --path DIR "
            "--json FILE` first and pass FILE"
        )
    if args.json:
        check_output_file("--json", args.json)


def disk_advice(nvme_bytes: int, path: str | None) -> str | None:
    """A line of advice when the swap directory exists here and its file system has less
    free space than the run's NVMe footprint (the same check `infinity train` refuses on)."""
    if not nvme_bytes or not isinstance(path, str) or not Path(path).expanduser().is_dir():
        return None
    free = shutil.disk_usage(Path(path).expanduser()).free
    if free >= nvme_bytes:
        return None
    return (
        f"the swap files need {_size(nvme_bytes)} but {path} has only {_size(free)} free: "
        "`infinity train` would refuse to start; free space or point --nvme at a larger disk"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / _GIB:.1f} GiB" if nbytes >= _GIB / 10 else f"{nbytes / (1 << 20):.1f} MiB"


def run(args: argparse.Namespace) -> int:
    from infinity.estimate import GPUS, estimate, model_shape
    from infinity.models.lora import LoraSpec
    from infinity.run.engine_costs import probe_batch, scale_compute

    check_paths(args)
    spec = model_spec(args.model)
    # The checks `infinity train` makes of the same flags, before any probe allocates.
    check_seq_len(args.seq_len, spec)
    check_lora_rank(LoraSpec(r=args.lora_r) if args.lora_r else None, spec)
    shape = model_shape(spec.hf_config, lora_r=args.lora_r or 0)
    raw = read_config_file(args)  # once: the config and what the user set in it
    config = _one_rank_config(args, raw)
    check_fits(shape, config, args)
    gpu = GPUS.get(args.device)  # placed as `infinity train` places it (run/placement.py)
    memory = (gpu.memory_bytes, f"the {gpu.name}'s memory", gpu.memory_bytes) if gpu else None
    plan = plan_run(args, config, spec.hf_config, gpu=gpu is not None,
                    lora_r=args.lora_r or 0, world_size=args.world_size,
                    device_default=memory, here=gpu is None,
                    given_zero=raw.get("zero_optimization") or {})  # fmt: skip
    if plan is not None:
        config = plan.apply(config)
    # The CPU probes run at a capped batch, scaled to the run's by the FLOPs formula; a GPU's
    # compute comes from its published figures at the run's own batch.
    probe_config, probe_seq_len = config, args.seq_len
    if args.device == "cpu":
        probe_config, probe_seq_len = probe_batch(shape, config, args.seq_len)
    resolved = resolve_run(config, shape.run_facts())  # its precision, as the engine's
    rates = _rates(args, shape, resolved, probe_config, probe_seq_len)
    rates = scale_compute(rates, shape, (probe_config, probe_seq_len), (config, args.seq_len))
    est = estimate(
        shape,
        config,
        rates,
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
        world_size=args.world_size,
        runtime_bytes=PROCESS_FLOOR_BYTES,  # as the plan counts it, not this process's RSS
    )
    zero = config.zero_optimization
    swap_dir = args.nvme or zero.offload_optimizer.nvme_path or zero.offload_param.nvme_path
    if line := disk_advice(est.sizes.nvme_bytes, swap_dir):
        est.advice.append(line)
    # With the JSON on stdout, the report goes to stderr so the two never mix.
    report = sys.stderr if args.json == "-" else sys.stdout
    print(render(est, args.model, args.world_size), file=report)
    if plan is not None:
        print("\n".join(plan.lines()), file=report)
    if args.json:
        out = est.as_json()
        out["placement"] = plan.to_dict() if plan is not None else None
        out["inputs"]["model"] = args.model
        out["inputs"]["world_size"] = args.world_size
        write_json(out, args.json)
        if args.json != "-":
            print(f"wrote {args.json}")
    return 0


def _one_rank_config(args: argparse.Namespace, raw: dict) -> Config:
    """The flags over the config file `raw`, as one rank of the run uses them: its micro batch
    and accumulation (the global batch checked), its nvme_path entry, and no schedule (the
    estimate models memory and time; an "auto" run length would wait for the data)."""
    flags = argparse.Namespace(**{**vars(args), "lr": None, "seed": None})
    config = config_from_args(flags, args.world_size, raw=raw)
    config = config.without_global_batch().for_local_rank(0)
    return config.without_schedule()


def _rates(
    args: argparse.Namespace, shape, config: ResolvedConfig, probe_config: Config, seq_len: int
):
    """The machine's rates for the estimate: on the CPU device with the engine probed at the
    run's sizes (its hooks and copies take the cores that compute), else a GPU's figures."""
    from infinity.estimate import measure_rates

    costs = None
    if args.device == "cpu":
        from infinity.run.engine_costs import probe_engine_costs
        from infinity.zero import model_dtype

        offload = config.zero_optimization.offload_param
        on_nvme = offload.device == "nvme" and args.nvme and Path(args.nvme).is_dir()
        costs = probe_engine_costs(
            model_dtype(config),
            lora_r=shape.lora_r,
            checkpointing=args.activation_checkpointing,
            nvme_path=args.nvme if on_nvme else None,
            like=shape.probe_config,
        )
    return measure_rates(
        shape,
        probe_config,
        device=args.device,
        seq_len=seq_len,
        activation_checkpointing=args.activation_checkpointing,
        nvme_path=args.nvme,
        bench_aio=args.bench_aio,
        module_overhead_s=costs.module_overhead_s if costs else 0.0,
        gather_copy_bytes_per_s=costs.gather_copy_bytes_per_s if costs else 0.0,
    )


def check_fits(shape, config: Config, args: argparse.Namespace) -> None:
    """Before any probe: refuse a run whose activations of one micro batch (from the
    formula) exceed the memory they live in (the GPU's, or this machine's RAM on the CPU
    device) even with activation checkpointing, which no offload setting changes. A run
    that fits with checkpointing gets the report and its advice."""
    from infinity.estimate import GPUS
    from infinity.estimate.result import activation_bytes
    from infinity.zero import model_dtype

    gpu = GPUS.get(args.device)
    if gpu is not None:
        limit, where = gpu.memory_bytes, f"the {gpu.name}'s {_size(gpu.memory_bytes)}"
    else:
        from infinity.utils.host_memory import physical_ram

        limit = physical_ram()
        where = f"this machine's {_size(limit)} of RAM"
    resolved = resolve_run(config, shape.run_facts())
    micro = resolved.train_micro_batch_size_per_gpu
    itemsize = model_dtype(resolved).itemsize
    acts = activation_bytes(shape, micro * args.seq_len, args.seq_len, itemsize, True)
    if acts > limit:
        raise ValueError(
            f"this run cannot fit: the activations of one micro batch ({micro} x "
            f"{args.seq_len} tokens) need {_size(acts)} even with activation checkpointing, "
            f"more than {where}; lower --micro-batch or --seq-len"
        )


def render(est, model: str, world_size: int = 1) -> str:
    """The estimate as the terminal shows it (one rank's, with `world_size` ranks)."""
    lines = [
        *_run_lines(est, model, world_size),
        "",
        *_memory_lines(est),
        "",
        *_time_lines(est, world_size),
        "",
        *(f"- {a}" for a in est.advice),
        "",
        "rates: " + "; ".join(f"{k}: {v}" for k, v in est.rates.sources.items()),
    ]
    return "\n".join(lines)


def _run_lines(est, model: str, world_size: int) -> list[str]:
    """What is estimated: the model, the batch, the offload targets."""
    s, i = est.sizes, est.inputs
    lora = f", LoRA r={i['lora_r']}" if i["lora_r"] else ""
    ranks = (
        f" per rank, x {world_size} ranks = {est.tokens_per_step * world_size} tokens per "
        "optimizer step"
        if world_size > 1
        else " per step"
    )
    return [
        f"{model}: {est.params / 1e9:.2f}B parameters ({est.trainable_params / 1e9:.3f}B "
        f"trainable{lora}), {i['dtype']}, {i['seq_len']} tokens x {i['micro_batch']} x "
        f"{i['gradient_accumulation_steps']} = {est.tokens_per_step} tokens{ranks}, "
        f"device {i['device']}",
        f"offload: parameters to {i['offload_param']}, optimizer state to "
        f"{_state_tier(i['offload_optimizer'], s)}; {s.num_sub_groups} "
        f"sub-group{_plural(s.num_sub_groups)} "
        f"of at most {i['sub_group_size']:,} elements",
    ]


def _state_tier(device: str, s) -> str:
    """Where the optimizer state is, a split (offload_optimizer.max_in_cpu) included."""
    if device != "nvme":
        return device
    if not s.optim_nvme_bytes:
        return "cpu (every sub-group kept in RAM)"
    return "nvme, part kept in RAM" if s.state_host_bytes > s.state_buffer_bytes else "nvme"


def _memory_lines(est) -> list[str]:
    """Memory by tier and by what holds it."""
    s = est.sizes
    return [
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
            f"{est.activation_bytes / _GIB:.1f} GiB"
            + (
                f", gradient sums {s.grad_device_bytes / _GIB:.1f} GiB"
                if s.grad_device_bytes
                else ""
            )
            + (
                f", weights kept across micro batches {s.kept_device_bytes / _GIB:.1f} GiB"
                if s.kept_device_bytes
                else ""
            )
            + (
                f", gradient buckets {s.grad_bucket_device_bytes / _GIB:.1f} GiB"
                if s.grad_bucket_device_bytes
                else ""
            ),
        ),
        _row(
            "NVMe",
            s.nvme_bytes,
            f"optimizer state {s.optim_nvme_bytes / _GIB:.1f} GiB, parameters "
            f"{s.param_nvme_bytes / _GIB:.1f} GiB, gradients {s.grad_nvme_bytes / _GIB:.1f} GiB",
        ),
    ]


def _time_lines(est, world_size: int) -> list[str]:
    """Bytes moved per step, then the step's time and its parts."""
    s, t = est.sizes, est.times
    waits = [
        ("engine hooks", t.hooks_s, t.hooks_s != 0),
        ("waiting for parameter reads", t.read_wait_s, t.read_wait_s > 0.005),
        ("waiting for gradient I/O", t.grad_wait_s, t.grad_wait_s > 0.005),
    ]
    return [
        "per step",
        f"  {'NVMe read / written':<28}{est.nvme_read_bytes_per_step / _GB:9.1f} GB "
        f"/ {est.nvme_write_bytes_per_step / _GB:.1f} GB",
        f"  {'  of which gradients':<28}{s.grad_read_bytes_per_step / _GB:9.1f} GB "
        f"/ {s.grad_write_bytes_per_step / _GB:.1f} GB",
        f"  {'host <-> device':<28}{est.host_device_bytes_per_step / _GB:9.1f} GB",
        *_reduce_line(est),
        "",
        f"time per step {t.step_s:.2f} s ({est.tokens_per_step / t.step_s:,.0f} tokens/s"
        f"{' per rank' if world_size > 1 else ''}); "
        f"bound: {est.bound}",
        f"  {'compute':<28}{t.compute_s:9.2f} s",
        f"  {'NVMe transfers':<28}{t.nvme_s:9.2f} s",
        f"  {'CPU-Adam (+ norm)':<28}{t.cpu_adam_s:9.2f} s",
        f"  {'host-device copies':<28}{t.copies_s:9.2f} s",
        *(f"  {label:<28}{value:9.2f} s" for label, value, shown in waits if shown),
        *(["", *t.timeline.lines()] if t.timeline else []),
    ]


def _reduce_line(est) -> list[str]:
    """The gradients' reduce-scatter per step, with several ranks (in the bytes the comm
    counts, in communication_data_type)."""
    s, accum = est.sizes, est.inputs["gradient_accumulation_steps"]
    if not s.reduce_scatter_bytes_per_micro_step:
        return []
    moved = accum * s.reduce_scatter_bytes_per_micro_step / _GB
    return [f"  {'gradient reduce-scatter':<28}{moved:9.1f} GB   ({est.inputs['comm_dtype']})"]


def _plural(n: int) -> str:
    return "" if n == 1 else "s"


def _row(label: str, nbytes: int, note: str = "") -> str:
    return f"  {label:<28}{nbytes / _GIB:9.1f} GiB" + (f"   ({note})" if note else "")
