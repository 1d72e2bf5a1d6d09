"""The partitioned optimizer the engine steps at each accumulation boundary.

Owns, for the trainable slots of one rank: the fp32 gradient partitions (one flat buffer per
sub-group, which the engine's gradient hooks accumulate into), the weight partitions in the
model dtype (one flat buffer per sub-group, which the step writes), the Adam/AdamW step over
the sub-groups, the global-norm clipping and the overflow check. The fp32 master weights and
moments live behind a `StateStore` (host or NVMe). It does not own the loss scale (the engine
drives the scaler and passes `loss_scale`), the learning-rate schedule (`lr` is passed to
`step`), nor gathering parameters to the device.

[Note: where the weights live] With an fp32 model and the host tier, a slot's partition is a
view of the master weights themselves: the step updates it in place and no copy exists (4
bytes per parameter saved, one pass fewer). With fp16/bf16 the partition is its own buffer,
written by the step's fused copy-out (the master rounded to nearest-even). With an fp32 model
on any other tier the master is not resident between steps, so the partition is its own fp32
buffer, copied from the master while the sub-group is resident during the sweep.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from infinity.config import AUTO, OptimizerConfig, ZeroConfig
from infinity.optim import adam_step_flat
from infinity.swap.state_store import HostStateStore, StateStore, SubGroupState
from infinity.zero.sub_groups import (
    MODEL_DTYPES,
    Slot,
    SubGroupLayout,
    check_slots,
    decay_runs,
    pack,
    resolve_sub_group_size,
)

logger = logging.getLogger(__name__)

__all__ = ["PartitionedOptimizer", "Slot", "StepResult", "sub_group_numels"]

STATE_FIELDS = SubGroupState._fields  # ("master", "exp_avg", "exp_avg_sq")
_KIND = "PartitionedOptimizer"
_VERSION = 1
_NORM_ROW_NUMEL = 4096  # see [Note: accurate norms]


class StepResult(NamedTuple):
    """What one `step` did."""

    overflow: bool
    """Some gradient was inf or NaN: nothing was updated and the step count is unchanged."""
    grad_norm: float
    """Global L2 norm of the unscaled gradients, before clipping (inf/NaN on overflow)."""


@dataclass(slots=True)
class _SubGroup:
    """One sub-group's host buffers (its fp32 state is in the store)."""

    layout: SubGroupLayout
    grad: torch.Tensor  # [numel] fp32, the slots' gradients back to back
    partition: torch.Tensor  # [numel] model dtype; the store's master when aliased
    runs: list[tuple[int, int, bool]]  # (start, stop, decays) element ranges


