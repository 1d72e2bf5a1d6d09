"""The typed sections: the contract every component codes against.

Each component receives only its own section. Sections are frozen values. In a loaded
`Config` some values may be `AUTO`; `resolve_run` derives them into a `ResolvedConfig`
(infinity/config/resolved.py), whose narrowed sections are what components read. Parsing,
emitting and resolving live in the sibling modules, and the verbs of the whole (`Config`) in
`infinity.config.config`, over them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from infinity.config.values import AUTO

OffloadDevice = Literal["none", "cpu", "nvme"]


class Section:
    """A config section's equality: the same section (`section_of`) with the same values,
    so a resolved section equals its base's with the same numbers."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        base = section_of(type(self))
        if not isinstance(other, Section):
            return NotImplemented
        if section_of(type(other)) is not base:
            return False
        return all(
            getattr(self, f.name) == getattr(other, f.name) for f in fields(base) if f.compare
        )

    __hash__ = None  # type: ignore[assignment]  # sections are compared, never keys


def section_of(cls: type) -> type:
    """The section `cls` is: the first of `SECTIONS` it derives from (`Config` adds only
    verbs to the whole config's fields; a resolved section only narrows its fields' types)."""
    return next(c for c in cls.__mro__ if c in SECTIONS)


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class OffloadParamConfig(Section):
    """Where the half-precision parameter homes live between uses."""

    device: OffloadDevice = "cpu"
    """"cpu" (pinned host RAM when CUDA is present), "nvme", or "none" (stay on the device)."""
    pin_memory: bool = True
    """Pin the NVMe staging buffers so device copies are asynchronous (the CPU accelerator
    cannot pin: there it changes nothing, and `memory_stats` reports 0 pinned bytes)."""
    nvme_path: str | list[str] | None = None
    """Directory on a fast SSD for the swap store; required when device is "nvme". A list
    gives one directory per local rank (each rank on its own SSD); see `Config.for_local_rank`."""
    buffer_count: int = 5
    """Number of pinned staging buffers for NVMe parameter reads."""
    buffer_size: int | str = AUTO
    """Elements per staging buffer; "auto" = at least the largest parameter."""
    max_in_cpu: int = 0
    """Elements of frozen parameters kept in host memory when device is "nvme" (the first
    ones in model order; the rest go to NVMe). DeepSpeed's key; its documented default of
    1e9 is never read there, so here the default is 0: RAM is spent only when asked for."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class OffloadOptimizerConfig(Section):
    """Where fp32 master weights and Adam moments live."""

    device: OffloadDevice = "cpu"
    """"cpu" (host RAM) or "nvme"; "none" is accepted and treated as "cpu" for stage 3."""
    pin_memory: bool = False
    """Pin the NVMe pipeline's host buffers (allocated pinned by the accelerator; the CPU
    accelerator cannot pin, so there it changes nothing and `memory_stats` reports 0 pinned
    bytes). With device "cpu" there are no such buffers: the state is stepped in place."""
    nvme_path: str | list[str] | None = None
    """Directory on a fast SSD for the optimizer swap store; required when device is "nvme".
    A list gives one directory per local rank; see `Config.for_local_rank`."""
    buffer_count: int = 4
    """Host buffers of the NVMe optimizer pipeline, one sub-group each; at least 3 (one read
    ahead, one stepped, one written back)."""
    pipeline_read: bool = True
    """Read the next sub-groups' state from NVMe while the current one is stepped (and the
    first ones of the next step during forward and backward). False reads each sub-group
    only when its turn comes (DeepSpeed's default; slower, same results)."""
    pipeline_write: bool = True
    """Write each stepped sub-group back to NVMe while the next one is stepped. False waits
    for each write-back before going on (DeepSpeed's default; slower, same results)."""
    fast_init: bool = False
    """Only false: Infinity has no separate optimizer-state initialization pass to skip."""
    max_in_cpu: int = 0
    """Elements of optimizer state kept in host memory when device is "nvme": the first
    sub-groups that fit in it whole stay in RAM (12 bytes per element, stepped in place) and
    the rest go to NVMe. Infinity's key (DeepSpeed's offload_optimizer has none); the
    placement planner sets it. Results are the same wherever each sub-group lives."""
    gradients_in_cpu: bool = False
    """Keep every fp32 gradient sum in host memory (4 bytes per trainable element)
    even when some optimizer state is on NVMe; by default they spill to NVMe with the state.
    Infinity's key, set by the placement planner: with gradient accumulation each micro
    batch adds into them, so a spilled gradient is read and written again at every one."""
    gradients_on_device: int = 0
    """Elements of fp32 gradient sums kept on the device across micro batches: the first
    sub-groups that fit in it whole (4 bytes per element of device memory) are added to
    there, never copied to the host in backward, and read to the host once per step; the
    others stay where `device`, `max_in_cpu` and `gradients_in_cpu` put them. Infinity's key,
    set by the placement planner on a GPU. Results are the same wherever each sum lives."""
    half_gradients: bool = True
    """With gradient_accumulation_steps 1 and fp16/bf16, keep each gradient as backward made
    it (2 bytes per element) for CPU-Adam to read, instead of adding it into a zeroed fp32
    sum (4 bytes, an add and a zeroing pass per step); the results are bitwise the same (see
    [Note: 16-bit gradient sums] in infinity/swap/grad_half.py). Applies when every
    gradient sum is in host memory. Infinity's key."""
    overlap_step: bool = False
    """Step each sub-group during the last micro batch's backward, as soon as its gradients
    are final, on a worker thread, assuming no clipping and no overflow; the step confirms
    it (or redoes it) once the global norm is known, so the results are bitwise those of a
    serial step (see [Note: the overlapped step] in infinity/zero/overlap.py). Infinity's
    key; false (the default) steps every sub-group after backward. Only sub-groups whose
    gradient sums are in host memory are stepped early. Its copies of the state (see
    `overlap_numel`) are allocated once and held for the run; the estimate and the
    placement planner count them in the host bytes. Off by default: on the CPU device
    backward leaves no idle core to step beside it; on a GPU the planner turns it on where
    the RAM its plan leaves holds the copies (when the config does not set it)."""
    overlap_numel: int = 50_000_000
    """Elements of optimizer state the overlapped step may step ahead of the norm: each
    holds a copy of its state from before the step until the step confirms it (12 bytes per
    element, plus the new weights in the model dtype). A sub-group larger than this is
    never stepped early; with `zero_optimization.sub_group_size` at its default (1e9) a
    model below 1B elements is one sub-group, final only when backward ends, so set
    sub_group_size well below the model's size for any overlap."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ZeroConfig(Section):
    """ZeRO stage-3 partitioning, prefetch and budget settings."""

    stage: int = 3
    """0, 1, 2 or 3; 0-2 keep every parameter on the device ([Note: stages 0-2] in
    infinity/config/resolve.py)."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    max_live_parameters: int | str = 1_000_000_000
    """Hard bound on gathered elements on the device at any moment (plus the largest module)."""
    prefetch_bucket_size: int | str = 50_000_000
    """Elements fetched ahead of use along the traced execution order."""
    keep_weights_numel: int = 0
    """Elements of trainable weights kept gathered on the device across the micro batches
    of one optimizer step, beyond `max_live_parameters` (the first trainable parameters in
    model order that fit; 0 keeps none). The placement planner sets it where the device has
    room ([Note: weights kept across micro batches] in infinity/zero/live_plan.py)."""
    max_reuse_distance: int | str = 1_000_000_000
    """A parameter reused within this many elements of later gathers is kept, not released."""
    param_persistence_threshold: int | str = 100_000
    """Parameters with fewer elements stay resident on the device."""
    sub_group_size: int | str = 1_000_000_000
    """Elements per optimizer sub-group (the unit of CPU-Adam and NVMe swapping)."""
    reduce_bucket_size: int | str = 500_000_000
    """With several ranks: gradient elements reduce-scattered in one collective (a larger
    parameter goes alone); "auto" = hidden_size^2 with `RunFacts.hidden_size`."""
    overlap_comm: bool = True
    """With several ranks: reduce-scatter a full gradient bucket while backward goes on (two
    buckets in use); False waits for each reduction before backward continues."""
    contiguous_gradients: bool = True
    """With several ranks: copy each gradient into the bucket's buffer as it is produced and
    free it at once; False keeps the gradients until their bucket is reduced."""
    gather_16bit_weights_on_model_save: bool = False
    """Allow `Engine.save_16bit_model`: consolidated 16-bit weights in one safetensors file
    (DeepSpeed's stage3_ key). `infinity export` does the same from a checkpoint."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class FP16Config(Section):
    """fp16 mixed precision with dynamic (or static) loss scaling."""

    enabled: bool | str = False
    """Train with fp16 weights and activations; "auto" resolves to false."""
    loss_scale: float = 0.0
    """0 means dynamic loss scaling; any other value is a static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every step without overflow (not only after a good window)."""
    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class BF16Config(Section):
    """bf16 mixed precision (no loss scaling needed)."""

    enabled: bool | str = False
    """Train with bf16 weights and activations; "auto" resolves to false."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class OptimizerConfig(Section):
    """The optimizer, run by CPU-Adam on the fp32 master weights."""

    type: Literal["Adam", "AdamW", "AdamW8bit"] = "AdamW"
    """Case-insensitive in the JSON. See `adamw_mode` for which weight decay applies.
    "AdamW8bit": AdamW with 8-bit blockwise moments (bitsandbytes' scheme; docs/optimizer_8bit.md),
    about half the optimizer state's bytes."""
    lr: float | str = 1e-3
    betas: tuple[float, float] | str = (0.9, 0.999)
    eps: float | str = 1e-8
    weight_decay: float | str = 0.0
    bias_correction: bool = True
    adam_w_mode: bool = True
    """DeepSpeed's flag: decoupled (AdamW) weight decay even when type is "Adam"."""
    torch_adam: bool = False
    """Use the torch reference step instead of the native CPU-Adam kernel."""
    convert_state: bool = False
    """Resuming from a checkpoint whose optimizer state is in the other format (32-bit or
    8-bit moments): convert it once instead of refusing."""

    @property
    def adamw_mode(self) -> bool:
        """Decoupled weight decay? As in DeepSpeed: type "AdamW", or "Adam" with adam_w_mode
        (which defaults to true, so a DeepSpeed "Adam" config trains with AdamW)."""
        return self.type in ("AdamW", "AdamW8bit") or self.adam_w_mode

    @property
    def eight_bit(self) -> bool:
        """8-bit blockwise moments (type "AdamW8bit")."""
        return self.type == "AdamW8bit"


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class SchedulerConfig(Section):
    """A learning-rate schedule, DeepSpeed names and parameters."""

    type: (
        Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "constant", "linear", "cosine"]
        | None
    ) = None
    """DeepSpeed's schedules, or transformers-style ones ([Note: transformers-style
    schedules] in infinity.config.scheduler_params)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The parameters for `type` (see `SCHEDULER_PARAMS`); missing ones take defaults."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class AioConfig(Section):
    """Async I/O settings for every NVMe transfer."""

    block_size: int = 1 << 20
    """Bytes per I/O request."""
    queue_depth: int = 32
    """Requests in flight per worker thread."""
    thread_count: int = 1
    """Worker threads (DeepSpeed: intra_op_parallelism)."""
    single_submit: bool = False
    """Hand each I/O request to the kernel with its own system call rather than one call per
    batch (io_uring and aio backends; the posix backend has no submission queue)."""
    overlap_events: bool = True
    """Submit new requests as earlier ones complete, keeping the queue full; False submits a
    batch of up to queue_depth, waits for all of it, then submits the next (io_uring and aio
    backends; the posix backend has no submission queue)."""
    backend: Literal["auto", "io_uring", "aio", "posix"] = "auto"
    """I/O engine. "auto" picks the fastest one available when the swapper starts: a run-time
    choice, not a placeholder, so `resolve_run` keeps it."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ConfigFields(Section):
    """The whole run configuration's fields; `infinity.config.Config` adds its verbs (load,
    to_dict, for_local_rank, ...), built over the parsing module that reads these."""

    train_batch_size: int | str = AUTO
    """Samples per optimizer step over all ranks: micro batch * accumulation * world size."""
    train_micro_batch_size_per_gpu: int | str = AUTO
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int | str = AUTO
    """Micro batches per optimizer step; the loss is scaled by 1/this."""
    gradient_clipping: float | str = 0.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    """With several ranks, the dtype gradients are reduce-scattered in (DeepSpeed's key;
    `communication_dtype` is the one in effect): null, the training dtype; "fp32" sums the
    ranks' gradients in fp32, so two ranks give the bits one rank accumulating the same
    micro batches gives (at twice a 16-bit run's bucket memory and reduce-scatter bytes; see
    [Note: gradient buckets] in infinity/zero/grad_reduce.py). A 16-bit dtype other than the
    training dtype is refused (`infinity.config.resolve.check_communication_dtype`)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    seed: int = 1234
    steps_per_print: int = 10
    """Log a progress line (step, skipped steps, lr, loss scale, grad norm) every this many
    optimizer steps, at INFO level."""
    wall_clock_breakdown: bool = False
    """Synchronize the device around each timed part of a step (the telemetry every step
    records, docs/telemetry.md), log the breakdown every `steps_per_print` steps and return
    it from `Engine.wall_clock_breakdown()`."""
    given_keys: frozenset[str] = field(
        default=frozenset(), compare=False, repr=False, metadata={"json": False}
    )
    """The dotted field paths the user's config set ("zero_optimization.sub_group_size",
    "optimizer.lr", "scheduler.params.warmup_num_steps"), recorded by `Config.load` from a
    file or dict; not a JSON key. A config rebuilt from `to_dict()` records every key."""

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """ "fp16", "bf16" or "fp32", from the enabled flags (`resolve_run` settles "auto")."""
        if AUTO in (self.fp16.enabled, self.bf16.enabled):
            raise ValueError("fp16/bf16.enabled: 'auto' must be resolved first; call resolve_run()")
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def communication_dtype(self) -> Literal["fp32", "fp16", "bf16"]:
        """The dtype gradients are reduce-scattered in: `communication_data_type`, or the
        training dtype where it is null (so an "auto" precision must be resolved first)."""
        return self.communication_data_type or self.precision


SECTIONS: tuple[type, ...] = (
    OffloadParamConfig,
    OffloadOptimizerConfig,
    ZeroConfig,
    FP16Config,
    BF16Config,
    OptimizerConfig,
    SchedulerConfig,
    AioConfig,
    ConfigFields,
)
"""The sections the key tables name; a subclass (`Config`, the resolved sections) reads
the tables of the first of these it derives from."""
