"""The training engine: forward, backward, step on a partitioned model.

`initialize(model, config)` partitions the model (`infinity.zero`), builds the partitioned
CPU-Adam optimizer, the loss scaler and the learning-rate schedule, and returns an `Engine`.
The engine owns the loop's bookkeeping (micro steps, accumulation boundaries, skipped steps,
the last gradient norm) and checkpoints; gathering, releasing and the iteration's lifecycle
belong to the coordinator (the engine calls its verbs around forward and backward).

[Note: gathered weights after a step] Trainable parameters that stay gathered between
iterations (persistent ones) must see each step's new weights. On both tiers they take them
from the optimizer's new weights while its sweep holds them (`on_new_weights`, then the
coordinator's `refresh`), not from their homes after the step: on the NVMe tier the disk is
then busy with the next sweep's read-ahead, and small reads queued behind it took 13 ms each
(0.35 s per step for 27 parameters at 507M); on the host tier the values are still in cache.
Anything in flight lands before the step (`Coordinator.quiesce`), so every gathered copy is
LIVE when the sweep reaches it.

[Note: loss scaling] `backward(loss)` differentiates loss * loss_scale / accumulation_steps,
as DeepSpeed does. Gradients therefore reach the fp32 partitions scaled by loss_scale; the
optimizer divides it out inside its step (after the overflow check and global-norm clipping).

[Note: plain backward] A plain `loss.backward()` works too, with PyTorch's meaning: the
gradient of `loss` as it is (a loop that accumulates divides its loss itself, as the HF
Trainer and Lightning do). The engine cannot see that loss, so it acts where the gradient
enters the model: `forward` marks every output that requires grad (`BackwardEntry`); the
first gradient to reach one (1) begins the coordinator's backward and queues its end for
when autograd finishes (the way FSDP ends its backward), and (2) with fp16 is
multiplied by the loss scale, inside an identity function the output passes through. Outputs
the model computes from one another (loss from logits) are wrapped after the fact, so each
gradient is scaled exactly once. What fp16 cannot do this way: a loss computed outside the
model from fp16 outputs (cross-entropy on `logits.float()`) has its gradient cast to fp16
before it reaches the scale, so values below fp16's range (about 6e-8) are lost; compute the
loss inside the model (HF models do, in fp32, when given `labels`) or call
`engine.backward(loss)`, which scales the loss itself (the entry then passes gradients
through unscaled). Activation checkpointing
recomputes modules inside backward: there the hooks enter the engine's torch-function mode
themselves (see `ModelHooks`), since autograd runs each node with the thread state captured
when backward was called.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity import checkpoint, engine_checkpoint
from infinity.accelerator import Accelerator, get_accelerator
from infinity.checkpoint import model16
from infinity.checkpoint.base_model import describe_base
from infinity.comm import Comm, from_env
from infinity.config import Config
from infinity.optim import Schedule, build_loss_scaler, build_schedule
from infinity.swap import (
    NvmeParamStore,
    SwapStores,
    make_grad_store,
    make_param_store,
    make_state_store,
)
from infinity.utils.profiler import StepProfiler
from infinity.utils.step_timer import StepTimer
from infinity.utils.telemetry import CounterDeltas, StepTelemetry, step_telemetry
from infinity.zero import (
    BackwardEntry,
    Coordinator,
    HomePlan,
    ModelHooks,
    ModuleUnit,
    OffloadParam,
    ParamState,
    PartitionedOptimizer,
    Phase,
    Slot,
    frozen_on_nvme,
    install_grad_hooks,
    make_weights,
    model_dtype,
    optimizer_layout,
    partition_model,
)
from infinity.zero.grad_reduce import GradReducer
from infinity.zero.shard import check_same_weights, shard_of

logger = logging.getLogger(__name__)

__all__ = ["Engine", "initialize"]


def initialize(
    model: nn.Module, config: Config | dict | str | os.PathLike, **kwargs: Any
) -> Engine:
    """Partition `model` (built under `infinity.init` or not) and return its Engine."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"initialize: expected the model as a torch.nn.Module, got {type(model).__name__}"
        )
    for key in sorted(kwargs.keys() & _NOT_TAKEN):
        raise TypeError(f"initialize: {key}= is not a parameter here: {_NOT_TAKEN[key]}")
    if model in _UNDER_ENGINE:
        raise ValueError(
            "initialize: this model is already under an engine (an earlier initialize "
            "partitioned its parameters); use that engine, or build the model again for a new one"
        )
    engine = Engine(model, config, **kwargs)
    _UNDER_ENGINE.add(model)
    return engine


