"""The training engine: forward, backward, step on a partitioned model.

`initialize(model, config)` resolves the config, has `infinity.assemble` build the
partitioned model and what trains it (records, tiers, optimizer, coordinator, hooks), builds
the loss scaler and the learning-rate schedule, and returns an `Engine`.
The engine owns the loop's bookkeeping (micro steps, accumulation boundaries, skipped steps,
the last gradient norm) and checkpoints; gathering, releasing and the iteration's lifecycle
belong to the coordinator (the engine runs forward and backward inside its `forward` and
`backward` context managers, which abort the iteration on an exception).

[Note: loss scaling] `backward(loss)` differentiates loss * loss_scale / accumulation_steps,
as DeepSpeed does. Gradients therefore reach the fp32 sums scaled by loss_scale; the
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
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from infinity import checkpoint, engine_checkpoint
from infinity.accelerator import Accelerator, get_accelerator
from infinity.assemble import assemble, run_config
from infinity.checkpoint.base_model import describe_base
from infinity.comm import Comm, from_env
from infinity.config import Config
from infinity.optim import ParamGroup, Schedule, build_loss_scaler, build_schedule, step_lrs
from infinity.utils.batch import check_fp16_inputs, to_device
from infinity.utils.profiler import StepProfiler
from infinity.utils.step_timer import StepTimer
from infinity.utils.telemetry import CounterDeltas, StepTelemetry, step_telemetry

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
        raise TypeError(
            f"initialize: {key}= is not a parameter here: {_NOT_TAKEN[key]} (or call "
            "infinity.deepspeed.initialize, which takes DeepSpeed's arguments)"
        )
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
        groups: Sequence[ParamGroup] = (),
        base_model: str | os.PathLike | dict | None = None,
        comm: Comm | None = None,
    ) -> None:
        """`no_decay`: names of parameters the optimizer's weight decay skips (the HF
        Trainer's biases and norms); or `groups`, torch.optim's parameter groups (each its
        betas, eps, weight decay; the schedule may give one lr per group). `base_model`
        says where the frozen weights came from (an HF directory, or a JSON-able record such
        as {"preset": ..., "seed": ...}): checkpoints, which leave them out, record it and
        refuse to resume on another base. `comm` connects the ranks (default:
        `infinity.comm.from_env()`); the engine closes it only if it made it."""
        self.accelerator = accelerator or get_accelerator()
        self._owns_comm = comm is None
        self.comm: Comm = comm if comm is not None else from_env(device=self.accelerator.device)
        self.config = run_config(config, model, self.comm)
        self.module = model
        self._base_source = base_model
        self._base_record: dict | None = None
        fp16 = self.config.fp16.enabled
        # See docs/telemetry.md: always timed; the device synchronized only when asked.
        sync = self.accelerator.synchronize if self.config.wall_clock_breakdown else None
        self._timer = StepTimer(synchronize=sync)
        # Built before the parts, which hold files and hooks: a refusal here leaks nothing.
        self.loss_scaler = build_loss_scaler(self.config.fp16)
        self.lr_schedule: Schedule = build_schedule(
            self.config.scheduler, float(self.config.optimizer.lr)
        )
        """The lr of each step. An integration may replace it between steps with anything
        that has `lr` (the next step's rate; maybe `lrs`, one per parameter group), `step()`
        and `state_dict`/`load_state_dict` (`infinity.integrations.hf` puts the HF Trainer's
        own scheduler here)."""
        self.parts = assemble(
            model, self.config, comm=self.comm, accelerator=self.accelerator,
            no_decay=set(no_decay), groups=tuple(groups), timer=self._timer,
            loss_scale=(lambda: self.loss_scaler.scale) if fp16 else None,
        )  # fmt: skip
        """The records, tiers, optimizer, coordinator and hooks `infinity.assemble` built."""
        self.gradient_accumulation_steps = self.config.gradient_accumulation_steps
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

    # ---- the loop ---------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; parameters are gathered module by module. Tensor arguments are
        moved to the device first (with fp16.auto_cast, floating-point ones cast to fp16).
        Outputs that require grad are marked so that a plain `loss.backward()` drives the
        engine (see [Note: plain backward])."""
        self._check_open("forward")
        fp16 = self.config.fp16
        if self.config.precision != "fp32" and not fp16.auto_cast:
            bf16 = self.config.precision == "bf16"
            check_fp16_inputs(args, "argument", bf16=bf16)
            check_fp16_inputs(kwargs, "argument", bf16=bf16)
        half = fp16.enabled and fp16.auto_cast
        args, kwargs = to_device((args, kwargs), self.accelerator.device, half=half)
        grad, parts = torch.is_grad_enabled(), self.parts
        # An evaluation forward belongs to no optimizer step's telemetry.
        before = None if grad else self._counters()
        start = self._timer.start() if grad else 0.0
        if grad and self.is_gradient_accumulation_boundary():  # see PartitionedOptimizer
            lrs, scale = step_lrs(self.lr_schedule), self.loss_scaler.scale
            parts.optimizer.step_ahead(lr=lrs, loss_scale=scale)
        with (
            parts.coordinator.forward((self.module.training, grad), backward=grad),
            self.accelerator.range("infinity::engine::forward"),
            parts.hooks.mode,
            parts.hooks.saved_tensors(),
        ):
            out = self.module(*args, **kwargs)
        if not grad:
            self._deltas.skip(before, self._counters())
            return out
        self._timer.stop("forward", start)
        return parts.entry.wrap(out)

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
        factor, parts = self.loss_scaler.scale, self.parts
        if scale_wrt_gas:
            factor /= self.gradient_accumulation_steps
        try:
            with (
                parts.coordinator.backward(),  # refused when no forward waits for its backward
                parts.entry.scaled_by_caller(),
                self.accelerator.range("infinity::engine::backward"),
                parts.hooks.mode,
                parts.hooks.saved_tensors(),
            ):
                start = self._timer.start()
                (loss.float() * factor).backward()
        except BaseException:
            parts.grad_offload.flush()  # what reached the hooks, as a blocking copy would have
            raise
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
        if self._backwards == 0 and self.parts.entry.finished == 0:
            # Adam on no gradient still moves the weights (weight decay, the moments).
            raise RuntimeError(
                "step: no backward() since the last step(); call engine.backward(loss) (or "
                "loss.backward()) on each micro batch's loss before engine.step()"
            )
        self._backwards = self.parts.entry.finished = 0
        ga = self.gradient_accumulation_steps
        if boundary is None:
            boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._optimizer_step()
            self.micro_steps = (self.micro_steps // ga + 1) * ga
        else:
            self.parts.optimizer.cancel_ahead()  # the loop's window goes on: no step yet
            self.micro_steps += 1

    def _optimizer_step(self) -> None:
        with self.accelerator.range("infinity::engine::step"):
            lr = self._run_optimizer()[0]
        self._telemetry = self._measure_step()
        self._log_progress(lr, self._telemetry)
        if self._profiler is not None and self._profiler.step(self.global_steps):
            self._profiler = None  # its trace is written

    def _run_optimizer(self) -> tuple[float, ...]:
        """The optimizer step proper; returns the lrs it used (one per parameter group)."""
        start, parts = self._timer.start(), self.parts
        if parts.grad_reducer is not None:  # normally done at the end of each backward
            parts.grad_reducer.flush()
        parts.grad_offload.flush()  # likewise
        parts.coordinator.quiesce()
        lr = step_lrs(self.lr_schedule)
        result = parts.optimizer.step(
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
            optimizer_compute_s=self.parts.optimizer.last_compute_s,
            peak_device_bytes=self.accelerator.max_memory_allocated(),
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
        """The learning rate of the next optimizer step, one entry per parameter group."""
        return list(step_lrs(self.lr_schedule))

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
        return self.parts.memory_stats(self.comm)

    # ---- checkpoints ------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        *,
        client_state: dict | None = None,
        include_frozen: bool = False,
    ) -> str:
        """Write weights (from their homes), optimizer state, schedule, loss scale, step
        counts and RNG states atomically under `save_dir/tag` (default: the step's tag).
        Frozen weights are left out unless `include_frozen`: a record of their base takes
        their place (see `infinity.checkpoint.base_model`). `client_state` (JSON-able: data
        position, model description...) is stored with them and handed back by
        `load_checkpoint`. Returns the tag. Call between steps (not between forward and
        backward)."""
        self.parts.coordinator.check_between_iterations("save_checkpoint")
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
        return engine_checkpoint.save_16bit(self, save_dir, save_filename)

    def load_checkpoint(
        self, save_dir: str | os.PathLike, tag: str | None = None, *, accept_unverified=False
    ) -> tuple[str, dict]:
        """Resume exactly from `save_dir/tag` (default: the latest). Returns the checkpoint's
        path and the `client_state` it was saved with, as DeepSpeed does. A checkpoint.json
        without its checksum is refused unless `accept_unverified`."""
        self.parts.coordinator.check_between_iterations("load_checkpoint")
        result = engine_checkpoint.load(self, save_dir, tag, accept_unverified)
        self._deltas.rebase(self._counters())  # its writes are no step's
        return result

    def base_record(self) -> dict:
        """The record of this engine's frozen base (built once: it fingerprints files)."""
        if self._base_record is None:
            frozen = {
                r.name: (r.shape, str(r.dtype).removeprefix("torch."))
                for r in self.parts.records
                if not r.trainable
            }
            self._base_record = describe_base(frozen, self._base_source)
        return self._base_record

    def loop_state(self) -> dict:
        """The loop's counters, as a checkpoint stores them (JSON-able)."""
        return {
            "micro_steps": self.micro_steps,
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "grad_norm": self._grad_norm,
        }

    def load_loop_state(self, state: dict) -> None:
        """Continue the loop from counters `loop_state` returned."""
        self.micro_steps = int(state["micro_steps"])
        self.global_steps = int(state["global_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self._grad_norm = state["grad_norm"]

    def close(self) -> None:
        """Remove the engine's hooks from the model, release what is gathered and close the
        optimizer's state tier. The weights stay in their homes
        (`named_parameters_host`). Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self._profiler is not None:  # a trace of the steps recorded so far
            self._profiler.stop()
            self._profiler = None
        try:
            self.parts.close()
        finally:
            if self._owns_comm:
                self.comm.close()

    def _check_open(self, what: str) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(
                f"{what}: the engine is closed (its hooks and optimizer state are gone); "
                "build a new one with infinity.initialize"
            )

    def named_parameters_host(self):
        """(name, a host copy of the weights in the parameter's shape) for every parameter,
        read from its home when reached (with several ranks, gathered from every rank: all
        of them must iterate it together)."""
        for rec in self.parts.records:
            yield rec.name, engine_checkpoint.full_weights(rec)()
