"""The rates the estimate turns bytes and FLOPs into seconds with, and where each came from.

A named GPU contributes its published peak (16-bit tensor and fp32 FLOP/s, memory, host link),
derated by `GPU_UTILIZATION`; the CPU device is measured: a short probe times one of the
model's own blocks and its head, forward and backward, on this machine. CPU-Adam is a probe
of `adam_step_flat` (the optimizer's kernel), the gradient-norm pass a probe of the same
reduction, host copies a probe of a copy. Disk
rates come from an `infinity bench aio --json` file, or a quick O_DIRECT probe of the NVMe
directory, or an assumed PCIe 4.0 SSD (said so in `Rates.sources`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from infinity.config import AioConfig
from infinity.io.aio import AioHandle, aligned_empty, preallocate
from infinity.models import LlamaConfig, LlamaForCausalLM
from infinity.models.llama import LlamaDecoderLayer, rope_cos_sin
from infinity.optim import adam_step_flat
from infinity.optim.adam8 import adam8_step_flat
from infinity.utils.quant_blocks import block_count

GPU_UTILIZATION = 0.5
"""Fraction of the published peak a training step sustains (model FLOPs utilization)."""
ASSUMED_NVME_READ_BPS = 3.0e9
ASSUMED_NVME_WRITE_BPS = 2.0e9
"""A PCIe 4.0 SSD's sustained O_DIRECT rates, used when nothing was measured."""
CUDA_RUNTIME_HOST_BYTES = 1 << 30
"""Host memory of the CUDA runtime and its libraries in a training process (about 1 GiB)."""
PROCESS_FLOOR_BYTES = 360 << 20
"""RSS of an `infinity train` process before its model: the interpreter, torch,
transformers, the tokenizer and the data's index (349 MiB measured at the placement of a
27M Llama, and 350 MiB in `infinity estimate`, with torch 2.13's CPU build on Linux x86-64;
rounded up). The plan counts this fixed figure, not the RSS of the moment, so that
`infinity estimate` and `infinity train` with the same flags make the same plan (see [Note:
a budget is a bound] in infinity/estimate/placement.py)."""
RSS_MARGIN_BYTES = 64 << 20
"""RAM of a budget the planner leaves unplanned: what the estimate does not count (thread
stacks and allocator arenas of the I/O and checkpoint threads, Python objects per
parameter), measured at 17-38 MiB over the estimate's peak for models of 20K to 27M
parameters; see [Note: a budget is a bound]."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Published figures of one accelerator (dense, no sparsity)."""

    name: str
    tensor_flops: float
    """16-bit tensor-core FLOP/s (bf16/fp16, fp32 accumulate)."""
    fp32_flops: float
    memory_bytes: int
    host_link_bps: float
    """Host <-> device copy rate over PCIe as measured in practice (about 80% of the link)."""


