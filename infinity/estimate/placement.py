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
Keeping every sub-group in RAM drops the state pipeline's buffers, so that plan may fit where
one that spills does not: it is tried on its own, and `--nvme` never refuses a run that fits
in RAM. A budget below the leanest plan's peak RSS is refused with that minimum.

[Note: a budget is a bound] A plan fits when its peak RSS plus `Budget.margin_bytes` (the
CLI leaves RSS_MARGIN_BYTES: what the estimate does not count) is within the budget. The
process before the model counts as PROCESS_FLOOR_BYTES, a fixed figure, not the RSS of the
moment: the plan is a function of the flags and the budget, so `infinity estimate` and
`infinity train` with the same flags make the same plan (`tests/test_placement_budget.py`
checks both, and the measured peak against the budget at several sizes).

The settings it tries besides the config's (lean buffers, the live set and gradient sums on
the device) are `infinity.estimate.placement_rungs`'s, with their notes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace

from infinity.config import Config, ResolvedConfig, resolve_run
from infinity.estimate.hardware import CUDA_RUNTIME_HOST_BYTES
from infinity.estimate.placement_rungs import (
    GRADS_ON_DEVICE,
    KEEP,
    OVERLAP,
    candidates,
    set_buffers,
)
from infinity.estimate.result import activation_bytes, memory_of
from infinity.estimate.shapes import ModelShape
from infinity.estimate.sizing import Sizes, layout_of, sizes
from infinity.zero import model_dtype


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
    margin_bytes: int = 0
    """Of `ram_bytes`, what no plan may use (see [Note: a budget is a bound])."""

    def fits(self, peak_rss_bytes: int) -> bool:
        return peak_rss_bytes + self.margin_bytes <= self.ram_bytes


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
    overlap_bytes: int
    """The overlapped step's state copies (see [Note: the overlapped step in the plan])."""
    nvme_read_bytes_per_step: int
    nvme_write_bytes_per_step: int
    host_device_bytes_per_step: int
    live_parameters: int
    """stage3_max_live_parameters: elements gathered on the device at most."""
    peak_rss_bytes: int
    device_bytes: int
    """The estimate's device memory (the live set, activations; host RAM on the CPU device)."""
    budget: Budget
    eight_bit_state: bool = False
    """The state's moments are 8-bit (AdamW8bit): its rows are labelled so."""
    buffers: dict[str, int] = field(default_factory=dict)
    """The buffer, live-set and device-gradient settings the plan changed (see [Note: lean
    buffers], [Note: resident on the device] and [Note: gradient sums on the device] in
    placement_rungs.py), keyed as LEAN_BUFFERS."""

    def apply(self, config: Config) -> Config:
        """`config` (as loaded: the run resolves it once, after) with the plan's keys set; its
        record of the keys the user set is kept."""
        raw = config.to_dict()
        zero = raw.setdefault("zero_optimization", {})
        set_buffers(zero, self.buffers)
        param = zero.setdefault("offload_param", {})
        param.update(device=self.param_device, max_in_cpu=self.param_max_in_cpu)
        optim = zero.setdefault("offload_optimizer", {})
        optim.update(device=self.optim_device, max_in_cpu=self.optim_max_in_cpu,
                     gradients_in_cpu=self.gradients_in_cpu)  # fmt: skip
        return replace(Config.load(raw), given_keys=config.given_keys)

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The plan as `infinity train` and `infinity estimate` print it."""
        rows = [
            ("16-bit trainable weights", self.weights),
            ("frozen parameters", self.frozen),
            (f"optimizer state ({'8-bit' if self.eight_bit_state else 'fp32'})", self.state),
            ("gradients (fp32)", self.grads),
        ]
        margin = self.budget.margin_bytes
        kept = f", {_size(margin)} of it left as margin" if margin else ""
        out = [
            f"placement within {_size(self.budget.ram_bytes)} of RAM ({self.budget.source}"
            f"{kept}): peak RSS {_size(self.peak_rss_bytes)}"
        ]
        for name, t in rows:
            if t.ram_bytes or t.nvme_bytes or t.device_bytes:
                device = f"   device {_size(t.device_bytes)}" if t.device_bytes else ""
                out.append(
                    f"  {name:<26} RAM {_size(t.ram_bytes):>10}   NVMe {_size(t.nvme_bytes):>10}"
                    + device
                )
        if self.overlap_bytes:
            out.append(f"  {'overlapped step copies':<26} RAM {_size(self.overlap_bytes):>10}")
        hidden = (GRADS_ON_DEVICE, KEEP, OVERLAP)
        shown = {k: v for k, v in self.buffers.items() if k not in hidden}
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
                f"elements gathered{self._kept()}; host to device "
                f"{_size(self.host_device_bytes_per_step)} per step"
            )
        return out

    def _kept(self) -> str:
        keep = self.buffers.get(KEEP, 0)
        return f" and {keep:,} trainable elements kept across micro batches" if keep else ""


def _margin(budget: Budget) -> str:
    return f" and a margin of {_size(budget.margin_bytes)}" if budget.margin_bytes else ""


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
    `tunable`: the keys of LEAN_BUFFERS (and GRADS_ON_DEVICE) the config leaves unset (see
    placement_rungs.py)."""
    config = resolve_trial(config, shape, world_size)
    acts = _activations(shape, config, seq_len, checkpointing)
    plans, evaluate = [], None
    rungs = candidates(shape, config, tunable, gpu, budget.device_bytes, acts, world_size)
    for rung, changed in enumerate(rungs):
        raw = config.to_dict()
        set_buffers(raw["zero_optimization"], changed)
        evaluate = _Evaluator(shape, Config.load(raw), budget, gpu, acts, checkpointing,
                              runtime_bytes, world_size, changed)  # fmt: skip
        for p in (evaluate.best("cpu"), evaluate.best("nvme")):
            if p is not None:
                on_device = GRADS_ON_DEVICE in p.buffers
                plans.append((_moved(p), on_device, p.host_device_bytes_per_step, rung,
                              p.peak_rss_bytes, p))  # fmt: skip
    if not plans:  # `evaluate` is the last rung's
        _refuse(evaluate, budget, gpu, runtime_bytes)
    # Fewest NVMe bytes, then no sums on the device (their copies at the step are not
    # overlapped), then host-to-device bytes, then the earliest rung, then less RSS.
    best = min(plans, key=lambda t: t[:5])[5]
    if gpu and OVERLAP in tunable:  # [Note: the overlapped step in the plan]
        return _with_overlap(best, shape, config, budget, acts, checkpointing, runtime_bytes,
                             world_size)  # fmt: skip
    return best


