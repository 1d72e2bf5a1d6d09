"""One estimate: memory, disk, traffic and the time of a step, what bounds it, what to change.

`estimate(shape, config, rates, ...)` combines the byte terms of `sizing` with the rates of
`hardware` into an `Estimate` record; `as_json()` is what `infinity estimate --json` writes.

[Note: the step model] The forward and backward of an accumulation window cost the
slower of two things that run at once: the compute of its micro steps (see
`hardware.passes`; on the CPU device the gather and gradient copies and the engine's hooks
take the same cores and add to it, on a GPU a copy stream overlaps the copies), and the
disk: the NVMe parameter reads, the spilled fp32 gradients written in backward and read
back for the next micro step, and the optimizer state the last sweep read ahead. The
optimizer step reads and writes the rest of the state (and the step's share of the
gradients, and writes the new 16-bit weights) one sub-group at a time while CPU-Adam steps
the previous one, so it costs the slower of the two (their sum with `pipeline_read` or
`pipeline_write` off), plus the gradient-norm pass before it. The disk's reads and writes
are taken one after the other at their measured rates.

On the CPU device with parameters on NVMe the reads do not hide behind the cores as a
whole: they run ahead only as far as the prefetch window (`stage3_prefetch_bucket_size`
elements along the trace) and the staging pool (`offload_param.buffer_count`) let them, so
a micro step is replayed gather by gather (`infinity.estimate.pipeline`): the cores run
each gather's share of the compute, copies and hooks and wait where its read has not
landed. With the cores the slower side and reads that run far enough ahead, this is the
cores' time; a disk slower than the cores, or a window too short, adds the waits.

Some of the spilled gradients' transfers backward cannot run ahead of: a sub-group a layer
returns to after it was written is read back while the add waits, and a small add to a
sub-group on disk reads and writes its rows, each after the sub-group's write has landed
(`infinity.estimate.grad_traffic`). Those bytes, at the disk's rates, add to the cores'
side (`grad_wait_s`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from infinity.accelerator.recycled import MIN_BYTES
from infinity.config import Config, ResolvedConfig, resolve_run
from infinity.estimate.bound import Bound
from infinity.estimate.hardware import CUDA_RUNTIME_HOST_BYTES, Rates, passes
from infinity.estimate.pipeline import Prefetch, micro_step_s, prefetch_of
from infinity.estimate.shapes import ModelShape
from infinity.estimate.sizing import Sizes, sizes
from infinity.estimate.timeline import Timeline, Window, step_timeline
from infinity.utils.host_memory import physical_ram
from infinity.zero.build import builds_in_files

_GIB = float(1 << 30)


@dataclass(slots=True)
class StepTimes:
    """Seconds of one optimizer step, by component (see [Note: the step model])."""

    compute_s: float
    """Forward + backward compute of every micro step."""
    nvme_s: float
    """Every NVMe transfer of the step: parameter reads, spilled gradients, the optimizer's
    state and new weights."""
    cpu_adam_s: float
    """CPU-Adam over the trainable elements, and the gradient-norm pass."""
    copies_s: float
    """Host <-> device copies of gathered parameters and gradients (on the CPU device, the
    gradients' adds into their fp32 sums)."""
    hooks_s: float
    """The engine's own work per module (gather, release and gradient hooks) on the CPU
    device, where it takes the cores that compute."""
    read_wait_s: float
    """Time the cores wait for parameter reads in forward and backward (the CPU device
    with parameters on NVMe; see [Note: the step model])."""
    grad_wait_s: float
    """Time backward waits for the spilled gradients' transfers it cannot run ahead of
    (infinity/estimate/grad_traffic.py), in every micro step of the step."""
    micro_step_s: float
    """Forward + backward of one micro step: its share of the accumulation window, which
    costs the slower of the compute (with the copies, on the CPU device) and the disk."""
    optimizer_step_s: float
    """From the end of backward to the end of the step."""
    step_s: float
    """The critical path of the step's timeline (see [Note: the step's timeline])."""
    ahead_s: float = 0.0
    """CPU-Adam run beside the last backward by the overlapped step (a GPU only)."""
    timeline: Timeline | None = None


@dataclass(slots=True)
class Estimate:
    """Everything `infinity estimate` reports; bytes are per rank."""

    sizes: Sizes
    times: StepTimes
    rates: Rates
    peak_rss_bytes: int
    steady_rss_bytes: int
    device_bytes: int
    activation_bytes: int
    bound: Bound
    advice: list[str]
    params: int
    trainable_params: int
    tokens_per_step: int
    inputs: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        s = self.sizes
        return {
            "peak_rss_bytes": self.peak_rss_bytes,
            "steady_rss_bytes": self.steady_rss_bytes,
            "host_bytes": s.host_bytes,
            "pinned_bytes": s.pinned_bytes,
            "device_bytes": self.device_bytes,
            "activation_bytes": self.activation_bytes,
            "nvme_bytes": s.nvme_bytes,
            "nvme_read_bytes_per_step": self.nvme_read_bytes_per_step,
            "nvme_write_bytes_per_step": self.nvme_write_bytes_per_step,
            "host_device_bytes_per_step": self.host_device_bytes_per_step,
            "step_seconds": self.times.step_s,
            "tokens_per_second": self.tokens_per_step / self.times.step_s,
            "bound": self.bound,
            "advice": self.advice,
            "times": asdict(self.times),
            "params": self.params,
            "trainable_params": self.trainable_params,
            "tokens_per_step": self.tokens_per_step,
            "terms": asdict(s),
            "rates": {k: v for k, v in asdict(self.rates).items() if k != "gpu"},
            "inputs": self.inputs,
        }

    @property
    def nvme_read_bytes_per_step(self) -> int:
        s, accum = self.sizes, self.inputs["gradient_accumulation_steps"]
        return (
            s.optim_read_bytes_per_step
            + s.grad_read_bytes_per_step
            + s.param_read_bytes_per_step(accum)
        )

    @property
    def nvme_write_bytes_per_step(self) -> int:
        s = self.sizes
        return (
            s.optim_write_bytes_per_step
            + s.grad_write_bytes_per_step
            + s.param_write_bytes_per_step
        )

    @property
    def host_device_bytes_per_step(self) -> int:
        return self.sizes.host_device_bytes_per_step(self.inputs["gradient_accumulation_steps"])


def estimate(
    shape: ModelShape,
    config: Config,
    rates: Rates,
    *,
    seq_len: int,
    activation_checkpointing: bool = False,
    runtime_bytes: int | None = None,
    ram_bytes: int | None = None,
    grads_spill: bool | None = None,
    aliases: bool | None = None,
    recycles: bool = True,
    world_size: int = 1,
) -> Estimate:
    """The estimate for `shape` trained under `config` (unresolved, as given) at `rates`.
    `runtime_bytes`: host memory of the Python process before any model (default: this
    process's RSS now); `ram_bytes`: the machine's RAM for the advice (default: this one's);
    `grads_spill`, `aliases`: see `sizes`; `recycles`: new buffers on the CPU device reuse
    freed ones (see [Note: recycled device buffers] in infinity/accelerator/recycled.py;
    False replays runs recorded before they did); `world_size`: the ranks sharing the
    parameters (the bytes are one rank's, see `sizes`)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    config = resolve_run(config, shape.run_facts())
    gpu = rates.gpu
    alias = gpu is None and aliases is not False  # only the CPU device shares host memory
    sz = sizes(
        shape, config, pins=gpu is not None, grads_spill=grads_spill,
        checkpointing=activation_checkpointing, aliases=alias, world_size=world_size,
    )  # fmt: skip
    micro = config.train_micro_batch_size_per_gpu
    accum = config.gradient_accumulation_steps
    tokens = micro * seq_len
    offload = config.zero_optimization.offload_optimizer
    pipelined = offload.pipeline_read and offload.pipeline_write
    reads = None
    if gpu is None and sz.param_read_bytes_per_micro_step:
        reads = prefetch_of(shape, config, checkpointing=activation_checkpointing)
    recycled = gpu is None and recycles
    n = passes(frozen=shape.lora_r > 0, checkpointing=activation_checkpointing)
    times = step_times(
        sz, rates, accum=accum, pipelined=pipelined, modules=shape.modules, prefetch=reads,
        recycled=recycled, backward_share=(n - 1) / n,
    )  # fmt: skip
    acts = activation_bytes(shape, tokens, seq_len, sz.itemsize, activation_checkpointing)
    memory = dict(acts=acts, alias=alias, recycled=recycled, runtime_bytes=runtime_bytes)
    device, steady, peak = memory_of(shape, config, sz, gpu=gpu is not None, **memory)
    est = Estimate(
        sizes=sz, times=times, rates=rates, peak_rss_bytes=peak, steady_rss_bytes=steady,
        device_bytes=device, activation_bytes=acts, bound=bound_of(times), advice=[],
        params=shape.numel, trainable_params=shape.trainable_numel, tokens_per_step=tokens * accum,
        inputs=_inputs(shape, config, rates, seq_len, activation_checkpointing),
    )  # fmt: skip
    if ram_bytes is None:  # this machine's RAM says nothing about a GPU machine's
        ram_bytes = physical_ram() if gpu is None else 0
    from infinity.estimate.advice import advice  # it reads a finished Estimate

    est.advice = advice(est, config, ram_bytes=ram_bytes)
    return est


def memory_of(
    shape: ModelShape,
    config: Config,
    sz: Sizes,
    *,
    gpu: bool,
    acts: int,
    alias: bool,
    recycled: bool,
    runtime_bytes: int | None,
) -> tuple[int, int, int]:
    """(device bytes, steady RSS, peak RSS) of the run: the live set, the activations, the
    largest gradient, and the gradient sums and gradient buckets kept there on the device;
    on the CPU device (`gpu` False) that memory is host RAM, less what gathers alias of
    host homes."""
    largest = max((p.numel for p in shape.params if p.trainable), default=0)
    device = sz.peak_live_numel * sz.itemsize + acts + largest * sz.itemsize
    device += sz.grad_device_bytes + sz.kept_device_bytes + sz.grad_bucket_device_bytes
    if recycled and (sz.gather_bytes_per_micro_step or sz.kept_gather_bytes_per_step):
        device += recycled_slack_bytes(shape, sz.itemsize)
    runtime = current_rss() if runtime_bytes is None else runtime_bytes
    if gpu:
        runtime += CUDA_RUNTIME_HOST_BYTES
    # The CPU device's memory is host RAM; gathers from host homes alias them (no RAM).
    host_homes = config.zero_optimization.offload_param.device != "nvme"
    gathered = sz.peak_live_numel * sz.itemsize + sz.kept_device_bytes
    aliased = gathered if not gpu and host_homes and alias else 0
    steady = runtime + sz.host_bytes + (0 if gpu else device - aliased)
    peak = max(
        steady + grad_transient_bytes(shape),
        runtime + sz.host_bytes + build_partition_bytes(shape, config, sz.itemsize),
    )
    return device, steady, peak


def _inputs(
    shape: ModelShape, config: ResolvedConfig, rates: Rates, seq_len: int, checkpointing: bool
) -> dict:
    """What the estimate was made for, as its JSON records it."""
    zero = config.zero_optimization
    return {
        "model_params": shape.numel,
        "dtype": config.precision,
        "comm_dtype": config.communication_dtype,
        "device": rates.device,
        "seq_len": seq_len,
        "micro_batch": config.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "activation_checkpointing": checkpointing,
        "lora_r": shape.lora_r,
        "offload_param": zero.offload_param.device,
        "offload_optimizer": zero.offload_optimizer.device,
        "sub_group_size": zero.sub_group_size,
        "max_live_parameters": zero.max_live_parameters,
    }


def step_times(
    sz: Sizes,
    rates: Rates,
    *,
    accum: int,
    pipelined: bool = True,
    modules: int = 0,
    prefetch: Prefetch | None = None,
    recycled: bool = True,
    backward_share: float = 2 / 3,
) -> StepTimes:
    """See [Note: the step model] and [Note: the step's timeline] (`backward_share`: of a
    micro step, its backward's); without `pipelined` (offload_optimizer.pipeline_read and
    pipeline_write) the state's transfers and CPU-Adam take turns. `modules`: the model's
    modules with parameters (the engine's hooks cost `rates.module_overhead_s` each).
    `prefetch`: the gathers of a micro step whose parameter reads the CPU device's cores
    wait for (None: the reads overlap the cores' work as a whole). `recycled`: see
    `micro_step_copies_s`."""
    read, write = rates.nvme_read_bps, rates.nvme_write_bps
    compute = rates.compute_s
    copies = micro_step_copies_s(sz, rates, recycled=recycled)
    kept = kept_copies_s(sz, rates, recycled=recycled)  # once a step
    hooks = modules * rates.module_overhead_s if rates.gpu is None else 0.0
    window_io, grad_wait = _window_disk_s(sz, read, write, accum)
    cores = compute + copies + hooks
    micro = cores
    if rates.gpu is None and prefetch is not None:
        # The last sweep's reads ahead were queued before the first parameter read (spread
        # over the window's micro steps, which the replay takes alike).
        ahead = sz.optim_ahead_read_bytes / read / accum
        micro = micro_step_s(prefetch, cpu_s=(compute, copies, hooks), read_bps=read,
                             itemsize=sz.itemsize, disk_busy_s=ahead)  # fmt: skip
    gpu = rates.gpu is not None
    if not gpu:  # the CPU device: copies run on the cores that compute
        window = max(accum * micro + kept + grad_wait, window_io)
    else:
        window = max(accum * compute + grad_wait, accum * copies + kept, window_io)
    state_io, adam, norm = _optimizer_parts_s(sz, rates)
    side = Window(accum * (compute if gpu else micro) + grad_wait, accum * copies if gpu else 0.0,
                  window_io, window, window / accum * backward_share,
                  "device" if gpu else "cores")  # fmt: skip
    timeline = step_timeline(
        side, adam_s=adam, state_io_s=state_io, norm_s=norm, flat_numel=sz.flat_numel,
        ahead_numels=sz.ahead_numels if gpu else (), pipelined=pipelined,
    )  # fmt: skip
    return StepTimes(
        compute_s=accum * compute,
        nvme_s=window_io + state_io,
        cpu_adam_s=adam + norm,
        copies_s=accum * copies + kept,
        hooks_s=accum * hooks,
        read_wait_s=accum * (micro - cores),
        grad_wait_s=grad_wait,
        micro_step_s=window / accum,
        optimizer_step_s=timeline.step_s - window,
        step_s=timeline.step_s,
        ahead_s=timeline.ahead_s,
        timeline=timeline,
    )


def _window_disk_s(sz: Sizes, read: float, write: float, accum: int) -> tuple[float, float]:
    """(the disk's seconds during forward and backward, what backward waits for of them):
    parameter reads, the spilled gradients written and read back, and the optimizer state
    the last sweep read ahead; backward's adds wait on the host thread, whatever the device."""
    window_io = (
        (sz.param_read_bytes_per_step(accum)
         + sz.grad_read_bytes_per_step - sz.grad_step_read_bytes
         + sz.optim_ahead_read_bytes) / read
        + sz.grad_write_bytes_per_step / write
    )  # fmt: skip
    grad_wait = (
        sz.grad_waited_read_bytes_per_step / read + sz.grad_waited_write_bytes_per_step / write
    )
    return window_io, grad_wait


def _optimizer_parts_s(sz: Sizes, rates: Rates) -> tuple[float, float, float]:
    """(the optimizer state's transfers, CPU-Adam, the norm pass) of one step, in seconds."""
    state_io = (
        sz.optim_read_bytes_per_step - sz.optim_ahead_read_bytes + sz.grad_step_read_bytes
    ) / rates.nvme_read_bps + (
        sz.optim_write_bytes_per_step + sz.param_write_bytes_per_step
    ) / rates.nvme_write_bps
    # Sums kept on the device are copied to the host for the norm and again for CPU-Adam:
    # the norm's copies run beside its pass ([Note: the norm's copies run ahead] in
    # infinity/swap/grad_device.py), CPU-Adam's take the sweep's thread, beside the disk.
    copy = sz.grad_step_copy_bytes / 2 / rates.copy_bytes_per_s
    adam = sz.flat_numel / rates.adam_numel_per_s + copy
    norm = sz.grad_host_bytes / rates.norm_bytes_per_s
    norm += max(sz.grad_device_bytes / rates.norm_bytes_per_s, copy)
    return state_io, adam, norm


def micro_step_copies_s(sz: Sizes, rates: Rates, *, recycled: bool = True) -> float:
    """Host-device copies of one micro step: gathered parameters to the device, gradients
    back. On the CPU device a gather from NVMe copies its pool buffer into a recycled buffer
    (at the rate the engine probe saw its gathers copy at, else the copy rate; into new
    memory, at the fresh-copy rate, without `recycled`: see [Note: recycled device buffers]
    in infinity/accelerator/recycled.py; a gather from host memory aliases its home: no
    copy), and autograd writes each gradient into newly allocated memory (at the fresh-copy
    rate); the gradient is then added straight into its fp32 sum (in pieces: see
    `infinity.swap.grad_tier.add_into`), reading the gradient and the sum and
    writing the sum (itemsize + 8 bytes per element, against a copy's 2 bytes of
    memory traffic per byte copied)."""
    if rates.gpu is not None:
        moved = sz.gather_bytes_per_micro_step + sz.grad_offload_bytes_per_micro_step
        return moved / rates.copy_bytes_per_s
    fresh = rates.fresh_copy_bytes_per_s or rates.copy_bytes_per_s
    gather = rates.gather_copy_bytes_per_s or rates.copy_bytes_per_s
    gathers = sz.gather_bytes_per_micro_step / (gather if recycled else fresh)
    grads = sz.trainable_numel * sz.itemsize / fresh
    grad_add = sz.trainable_numel * (sz.itemsize + 8) / (2 * rates.copy_bytes_per_s)
    return gathers + grads + grad_add


def kept_copies_s(sz: Sizes, rates: Rates, *, recycled: bool = True) -> float:
    """The kept weights' copies to the device, once a step (see `micro_step_copies_s` for
    the rates)."""
    if rates.gpu is not None:
        return sz.kept_gather_bytes_per_step / rates.copy_bytes_per_s
    fresh = rates.fresh_copy_bytes_per_s or rates.copy_bytes_per_s
    gather = rates.gather_copy_bytes_per_s or rates.copy_bytes_per_s
    return sz.kept_gather_bytes_per_step / (gather if recycled else fresh)


def recycled_slack_bytes(shape: ModelShape, itemsize: int) -> int:
    """Memory the CPU device's recycled buffers keep beyond the most held at once: one
    buffer of the largest gathered parameter, when it is large enough to be recycled (see
    [Note: recycled device buffers] in infinity/accelerator/recycled.py)."""
    largest = max((p.numel for p in shape.params), default=0) * itemsize
    return largest if largest >= MIN_BYTES else 0


def bound_of(times: StepTimes) -> Bound:
    parts = {
        Bound.COMPUTE: times.compute_s,
        Bound.NVME: times.nvme_s,
        Bound.CPU_ADAM: times.cpu_adam_s,
        Bound.COPIES: times.copies_s,
    }
    return max(parts, key=parts.__getitem__)


LOGIT_FP32_BYTES = 13
"""Bytes per logit the loss holds at its peak beside the logits themselves: the fp32 upcast,
log-softmax and its gradient, and the logits' gradient in passing. Measured through
`F.cross_entropy(logits.float(), ...)` and its backward at 512 x 32000 logits: 17 bytes
per logit in all with fp32 logits, 14.7 with bf16 (2026-11-28); two fp32 copies (8), the
figure before, left a LoRA run with a 32000-token vocabulary 76 MiB over its plan."""


def activation_bytes(
    shape: ModelShape, tokens: int, seq_len: int, itemsize: int, checkpointing: bool
) -> int:
    """Activations held for backward: per layer about tokens x hidden x (34 + 5 x heads x
    seq / hidden) 16-bit bytes (Korthikanti et al., 2022, no recomputation), scaled to the
    model dtype; with checkpointing each layer keeps only its input, and one layer at a time
    is recomputed in full. The logits add tokens x vocab x (itemsize +
    LOGIT_FP32_BYTES): the logits in the model dtype and the loss's fp32 tensors at the peak
    of its backward."""
    c = shape.dims
    h, heads, layers = c.hidden_size, c.num_attention_heads, c.num_hidden_layers
    layer = tokens * h * (34 + 5 * heads * seq_len / h) * itemsize / 2
    kept = layers * tokens * h * itemsize + layer if checkpointing else layers * layer
    return int(kept + tokens * c.vocab_size * (itemsize + LOGIT_FP32_BYTES))


def build_partition_bytes(shape: ModelShape, config: Config, itemsize: int) -> int:
    """Host memory the trainable parameters' build partitions hold while `initialize` lays
    out the optimizer's buffers: with parameters in host memory the model is built there,
    and (as measured: 9.05 GiB at initialization against 5.6 GiB steady for a 2.1B bf16
    model, 2026-11-23) its partitions stay until the optimizer holds their weights. Built
    in files (offload_param "nvme", or a swap directory given: `builds_in_files`) they hold
    nothing."""
    if builds_in_files(config, here=False):
        return 0
    return shape.trainable_numel * itemsize


def grad_transient_bytes(shape: ModelShape) -> int:
    """Host memory a gradient takes on its way into its fp32 sum: the largest
    trainable parameter's gradient converted to fp32."""
    return 4 * max((p.numel for p in shape.params if p.trainable), default=0)


def current_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