class PartitionedOptimizer:
    """Adam/AdamW (exactly torch.optim's, foreach=False) over flat sub-groups of slots.

    Slots are packed in order into sub-groups of at most `zero.sub_group_size` elements (a
    larger slot is a sub-group alone); master weights start from the slots' partitions. After
    construction the engine must use `partition(i)` and `grad(i)` as slot i's storage. Weight
    decay applies to every slot except the indices in `no_decay`.
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        *,
        optimizer: OptimizerConfig,
        zero: ZeroConfig,
        state_store: StateStore | None = None,
        no_decay: Collection[int] = (),
    ) -> None:
        self.dtype = check_slots(slots) or torch.float32
        self.hyper = _hyperparameters(optimizer)
        self.backend = "torch" if optimizer.torch_adam else None  # None: env var, then auto
        self.sub_group_size = resolve_sub_group_size(zero.sub_group_size)
        self._names = [s.name for s in slots]
        self._numels = [s.numel for s in slots]
        self.no_decay = frozenset(_check_no_decay(no_decay, len(slots)))
        layouts = pack(self._numels, self.sub_group_size)
        numels = [g.numel for g in layouts]
        if state_store is None:
            state_store = HostStateStore(numels)
        elif list(state_store.numels) != numels:
            raise ValueError(
                f"the state store holds sub-groups of {list(state_store.numels)} elements but "
                f"these slots pack into {numels} (sub_group_size={self.sub_group_size}); build "
                "the store with infinity.zero.sub_group_numels(...)"
            )
        self.store = state_store
        # See [Note: where the weights live].
        self.aliased = self.dtype == torch.float32 and isinstance(state_store, HostStateStore)
        self._groups = [self._build(g, slots) for g in layouts]
        self._where = [(g, k) for g in self._groups for k in range(g.layout.stop - g.layout.first)]
        self.step_count = 0
        self.last_timings: dict[str, float] = {}

    def _build(self, layout: SubGroupLayout, slots: Sequence[Slot]) -> _SubGroup:
        n = layout.numel
        if self.aliased:
            # Zero-fill through the protocol, then load the weights straight into the master.
            self.store.initialize(layout.index, torch.zeros((), dtype=torch.float32).expand(n))
            partition = self.store.resident(layout.index).master
            _fill(partition, layout, slots)
        else:
            partition = torch.empty(n, dtype=self.dtype)
            _fill(partition, layout, slots)
            self.store.initialize(layout.index, partition)
        runs = decay_runs(layout, self._numels, self.no_decay)
        return _SubGroup(layout, torch.zeros(n, dtype=torch.float32), partition, runs)

    # -- the engine's views -------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._names)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

    def _view(self, i: int, which: str) -> torch.Tensor:
        if not 0 <= i < len(self._where):
            raise IndexError(f"slot {i} out of range: the optimizer has {len(self._where)} slots")
        group, k = self._where[i]
        start = group.layout.offsets[k]
        return getattr(group, which)[start : start + self._numels[i]]

    def partition(self, i: int) -> torch.Tensor:
        """Slot i's weights from now on: [numel] in the model dtype, written by `step`."""
        return self._view(i, "partition")

    def grad(self, i: int) -> torch.Tensor:
        """Slot i's gradient partition: [numel] fp32, accumulated into by the engine."""
        return self._view(i, "grad")

    def zero_grad(self) -> None:
        for group in self._groups:
            group.grad.zero_()

    def refresh_masters(self) -> None:
        """Master weights := the partitions, moments kept: call after writing new weights
        into `partition(i)` (e.g. loading model weights without optimizer state), else the
        next step would overwrite them from the old masters. A no-op when they alias."""
        if self.aliased:
            return
        for group in self._groups:
            state = self.store.read(group.layout.index)
            state.master.copy_(group.partition)
            self.store.write(group.layout.index, state)

    # -- the step -----------------------------------------------------------------------
    def step(self, *, lr: float, loss_scale: float = 1.0, max_grad_norm: float = 0.0) -> StepResult:
        """Clip, one Adam pass per sub-group, new weights into the partitions, zero the grads.

        The gradients hold the loss-scaled sum of the micro-batches; `loss_scale` divides it
        out inside the same pass. On inf/NaN nothing is updated (see `StepResult`).
        """
        _check_step_args(lr, loss_scale, max_grad_norm)
        with torch.profiler.record_function("infinity::zero::step"):
            t0 = time.perf_counter()
            norm = self._scaled_norm() / loss_scale
            t1 = time.perf_counter()
            overflow = not math.isfinite(norm)
            if not overflow:
                clip = 1.0
                if max_grad_norm > 0.0:  # torch.nn.utils.clip_grad_norm_'s coefficient
                    clip = min(1.0, max_grad_norm / (norm + 1e-6))
                self._adam(lr, clip / loss_scale)
            t2 = time.perf_counter()
            self.zero_grad()
            t3 = time.perf_counter()
        self.last_timings = {"norm_s": t1 - t0, "adam_s": t2 - t1, "zero_grad_s": t3 - t2}
        if overflow:
            logger.info("gradient overflow (norm %s): step skipped", norm)
        return StepResult(overflow, norm)

    def _scaled_norm(self) -> float:
        # One read of each flat gradient; inf/NaN anywhere propagates into the norm.
        sums = [_sum_of_squares(g.grad) for g in self._groups if g.layout.numel]
        return math.sqrt(torch.stack(sums).sum().item()) if sums else 0.0

    def _adam(self, lr: float, grad_scale: float) -> None:
        step = self.step_count + 1
        h = self.hyper
        for index, state in self.store.sweep():
            group = self._groups[index]
            half = None if self.dtype == torch.float32 else group.partition
            for start, stop, decays in group.runs:
                span = slice(start, stop)
                adam_step_flat(
                    state.master[span],
                    group.grad[span],
                    state.exp_avg[span],
                    state.exp_avg_sq[span],
                    step=step,
                    lr=lr,
                    beta1=h["beta1"],
                    beta2=h["beta2"],
                    eps=h["eps"],
                    weight_decay=h["weight_decay"] if decays else 0.0,
                    adamw_mode=h["adamw_mode"],
                    bias_correction=h["bias_correction"],
                    grad_scale=grad_scale,
                    half_out=half[span] if half is not None else None,
                    backend=self.backend,
                )
            if half is None and not self.aliased:
                group.partition.copy_(state.master)
        self.step_count = step

    # -- checkpoints --------------------------------------------------------------------
    def state_tensors(self) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        """("<slot>.master" / ".exp_avg" / ".exp_avg_sq", thunk) for every slot, in order.

        A sub-group is read from the store when the first of its thunks is called and dropped
        when the iterator moves past it, so at most one sub-group's copy is held at a time.
        """
        for group in self._groups:
            cache: list[SubGroupState] = []

            def read(index: int = group.layout.index, cache: list = cache) -> SubGroupState:
                if not cache:
                    cache.append(self.store.read(index))
                return cache[0]

            for k, slot in enumerate(range(group.layout.first, group.layout.stop)):
                start = group.layout.offsets[k]
                stop = start + self._numels[slot]
                for field in STATE_FIELDS:
                    yield f"{self._names[slot]}.{field}", _thunk(read, field, start, stop)
            cache.clear()

    def load_state_tensors(self, get: Callable[[str], torch.Tensor]) -> None:
        """Every slot's state from `get(name)` (names as in `state_tensors`), written to the
        store one sub-group at a time; the partitions become the loaded masters."""
        for group in self._groups:
            n = group.layout.numel
            state = SubGroupState(*(torch.empty(n, dtype=torch.float32) for _ in STATE_FIELDS))
            for k, slot in enumerate(range(group.layout.first, group.layout.stop)):
                start = group.layout.offsets[k]
                for field in STATE_FIELDS:
                    src = self._get_state(get, slot, field)
                    getattr(state, field)[start : start + src.numel()].copy_(src)
            self.store.write(group.layout.index, state)
            if self.aliased:
                assert self.store.resident(group.layout.index).master is group.partition
            else:
                group.partition.copy_(state.master)

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
            "hyperparameters": dict(self.hyper),
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
        _check_same_slots(d["slots"], self._names, self._numels)
        for key, saved in d.get("hyperparameters", {}).items():
            if self.hyper.get(key) != saved:
                logger.warning(
                    "optimizer %s was %r in the checkpoint and is %r now; using %r",
                    key, saved, self.hyper.get(key), self.hyper.get(key),
                )  # fmt: skip
        self.step_count = int(d["step_count"])

    def memory_stats(self) -> dict[str, int]:
        """Host bytes the optimizer holds: fp32 grads, partitions (0 when they alias the
        masters) and state: all of it with the host tier; with another tier, its host buffers
        ("optim_host_buffer_bytes" of the store's own `memory_stats()`, whose entries are
        merged in)."""
        grad = sum(g.grad.nbytes for g in self._groups)
        part = 0 if self.aliased else sum(g.partition.nbytes for g in self._groups)
        store_stats = {}
        if isinstance(self.store, HostStateStore):
            state = 3 * 4 * sum(self.store.numels)
        else:
            if callable(getattr(self.store, "memory_stats", None)):
                store_stats = dict(self.store.memory_stats())
            state = int(store_stats.get("optim_host_buffer_bytes", 0))
        return {
            **store_stats,
            "numel": sum(self._numels),
            "grad_bytes": grad,
            "partition_bytes": part,
            "state_bytes": state,
            "host_bytes": grad + part + state,
        }