def _with_overlap(best, shape, config, budget, acts, checkpointing, runtime, world) -> Placement:
    """`best` with the overlapped step where its copies fit the budget beside it."""
    changed = {**best.buffers, OVERLAP: True}
    raw = config.to_dict()
    set_buffers(raw["zero_optimization"], changed)
    evaluate = _Evaluator(shape, Config.load(raw), budget, True, acts, checkpointing, runtime,
                          world, changed)  # fmt: skip
    kept = (best.param_max_in_cpu, best.optim_max_in_cpu, best.gradients_in_cpu)
    plan = evaluate.plan(best.param_device, *kept)
    return plan if evaluate.fits(plan) and plan.overlap_bytes else best


def _refuse(evaluate: _Evaluator, budget: Budget, gpu: bool, runtime_bytes: int) -> None:
    """The error of a budget no plan fits: the leanest plan's needs, and what would help."""
    spilled = min((evaluate.plan("nvme", 0, 0, g) for g in (False, True)),
                  key=lambda p: p.peak_rss_bytes)  # fmt: skip
    in_ram = evaluate.plan("cpu", 0, evaluate.state_steps[-1])
    floor = min(spilled, in_ram, key=lambda p: p.peak_rss_bytes)
    if gpu and budget.device_bytes and floor.device_bytes > budget.device_bytes:
        raise _device_error(budget.device_bytes, budget.device_source, floor.device_bytes)
    where = "everything in RAM" if floor is in_ram else "everything on NVMe"
    device = "" if gpu else f", the device's memory (host RAM here) {_size(floor.device_bytes)}"
    process = runtime_bytes + (CUDA_RUNTIME_HOST_BYTES if gpu else 0)
    held = (
        f"the optimizer state and gradients {_size(floor.state.ram_bytes + floor.grads.ram_bytes)}"
        if floor is in_ram
        else f"its NVMe staging buffers {_size(floor.buffers_bytes)}"
    )
    fix = (
        "or lower --micro-batch or --seq-len"
        if floor is in_ram
        else "or shrink the buffers: offload_param.buffer_count (each holds the largest "
        "parameter), zero_optimization.sub_group_size, stage3_max_live_parameters"
    )
    raise ValueError(
        f"a RAM budget of {_size(budget.ram_bytes)} ({budget.source}) is below the "
        f"{_size(floor.peak_rss_bytes + budget.margin_bytes)} this run needs with its "
        f"leanest plan, {where}{_margin(budget)} (the process before the model "
        f"{_size(process)}{' with the CUDA runtime' if gpu else ''}, {held}{device}); raise "
        f"--ram-budget, {fix}"
    )


def _device_error(limit: int, source: str, needed: int) -> ValueError:
    return ValueError(
        f"a device budget of {_size(limit)} ({source}) is below the {_size(needed)} this run "
        "needs on the device (the live parameters and the activations); lower "
        "stage3_max_live_parameters, --micro-batch or --seq-len, or turn on "
        "--activation-checkpointing"
    )


def resolve_trial(config: Config, shape: ModelShape, world_size: int) -> ResolvedConfig:
    """`config` resolved as the engine would run it for `shape` on `world_size` ranks: a
    trial the planner or a budget check models (a candidate placement, or the config as the
    user wrote it), never the run's own config, which `infinity.run.training` resolves once
    after the chosen plan's keys are set on it (`Placement.apply`). Every resolution here goes
    through this one function. A trial places the state, not the schedule: the schedule is
    left out, so a run whose schedule waits for its length is planned before it is known."""
    return resolve_run(config.without_schedule(), shape.run_facts(world_size))


