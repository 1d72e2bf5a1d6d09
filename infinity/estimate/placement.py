"""The placement planner: which tier each class of tensor lives in under a host-RAM budget.

A pure function of the model's shape, the run (dtype, batch, accumulation, LoRA, ranks) and
the budgets: no tensor, no I/O. It writes its choice as the config keys the engine already
executes (`offload_param.device` and `max_in_cpu`, `offload_optimizer.device`, `max_in_cpu`
and `gradients_in_cpu`, and the buffer and live-set settings of the notes below), so the
engine runs exactly the plan and the estimate of the planned config is the plan's own
figures: the two agree by construction.

[Note: what the planner keeps in RAM] With the budget as the only limit, every class that
fits stays in host memory, and the rest goes to NVMe in the order that moves the fewest
bytes per step for the bytes it frees. For each home of the 16-bit trainable weights (RAM or
NVMe), it keeps in RAM the frozen parameters that fit first (in model order, as
`offload_param.max_in_cpu` keeps them: each one kept is a read per forward and per backward
saved), then the optimizer's sub-groups that fit (`offload_optimizer.max_in_cpu`: each one
kept saves reading and writing its 12 bytes per element every step), with the fp32 gradients
spilled with the state or all kept in RAM (`offload_optimizer.gradients_in_cpu`: with
accumulation a spilled gradient is read and written again at every micro batch, so 4 bytes
held can save far more than the state's 12), and of the two homes it takes the one with the
fewest NVMe bytes per step, then the smaller peak RSS. Peak RSS is the estimate's
(`memory_of`), which counts the pipelines' buffers and, on the CPU device, the device memory.
A budget below the all-NVMe plan's peak RSS is refused with that minimum.

[Note: lean buffers] The staging buffers are RAM too. Where the config leaves a buffer
setting unset (the caller says which: `tunable`), the planner also tries the lean settings
of `LEAN_BUFFERS` (fewer parameter staging buffers, a smaller live set, the shallowest state
pipeline) and keeps them when they move fewer bytes within the budget (the RAM they free
holds state instead) or when only they fit. None of them changes a result: they decide how
many transfers are in flight and how much stays gathered, never how a number is computed.
The sub-group size, which orders the gradient norm's sum, is not among them.

[Note: resident on the device] On a GPU the live set is device memory, not RAM: where the
config leaves `stage3_max_live_parameters` unset and a device budget is given, the planner
also tries the largest live set the device holds beside the activations (`_resident_live`).
The live-set policy then keeps parameters gathered across uses (a frozen base that fits is
read to the device once, not at every micro batch; trainable weights gathered in forward
stay for backward), which the estimate's replay counts. Among plans that move the same NVMe
bytes the one with the fewest host-to-device bytes wins. Every plan on a GPU must fit the
device budget.

[Note: gradient sums on the device] Where the config leaves
`offload_optimizer.gradients_on_device` unset and a device budget is given, the planner also
tries keeping the first sub-groups' fp32 gradient sums on the GPU across micro batches
(`_device_grads`: as many as fit beside the configured live set and the activations, less
DEVICE_HEADROOM), alone and with the resident live set in what they leave. Their RAM (or
their spill: read and written at every micro batch) goes to optimizer state, and backward
copies none of their gradients to the host; the step copies each sum to the host twice (the
norm, CPU-Adam). The planner keeps them only when they move fewer NVMe bytes: the copies
backward saves overlap its compute on a GPU, the step's copies do not (a 13B run whose state
all fits in RAM steps in 24.6 s with them and 20.0 s without, by the estimate).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace

from infinity.config import Config
from infinity.estimate.hardware import CUDA_RUNTIME_HOST_BYTES
from infinity.estimate.result import activation_bytes, memory_of
from infinity.estimate.shapes import ModelShape
from infinity.estimate.sizing import Sizes, layout_of, resolve_config, sizes
from infinity.zero import model_dtype

LEAN_BUFFERS: dict[str, int] = {
    "stage3_max_live_parameters": 300_000_000,
    "offload_param.buffer_count": 3,
    "offload_optimizer.buffer_count": 3,
}
"""The buffer settings the planner may lower (see [Note: lean buffers]), by their key under
zero_optimization: at least 3 staging buffers keep a read, a copy and a prefetch in flight,
and 3e8 live elements hold any linear layer of a 70B Llama with room to prefetch."""


DEVICE_HEADROOM = 0.2
"""The share of the device budget a resident live set leaves free: the caching allocator's
fragmentation, the CUDA context's workspaces and what the estimate does not count (the
resident plan has not run on a GPU yet; see [Note: resident on the device])."""


@dataclass(frozen=True, slots=True)
class Budget:
    """Host memory the run may use, and where the figure came from."""

    ram_bytes: int
    source: str
    """e.g. "--ram-budget 16G", or "80% of the 21.3 GiB available"."""
    device_bytes: int = 0
    """GPU memory the run may use (0: unbounded here, as on the CPU device, whose memory is
    host RAM and within `ram_bytes`)."""
    device_source: str = ""


@dataclass(frozen=True, slots=True)
class Tiers:
    """One class of tensors: bytes in host RAM, on NVMe and on the device."""

    ram_bytes: int
    nvme_bytes: int
    device_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    """The plan, as config keys and as the bytes each class keeps in each tier."""

    param_device: str
    """offload_param.device: "cpu" (the 16-bit trainable weights in RAM) or "nvme"."""
    param_max_in_cpu: int
    """offload_param.max_in_cpu: elements of frozen parameters kept in RAM."""
    optim_device: str
    """offload_optimizer.device ("nvme" also when every sub-group is kept in RAM)."""
    optim_max_in_cpu: int
    """offload_optimizer.max_in_cpu: elements of optimizer state kept in RAM."""
    gradients_in_cpu: bool
    """offload_optimizer.gradients_in_cpu: every fp32 gradient in RAM though state spills."""
    weights: Tiers
    frozen: Tiers
    state: Tiers
    grads: Tiers
    buffers_bytes: int
    """Host staging of the NVMe tiers (parameter pool, state pipeline)."""
    nvme_read_bytes_per_step: int
    nvme_write_bytes_per_step: int
    host_device_bytes_per_step: int
    live_parameters: int
    """stage3_max_live_parameters: elements gathered on the device at most."""
    peak_rss_bytes: int
    device_bytes: int
    """The estimate's device memory (the live set, activations; host RAM on the CPU device)."""
    budget: Budget
    buffers: dict[str, int] = field(default_factory=dict)
    """The buffer, live-set and device-gradient settings the plan changed (see [Note: lean
    buffers], [Note: resident on the device] and [Note: gradient sums on the device]), keyed
    as LEAN_BUFFERS."""

    def apply(self, config: Config) -> Config:
        """`config` with the plan's keys set."""
        raw = config.to_dict()
        zero = raw.setdefault("zero_optimization", {})
        _set_buffers(zero, self.buffers)
        param = zero.setdefault("offload_param", {})
        param.update(device=self.param_device, max_in_cpu=self.param_max_in_cpu)
        optim = zero.setdefault("offload_optimizer", {})
        optim.update(device=self.optim_device, max_in_cpu=self.optim_max_in_cpu,
                     gradients_in_cpu=self.gradients_in_cpu)  # fmt: skip
        return Config.load(raw)

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The plan as `infinity train` and `infinity estimate` print it."""
        rows = [
            ("16-bit trainable weights", self.weights),
            ("frozen parameters", self.frozen),
            ("optimizer state (fp32)", self.state),
            ("gradients (fp32)", self.grads),
        ]
        out = [
            f"placement within {_size(self.budget.ram_bytes)} of RAM ({self.budget.source}): "
            f"peak RSS {_size(self.peak_rss_bytes)}"
        ]
        for name, t in rows:
            if t.ram_bytes or t.nvme_bytes or t.device_bytes:
                device = f"   device {_size(t.device_bytes)}" if t.device_bytes else ""
                out.append(
                    f"  {name:<26} RAM {_size(t.ram_bytes):>10}   NVMe {_size(t.nvme_bytes):>10}"
                    + device
                )
        shown = {k: v for k, v in self.buffers.items() if k != GRADS_ON_DEVICE}
        chosen = ", ".join(f"{k} {v:,}" for k, v in shown.items())
        out.append(
            f"  {'NVMe staging buffers':<26} RAM {_size(self.buffers_bytes):>10}"
            + (f"   (set for this budget: {chosen})" if chosen else "")
        )
        out.append(
            f"  NVMe per step: {_size(self.nvme_read_bytes_per_step)} read, "
            f"{_size(self.nvme_write_bytes_per_step)} written"
        )
        if self.budget.device_bytes:
            out.append(
                f"  device: {_size(self.device_bytes)} of {_size(self.budget.device_bytes)} "
                f"({self.budget.device_source}), up to {self.live_parameters:,} parameter "
                f"elements gathered; host to device {_size(self.host_device_bytes_per_step)} "
                "per step"
            )
        return out


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def plan_placement(
    shape: ModelShape,
    config: Config,
    budget: Budget,
    *,
    gpu: bool,
    seq_len: int,
    checkpointing: bool = False,
    runtime_bytes: int,
    world_size: int = 1,
    tunable: Collection[str] = (),
) -> Placement:
    """The placement of `shape` trained under `config` (its offload devices are what the
    planner chooses; the nvme_path must be set) within `budget` (see [Note: what the planner
    keeps in RAM]). `gpu`: the device is a GPU (its host memory pins; on the CPU device the
    device memory is host RAM); `runtime_bytes`: the process's RSS before the model;
    `tunable`: the keys of LEAN_BUFFERS the config leaves unset (see [Note: lean buffers])."""
    config = resolve_config(config, shape)
    acts = _activations(shape, config, seq_len, checkpointing)
    plans, evaluate = [], None
    rungs = _rungs(shape, config, tunable, gpu, budget, acts, world_size)
    for rung, changed in enumerate(rungs):
        raw = config.to_dict()
        _set_buffers(raw["zero_optimization"], changed)
        evaluate = _Evaluator(shape, Config.load(raw), budget, gpu, acts, checkpointing,
                              runtime_bytes, world_size, changed)  # fmt: skip
        for p in (evaluate.best("cpu"), evaluate.best("nvme")):
            if p is not None:
                on_device = GRADS_ON_DEVICE in p.buffers
                plans.append((_moved(p), on_device, p.host_device_bytes_per_step, rung,
                              p.peak_rss_bytes, p))  # fmt: skip
    if not plans:  # `evaluate` is the last rung's
        floor = evaluate.plan("nvme", 0, 0)
        if gpu and budget.device_bytes and floor.device_bytes > budget.device_bytes:
            raise ValueError(
                f"a device budget of {_size(budget.device_bytes)} ({budget.device_source}) is "
                f"below the {_size(floor.device_bytes)} this run needs on the device (the live "
                "parameters and the activations); lower stage3_max_live_parameters, "
                "--micro-batch or --seq-len, or turn on --activation-checkpointing"
            )
        device = "" if gpu else f", the device's memory (host RAM here) {_size(floor.device_bytes)}"
        process = runtime_bytes + (CUDA_RUNTIME_HOST_BYTES if gpu else 0)
        raise ValueError(
            f"a RAM budget of {_size(budget.ram_bytes)} ({budget.source}) is below the "
            f"{_size(floor.peak_rss_bytes)} this run needs with everything on NVMe (the "
            f"process before the model {_size(process)}{' with the CUDA runtime' if gpu else ''}"
            f", its NVMe staging buffers {_size(floor.buffers_bytes)}{device}); raise "
            "--ram-budget, "
            "or shrink the buffers: offload_param.buffer_count (each holds the largest "
            "parameter), zero_optimization.sub_group_size, stage3_max_live_parameters"
        )
    # Fewest NVMe bytes, then no sums on the device (their copies at the step are not
    # overlapped), then host-to-device bytes, then the earliest rung, then less RSS.
    return min(plans, key=lambda t: t[:5])[5]


LIVE = "stage3_max_live_parameters"
GRADS_ON_DEVICE = "offload_optimizer.gradients_on_device"
"""The device's gradient sums (see [Note: gradient sums on the device]), keyed as
LEAN_BUFFERS; a config that sets it keeps it."""


def _rungs(shape, config, tunable, gpu, budget, acts, world) -> list[dict[str, int]]:
    """The buffer and live-set settings to plan with: as configured, then lowered where
    `tunable` lets (see [Note: lean buffers]); on a GPU with a device budget, the host
    buffers lowered or not, each with the live set the device holds (see [Note: resident on
    the device]), with gradient sums on the device, and with both (see [Note: gradient sums
    on the device])."""
    zero = config.to_dict()["zero_optimization"]
    lean = {k: v for k, v in LEAN_BUFFERS.items() if k in tunable and v < _get(zero, k)}
    if gpu:  # the live set is device memory there: lowering it frees no RAM
        lean.pop(LIVE, None)
    base = [{}, lean] if lean else [{}]
    if not (gpu and budget.device_bytes):
        return base
    rungs = list(base)
    if LIVE in tunable:
        live = _resident_live(shape, config, budget.device_bytes, acts)
        if live > _get(zero, LIVE):
            rungs += [{**r, LIVE: live} for r in base]
    grads = _device_grads(shape, config, budget.device_bytes, acts, world)
    if GRADS_ON_DEVICE in tunable and grads:
        rungs += [{**r, GRADS_ON_DEVICE: grads} for r in base]
        live = _resident_live(shape, config, budget.device_bytes, acts, reserved=4 * grads)
        if LIVE in tunable and live > _get(zero, LIVE):
            rungs += [{**r, GRADS_ON_DEVICE: grads, LIVE: live} for r in base]
    return rungs


def _free_device_bytes(shape: ModelShape, config: Config, device_bytes: int, acts: int) -> int:
    """The device budget less DEVICE_HEADROOM, the activations, the largest gradient and
    the one unit a gather may exceed the live budget by (see `memory_of`)."""
    itemsize = model_dtype(config).itemsize
    largest = max((p.numel for p in shape.params), default=0)
    return int(device_bytes * (1 - DEVICE_HEADROOM)) - acts - 2 * largest * itemsize


def _resident_live(
    shape: ModelShape, config: Config, device_bytes: int, acts: int, *, reserved: int = 0
) -> int:
    """The largest live set (elements) that fits `device_bytes` beside the activations (and
    `reserved` bytes of gradient sums): see `_free_device_bytes`."""
    itemsize = model_dtype(config).itemsize
    free = _free_device_bytes(shape, config, device_bytes, acts) - reserved
    return max(0, min(free // itemsize, shape.numel))  # no more than the whole model


def _device_grads(
    shape: ModelShape, config: Config, device_bytes: int, acts: int, world: int
) -> int:
    """Elements of fp32 gradient sums the device holds beside the configured live set: the
    first whole sub-groups that fit (see [Note: gradient sums on the device])."""
    itemsize = model_dtype(config).itemsize
    live = min(int(config.zero_optimization.max_live_parameters), shape.numel) * itemsize
    room = (_free_device_bytes(shape, config, device_bytes, acts) - live) // 4
    total = 0
    for n in layout_of(shape, config, world).sub_group_numels:
        if total + n > room:
            break
        total += n
    return total


def _get(zero: dict, key: str):
    *path, name = key.split(".")
    for part in path:
        zero = zero[part]
    return zero[name]


def _set_buffers(zero: dict, buffers: dict[str, int]) -> None:
    for key, value in buffers.items():
        *path, name = key.split(".")
        section = zero
        for part in path:
            section = section.setdefault(part, {})
        section[name] = value


def _moved(p: Placement) -> int:
    return p.nvme_read_bytes_per_step + p.nvme_write_bytes_per_step


class _Evaluator:
    """Plans for one run: the estimate's sizes and peak RSS of each candidate."""

    def __init__(self, shape, config, budget, gpu, acts, checkpointing, runtime, world,
                 buffers):  # fmt: skip
        self.shape, self.config, self.budget, self.buffers = shape, config, budget, buffers
        self.gpu, self.checkpointing, self.runtime, self.world = gpu, checkpointing, runtime, world
        self.acts = acts
        frozen = [p.numel for p in shape.params if not p.trainable]
        self.frozen_steps = [0]
        for n in frozen:  # max_in_cpu values at which one more frozen parameter fits
            self.frozen_steps.append(self.frozen_steps[-1] + n)
        numels = layout_of(shape, config, world).sub_group_numels
        self.state_steps = [0]
        for n in numels:
            self.state_steps.append(self.state_steps[-1] + n)

    def plan(self, param: str, frozen: int, state: int, grads: bool = False) -> Placement:
        raw = self.config.to_dict()
        zero = raw["zero_optimization"]
        zero["offload_param"].update(device=param, max_in_cpu=frozen)
        zero["offload_optimizer"].update(device="nvme", max_in_cpu=state, gradients_in_cpu=grads)
        cfg = Config.load(raw)
        sz, device, peak = _memory(self.shape, cfg, self.gpu, self.acts, self.checkpointing,
                                   self.runtime, self.world)  # fmt: skip
        plan = _placement(param, (frozen, state, grads), sz, (peak, device), self.budget, cfg)
        return replace(plan, buffers=self.buffers)

    def best(self, param: str) -> Placement | None:
        """The frozen parameters, then the sub-groups, that fit, with `param`'s home."""
        frozen_steps = self.frozen_steps if param == "nvme" else [0]  # "cpu": all in RAM
        fits = self._fits(lambda k: self.plan(param, frozen_steps[k], 0), frozen_steps)
        if fits is None:
            return None
        frozen = frozen_steps[fits]
        plans = []
        steps = self.state_steps
        for grads in (False, True):  # the gradients spilled with the state, or all in RAM
            fits = self._fits(lambda k, g=grads: self.plan(param, frozen, steps[k], g), steps)
            if fits is not None:
                plans.append(self.plan(param, frozen, steps[fits], grads))
        return min(plans, key=lambda p: (_moved(p), p.host_device_bytes_per_step, p.peak_rss_bytes))

    def fits(self, p: Placement) -> bool:
        """Within the RAM budget and, on a GPU, the device budget (when one is given)."""
        device = self.budget.device_bytes
        over_device = self.gpu and device and p.device_bytes > device
        return p.peak_rss_bytes <= self.budget.ram_bytes and not over_device

    def _fits(self, make: Callable[[int], Placement], steps: list[int]) -> int | None:
        """The largest k whose plan fits the budget (peak RSS grows with k; the last step,
        everything in RAM, is tried on its own: it drops the NVMe buffers), None if none."""
        ok = lambda k: self.fits(make(k))  # noqa: E731
        last = len(steps) - 1
        if ok(last):
            return last
        if not ok(0):
            return None
        lo, hi = 0, last - 1  # ok(lo) holds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
        return lo


