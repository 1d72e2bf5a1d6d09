"""What to change when a run is bound by something or does not fit: the estimate's advice,
one line per finding, each naming the setting and what it costs or saves.

Reads a finished `Estimate` (infinity.estimate.result) and the config; computes nothing new.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from infinity.config import Config
from infinity.estimate.bound import Bound

if TYPE_CHECKING:
    from infinity.estimate.result import Estimate

__all__ = ["advice"]

_GIB = float(1 << 30)


def advice(est: Estimate, config: Config, *, ram_bytes: int) -> list[str]:
    """What to change: the bound's usual remedy, and whatever does not fit."""
    zero = config.zero_optimization
    out = []
    if est.bound == Bound.NVME:
        if zero.offload_param.device == "nvme" and ram_bytes:
            need = est.peak_rss_bytes + est.sizes.flat_numel * est.sizes.itemsize
            if need < 0.9 * ram_bytes:
                out.append(
                    f"the disk bounds the step: keep the 16-bit parameters in RAM "
                    f'(offload_param.device "cpu", about {need / _GIB:.1f} GiB peak RSS) '
                    "so forward and backward read nothing from NVMe"
                )
        out.append(_nvme_advice(est))
    elif est.bound == Bound.CPU_ADAM:
        out.append(
            "CPU-Adam bounds the step: more CPU cores (or a larger --grad-accum to run it "
            "less often per token) shorten it"
        )
    elif est.bound == Bound.COPIES:
        out.append(
            "host-device copies bound the step: keep offload_param.pin_memory true, raise "
            "stage3_max_live_parameters so fewer parameters are gathered twice, or raise "
            "--micro-batch so each copy serves more tokens"
        )
    if est.times.grad_wait_s > 0.03 * est.times.step_s:
        out.append(
            f"backward waits {est.times.grad_wait_s:.2f} s a step for spilled gradients a "
            "layer returns to after they were written: a zero_optimization.sub_group_size "
            "of at least a layer's parameters keeps every layer within two sub-groups (the "
            "optimizer's offload_optimizer.buffer_count buffers grow with it)"
        )
    gpu = est.rates.gpu
    device_full = gpu is not None and est.device_bytes > gpu.memory_bytes
    if est.bound == Bound.COMPUTE:
        out.append(_compute_advice(est, device_full))
    if device_full:
        out.append(
            f"device memory {est.device_bytes / _GIB:.1f} GiB exceeds the {gpu.name}'s "
            f"{gpu.memory_bytes / _GIB:.0f} GiB: enable --activation-checkpointing, lower "
            "--micro-batch or stage3_max_live_parameters"
        )
    if ram_bytes and est.peak_rss_bytes > ram_bytes:
        fix = (
            "lower zero_optimization.sub_group_size or offload_optimizer.buffer_count"
            if zero.offload_optimizer.device == "nvme"
            else "put the optimizer state and parameters on NVMe (--nvme PATH)"
        )
        out.append(
            f"peak host memory {est.peak_rss_bytes / _GIB:.1f} GiB exceeds this machine's "
            f"{ram_bytes / _GIB:.1f} GiB of RAM: {fix}"
        )
    return out


def _nvme_advice(est: Estimate) -> str:
    """The remedy for a disk-bound step, by which traffic dominates: parameter reads recur
    every micro step (more accumulation multiplies them), the optimizer's state moves once
    per step whatever the batch."""
    s, accum = est.sizes, est.inputs["gradient_accumulation_steps"]
    param_reads = s.param_read_bytes_per_step(accum)
    if param_reads > est.nvme_read_bytes_per_step + est.nvme_write_bytes_per_step - param_reads:
        return (
            f"parameter reads in forward and backward are most of the disk traffic "
            f"({param_reads / 1e9:.1f} GB per step, again for every micro batch, so --grad-accum "
            "multiplies them): raise --micro-batch so each read serves more tokens, raise "
            "stage3_max_live_parameters so fewer are read twice, or keep the parameters in RAM "
            '(offload_param.device "cpu") on a machine that holds them'
        )
    return (
        "the optimizer moves its state once per step whatever the batch: raise "
        "--grad-accum (or --micro-batch) to spread it over more tokens, or put the swap "
        "directory on a faster SSD (RAID 0 of several)"
    )


OPTIMIZER_SHARE = 0.25
"""Of a compute-bound step, the share the optimizer step (after forward and backward) may
take before the advice names it."""


def _compute_advice(est: Estimate, device_full: bool) -> str:
    """Compute is the largest part: say whether the optimizer step, which runs after forward
    and backward, still costs much, and what raises throughput."""
    t = est.times
    grow = (
        ""
        if device_full
        else "; a larger --micro-batch raises throughput while device memory allows"
    )
    if t.optimizer_step_s <= OPTIMIZER_SHARE * t.step_s:
        return "compute bounds the step: offload costs little here" + grow
    return (
        f"compute is the largest part of the step, but the optimizer step adds "
        f"{t.optimizer_step_s:.1f} s of {t.step_s:.1f} after forward and backward (its NVMe "
        "transfers and CPU-Adam): a larger --grad-accum spreads it over more tokens" + grow
    )