def check_device(
    shape: ModelShape, config: Config, limit: int, source: str, *, gpu: bool, seq_len: int,
    checkpointing: bool = False, runtime_bytes: int, world_size: int = 1,
) -> int:  # fmt: skip
    """A run whose placement the config fixes: its device memory, or ValueError when that
    is over `limit` bytes (from `source`, e.g. "--device-memory 1.0G")."""
    config = resolve_trial(config, shape, world_size)
    acts = _activations(shape, config, seq_len, checkpointing)
    _, device, _ = _memory(shape, config, gpu, acts, checkpointing, runtime_bytes, world_size)
    if device > limit:
        raise _device_error(limit, source, device)
    return device


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
        """The frozen parameters, then the sub-groups, that fit, with `param`'s home; and
        the frozen parameters that fit beside every sub-group in RAM (see [Note: what the
        planner keeps in RAM])."""
        frozen_steps = self.frozen_steps if param == "nvme" else [0]  # "cpu": all in RAM
        steps = self.state_steps
        plans = []
        fits = self._fits(lambda k: self.plan(param, frozen_steps[k], steps[-1]), frozen_steps)
        if fits is not None:  # no state pipeline: it may fit where a spilled state does not
            plans.append(self.plan(param, frozen_steps[fits], steps[-1]))
        fits = self._fits(lambda k: self.plan(param, frozen_steps[k], 0), frozen_steps)
        if fits is not None:
            frozen = frozen_steps[fits]
            for grads in (False, True):  # the gradients spilled with the state, or in RAM
                k = self._fits(lambda k, g=grads: self.plan(param, frozen, steps[k], g), steps)
                if k is not None:
                    plans.append(self.plan(param, frozen, steps[k], grads))
        key = lambda p: (_moved(p), p.host_device_bytes_per_step, p.peak_rss_bytes)  # noqa: E731
        return min(plans, key=key, default=None)

    def fits(self, p: Placement) -> bool:
        """Within the RAM budget and, on a GPU, the device budget (when one is given)."""
        device = self.budget.device_bytes
        over_device = self.gpu and device and p.device_bytes > device
        return self.budget.fits(p.peak_rss_bytes) and not over_device

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


def _activations(
    shape: ModelShape, config: ResolvedConfig, seq_len: int, checkpointing: bool
) -> int:
    """The estimate's activation bytes of one micro batch of the resolved `config`."""
    micro = config.train_micro_batch_size_per_gpu
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
    config = resolve_trial(config, shape, world_size)
    acts = _activations(shape, config, seq_len, checkpointing)
    _, _, peak = _memory(shape, config, gpu, acts, checkpointing, runtime_bytes, world_size)
    if not budget.fits(peak):
        zero = config.zero_optimization
        devices = (zero.offload_param.device, zero.offload_optimizer.device)
        raise ValueError(
            f"this run needs {_size(peak)} of RAM at its peak{_margin(budget)}, over the "
            f"budget of {_size(budget.ram_bytes)} ({budget.source}); its config places the "
            f"parameters on {devices[0]!r} and the optimizer state on {devices[1]!r}. Give "
            "--nvme DIR (and no offload devices in the config) to let the planner keep in RAM "
            "what fits and put the rest on the SSD, or raise --ram-budget"
        )
    return peak


def _placement(
    param: str,
    kept: tuple[int, int, bool],
    sz: Sizes,
    memory: tuple[int, int],
    budget: Budget,
    cfg: ResolvedConfig,
) -> Placement:
    weights_ram = sz.weights_host_bytes if param == "cpu" else 0  # else the staging ring
    state_ram = sz.state_host_bytes - sz.state_buffer_bytes
    accum = cfg.gradient_accumulation_steps
    read = sz.optim_read_bytes_per_step + sz.grad_read_bytes_per_step
    read += sz.param_read_bytes_per_step(accum)
    write = sz.optim_write_bytes_per_step + sz.grad_write_bytes_per_step
    write += sz.param_write_bytes_per_step
    host_device = sz.host_device_bytes_per_step(accum)
    return Placement(
        param_device=param, param_max_in_cpu=kept[0], optim_device="nvme",
        optim_max_in_cpu=kept[1], gradients_in_cpu=kept[2],
        weights=Tiers(weights_ram, sz.param_nvme_bytes - sz.frozen_nvme_bytes),
        frozen=Tiers(sz.frozen_host_bytes, sz.frozen_nvme_bytes),
        state=Tiers(state_ram, sz.optim_nvme_bytes),
        grads=Tiers(sz.grad_host_bytes, sz.grad_nvme_bytes, sz.grad_device_bytes),
        buffers_bytes=sz.param_pool_bytes + sz.state_buffer_bytes,
        overlap_bytes=sz.overlap_host_bytes,
        nvme_read_bytes_per_step=read, nvme_write_bytes_per_step=write,
        host_device_bytes_per_step=host_device,
        live_parameters=cfg.zero_optimization.max_live_parameters,
        peak_rss_bytes=memory[0], device_bytes=memory[1], budget=budget,
        eight_bit_state=cfg.optimizer.eight_bit,
    )  # fmt: skip