def _activations(shape: ModelShape, config: Config, seq_len: int, checkpointing: bool) -> int:
    """The estimate's activation bytes of one micro batch of the resolved `config`."""
    micro = int(config.train_micro_batch_size_per_gpu)
    itemsize = model_dtype(config).itemsize
    return activation_bytes(shape, micro * seq_len, seq_len, itemsize, checkpointing)


def _memory(shape, cfg, gpu, acts, checkpointing, runtime, world) -> tuple[Sizes, int, int]:
    """The estimate's sizes, device bytes and peak RSS of `cfg` (see `memory_of`)."""
    sz = sizes(shape, cfg, pins=gpu, checkpointing=checkpointing, aliases=not gpu,
               world_size=world)  # fmt: skip
    device, _, peak = memory_of(shape, cfg, sz, gpu=gpu, acts=acts, alias=not gpu,
                                recycled=not gpu, runtime_bytes=runtime)  # fmt: skip
    return sz, device, peak


def check_budget(
    shape: ModelShape,
    config: Config,
    budget: Budget,
    *,
    gpu: bool,
    seq_len: int,
    checkpointing: bool = False,
    runtime_bytes: int,
    world_size: int = 1,
) -> int:
    """A run whose placement the config fixes (no planning): its peak RSS, or ValueError
    when that is over `budget` (naming both and what would help)."""
    config = resolve_config(config, shape)
    acts = _activations(shape, config, seq_len, checkpointing)
    _, _, peak = _memory(shape, config, gpu, acts, checkpointing, runtime_bytes, world_size)
    if peak > budget.ram_bytes:
        zero = config.zero_optimization
        devices = (zero.offload_param.device, zero.offload_optimizer.device)
        raise ValueError(
            f"this run needs {_size(peak)} of RAM at its peak, over the budget of "
            f"{_size(budget.ram_bytes)} ({budget.source}); its config places the parameters "
            f"on {devices[0]!r} and the optimizer state on {devices[1]!r}. Give --nvme DIR "
            "(and no offload devices in the config) to let the planner keep in RAM what fits "
            "and put the rest on the SSD, or raise --ram-budget"
        )
    return peak