GPUS = {
    "h100": GpuSpec("NVIDIA H100 SXM5 80GB", 989e12, 67e12, 80 << 30, 50e9),
    "h200": GpuSpec("NVIDIA H200 SXM 141GB", 989e12, 67e12, 140 << 30, 50e9),
    "a100": GpuSpec("NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, 80 << 30, 25e9),
    "a100-40": GpuSpec("NVIDIA A100 40GB", 312e12, 19.5e12, 40 << 30, 25e9),
    "l40s": GpuSpec("NVIDIA L40S 48GB", 362e12, 91.6e12, 48 << 30, 25e9),
    "4090": GpuSpec("NVIDIA GeForce RTX 4090 24GB", 165e12, 82.6e12, 24 << 30, 25e9),
    "3090": GpuSpec("NVIDIA GeForce RTX 3090 24GB", 71e12, 35.6e12, 24 << 30, 25e9),
    "v100": GpuSpec("NVIDIA V100 SXM2 32GB", 125e12, 15.7e12, 32 << 30, 12e9),
}
DEVICES = ("cpu", *GPUS)


@dataclass(slots=True)
class Rates:
    """Seconds per unit of work, with a note on where each rate came from."""

    device: str
    gpu: GpuSpec | None
    compute_s: float
    """Forward + backward compute of one micro batch (recomputation included)."""
    adam_numel_per_s: float
    norm_bytes_per_s: float
    copy_bytes_per_s: float
    """Home -> device copies: the host link of a GPU, a memory copy on the CPU device."""
    nvme_read_bps: float
    nvme_write_bps: float
    sources: dict[str, str] = field(default_factory=dict)
    fresh_copy_bytes_per_s: float = 0.0
    """Writes into newly allocated memory (the gradients autograd makes on the CPU device);
    0: as `copy_bytes_per_s`."""
    module_overhead_s: float = 0.0
    """What the engine adds per module with parameters in one micro step on the CPU device
    (its gather, release and gradient hooks; `infinity.run.engine_costs`); 0: not
    probed. On a GPU the hooks run while the device computes."""
    gather_copy_bytes_per_s: float = 0.0
    """The CPU device's gathers from NVMe as the engine copied them (staging buffer into a
    recycled buffer while the other core computes; `infinity.run.engine_costs`); 0: at
    `copy_bytes_per_s`."""


# -- compute ---------------------------------------------------------------------------------


def passes(*, frozen: bool, checkpointing: bool) -> float:
    """Forward-equivalents of one training micro step: the forward, a backward of two (one
    when the weights are frozen: no weight gradients), one more with recomputation."""
    return 1.0 + (1.0 if frozen else 2.0) + (1.0 if checkpointing else 0.0)


def gpu_compute_s(gpu: GpuSpec, forward_flops: float, dtype: torch.dtype, n_passes: float) -> float:
    """A micro step's compute from its forward FLOPs on a named GPU: peak x utilization."""
    peak = gpu.fp32_flops if dtype == torch.float32 else gpu.tensor_flops
    return forward_flops * n_passes / (peak * GPU_UTILIZATION)


def probe_compute_s(
    config: LlamaConfig, micro: int, seq_len: int, dtype: torch.dtype, *, lora_r: int = 0,
    checkpointing: bool,
) -> float:  # fmt: skip
    """Seconds of one micro step's forward + backward on this CPU: the model cut to one
    decoder layer (embedding, the layer, final norm, head and loss, in the model dtype)
    timed whole, plus one real decoder block (its norms, attention, MLP and autograd) for
    each further layer. Recomputation adds one forward of each block. With `lora_r` the
    base weights are frozen and every linear layer of the blocks carries peft's adapters of
    rank r, as `apply_lora` builds them (their small matmuls, scaling and gradients)."""
    frozen = lora_r > 0
    cos, sin = rope_cos_sin(config, torch.arange(seq_len), dtype)
    block = _adapted(_filled(LlamaDecoderLayer(config), dtype, frozen), lora_r)
    x = torch.randn(micro, seq_len, config.hidden_size).to(dtype).requires_grad_()

    def block_step():
        y = block(x, cos, sin)
        if checkpointing:
            with torch.no_grad():
                block(x, cos, sin)
        y.backward(torch.ones_like(y))

    layers_s = (config.num_hidden_layers - 1) * _median_s(block_step, repeats=3)
    one = _filled(LlamaForCausalLM(dataclasses.replace(config, num_hidden_layers=1)), dtype,
                  frozen)  # fmt: skip
    one.model.layers[0] = _adapted(one.model.layers[0], lora_r)
    one.set_gradient_checkpointing(checkpointing)
    ids = torch.randint(0, config.vocab_size, (micro, seq_len))

    def model_step():
        one(ids, ids).backward()
        one.zero_grad(set_to_none=True)

    return layers_s + _median_s(model_step, repeats=3)


def _adapted(block: nn.Module, lora_r: int) -> nn.Module:
    """`block` with LoRA adapters of rank `lora_r` on each of its linear layers (0: as is)."""
    if not lora_r:
        return block
    from infinity.models.lora import LoraSpec, inject_lora

    names = sorted(
        {n.rsplit(".", 1)[-1] for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    )
    return inject_lora(block, LoraSpec(r=lora_r), names)


def _filled(module: nn.Module, dtype: torch.dtype, frozen: bool) -> nn.Module:
    """`module` in `dtype` with small normal weights (no denormals to slow it down)."""
    module = module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
            p.requires_grad_(not frozen)
    return module


def _median_s(fn, *, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- host memory: CPU-Adam, the gradient norm, copies ------------------------------------------


def probe_adam_numel_per_s(
    dtype: torch.dtype, numel: int = 1 << 23, *, eight_bit: bool = False
) -> float:
    """Elements per second of `adam_step_flat` (or with `eight_bit` `adam8_step_flat`) as
    the optimizer runs it (fp32 master and gradients, a 16-bit copy-out for a 16-bit
    model)."""
    g = torch.Generator().manual_seed(0)
    param, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    if eight_bit:
        nb = block_count(numel)
        codes = (
            torch.full((numel,), 127, dtype=torch.uint8),
            torch.zeros(numel, dtype=torch.uint8),
        )
        moments = (*codes, torch.zeros(nb), torch.zeros(nb))
        step_fn = adam8_step_flat
    else:
        moments, step_fn = (torch.zeros(numel), torch.zeros(numel)), adam_step_flat
    half = None if dtype == torch.float32 else torch.empty(numel, dtype=dtype)
    step = [0]

    def run():
        step[0] += 1
        step_fn(param, grad, *moments, step=step[0], lr=1e-4, weight_decay=0.01,
                half_out=half)  # fmt: skip

    return numel / _median_s(run, repeats=5)


def probe_norm_bytes_per_s(numel: int = 1 << 24) -> float:
    """Bytes per second of the gradient-norm pass (row norms of a flat fp32 buffer)."""
    flat = torch.randn(numel)
    rows = flat.view(-1, 4096)
    return flat.nbytes / _median_s(lambda: torch.linalg.vector_norm(rows, dim=1), repeats=5)


def probe_copy_bytes_per_s(numel: int = 1 << 24) -> float:
    """Bytes per second of a host copy the size of a large parameter (bytes copied) between
    buffers already in memory (a gradient's add into its fp32 sum)."""
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    return src.nbytes / _median_s(lambda: dst.copy_(src), repeats=5)


def probe_fresh_copy_bytes_per_s(numel: int = 1 << 24) -> float:
    """Bytes per second of the same copy into a newly allocated buffer, as autograd writes a
    gradient on the CPU device: the kernel maps and zeroes its pages first, which on this VM
    costs more than the copy."""
    src = torch.randn(numel)
    return src.nbytes / _median_s(lambda: torch.empty_like(src).copy_(src), repeats=5)


# -- the disk --------------------------------------------------------------------------------


def rates_from_bench_aio(path: str | os.PathLike) -> tuple[float, float]:
    """Best read and write bytes/s of an `infinity bench aio --json` file (overwrites only:
    the swap files are pre-allocated)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--bench-aio {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--bench-aio {path} is not JSON ({e}); pass the file `infinity bench aio --json "
            "FILE` wrote"
        ) from None
    records = data.get("records", []) if isinstance(data, dict) else data
    best = {"read": 0.0, "write": 0.0}
    for rec in records if isinstance(records, list) else []:
        if isinstance(rec, dict) and rec.get("op") in best and not rec.get("fresh_file"):
            best[rec["op"]] = max(best[rec["op"]], float(rec.get("gbps", 0.0)))
    if not best["read"] or not best["write"]:
        raise ValueError(
            f"--bench-aio {path} has no read and write records with 'gbps'; run "
            "`infinity bench aio --path DIR --json FILE` and pass FILE"
        )
    return best["read"] * 1e9, best["write"] * 1e9


def probe_nvme(directory: str | os.PathLike, nbytes: int = 256 << 20) -> tuple[float, float]:
    """Read and write bytes/s of `directory`: one pre-allocated file written and read with
    O_DIRECT in 8 MiB blocks (a quick look; `infinity bench aio` sweeps properly)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ValueError(
            f"--nvme {directory} is not a writable directory, so its speed cannot be probed; "
            "create it, or pass --bench-aio FILE from a run of `infinity bench aio` there"
        )
    buf = aligned_empty(nbytes, torch.uint8)
    buf.fill_(1)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".infinity-estimate-") as tmp:
        path = os.path.join(tmp, "probe.swp")
        preallocate(path, nbytes)
        with AioHandle.from_config(AioConfig(block_size=8 << 20, queue_depth=32)) as aio:
            aio.write(buf, path)  # warm-up: the first write allocates blocks
            t0 = time.perf_counter()
            aio.write(buf, path)
            t1 = time.perf_counter()
            aio.read(buf, path)
            t2 = time.perf_counter()
    return nbytes / (t2 - t1), nbytes / (t1 - t0)
