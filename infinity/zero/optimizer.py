"""The partitioned optimizer the engine steps at each accumulation boundary.

Owns, for the trainable slots of one rank: the flat space they are laid out in and its
sub-groups (see [Note: the flat space] in sub_groups.py), the Adam/AdamW step over the
sub-groups, the global-norm clipping and the overflow check. The fp32 gradient sums that the
engine's hooks accumulate into live behind a grad store (`infinity.swap.grad_tier`: one flat
host buffer, or a few host buffers and NVMe); the fp32 master weights and moments behind a
`StateTier` (host or NVMe); the weights in the model dtype in a weight output
(`infinity.zero.weights`: host memory, or NVMe through the parameter store) whose ranges are
the trainable parameters' homes. It does not own
the loss scale (the engine drives the scaler and passes `loss_scale`), the learning-rate
schedule (`lr` is passed to `step`), nor gathering parameters to the device. With several
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
from typing import Any, NamedTuple

import torch

from infinity.accelerator import profile_range
from infinity.comm import Comm, SingleProcess
from infinity.config import AUTO, OptimizerConfig, ZeroConfig
from infinity.optim import AdamHyper, adam_step_flat
from infinity.swap.grad_device import DeviceGradTier
from infinity.swap.grad_tier import HostGradTier
from infinity.swap.split_state import SplitGradTier
from infinity.swap.state_tier import HostStateTier, StateTier, SubGroupState
from infinity.zero.build_files import release_build_pages
from infinity.zero.optimizer_checks import check_no_decay, check_same_slots, check_step_args
from infinity.zero.sub_groups import (
    MODEL_DTYPES,
    FlatLayout,
    Slot,
    check_slots,
    decay_runs,
    flat_layout,
    resolve_sub_group_size,
)
from infinity.zero.weights import HostWeights, NvmeWeights, aliases_masters, make_weights

logger = logging.getLogger(__name__)

__all__ = ["PartitionedOptimizer", "Slot", "StepResult"]

STATE_FIELDS = SubGroupState._fields  # ("master", "exp_avg", "exp_avg_sq")
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
    `accumulate_grad(i, grad)` (`grad(i)` is the host grad store's view of them) and must
    drop its own copies of the partitions before the first gradient (the host gradient
    buffer is allocated then). `grad_tier` (an `NvmeGradTier` of the same sub-groups)
    keeps most of the gradients on NVMe. Weight decay applies to every slot except the
    indices in `no_decay`. `comm` (default: one process) sums the squared gradient norm over
    the ranks, so every rank clips by the global norm and skips the same overflowing steps.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        *,
        optimizer: OptimizerConfig,
        zero: ZeroConfig,
        state_tier: StateTier | None = None,
        no_decay: Collection[int] = (),
        weights: HostWeights | NvmeWeights | None = None,
        grad_tier: Any = None,
        comm: Comm | None = None,
    ) -> None:
        self.comm = comm or SingleProcess()
        self.dtype = check_slots(slots) or torch.float32
        self.hyper = _hyperparameters(optimizer)
        self.backend = "torch" if optimizer.torch_adam else None  # None: env var, then auto
        self.sub_group_size = resolve_sub_group_size(zero.sub_group_size)
        self._names = [s.name for s in slots]
        self._numels = [s.numel for s in slots]
        self.no_decay = frozenset(check_no_decay(no_decay, len(slots)))
        self.layout: FlatLayout = _layout(weights, self._numels, self.sub_group_size)
        numels = self.layout.sub_group_numels
        if state_tier is None:
            state_tier = HostStateTier(numels)
        elif list(state_tier.numels) != numels:
            raise ValueError(
                f"the state store holds sub-groups of {list(state_tier.numels)} elements but "
                f"these slots make {numels} (sub_group_size={self.sub_group_size}); build "
                "the store with infinity.zero.sub_group_numels(...)"
            )
        self.store = state_tier
        if grad_tier is None:
            grad_tier = HostGradTier(numels)
        elif list(grad_tier.numels) != numels:
            raise ValueError(
                f"the grad store holds sub-groups of {list(grad_tier.numels)} elements but "
                f"these slots make {numels}; build it with infinity.zero.sub_group_numels(...)"
            )
        self.grads = grad_tier
        if weights is None:
            weights = make_weights(self.layout, self._names, self.dtype, state_tier=state_tier)
        self.weights = weights
        self.aliased = aliases_masters(weights, state_tier)  # [Note: where the weights live]
        self._runs = [
            decay_runs(self.layout, g, self.no_decay) for g in range(self.layout.num_sub_groups)
        ]
        self._load_initial(slots)
        self.on_new_weights: Callable[[int, torch.Tensor], None] | None = None
        """Called during the step with (flat start, new weights) of each sub-group, before
        they are written to their homes (`infinity.assemble` wires it to the gathered
        parameters' refresh: see [Note: gathered weights after a step] in assemble.py)."""
        self.step_count = 0
        self.last_timings: dict[str, float] = {}
        self.last_compute_s = 0.0
        """Seconds the last step spent in the Adam kernels (its sweep also waits for I/O)."""

    @torch.no_grad()  # a partition may be a leaf that requires grad; the buffers never do
    def _load_initial(self, slots: Sequence[Slot]) -> None:
        """Weights and masters from the slots' partitions, one sub-group at a time."""
        layout = self.layout
        for g in range(layout.num_sub_groups):
            start, stop = layout.range(g)
            out = self.weights.out(start, stop)
            pieces = layout.pieces(g)
            done = 0  # out[:done] is written: the pieces cover it, the padding between is zero
            for slot, a, b in pieces:
                at = layout.offsets[slot] + a - start
                if not self.aliased:
                    out[done:at].zero_()
                out[at : at + b - a].copy_(slots[slot].partition[a:b])
                done = at + b - a
            if not self.aliased:
                out[done:].zero_()
            release_build_pages(slots[slot].partition for slot, _, _ in pieces)
            if not self.aliased:
                self.store.initialize(g, out)
            self.weights.commit(start, out)
        self.weights.finish()

    # -- the engine's views -------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._names)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

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
        """Slot i's gradient sum: [numel] fp32 (host grad store only)."""
        start, stop = self._span(i)
        return self.flat_grad[start:stop]

    @property
    def flat_grad(self) -> torch.Tensor:
        """Every slot's gradient in the flat space (padding stays zero; host grad store
        only: the sub-groups of the flat space are back to back in its buffer)."""
        if not isinstance(self.grads, HostGradTier):
            raise RuntimeError(
                "the gradients are spilled to NVMe (offload_optimizer.device 'nvme'): there is "
                "no flat host gradient; add to a slot's gradient with accumulate_grad(i, grad)"
            )
        return self.grads.flat

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

    def device_slots(self) -> frozenset[int]:
        """The slots whose every sub-group sums its gradients on the device
        (`offload_optimizer.gradients_on_device`): the hooks add theirs there, never copying
        them to the host in backward."""
        if isinstance(self.grads, DeviceGradTier):
            return frozenset(range(self.num_slots))
        on_device = self.grads.on_device if isinstance(self.grads, SplitGradTier) else 0
        return self.layout.slots_within(on_device)

    def zero_grad(self) -> None:
        self.grads.zero()

    def refresh_masters(self) -> None:
        """Master weights := the homes, moments kept: call after writing new weights
        into `home(i)` (e.g. loading model weights without optimizer state), else the
        next step would overwrite them from the old masters. A no-op when they alias."""
        if self.aliased:
            return
        for g in range(self.layout.num_sub_groups):
            state = self.store.read(g)
            state.master.copy_(self.weights.view(*self.layout.range(g)))
            self.store.write(g, state)

    @torch.no_grad()
    def set_masters(self, i: int, values: torch.Tensor) -> None:
        """Slot i's fp32 master weights := `values` (its numel), moments kept, in whichever
        tier holds the state (the caller writes the slot's 16-bit home, which the model reads:
        with fp32 weights aliasing the masters, this writes both)."""
        lo, hi = self._span(i)
        if values.numel() != hi - lo:
            raise ValueError(f"set_masters: slot {i} has {hi - lo} elements, got {values.numel()}")
        for g in self.layout.sub_groups_of(i):
            start, stop = self.layout.range(g)
            a, b = max(lo, start), min(hi, stop)
            state = self.store.read(g)
            state.master[a - start : b - start].copy_(values[a - lo : b - lo])
            self.store.write(g, state)

    # -- the step -----------------------------------------------------------------------
    def step(self, *, lr: float, loss_scale: float = 1.0, max_grad_norm: float = 0.0) -> StepResult:
        """Clip, one Adam pass per sub-group, new weights into the partitions, zero the grads.

        The gradients hold the loss-scaled sum of the micro-batches; `loss_scale` divides it
        out inside the same pass. On inf/NaN nothing is updated (see `StepResult`).
        """
        check_step_args(lr, loss_scale, max_grad_norm)
        self.last_compute_s = 0.0
        with profile_range("infinity::zero::step"):
            t0 = time.perf_counter()
            norm = self._scaled_norm() / loss_scale
            t1 = time.perf_counter()
            overflow = not math.isfinite(norm)
            if not overflow:
                clip = 1.0
                if max_grad_norm > 0.0:  # torch.nn.utils.clip_grad_norm_'s coefficient
                    clip = min(1.0, max_grad_norm / (norm + 1e-6))
                self._adam(lr, clip / loss_scale)  # zeroes each sub-group's gradient
            t2 = time.perf_counter()
            if overflow:
                self.zero_grad()
            t3 = time.perf_counter()
        self.last_timings = {"norm_s": t1 - t0, "adam_s": t2 - t1, "zero_grad_s": t3 - t2}
        if overflow:
            logger.info("gradient overflow (norm %s): step skipped", norm)
        return StepResult(overflow, norm)

    def _scaled_norm(self) -> float:
        # In sub-group order on every grad store, so host and NVMe give the same bits (see
        # [Note: spilled gradients]); inf/NaN anywhere propagates into the norm.
        total = 0.0
        for s in self.grads.sums_of_squares():
            total += s
        if self.comm.world_size > 1:  # the shards' padding is zero: it adds nothing
            total = float(self.comm.all_reduce_(torch.tensor([total], dtype=torch.float64)))
        return math.sqrt(total)

    def _adam(self, lr: float, grad_scale: float) -> None:
        step = self.step_count + 1
        decayed = self.hyper.with_lr(lr)
        undecayed = decayed.without_decay()
        try:
            for index, state in self.store.sweep():
                start, stop = self.layout.range(index)
                out = None if self.aliased else self.weights.out(start, stop)
                half = out if self.dtype != torch.float32 else None
                grad = self.grads.take(index)
                t0 = time.perf_counter()
                with profile_range("infinity::zero::adam_sub_group"):
                    for a, b, decays in self._runs[index]:
                        adam_step_flat(
                            state.master[a:b],
                            grad[a:b],
                            state.exp_avg[a:b],
                            state.exp_avg_sq[a:b],
                            step=step,
                            hyper=decayed if decays else undecayed,
                            grad_scale=grad_scale,
                            half_out=half[a:b] if half is not None else None,
                            backend=self.backend,
                        )
                self.last_compute_s += time.perf_counter() - t0
                if out is not None and half is None:
                    out.copy_(state.master)
                if self.on_new_weights is not None:
                    self.on_new_weights(start, state.master if out is None else out)
                if out is not None:
                    self.weights.commit(start, out)
                self.grads.release(index)  # zeroed while the disk is busy with this sweep
        finally:
            self.weights.finish()
        self.step_count = step

    # -- checkpoints --------------------------------------------------------------------
    def state_tensors(self) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        """("<slot>.master" / ".exp_avg" / ".exp_avg_sq", thunk) for every slot, in order.

        A thunk reads just that slot's share of the field from the store (a slot may span
        sub-groups), so one slot's field is the most held at a time.
        """
        for slot, name in enumerate(self._names):
            for field in STATE_FIELDS:
                yield f"{name}.{field}", functools.partial(self._read_slot, slot, field)

    def _read_slot(self, slot: int, field: str) -> torch.Tensor:
        lo, hi = self._span(slot)
        out = torch.empty(hi - lo, dtype=torch.float32)
        for g in self.layout.sub_groups_of(slot):
            start, stop = self.layout.range(g)
            a, b = max(lo, start), min(hi, stop)
            out[a - lo : b - lo] = self.store.read_range(g, field, a - start, b - start)
        return out

    @torch.no_grad()
    def load_state_tensors(self, get: Callable[[str], torch.Tensor]) -> None:
        """Every slot's state from `get(name)` (names as in `state_tensors`), written to the
        store one sub-group at a time; the weights become the loaded masters."""
        layout = self.layout
        try:
            for g in range(layout.num_sub_groups):
                start, stop = layout.range(g)
                state = SubGroupState(
                    *(torch.zeros(stop - start, dtype=torch.float32) for _ in STATE_FIELDS)
                )
                for slot, a, b in layout.pieces(g):
                    at = layout.offsets[slot] + a - start
                    for field in STATE_FIELDS:
                        src = self._get_state(get, slot, field)
                        getattr(state, field)[at : at + b - a].copy_(src[a:b])
                self.store.write(g, state)
                if not self.aliased:
                    out = self.weights.out(start, stop)
                    out.copy_(state.master)
                    self.weights.commit(start, out)
        finally:
            self.weights.finish()

    def _get_state(self, get: Callable[[str], torch.Tensor], slot: int, field: str):
        name = f"{self._names[slot]}.{field}"
        try:
            t = get(name)
        except KeyError:
            raise ValueError(
                f"no optimizer state {name!r} (slot {slot}) to load; the checkpoint was saved "
                "from another model or without optimizer state"
            ) from None
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"optimizer state {name!r} must be a float tensor, got {t!r:.80}")
        if t.numel() != self._numels[slot]:
            raise ValueError(
                f"optimizer state {name!r} has {t.numel()} elements but slot {slot} has "
                f"{self._numels[slot]}; the checkpoint is from a different model or partitioning"
            )
        return t.reshape(-1)

    def state_dict(self) -> dict:
        """JSON-able: step count, hyperparameters and layout (the tensors are separate)."""
        return {
            "kind": _KIND,
            "version": _VERSION,
            "step_count": self.step_count,
            "hyperparameters": self.hyper.constants(),
            "model_dtype": MODEL_DTYPES[self.dtype],
            "sub_group_size": self.sub_group_size,
            "slots": [[name, n] for name, n in zip(self._names, self._numels, strict=True)],
        }

    def load_state_dict(self, d: dict) -> None:
        """Restores the step count after checking the slots match (sub-group size, tier and
        model dtype may differ: state is stored per slot). The configured hyperparameters
        stay in force; differences from the saved ones are logged."""
        if not isinstance(d, dict) or d.get("kind") != _KIND:
            raise ValueError(f"not a {_KIND} state dict: {str(d)[:120]}")
        if d.get("version", 0) > _VERSION:
            raise ValueError(f"state dict version {d['version']} is newer than {_VERSION}")
        check_same_slots(d["slots"], self._names, self._numels)
        configured = self.hyper.constants()
        for key, saved in d.get("hyperparameters", {}).items():
            if configured.get(key) != saved:
                logger.warning(
                    "optimizer %s was %r in the checkpoint and is %r now; using %r",
                    key, saved, configured.get(key), configured.get(key),
                )  # fmt: skip
        self.step_count = int(d["step_count"])

    def memory_stats(self) -> dict[str, int]:
        """Host bytes the optimizer holds: fp32 grads, weights (0 when they alias the
        masters; the staging ring with the NVMe weight home) and state: all of it with the
        host tier; with another tier, its host buffers ("optim_host_buffer_bytes" of the
        store's own `memory_stats()`, whose entries are merged in)."""
        grad_stats = dict(self.grads.memory_stats())
        grad = grad_stats.pop("grad_host_bytes")
        part = 0 if self.aliased else self.weights.host_bytes
        store_stats = {}
        if isinstance(self.store, HostStateTier):
            state = 3 * 4 * sum(self.store.numels)
        else:
            if callable(getattr(self.store, "memory_stats", None)):
                store_stats = dict(self.store.memory_stats())
            # The NVMe pipeline's buffers, and the sub-groups a split keeps in RAM.
            state = int(store_stats.get("optim_host_buffer_bytes", 0))
            state += int(store_stats.pop("optim_host_state_bytes", 0))
        return {
            **store_stats,
            **grad_stats,
            "numel": sum(self._numels),
            "grad_bytes": grad,
            "partition_bytes": part,
            "state_bytes": state,
            "host_bytes": grad + part + state,
        }


def _layout(
    weights: HostWeights | NvmeWeights | None, numels: list[int], sub_group_size: int
) -> FlatLayout:
    """The flat layout of slots of `numels`: the one `weights` (and so the homes) were made
    with, computed once by whoever built them, or a new one without weights."""
    if weights is None:
        return flat_layout(numels, sub_group_size)
    layout = weights.layout
    if list(layout.numels) != numels or layout.sub_group_size != sub_group_size:
        raise ValueError(
            "the weights were made for another flat layout than these slots'; build them "
            "with make_weights(optimizer_layout(...), ...) from the same slots and config"
        )
    return layout


def _hyperparameters(cfg: OptimizerConfig) -> AdamHyper:
    """The config's hyperparameters, at lr 0: `step` puts in the scheduled lr (with_lr)."""
    values = {"betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    for key, value in values.items():
        if value == AUTO:
            raise ValueError(
                f"optimizer.params.{key} is 'auto'; resolve the config first (Config.resolve())"
            )
    try:
        modes = {"adamw_mode": cfg.adamw_mode, "bias_correction": cfg.bias_correction}
        return AdamHyper.of(lr=0.0, **values, **modes)
    except (TypeError, ValueError) as e:
        raise type(e)(f"optimizer.params.{e}") from None
