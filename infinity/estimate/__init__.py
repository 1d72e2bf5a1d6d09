"""`infinity estimate`'s model: what a run needs (host RAM, pinned memory, device memory,
disk) and how long its steps take, before anything is allocated.

Owns the estimate only: the byte terms call the engine's own sizing functions
(`infinity.estimate.sizing`), the rates come from published GPU figures or short probes on
this machine (`infinity.estimate.hardware`), and `infinity.estimate.result` combines them and
says what bounds the step. The engine never imports this package.
"""

from __future__ import annotations

import os
import shutil

from infinity.config import Config, resolve_run
from infinity.estimate import hardware
from infinity.estimate.hardware import DEVICES, GPUS, Rates
from infinity.estimate.result import Bound, Estimate, StepTimes, estimate
from infinity.estimate.shapes import ModelShape, model_shape
from infinity.estimate.sizing import Sizes, sizes
from infinity.zero import model_dtype

__all__ = [
    "DEVICES",
    "GPUS",
    "Bound",
    "Estimate",
    "ModelShape",
    "Rates",
    "Sizes",
    "StepTimes",
    "estimate",
    "measure_rates",
    "model_shape",
    "sizes",
]


def measure_rates(
    shape: ModelShape,
    config: Config,
    *,
    device: str,
    seq_len: int,
    activation_checkpointing: bool = False,
    nvme_path: str | None = None,
    bench_aio: str | None = None,
    module_overhead_s: float = 0.0,
    gather_copy_bytes_per_s: float = 0.0,
) -> Rates:
    """The rates for `device` ("cpu": probed here; a name in `GPUS`: published figures),
    CPU-Adam and the norm pass probed here, the disk from `bench_aio` (a `bench aio --json`
    file), else a probe of `nvme_path` when the tiers use NVMe, else an assumed SSD.
    `module_overhead_s` and `gather_copy_bytes_per_s`: the engine's cost per module on this
    CPU and the rate its gathers copied at, which a caller that may run the engine probes
    (`infinity.run.engine_costs`; 0: not probed)."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r} is not known; choose one of {', '.join(DEVICES)}")
    config = resolve_run(config, shape.run_facts())
    dtype = model_dtype(config)
    micro = config.train_micro_batch_size_per_gpu
    sources: dict[str, str] = {}
    gpu = GPUS.get(device)
    if gpu is None:
        compute_s, copy, fresh = _cpu_rates(
            shape, micro, seq_len, dtype, activation_checkpointing, sources,
            hooks_probed=bool(module_overhead_s), gathers_probed=bool(gather_copy_bytes_per_s),
        )  # fmt: skip
    else:
        compute_s, copy, fresh = _gpu_rates(
            gpu, shape, micro, seq_len, dtype, activation_checkpointing, sources
        )
    read, write, sources["nvme"] = _disk(config, nvme_path, bench_aio)
    eight_bit = config.optimizer.eight_bit
    sources["cpu_adam"] = (
        f"probe: {'adam8_step_flat' if eight_bit else 'adam_step_flat'} on this CPU"
    )
    return Rates(
        device=device,
        gpu=gpu,
        compute_s=compute_s,
        adam_numel_per_s=hardware.probe_adam_numel_per_s(dtype, eight_bit=eight_bit),
        norm_bytes_per_s=hardware.probe_norm_bytes_per_s(),
        copy_bytes_per_s=copy,
        fresh_copy_bytes_per_s=fresh,
        nvme_read_bps=read,
        nvme_write_bps=write,
        sources=sources,
        module_overhead_s=module_overhead_s if gpu is None else 0.0,
        gather_copy_bytes_per_s=gather_copy_bytes_per_s if gpu is None else 0.0,
    )


def _cpu_rates(
    shape: ModelShape,
    micro: int,
    seq_len: int,
    dtype,
    checkpointing: bool,
    sources: dict,
    *,
    hooks_probed: bool,
    gathers_probed: bool,
) -> tuple[float, float, float]:
    """(compute seconds of a micro batch, copy and fresh-copy bytes/s), probed on this CPU;
    where each came from goes into `sources`."""
    compute_s = hardware.probe_compute_s(
        shape.probe_config, micro, seq_len, dtype,
        lora_r=shape.lora_r, checkpointing=checkpointing,
    )  # fmt: skip
    copy = hardware.probe_copy_bytes_per_s()
    fresh = hardware.probe_fresh_copy_bytes_per_s()
    kind = shape.dims.model_type
    stand_in = "" if kind == "llama" else f" (a Llama of the {kind} model's sizes)"
    sources["compute"] = (
        "probe: the model cut to one layer, and a block per further layer, forward and "
        f"backward on this CPU{stand_in}"
    )
    sources["copies"] = "probe: a host memory copy, and one into new memory (gradients)"
    if hooks_probed:
        sources["hooks"] = (
            "probe: a Llama of three blocks of this model's sizes (a tiny one for full "
            "fine-tuning) through the engine against plain PyTorch"
        )
    if gathers_probed:
        sources["copies"] += "; gathers at the rate the engine copied them in that probe"
    return compute_s, copy, fresh


def _gpu_rates(
    gpu, shape: ModelShape, micro: int, seq_len: int, dtype, checkpointing: bool, sources: dict
) -> tuple[float, float, float]:
    """(compute seconds of a micro batch, copy bytes/s, 0) from `gpu`'s published figures."""
    flops = shape.train_flops_per_token(seq_len) / 3 * micro * seq_len  # one forward
    n = hardware.passes(frozen=shape.lora_r > 0, checkpointing=checkpointing)
    compute_s = hardware.gpu_compute_s(gpu, flops, dtype, n)
    peak = "fp32" if dtype.itemsize == 4 else "16-bit tensor"
    sources["compute"] = (
        f"{gpu.name}: published {peak} peak x {hardware.GPU_UTILIZATION:.0%} utilization"
    )
    sources["copies"] = f"{gpu.name}: PCIe {gpu.host_link_bps / 1e9:.0f} GB/s"
    return compute_s, gpu.host_link_bps, 0.0


def _disk(config: Config, nvme_path: str | None, bench_aio: str | None) -> tuple[float, float, str]:
    zero = config.zero_optimization
    uses_nvme = "nvme" in (zero.offload_param.device, zero.offload_optimizer.device)
    path = nvme_path or zero.offload_optimizer.nvme_path or zero.offload_param.nvme_path
    if bench_aio:
        read, write = hardware.rates_from_bench_aio(bench_aio)
        return read, write, f"bench aio file {bench_aio}: best read and write"
    if uses_nvme and path and _probeable(path):
        if shutil.disk_usage(path).free >= 2 * _PROBE_BYTES:
            read, write = hardware.probe_nvme(path, _PROBE_BYTES)
            return read, write, f"probe: 256 MiB O_DIRECT write and read in {path}"
        why = f"{path} has too little free space to probe"
    elif uses_nvme and path:
        why = f"{path} is not here to probe"
    else:
        why = "nothing measured"
    return (
        hardware.ASSUMED_NVME_READ_BPS,
        hardware.ASSUMED_NVME_WRITE_BPS,
        f"assumed PCIe 4.0 SSD ({why}; pass --bench-aio FILE for measured rates)",
    )


_PROBE_BYTES = 256 << 20


def _probeable(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK)