def sub_group_numels(slot_numels: Sequence[int], zero: ZeroConfig) -> list[int]:
    """Elements of each sub-group the optimizer will make of slots of `slot_numels`: the
    `numels` to build a `StateStore` with before constructing the optimizer."""
    return [g.numel for g in pack(slot_numels, resolve_sub_group_size(zero.sub_group_size))]


def _sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat fp32 tensor, as a 0-d fp64 tensor (inf/NaN propagate).

    [Note: accurate norms] One fp32 `vector_norm` over 1e8 elements came out 1% low on this
    machine (its accumulators grow too large to add small terms). Rows of `_NORM_ROW_NUMEL`
    reduced in fp32, then summed in fp64, are within 1e-8 and faster (one pass, better
    vectorized); see benchmarks/zero_optimizer_bench.py for the step's timings.
    """
    rows = flat.numel() // _NORM_ROW_NUMEL * _NORM_ROW_NUMEL
    total = torch.zeros((), dtype=torch.float64)
    if rows:
        row_norms = torch.linalg.vector_norm(flat[:rows].view(-1, _NORM_ROW_NUMEL), dim=1)
        total += row_norms.double().square().sum()
    if rows < flat.numel():
        total += torch.linalg.vector_norm(flat[rows:]).double().square()
    return total


def _thunk(read, field: str, start: int, stop: int) -> Callable[[], torch.Tensor]:
    return lambda: getattr(read(), field)[start:stop]


@torch.no_grad()  # a partition may be a leaf that requires grad; the buffers never do
def _fill(flat: torch.Tensor, layout: SubGroupLayout, slots: Sequence[Slot]) -> None:
    for k, slot in enumerate(slots[layout.first : layout.stop]):
        start = layout.offsets[k]
        flat[start : start + slot.numel].copy_(slot.partition)


def _hyperparameters(cfg: OptimizerConfig) -> dict:
    values = {"betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    for key, value in values.items():
        if value == AUTO:
            raise ValueError(
                f"optimizer.params.{key} is 'auto'; resolve the config first (Config.resolve())"
            )
    betas = tuple(float(b) for b in cfg.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"optimizer.params.betas must be two values in [0, 1), got {cfg.betas}")
    if not float(cfg.eps) >= 0.0:
        raise ValueError(f"optimizer.params.eps must be >= 0, got {cfg.eps}")
    if not float(cfg.weight_decay) >= 0.0:
        raise ValueError(f"optimizer.params.weight_decay must be >= 0, got {cfg.weight_decay}")
    return {
        "beta1": betas[0],
        "beta2": betas[1],
        "eps": float(cfg.eps),
        "weight_decay": float(cfg.weight_decay),
        "adamw_mode": bool(cfg.adamw_mode),
        "bias_correction": bool(cfg.bias_correction),
    }


def _check_no_decay(no_decay: Collection[int], num_slots: int) -> set[int]:
    bad = [i for i in no_decay if isinstance(i, bool) or not isinstance(i, int)]
    bad += [i for i in no_decay if isinstance(i, int) and not 0 <= i < num_slots]
    if bad:
        raise ValueError(
            f"no_decay holds {bad[:5]}, which are not slot indices (0..{num_slots - 1})"
        )
    return set(no_decay)


def _check_step_args(lr: float, loss_scale: float, max_grad_norm: float) -> None:
    for name, value in (("lr", lr), ("loss_scale", loss_scale), ("max_grad_norm", max_grad_norm)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {value!r}")
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}; check the schedule")
    if not (math.isfinite(loss_scale) and loss_scale > 0.0):
        raise ValueError(f"loss_scale must be finite and > 0, got {loss_scale}; 1.0 disables it")
    if not max_grad_norm >= 0.0:
        raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm}")


def _check_same_slots(saved: list, names: list[str], numels: list[int]) -> None:
    for i, (entry, name, numel) in enumerate(zip(saved, names, numels, strict=False)):
        if list(entry) != [name, numel]:
            raise ValueError(
                f"the checkpoint's slot {i} is {entry[0]!r} ({entry[1]} elements) but this "
                f"optimizer's is {name!r} ({numel} elements); load it into the same model, "
                "the same trainable parameters and the same partitioning"
            )
    if len(saved) != len(names):
        raise ValueError(
            f"the checkpoint has {len(saved)} slots but this optimizer has {len(names)}; the "
            "first difference is at slot "
            f"{min(len(saved), len(names))}: load it into the same trainable parameters"
        )
