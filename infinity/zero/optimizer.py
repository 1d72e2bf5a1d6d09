"""The partitioned optimizer the engine steps at each accumulation boundary.

Owns, for the trainable slots of one rank: the flat space they are laid out in and its
sub-groups (see [Note: the flat space] in sub_groups.py), the Adam/AdamW step over the
sub-groups, the global-norm clipping and the overflow check. The fp32 gradient sums that the
engine's hooks accumulate into live behind a gradient tier (`infinity.swap.grad_tier`: one flat
host buffer, or a few host buffers and NVMe); the fp32 master weights and moments behind a
`StateTier` (host or NVMe); the weights in the model dtype in a weight output
(`infinity.zero.weights`: host memory, or NVMe through the parameter tier) whose ranges are
the trainable parameters' homes. It does not own the loss scale (the engine drives the
scaler and passes `loss_scale`), the learning-rate schedule (`lr` is passed to `step`), nor
gathering parameters to the device. With several
ranks each rank's optimizer steps its own shards (slots of S elements, see
`infinity.zero.shard`) and agrees with the others on the global norm and overflow through
the comm it is given.

[Note: where the weights live] With an fp32 model and the host tier, a slot's home is a
view of the master weights themselves: the step updates it in place and no copy exists (4
bytes per parameter saved, one pass fewer). With fp16/bf16 the homes are their own flat
buffer, written by the step's fused copy-out (the master rounded to nearest-even). With an
fp32 model on any other tier the master is not resident between steps, so the homes are
their own fp32 buffer, copied from the master while the sub-group is resident during the
sweep. With the NVMe parameter tier no weights are in memory: each sub-group's new weights go
through a staging buffer to disk during the sweep.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch

from infinity.accelerator import profile_range
from infinity.comm import Comm, SingleProcess
from infinity.config import OptimizerConfig, ZeroConfig
from infinity.optim.groups import ParamGroup
from infinity.swap.grad_tier import GradTier
from infinity.swap.state_tier import StateFormat, StateTier, SubGroupState
from infinity.zero.optimizer_checks import (
    check_grad_tier,
    check_groups,
    check_layout,
    check_no_decay,
    check_state_dict,
    check_state_tier,
    check_step_args,
    hyperparameters,
)
from infinity.zero.optimizer_io import load_initial, memory_stats, scaled_norm, write_masters
from infinity.zero.optimizer_state import (
    check_format,
    load_sub_groups,
    read_slot,
    saved_fields,
    state_format,
    step_run,
)
from infinity.zero.overlap import Ahead, AheadCopies, OverlapStep, overlap_plan
from infinity.zero.param_groups import check_lrs, group_runs, step_groups
from infinity.zero.sub_groups import (
    MODEL_DTYPES,
    FlatLayout,
    Slot,
    aligned_sub_group_size,
    check_slots,
)
from infinity.zero.weights import HostWeights, NvmeWeights, aliases_masters, make_weights

logger = logging.getLogger(__name__)

__all__ = ["PartitionedOptimizer", "Slot", "StepResult"]

_KIND = "PartitionedOptimizer"
_VERSION = 1


class StepResult(NamedTuple):
    """What one `step` did."""

    overflow: bool
    """Some gradient was inf or NaN: nothing was updated and the step count is unchanged."""
    grad_norm: float
    """Global L2 norm of the unscaled gradients, before clipping (inf/NaN on overflow)."""


class PartitionedOptimizer:
    """Adam/AdamW (exactly torch.optim's, foreach=False) over the sub-groups of the slots'
    flat space.

    Slots are laid out in order (each on a SLOT_ALIGN boundary) and the space is cut into
    sub-groups of `zero.sub_group_size` elements, which may split a slot; master weights
    start from the slots' (build) partitions and the weights are written to `weights` (built
    with `make_weights` before the optimizer: its `home(i)` is slot i's home from then on; by
    default a host buffer, which `home(i)` returns). The engine adds gradients with
    `accumulate_grad(i, grad)` (`grad(i)` is the host gradient tier's view of them) and must
    drop its own copies of the partitions before the first gradient (the host gradient
    buffer is allocated then). `grad_tier` (a `GradTier` of the same sub-groups; default a
    `HostGradTier`) keeps the gradient sums. Weight decay applies to every slot except the
    indices in `no_decay`; or `groups` (torch.optim's parameter groups) give each slot its
    group's betas, eps and weight decay, and a step may give one lr per group. `comm`
    (default: one process) sums the squared gradient norm over the ranks, so every rank
    clips by the global norm and skips the same overflowing steps. `on_new_weights` is
    called during the step with (flat start, new weights) of each sub-group, before they
    are written to their homes (`infinity.assemble` gives the gathered parameters' refresh:
    see [Note: gathered weights after a step] in assemble.py); the step's profiler ranges
    are `profile_range`'s (the accelerator's `range`).
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        *,
        optimizer: OptimizerConfig,
        zero: ZeroConfig,
        state_tier: StateTier | None = None,
        no_decay: Collection[int] = (),
        groups: Sequence[ParamGroup] = (),
        weights: HostWeights | NvmeWeights | None = None,
        grad_tier: GradTier | None = None,
        comm: Comm | None = None,
        on_new_weights: Callable[[int, torch.Tensor], None] | None = None,
        profile_range: Callable[[str], AbstractContextManager] = profile_range,
    ) -> None:
        self.comm = comm or SingleProcess()
        self.dtype = check_slots(slots) or torch.float32
        self.hyper = hyperparameters(optimizer)
        self.backend = "torch" if optimizer.torch_adam else None  # None: env var, then auto
        self.format = state_format(optimizer)
        self.convert_state = optimizer.convert_state
        self._saved_format = self.format  # of the checkpoint being loaded
        self.sub_group_size = aligned_sub_group_size(zero.sub_group_size)
        self._names = [s.name for s in slots]
        self._numels = [s.numel for s in slots]
        no_decay = frozenset(check_no_decay(no_decay, len(slots)))
        self.groups = step_groups(self.hyper, self._names, no_decay, groups)
        self.layout: FlatLayout = check_layout(weights, self._numels, self.sub_group_size)
        numels = self.layout.sub_group_numels
        self.state_tier = state_tier = check_state_tier(
            state_tier, numels, self.format, self.sub_group_size
        )
        self.grads = grad_tier = check_grad_tier(grad_tier, numels)
        if weights is None:
            weights = make_weights(self.layout, self._names, self.dtype, state_tier=state_tier)
        self.weights = weights
        self.aliased = aliases_masters(weights, state_tier)  # [Note: where the weights live]
        self._runs = [
            group_runs(self.layout, g, self.groups.of_slot)
            for g in range(self.layout.num_sub_groups)
        ]
        load_initial(self, slots)
        self.on_new_weights = on_new_weights
        self.range = profile_range
        self._overlap = overlap_plan(zero, self.layout, grad_tier)
        self._order = self._overlap[0] if self._overlap else None  # the sweeps' order
        sizes, fmt = self.layout.sub_group_numels, self.format
        self.ahead_copies = AheadCopies.of(self._overlap, sizes, fmt, self.dtype, self.aliased)
        self._ahead: OverlapStep | None = None
        self.overlap_peak_bytes = 0
        self.step_count = 0
        self.last_timings: dict[str, float] = {}
        self.last_compute_s = 0.0
        """Seconds the last step spent in the Adam kernels (its sweep also waits for I/O)."""

    # -- the engine's views -------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._names)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

    def slot_numel(self, i: int) -> int:
        return self._numels[i]

    def slot_span(self, i: int) -> tuple[int, int]:
        """Slot i's [start, stop) in the flat space."""
        return self._span(i)

    def _span(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self._names):
            raise IndexError(f"slot {i} out of range: the optimizer has {len(self._names)} slots")
        start = self.layout.offsets[i]
        return start, start + self._numels[i]

    def home(self, i: int) -> torch.Tensor:
        """Slot i's home: its weights from now on, [numel] in the model dtype, written by
        `step` (host weight home only)."""
        return self.weights.view(*self._span(i))

    def grad(self, i: int) -> torch.Tensor:
        """Slot i's gradient sum: [numel] fp32 (host gradient tier only)."""
        start, stop = self._span(i)
        return self.flat_grad[start:stop]

    @property
    def flat_grad(self) -> torch.Tensor:
        """Every slot's gradient in the flat space (padding stays zero; host gradient tier
        only: the sub-groups of the flat space are back to back in its buffer)."""
        flat = self.grads.host_flat()
        if flat is None:
            raise RuntimeError(
                "the gradients are spilled to NVMe (offload_optimizer.device 'nvme'): there is "
                "no flat host gradient; add to a slot's gradient with accumulate_grad(i, grad)"
            )
        return flat

    def accumulate_grad(self, i: int, grad: torch.Tensor) -> None:
        """Slot i's gradient += `grad` (flat tensor of the slot's numel, any float dtype; on
        the host, or on the device for the `device_slots`), one sub-group piece at a time."""
        lo, hi = self._span(i)
        if grad.numel() != hi - lo:
            raise ValueError(
                f"accumulate_grad: slot {i} ({self._names[i]!r}) has {hi - lo} elements, "
                f"the gradient {grad.numel()}"
            )
        for g in self.layout.sub_groups_of(i):
            start, stop = self.layout.range(g)
            a, b = max(lo, start), min(hi, stop)
            self.grads.add(g, a - start, grad[a - lo : b - lo])
        if self._ahead is not None:
            self._ahead.added(i)

    def device_slots(self) -> frozenset[int]:
        """The slots whose every sub-group sums its gradients on the device
        (`offload_optimizer.gradients_on_device`): the hooks add theirs there, never copying
        them to the host in backward."""
        return self.layout.slots_within(self.grads.on_device)

    def zero_grad(self) -> None:
        self.grads.zero()

    def refresh_masters(self) -> None:
        """Master weights := the homes, moments kept: call after writing new weights
        into `home(i)` (e.g. loading model weights without optimizer state), else the
        next step would overwrite them from the old masters. A no-op when they alias."""
        self.cancel_ahead()
        if self.aliased:
            return
        for g in range(self.layout.num_sub_groups):
            state = self.state_tier.read(g)
            state.master.copy_(self.weights.view(*self.layout.range(g)))
            self.state_tier.write(g, state)

    @torch.no_grad()
    def set_masters(self, i: int, values: torch.Tensor) -> None:
        """Slot i's fp32 master weights := `values`, moments kept (see `write_masters`)."""
        self.cancel_ahead()
        write_masters(self, i, values)

    # -- the step -----------------------------------------------------------------------
    def step_ahead(self, *, lr: float | Sequence[float], loss_scale: float = 1.0) -> None:
        """Begin this step during the last micro batch: each sub-group is stepped on a
        worker thread once its gradients are final, assuming no clipping and no overflow, and
        `step` confirms or redoes it (see [Note: the overlapped step] in overlap.py). A no-op
        when `offload_optimizer.overlap_step` is off, nothing can be stepped early, or it has
        begun already."""
        if self._ahead is not None or not self._overlap:
            return
        lr = check_lrs(lr, self.groups.num_lrs)
        check_step_args(lr[0], loss_scale, 0.0)
        order, limit = self._overlap
        step = self.step_count + 1
        kernel = functools.partial(self._update, hypers=self.groups.at(lr), step=step)
        update = functools.partial(self._update_ahead, kernel=kernel, grad_scale=1.0 / loss_scale)
        self._ahead = OverlapStep(
            self.state_tier.sweep(order), order, limit=limit,
            slots_in=[len(self.layout.pieces(g)) for g in range(self.layout.num_sub_groups)],
            groups_of=self.layout.sub_groups_of, update=update,
            key=(lr, loss_scale, self.step_count), range=self.range,
        )  # fmt: skip

    def wait_ahead(self, timeout_s: float = 60.0) -> bool:
        """Wait until what `step_ahead` began has stepped every sub-group it can so far
        (tests and benchmarks); False on timeout. True when nothing was begun."""
        return self._ahead is None or self._ahead.wait_idle(timeout_s)

    def cancel_ahead(self) -> None:
        """Undo what `step_ahead` began (no step follows): the state is as before it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            try:
                ahead.stop()
            finally:
                ahead.restore(self.state_tier)

    def step(
        self, *, lr: float | Sequence[float], loss_scale: float = 1.0, max_grad_norm: float = 0.0
    ) -> StepResult:
        """Clip, one Adam pass per sub-group, new weights into the homes, zero the grads.

        The gradients hold the loss-scaled sum of the micro-batches; `loss_scale` divides it
        out inside the same pass. On inf/NaN nothing is updated (see `StepResult`). What
        `step_ahead` began is settled here, with the same bits as a serial step.
        """
        lr = check_lrs(lr, self.groups.num_lrs)  # one per parameter group
        check_step_args(lr[0], loss_scale, max_grad_norm)
        self.last_compute_s = 0.0
        ahead, self._ahead = self._ahead, None
        with profile_range("infinity::zero::step"):
            t0 = time.perf_counter()
            if ahead is not None:
                try:
                    ahead.stop()  # the norm's sums are final; the worker finishes its sub-group
                except BaseException:
                    ahead.restore(self.state_tier)
                    raise
                self.last_compute_s += ahead.compute_s
                self.overlap_peak_bytes = max(self.overlap_peak_bytes, ahead.peak_bytes)
            norm = scaled_norm(self.grads, self.comm) / loss_scale
            t1 = time.perf_counter()
            overflow = not math.isfinite(norm)
            if not overflow:
                clip = 1.0
                if max_grad_norm > 0.0:  # torch.nn.utils.clip_grad_norm_'s coefficient
                    clip = min(1.0, max_grad_norm / (norm + 1e-6))
                confirm = clip == 1.0 and ahead is not None
                confirm = confirm and ahead.key == (lr, loss_scale, self.step_count)
                self._adam(lr, clip / loss_scale, ahead, confirm)  # zeroes each gradient
            elif ahead is not None:
                ahead.restore(self.state_tier)
            t2 = time.perf_counter()
            if overflow:
                self.zero_grad()
            t3 = time.perf_counter()
        self.last_timings = {"norm_s": t1 - t0, "adam_s": t2 - t1, "zero_grad_s": t3 - t2}
        if ahead is not None:
            self.last_timings["ahead_sub_groups"] = ahead.stepped
            self.last_timings["ahead_confirmed"] = ahead.confirmed
        if overflow:
            logger.info("gradient overflow (norm %s): step skipped", norm)
        return StepResult(overflow, norm)

    def _update(
        self,
        index: int,
        state: SubGroupState,
        half: torch.Tensor | None,
        *,
        hypers: tuple,
        step: int,
        grad_scale: float,
    ) -> float:
        """The optimizer's pass over sub-group `index`: `state` in place, the new weights
        into `half` when given (fp16/bf16). Returns its seconds. The one per-sub-group
        call of every path (serial, early, redone)."""
        grad = self.grads.take(index)
        t0 = time.perf_counter()
        with self.range("infinity::zero::adam_sub_group"):
            for a, b, k in self._runs[index]:
                step_run(
                    self.format, state, grad, a, b,
                    step=step,
                    hyper=hypers[k],
                    grad_scale=grad_scale,
                    half_out=half[a:b] if half is not None else None,
                    backend=self.backend,
                )  # fmt: skip
        return time.perf_counter() - t0

    def _update_ahead(
        self, index: int, state: SubGroupState, *, kernel: Callable, grad_scale: float
    ) -> tuple[Ahead, float]:
        """`_update` ahead of the norm, nothing the model reads changed: (what the step
        settles, seconds). See [Note: the overlapped step]."""
        copy = self.ahead_copies.copy_of(index, state)  # [Note: the overlapped step's copies]
        if self.aliased:  # the live master is the weights: step a copy
            return Ahead(copy.master, after=copy), kernel(index, copy, None, grad_scale=grad_scale)
        new = self.ahead_copies.new(index)
        seconds = self._update_into(new, index, state, kernel=kernel, grad_scale=grad_scale)
        return Ahead(new, before=copy), seconds

    def _update_into(
        self, new: torch.Tensor, index: int, state: SubGroupState, *, kernel: Callable,
        grad_scale: float,
    ) -> float:  # fmt: skip
        """`_update` in place, the new weights into `new`, a buffer of their own (not
        aliased): its seconds."""
        half = new if self.dtype != torch.float32 else None
        seconds = kernel(index, state, half, grad_scale=grad_scale)
        if half is None:
            new.copy_(state.master)
        return seconds

    def _publish(self, index: int, new: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Sub-group `index`'s new weights `new` to the gathered copies and the homes (`out`:
        the weight output they are in already, if so); its gradient sums zeroed."""
        start, stop = self.layout.range(index)
        if out is None and not self.aliased:
            out = self.weights.out(start, stop)
            out.copy_(new)
        if self.on_new_weights is not None:
            self.on_new_weights(start, new if out is None else out)
        if out is not None:
            self.weights.commit(start, out)
        self.grads.release(index)  # zeroed while the disk is busy with this sweep

    def _adam(self, lr: tuple, grad_scale: float, ahead: OverlapStep | None, confirm: bool) -> None:
        step = self.step_count + 1
        base = functools.partial(self._update, hypers=self.groups.at(lr), step=step)
        kernel = functools.partial(base, grad_scale=grad_scale)

        def run(index: int, state: SubGroupState) -> None:
            start, stop = self.layout.range(index)
            out = None if self.aliased else self.weights.out(start, stop)
            half = out if self.dtype != torch.float32 else None
            self.last_compute_s += kernel(index, state, half)
            if out is not None and half is None:
                out.copy_(state.master)
            self._publish(index, state.master if out is None else out, out)

        def confirm_ahead(index: int, ahead: Ahead) -> None:
            if ahead.after is not None:
                self.state_tier.write(index, ahead.after)
            self._publish(index, ahead.new)

        redone: list[tuple[int, SubGroupState]] = []

        def redo(index: int, ahead: Ahead) -> None:
            if ahead.before is None:  # stepped on a copy: the live state is as it was
                return run(index, self.state_tier.resident(index))
            new = ahead.new  # its speculated weights, never published: overwritten
            self.last_compute_s += self._update_into(
                new, index, ahead.before, kernel=base, grad_scale=grad_scale
            )
            redone.append((index, ahead.before))  # written once the sweep is through
            self._publish(index, new)

        try:
            if ahead is None:
                for index, state in self.state_tier.sweep(self._order):
                    run(index, state)
            else:
                ahead.settle(confirm=confirm, run=run, publish=confirm_ahead, redo=redo)
                for index, state in redone:  # over what the sweep wrote back for them
                    self.state_tier.write(index, state)
        finally:
            self.weights.finish()
        self.step_count = step

    # -- checkpoints --------------------------------------------------------------------
    def state_tensors(self) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        """("<slot>.master" / ".exp_avg" / ".exp_avg_sq", and with 8-bit moments
        ".exp_avg_absmax" / ".exp_avg_sq_absmax", thunk) for every slot, in order.

        A thunk reads just that slot's share of the field from the state tier (a slot may span
        sub-groups), so one slot's field is the most held at a time.
        """
        self.cancel_ahead()
        for slot, name in enumerate(self._names):
            for field in saved_fields(self.format):
                yield f"{name}.{field}", functools.partial(read_slot, self, slot, field)

    @torch.no_grad()
    def load_state_tensors(self, get: Callable[[str], torch.Tensor]) -> None:
        """Every slot's state from `get(name)` (names as in `state_tensors` of the format
        `load_state_dict` found), written to the state tier one sub-group at a time; the weights
        become the loaded masters."""
        self.cancel_ahead()
        load_sub_groups(self, get, self._saved_format)

    def state_dict(self) -> dict:
        """JSON-able: step count, hyperparameters and layout (the tensors are separate)."""
        return {
            "kind": _KIND, "version": _VERSION, "step_count": self.step_count,
            "hyperparameters": self.hyper.constants(), "groups": self.groups.constants(),
            "model_dtype": MODEL_DTYPES[self.dtype],
            "state_format": self.format.value, "sub_group_size": self.sub_group_size,
            "slots": [[name, n] for name, n in zip(self._names, self._numels, strict=True)],
        }  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        """Restores the step count after checking the slots match (sub-group size, tier and
        model dtype may differ: state is stored per slot). The configured hyperparameters
        stay in force; differences from the saved ones are logged."""
        self.cancel_ahead()
        check_state_dict(d, _KIND, _VERSION, self._names, self._numels, self.hyper.constants())
        check_groups(d.get("groups"), self.groups.constants())
        saved = StateFormat(d.get("state_format", StateFormat.ADAMW.value))
        check_format(saved, self.format, self.convert_state)
        self._saved_format = saved
        self.step_count = int(d["step_count"])

    def memory_stats(self) -> dict[str, int]:
        """Host bytes the optimizer holds (see `optimizer_io.memory_stats`)."""
        return memory_stats(self)