def _placement(
    param: str,
    kept: tuple[int, int, bool],
    sz: Sizes,
    memory: tuple[int, int],
    budget: Budget,
    cfg: Config,
) -> Placement:
    weights_ram = sz.weights_host_bytes if param == "cpu" else 0  # else the staging ring
    state_ram = sz.state_host_bytes - sz.state_buffer_bytes
    accum = int(cfg.gradient_accumulation_steps)
    read = sz.optim_read_bytes_per_step + sz.grad_read_bytes_per_step
    read += sz.param_read_bytes_per_micro_step * accum
    write = sz.optim_write_bytes_per_step + sz.grad_write_bytes_per_step
    write += sz.param_write_bytes_per_step
    micro = sz.gather_bytes_per_micro_step + sz.grad_offload_bytes_per_micro_step
    host_device = accum * micro + sz.refresh_bytes_per_step + sz.grad_step_copy_bytes
    return Placement(
        param_device=param, param_max_in_cpu=kept[0], optim_device="nvme",
        optim_max_in_cpu=kept[1], gradients_in_cpu=kept[2],
        weights=Tiers(weights_ram, sz.param_nvme_bytes - sz.frozen_nvme_bytes),
        frozen=Tiers(sz.frozen_host_bytes, sz.frozen_nvme_bytes),
        state=Tiers(state_ram, sz.optim_nvme_bytes),
        grads=Tiers(sz.grad_host_bytes, sz.grad_nvme_bytes, sz.grad_device_bytes),
        buffers_bytes=sz.param_pool_bytes + sz.state_buffer_bytes,
        nvme_read_bytes_per_step=read, nvme_write_bytes_per_step=write,
        host_device_bytes_per_step=host_device,
        live_parameters=int(cfg.zero_optimization.max_live_parameters),
        peak_rss_bytes=memory[0], device_bytes=memory[1], budget=budget,
    )  # fmt: skip