# DeepSpeed's initialize takes these; here the config says what they said.
_NOT_TAKEN = {
    "optimizer": "the optimizer is the engine's own (CPU Adam over the offloaded states); "
    'set it in the config, e.g. {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}',
    "lr_scheduler": "the schedule is the engine's; set it in the config's scheduler section",
    "model_parameters": "every parameter with requires_grad=True is trained; set "
    "requires_grad=False on those to freeze",
}
_UNDER_ENGINE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models partitioned by `initialize`: a second engine on one would fail later, unclearly."""


class Engine:
    """`engine(batch)` -> forward; `engine.backward(loss)`; `engine.step()`."""

    def __init__(
        self,
        model: nn.Module,
        config: Config | dict | str | os.PathLike,
        *,
        accelerator: Accelerator | None = None,
        no_decay: Collection[str] = (),
        base_model: str | os.PathLike | dict | None = None,
        comm: Comm | None = None,
    ) -> None:
        """`no_decay`: names of parameters the optimizer's weight decay skips (the HF
        Trainer's biases and norms). `base_model` says where the frozen weights came from (a
        Hugging Face directory, or a JSON-able description such as {"preset": ..., "seed":
        ...}): checkpoints, which leave them out, record it and refuse to resume on another
        base. `comm` connects the ranks (default: `infinity.comm.from_env()`, one process
        unless launched by torchrun); the engine closes it only if it made it."""
        config = Config.load(config)
        largest = max((p.numel() for p in model.parameters()), default=1)
        self.accelerator = accelerator or get_accelerator()
        self._owns_comm = comm is None
        self.comm: Comm = comm if comm is not None else from_env(device=self.accelerator.device)
        self.config = config.resolve(
            world_size=self.comm.world_size, largest_param_numel=max(1, largest)
        ).for_local_rank(self.comm.local_rank)
        zero = self.config.zero_optimization
        if zero.stage != 3:
            raise ValueError(f"zero_optimization.stage: only 3 is supported, got {zero.stage}")
        self.module = model
        self._base_source = base_model
        self._base_record: dict | None = None
        if self.comm.world_size > 1:
            check_same_weights(model.named_parameters(), self.comm)
        self.optimizer, units = self._build_optimizer(set(no_decay))
        # By slot (records are in model order, as the slots): see [Note: gathered weights
        # after a step].
        self._trainable = [r for r in self.records if r.trainable]
        self.optimizer.on_new_weights = self._weights_changed
        try:
            self.coordinator = Coordinator(self.records, zero, accelerator=self.accelerator)
            by_param = {rec.param: rec for rec in self.records}
            self.hooks = ModelHooks(
                model, units, by_param, self.coordinator, iteration_key=self._iteration_key
            )
            self.grad_reducer = self._make_grad_reducer()
            self._grad_handles = install_grad_hooks(
                self.records,
                self.optimizer.accumulate_grad,
                self.hooks,
                self.accelerator,
                self.grad_reducer,
            )
        except BaseException:  # no swap directory outlives a failed start
            self._close_stores(self.optimizer)
            raise
        self.loss_scaler = build_loss_scaler(self.config.fp16)
        self.lr_schedule: Schedule = build_schedule(
            self.config.scheduler, float(self.config.optimizer.lr)
        )
        """The lr of each step. An integration may replace it between steps with anything
        that has `lr` (the next step's rate), `step()` and `state_dict`/`load_state_dict`
        (`infinity.integrations.hf` puts the HF Trainer's own scheduler here)."""
        fp16 = self.config.fp16.enabled
        # See docs/telemetry.md: always timed; the device synchronized only when asked.
        sync = self.accelerator.synchronize if self.config.wall_clock_breakdown else None
        self._timer = StepTimer(synchronize=sync)
        self.entry = BackwardEntry(
            self.hooks,
            self.coordinator,
            loss_scale=(lambda: self.loss_scaler.scale) if fp16 else None,
            timer=self._timer,
        )
        self.gradient_accumulation_steps = int(self.config.gradient_accumulation_steps)
        self.micro_steps = 0
        self._backwards = 0
        """backward() calls since the last step(): a step without one is a mistake."""
        self.global_steps = 0
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._last_overflow = False
        # The start's writes and waits for the disk are not the first step's.
        self._deltas = CounterDeltas(self._counters())
        self._telemetry: StepTelemetry | None = None
        self._profiler: StepProfiler | None = None

    def _build_optimizer(
        self, no_decay: set[str]
    ) -> tuple[PartitionedOptimizer, dict[nn.Module, ModuleUnit]]:
        """The homes first (decided once, see `HomePlan`), the records with them, then the
        optimizer, which writes the trainable weights into their homes."""
        named = list(self.module.named_parameters())
        shard = self._shard_numel
        trainable = [(n, shard(p.numel())) for n, p in named if p.requires_grad]
        if not trainable:
            raise ValueError(
                "initialize: the model has no parameter with requires_grad=True; nothing to train"
            )
        unknown = sorted(no_decay - {n for n, _ in named})
        if unknown:
            raise ValueError(
                f"initialize: no_decay names {unknown[:5]}, which are not parameters of the "
                "model; use names from model.named_parameters()"
            )
        zero = self.config.zero_optimization
        dtype = model_dtype(self.config)
        names = [n for n, _ in trainable]
        self._swap_stores = SwapStores(rank=self.comm.rank)
        self.param_store: NvmeParamStore | None = None
        try:
            on_nvme: set[str] = set()
            if zero.offload_param.device == "nvme":
                on_nvme = frozen_on_nvme(named, zero.offload_param)
                self.param_store = self._make_param_store(named, on_nvme, dtype)
            layout = optimizer_layout([n for _, n in trainable], zero)
            numels = layout.sub_group_numels
            store = make_state_store(
                numels, zero.offload_optimizer, self.config.aio, stores=self._swap_stores
            )
            weights = make_weights(
                layout, names, dtype, state_store=store, param_store=self.param_store
            )
            plan = HomePlan(
                weights,
                {n: i for i, n in enumerate(names)},
                self.param_store,
                frozenset(on_nvme),
                comm=self.comm if self.comm.world_size > 1 else None,
            )
            self.records, units, sources = partition_model(
                self.module, self.config, self.accelerator, plan
            )
            slots = [Slot(n, k, src) for (n, k), src in zip(trainable, sources, strict=True)]
            del sources
            grads = make_grad_store(
                numels, zero.offload_optimizer, self.config.aio, stores=self._swap_stores
            )
            optimizer = PartitionedOptimizer(
                slots,
                optimizer=self.config.optimizer,
                zero=zero,
                state_store=store,
                weights=weights,
                no_decay=[i for i, n in enumerate(names) if n in no_decay],
                grad_store=grads,
                comm=self.comm,
            )
        except BaseException:
            self._close_stores()  # no swap directory or lock outlives a failed start
            raise
        return optimizer, units

    def _shard_numel(self, numel: int) -> int:
        """Elements of this rank's shard of a parameter (all of them with one rank)."""
        return shard_of(numel, self.comm.world_size, self.comm.rank).numel

    def _make_grad_reducer(self) -> GradReducer | None:
        """With several ranks, the buckets that reduce-scatter gradients into the slots."""
        if self.comm.world_size == 1:
            return None
        zero = self.config.zero_optimization
        return GradReducer(
            self.comm,
            self.optimizer.accumulate_grad,
            self.accelerator,
            bucket_numel=int(zero.reduce_bucket_size),
            overlap=zero.overlap_comm,
            contiguous=zero.contiguous_gradients,
            total_shard_numel=self.optimizer.layout.total,
        )

    def _make_param_store(
        self, named: list[tuple[str, nn.Parameter]], on_nvme: set[str], dtype: torch.dtype
    ) -> NvmeParamStore:
        """The NVMe parameter tier: frozen parameters laid out one extent each (the optimizer
        lays out the trainable ones in its flat space); this rank's shards of them."""
        zero = self.config.zero_optimization
        numels = [self._shard_numel(p.numel()) for _, p in named]
        return make_param_store(
            {n: (k, dtype) for (n, _), k in zip(named, numels, strict=True) if n in on_nvme},
            zero.offload_param,
            self.config.aio,
            stores=self._swap_stores,
            largest_numel=max(numels),
            element_size=dtype.itemsize,
            # Prefetch never reads ahead more than the whole model: a bucket larger than the
            # model asks for no more buffers than the model has parameters to fill.
            prefetch_numel=min(int(zero.prefetch_bucket_size), sum(numels)),
        )

    def _close_stores(self, optimizer: PartitionedOptimizer | None = None) -> None:
        """Close the optimizer's state and gradient tiers (if given), the parameter tier,
        then the swap stores under them, each even if an earlier one fails."""
        try:
            if optimizer is not None:
                try:
                    optimizer.store.close()
                finally:
                    optimizer.grads.close()
        finally:
            try:
                if self.param_store is not None:
                    self.param_store.close()
            finally:
                self._swap_stores.close()

    def _iteration_key(self) -> object:
        return (self.module.training, torch.is_grad_enabled())

    # ---- the loop ---------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; parameters are gathered module by module. With fp16.auto_cast,
        floating-point tensor arguments are cast to fp16 first. Outputs that require grad
        are marked so that a plain `loss.backward()` drives the engine (see [Note: plain
        backward])."""
        self._check_open("forward")
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _to_half((args, kwargs))
        coord = self.coordinator
        grad = torch.is_grad_enabled()
        # An evaluation forward belongs to no optimizer step's telemetry.
        before = None if grad else self._counters()
        start = self._timer.start() if grad else 0.0
        if coord.phase is Phase.BACKWARD_PENDING:  # a forward whose backward never came
            self.hooks.reset()  # (begin_forward closes its iteration)
        elif coord.phase is Phase.BACKWARD:  # a plain backward that raised out of autograd
            self.hooks.reset()
            coord.abort()
        self.entry.new_iteration()
        coord.begin_forward(self._iteration_key())
        try:
            with (
                self.accelerator.range("infinity::engine::forward"),
                self.hooks.mode,
                self.hooks.saved_tensors(),
            ):
                out = self.module(*args, **kwargs)
        except BaseException:
            self.hooks.reset()
            coord.abort()
            raise
        if not grad:
            self.hooks.reset()
        coord.end_forward(backward=grad)
        if not grad:
            self._deltas.skip(before, self._counters())
            return out
        self._timer.stop("forward", start)
        return self.entry.wrap(out)

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backpropagate loss * loss_scale / gradient_accumulation_steps (DeepSpeed's meaning;
        `scale_wrt_gas=False` leaves out the division, for loops that divide themselves).
        A plain `loss.backward()` is accepted as well (see [Note: plain backward])."""
        self._check_open("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"backward: expected a scalar loss tensor, got {type(loss).__name__} "
                f"with shape {getattr(loss, 'shape', None)}"
            )
        factor = self.loss_scaler.scale
        if scale_wrt_gas:
            factor /= self.gradient_accumulation_steps
        coord = self.coordinator
        if coord.phase is Phase.IDLE:
            raise RuntimeError(
                "backward: no forward is waiting for its backward (its backward already ran, "
                "or the loss was not computed from engine(...)); run one backward per forward"
            )
        start = self._timer.start()
        coord.begin_backward()
        self.entry.caller_scaled = True
        try:
            with (
                self.accelerator.range("infinity::engine::backward"),
                self.hooks.mode,
                self.hooks.saved_tensors(),
            ):
                (loss.float() * factor).backward()
        except BaseException:
            self.hooks.reset()
            coord.abort()
            raise
        finally:
            self.entry.caller_scaled = False
        if coord.phase is Phase.BACKWARD:  # the loss bypassed the outputs: no entry ended it
            self.hooks.reset()
            coord.end_backward()
        self._backwards += 1
        self._timer.stop("backward", start)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step()` applies the optimizer (DeepSpeed's meaning)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self, *, boundary: bool | None = None) -> None:
        """Count a micro step; at the accumulation boundary run the optimizer.

        `boundary` overrides the count for loops that keep their own (the HF Trainer, whose
        last window of an epoch may be shorter): True runs the optimizer now and starts a new
        window, False only counts."""
        self._check_open("step")
        if self._backwards == 0 and self.entry.finished == 0:
            # Adam on no gradient still moves the weights (weight decay, the moments).
            raise RuntimeError(
                "step: no backward() since the last step(); call engine.backward(loss) (or "
                "loss.backward()) on each micro batch's loss before engine.step()"
            )
        self._backwards = self.entry.finished = 0
        ga = self.gradient_accumulation_steps
        if boundary is None:
            boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._optimizer_step()
            self.micro_steps = (self.micro_steps // ga + 1) * ga
        else:
            self.micro_steps += 1

    def _optimizer_step(self) -> None:
        with self.accelerator.range("infinity::engine::step"):
            lr = self._run_optimizer()
        self._telemetry = self._measure_step()
        self._log_progress(lr, self._telemetry)
        if self._profiler is not None and self._profiler.step(self.global_steps):
            self._profiler = None  # its trace is written

    def _run_optimizer(self) -> float:
        """The optimizer step proper; returns the lr it used."""
        start = self._timer.start()
        if self.grad_reducer is not None:  # normally done at the end of each backward
            self.grad_reducer.flush()
        self.coordinator.quiesce()
        lr = self.lr_schedule.lr
        result = self.optimizer.step(
            lr=lr,
            loss_scale=self.loss_scaler.scale,
            max_grad_norm=float(self.config.gradient_clipping),
        )
        self.loss_scaler.update(result.overflow)
        self._last_overflow = result.overflow
        self._grad_norm = result.grad_norm
        if result.overflow:
            self.skipped_steps += 1
        else:
            self.lr_schedule.step()
        self.global_steps += 1
        self.comm.end_step()  # with INFINITY_COMM_CHECK: the ranks' collectives compared
        self._timer.stop("optimizer", start)
        return lr

    def _counters(self) -> dict[str, float]:
        """The running counters a step's telemetry is the difference of."""
        copies = self.accelerator.copies
        return {
            **self.memory_stats(),
            "host_to_device_bytes": copies.host_to_device_bytes,
            "device_to_host_bytes": copies.device_to_host_bytes,
            "copy_s": copies.seconds,
        }

    def _measure_step(self) -> StepTelemetry:
        """The finished optimizer step's record: its phase times and what the counters grew
        by (perf_counter pairs and integer differences; no device synchronization unless
        `wall_clock_breakdown`)."""
        phases = self._timer.finish()
        return step_telemetry(
            step=self.global_steps,
            window_s=self._timer.last_window_s,
            phases=phases,
            deltas=self._deltas.take(self._counters()),
            optimizer_compute_s=self.optimizer.last_compute_s,
            synchronized=self._timer.synchronizes,
        )

    def _log_progress(self, lr: float, telemetry: StepTelemetry) -> None:
        """Every `steps_per_print` optimizer steps: a progress line and, with
        `wall_clock_breakdown`, where the step's time went."""
        if self.global_steps % self.config.steps_per_print:
            return
        logger.info(
            "step %d: lr %.4g, loss scale %g, grad norm %.4g, skipped steps %d",
            self.global_steps, lr, self.loss_scaler.scale, self._grad_norm, self.skipped_steps,
        )  # fmt: skip
        if self.config.wall_clock_breakdown:
            logger.info("step %d time: %s", self.global_steps, telemetry.describe())

    def _weights_changed(self, start: int, weights: torch.Tensor) -> None:
        """The optimizer's new weights of flat elements [start, start + numel): gathered
        trainable parameters take them (see [Note: gathered weights after a step])."""
        layout = self.optimizer.layout
        refresh = self.coordinator.refresh
        for slot, a, b in layout.pieces(start // layout.sub_group_size):
            rec = self._trainable[slot]
            if rec.state is not ParamState.RELEASED:
                at = layout.offsets[slot] + a - start
                refresh(rec, weights[at : at + b - a], start=a)

    # ---- accessors ----------------------------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def get_lr(self) -> list[float]:
        """The learning rate of the next optimizer step (one entry: one parameter group)."""
        return [self.lr_schedule.lr]

    def get_global_grad_norm(self) -> float | None:
        """The unscaled global gradient norm of the last optimizer step (before clipping)."""
        return self._grad_norm

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def was_step_skipped(self) -> bool:
        return self._last_overflow

    def wall_clock_breakdown(self) -> dict[str, float]:
        """The `*_seconds` parts of the last optimizer step's telemetry, with the device
        synchronized around each; {} unless the config's `wall_clock_breakdown` is true."""
        if not self.config.wall_clock_breakdown or self._telemetry is None:
            return {}
        return self._telemetry.seconds()

    def last_step_telemetry(self) -> StepTelemetry | None:
        """Where the last optimizer step's time went and what it moved (None before the
        first step): recorded for every step, see docs/telemetry.md."""
        return self._telemetry

    def profile(
        self, steps: int, out_dir: str | os.PathLike, *, warmup_steps: int = 1
    ) -> StepProfiler:
        """Record the optimizer steps after the next `warmup_steps` ones, `steps` of them,
        with torch.profiler (the engine's ranges are `infinity::<component>::<op>`), and
        write a Chrome trace into `out_dir` (atomically) once they are done, or when the
        engine closes. Returns the profiler: its `path` is the trace's, once written."""
        if self._profiler is not None:
            raise RuntimeError(
                "profile: a profile is already being recorded; wait for its trace (its "
                "`path`) or close the engine first"
            )
        self._profiler = StepProfiler(
            steps,
            out_dir,
            warmup_steps=warmup_steps,
            activities=self.accelerator.profiler_activities(),
        )
        self._profiler.start(self.global_steps)
        return self._profiler

    def memory_stats(self) -> dict[str, int]:
        """Live/peak gathered elements and bytes, host bytes, prefetch hits and misses, the
        time gathers waited (`gather_wait_us`, a running total); with NVMe tiers, bytes read
        and written, time waited, the staging buffers' sizes and peak use, and the pinned
        bytes (allocated, and the peak in use); this rank's figures, with `rank`,
        `world_size`, `home_numel` (the elements its homes hold: about 1/world_size of the
        model) and the comm's bytes and calls per collective."""
        stats = self.coordinator.stats()
        # Trainable homes are the optimizer's buffers (it counts them, or they alias its fp32
        # masters); frozen ones are only ours.
        host = sum(r.home.host_bytes for r in self.records if not r.trainable)
        optim = self.optimizer.memory_stats()
        stats["host_bytes"] = host + optim["host_bytes"]
        stats.update(
            {
                k: v
                for k, v in optim.items()
                if k.startswith(("nvme_", "optim_host_buffer", "grad_"))
            }
        )
        pinned = optim.get("optim_host_buffer_pinned_bytes", 0)  # offload_optimizer.pin_memory
        peak_pinned = optim.get("optim_host_buffer_peak_bytes", 0) if pinned else 0
        if self.param_store is not None:
            stats.update(self.param_store.memory_stats())
            pool = self.param_store.pool
            stats["host_bytes"] += pool.total_bytes
            if pool.pinned:
                pinned += pool.total_bytes
                peak_pinned += pool.peak_bytes_in_use
        stats["pinned_bytes"], stats["peak_pinned_bytes"] = pinned, peak_pinned
        stats["rank"], stats["world_size"] = self.comm.rank, self.comm.world_size
        stats["home_numel"] = sum(r.home.numel for r in self.records)  # this rank's shards
        stats.update(self.comm.stats())
        if self.grad_reducer is not None:
            stats.update(self.grad_reducer.memory_stats())
        return stats

    # ---- checkpoints ------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        *,
        client_state: dict | None = None,
        include_frozen: bool = False,
    ) -> str:
        """Write weights (from the partitions), optimizer state, schedule, loss scale, step
        counts and RNG states atomically under `save_dir/tag` (default: the step's tag).
        Frozen weights are left out unless `include_frozen`: a record of their base takes
        their place (see `infinity.checkpoint.base_model`). `client_state` (JSON-able: data
        position, model description...) is stored with them and handed back by
        `load_checkpoint`. Returns the tag. Call between steps (not between forward and
        backward)."""
        self._check_idle("save_checkpoint")
        tag = tag or checkpoint.step_tag(self.global_steps)
        engine_checkpoint.save(
            self, save_dir, tag, client_state=client_state, include_frozen=include_frozen
        )
        self._deltas.rebase(self._counters())  # a checkpoint's reads are no step's
        return tag

    def save_16bit_model(
        self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors"
    ) -> str:
        """Write the whole model's weights (and persistent buffers) in 16 bits to one
        safetensors file, `save_dir/save_filename`, with the model's config.json when it has
        one, so `from_pretrained(save_dir)` loads it. The training dtype when it is fp16 or
        bf16, else bf16. Needs zero_optimization.stage3_gather_16bit_weights_on_model_save
        (DeepSpeed's switch for this). Returns the file's path. With several ranks every
        rank calls it (each parameter is gathered from all of them) and rank 0 writes."""
        if not self.config.zero_optimization.gather_16bit_weights_on_model_save:
            raise ValueError(
                "save_16bit_model: zero_optimization.stage3_gather_16bit_weights_on_model_save "
                "is false; set it to true, or export a checkpoint with "
                "`infinity export CKPT --out DIR`"
            )
        self._check_idle("save_16bit_model")
        dtype = self.records[0].dtype
        dtype = dtype if dtype in model16.SIXTEEN_BIT else torch.bfloat16
        weights = [(r.name, _weights_of(r)) for r in self.records]
        if self.comm.rank != 0:  # the gathers are collectives: take part, write nothing
            for _, gather in weights:
                gather()
            self.comm.barrier()  # returns once rank 0 has written the file
            return str(Path(save_dir) / save_filename)
        path = model16.save_16bit_model(
            weights + list(model16.persistent_buffers(self.module)),
            save_dir,
            save_filename,
            dtype=dtype,
            config_json=model16.model_config_json(self.module, dtype),
        )
        if self.comm.world_size > 1:
            self.comm.barrier()
        logger.info("saved 16-bit model weights to %s", path)
        return str(path)

    def load_checkpoint(
        self, save_dir: str | os.PathLike, tag: str | None = None
    ) -> tuple[str, dict]:
        """Resume exactly from `save_dir/tag` (default: the latest). Returns the checkpoint's
        path and the `client_state` it was saved with, as DeepSpeed does."""
        self._check_idle("load_checkpoint")
        result = engine_checkpoint.load(self, save_dir, tag)
        self._deltas.rebase(self._counters())  # its writes are no step's
        return result

    def _base(self) -> dict:
        """The record of this engine's frozen base (built once: it fingerprints files)."""
        if self._base_record is None:
            frozen = {
                r.name: (r.shape, str(r.dtype).removeprefix("torch."))
                for r in self.records
                if not r.trainable
            }
            self._base_record = describe_base(frozen, self._base_source)
        return self._base_record

    def close(self) -> None:
        """Remove the engine's hooks from the model, release what is gathered and close the
        optimizer's state tier. The weights stay in the partitions
        (`named_parameters_host`). Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self._profiler is not None:  # a trace of the steps recorded so far
            self._profiler.stop()
            self._profiler = None
        self.hooks.remove()
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = []
        self.coordinator.abort()
        self.accelerator.empty_cache()
        try:
            self._close_stores(self.optimizer)
        finally:
            if self._owns_comm:
                self.comm.close()

    def _check_open(self, what: str) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(
                f"{what}: the engine is closed (its hooks and optimizer state are gone); "
                "build a new one with infinity.initialize"
            )

    def _check_idle(self, what: str) -> None:
        phase = self.coordinator.phase
        if phase is not Phase.IDLE and torch.is_grad_enabled():
            raise RuntimeError(
                f"{what}: a forward is waiting for its backward (phase {phase.name}); call it "
                "between steps"
            )

    def named_parameters_host(self):
        """(name, a host copy of the weights in the parameter's shape) for every parameter,
        read from its home when reached (with several ranks, gathered from every rank: all
        of them must iterate it together)."""
        for rec in self.records:
            yield rec.name, _weights_of(rec)()


def _weights_of(rec: OffloadParam):
    """A thunk for a parameter's weights that reads its home when the writer reaches it (one
    parameter in memory at a time; with several ranks every rank's shard, gathered)."""
    return lambda: rec.read_full().view(rec.shape)


def _to_half(obj: Any) -> Any:
    """`obj` with every floating-point tensor (in tuples, lists, dicts) cast to fp16."""
    if isinstance(obj, torch.Tensor):
        return obj.half() if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_half(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_half(v) for k, v in obj.items()}
    return obj
