"""The engine's checkpoints: what `Engine.save_checkpoint` writes and `load_checkpoint` reads.

Owns which tensors and JSON state make up an engine checkpoint and how they map to the
engine's records under any world size: every rank writes its unpadded span of each weight and
optimizer field (`param/<name>`, `optim/<name>.<field>`; [Note: spans] in
`infinity.checkpoint.spans`) into its own shard, all ranks at once; loading reads each rank's
new span from whichever saved ranks hold it, so a run saved on W ranks resumes on any number.
With one rank the files are exactly those of a single-process engine.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from infinity import checkpoint
from infinity.checkpoint import model16
from infinity.checkpoint.base_model import BASE_MODEL_KEY, check_base
from infinity.checkpoint.collective import save_on_all_ranks
from infinity.checkpoint.spans import SpanReader, shard_numel
from infinity.swap.state_format import ZERO_CODE_SIGNED
from infinity.utils.quant_blocks import BLOCK, block_count
from infinity.zero.shard import shard_align

if TYPE_CHECKING:
    from torch import nn

    from infinity.assemble import PartitionedModel
    from infinity.comm import Comm
    from infinity.config import Config
    from infinity.zero import OffloadParam


class CheckpointedEngine(Protocol):
    """The engine as its checkpoints see it (`infinity.engine.Engine`, which imports this
    module): its public parts, its loop counters through `loop_state`/`load_loop_state`,
    and the record of its frozen base."""

    module: nn.Module
    config: Config
    comm: Comm
    parts: PartitionedModel
    lr_schedule: Any
    loss_scaler: Any
    global_steps: int

    def loop_state(self) -> dict: ...

    def load_loop_state(self, state: dict) -> None: ...

    def base_record(self) -> dict: ...


logger = logging.getLogger(__name__)

# Keys of a checkpoint's JSON state that the engine owns; the rest is the client's.
ENGINE_STATE_KEYS = ("engine", "optimizer", "lr_schedule", "loss_scaler", BASE_MODEL_KEY)

PARAM = checkpoint.layout.PARAM_PREFIX
OPTIM = "optim/"


@dataclass(frozen=True, slots=True)
class _OneRank:
    """The rank information of an engine built without a communicator."""

    rank: int = 0
    world_size: int = 1


def comm_of(engine: CheckpointedEngine) -> Any:
    """The engine's communicator (rank and world size), one rank when it has none."""
    return getattr(engine, "comm", None) or _OneRank()


ABSMAX = "_absmax"
"""The suffix of an 8-bit moment's absmax per block.

[Note: 8-bit state in checkpoints] 8-bit moments are saved per slot like 32-bit ones: the
master and the codes (uint8) as this rank's span of the parameter, so they join across
ranks; an absmax has one entry per block of 256 of the rank's padded shard, so each rank
saves its shard's blocks whole (the saved "tensor" is W times as long). With several ranks
the shards are aligned to the block (`infinity.zero.shard`, recorded as the engine state's
"shard_align"), so block k of a parameter holds the same elements under any world size and
the saved absmax is the parameter's blocks in order, then all-padding blocks (absmax 0):
any world size reads its blocks from it. A multi-rank checkpoint saved before the
alignment resumes under its own world size only. The padding's exp_avg codes are the code
of zero, as the step leaves them."""


def _full_numel(rec: OffloadParam) -> int:
    return math.prod(rec.shape)


def _span(rec: OffloadParam, comm: Any) -> tuple[int, int]:
    return rec.shard.span


def _weights(rec: OffloadParam, comm: Any):
    """A thunk for a parameter's saved weights, read from its home when the writer reaches
    it (one parameter in memory at a time): in its shape with one rank (as ever), else this
    rank's unpadded span of the padded shard its home holds."""
    if comm.world_size == 1:
        return lambda: rec.home.read().view(rec.shape)
    lo, hi = _span(rec, comm)
    return lambda: rec.home.read()[: hi - lo]


def _cut(thunk, numel: int):
    return lambda: thunk()[:numel]


def save(
    engine: CheckpointedEngine,
    save_dir: str | os.PathLike,
    tag: str,
    *,
    client_state: dict | None,
    include_frozen: bool,
) -> str:
    """See `Engine.save_checkpoint`. Every rank calls it; each writes its own shard."""
    clash = sorted(set(client_state or {}) & set(ENGINE_STATE_KEYS))
    if clash:
        raise ValueError(
            f"save_checkpoint: client_state keys {clash} are the engine's own; rename them"
        )
    comm = comm_of(engine)
    frozen = [r for r in engine.parts.records if not r.trainable]
    saved = (
        engine.parts.records if include_frozen else [r for r in engine.parts.records if r.trainable]
    )
    by_name = {r.name: r for r in engine.parts.records}

    def tensors():
        for rec in saved:
            yield f"{PARAM}{rec.name}", _weights(rec, comm)
        for name, thunk in engine.parts.optimizer.state_tensors():
            # The slot is the padded shard: its span is saved (an 8-bit absmax whole, see
            # [Note: 8-bit state in checkpoints]).
            if comm.world_size > 1 and not name.endswith(ABSMAX):
                lo, hi = _span(by_name[name.rsplit(".", 1)[0]], comm)
                thunk = _cut(thunk, hi - lo)
            yield f"{OPTIM}{name}", thunk

    state = {
        "engine": engine.loop_state(),
        "optimizer": engine.parts.optimizer.state_dict(),
        "lr_schedule": engine.lr_schedule.state_dict(),
        "loss_scaler": engine.loss_scaler.state_dict(),
        **(client_state or {}),
    }
    if comm.world_size > 1:  # the files hold flat spans: the shapes, for joining them
        state["engine"]["shapes"] = {r.name: list(r.shape) for r in saved}
        state["engine"]["shard_align"] = _align(engine)
    if frozen and not include_frozen:
        state[BASE_MODEL_KEY] = engine.base_record()
    save_on_all_ranks(
        save_dir, tensors(), comm=comm, step=engine.global_steps, state=state, tag=tag
    )
    logger.info("saved checkpoint %s/%s", save_dir, tag)
    return tag


def load(
    engine: CheckpointedEngine, save_dir: str | os.PathLike, tag: str | None, accept_unverified
) -> tuple[str, dict]:
    """See `Engine.load_checkpoint`. Every rank calls it and reads its own spans."""
    comm = comm_of(engine)
    ckpt = checkpoint.load_checkpoint(
        save_dir, tag, verify=False, accept_unverified=accept_unverified
    )
    # A rank reads from the saved shards its spans overlap: its own under the same world size.
    ckpt.verify([comm.rank] if ckpt.world_size == comm.world_size else None)
    names = set(ckpt.tensor_names())
    with_frozen = BASE_MODEL_KEY not in ckpt.state
    if not with_frozen:
        check_base(ckpt.state[BASE_MODEL_KEY], engine.base_record(), str(ckpt.path))
    needed = [r for r in engine.parts.records if r.trainable or with_frozen]
    missing = [PARAM + r.name for r in needed if PARAM + r.name not in names]
    if missing:
        raise ValueError(
            f"checkpoint {ckpt.path} has no weights for {missing[:5]} "
            f"({len(missing)} missing): it was saved from a different model"
        )
    by_name = {r.name: r for r in engine.parts.records}
    # No transfer may still read a home the load writes (an async copy or all-gather).
    engine.parts.coordinator.quiesce()
    saved = _Saved(ckpt.world_size, int(ckpt.state["engine"].get("shard_align", 1)))
    engine.parts.optimizer.load_state_dict(
        _resharded(ckpt.state["optimizer"], by_name, saved, comm.world_size, _align(engine))
    )
    align = _align(engine)
    with ckpt.span_reader() as spans:
        engine.parts.optimizer.load_state_tensors(
            lambda name: _read_optim(
                spans, name, by_name[name.rsplit(".", 1)[0]], comm, saved, align
            )
        )
        if with_frozen:
            for rec in engine.parts.records:
                if not rec.trainable:
                    rec.home.write(_read_own(spans, PARAM + rec.name, rec, comm))
    for rec in engine.parts.records:
        if rec.trainable or with_frozen:
            engine.parts.coordinator.refresh(rec)
    engine.lr_schedule.load_state_dict(ckpt.state["lr_schedule"])
    engine.loss_scaler.load_state_dict(ckpt.state["loss_scaler"])
    engine.load_loop_state(ckpt.state["engine"])
    _restore_rng(ckpt, comm)
    logger.info("loaded checkpoint %s", ckpt.path)
    client_state = {k: v for k, v in ckpt.state.items() if k not in ENGINE_STATE_KEYS}
    return str(ckpt.path), client_state


def _read_own(spans: SpanReader, key: str, rec: OffloadParam, comm: Any) -> torch.Tensor:
    """This rank's padded shard of saved tensor `key` (the whole tensor with one rank)."""
    lo, hi = _span(rec, comm)
    n = _full_numel(rec)
    return spans.read(key, n, lo, hi, pad_to=rec.shard.numel)


@dataclass(frozen=True)
class _Saved:
    """How the checkpoint's shards were cut."""

    world_size: int
    align: int
    """The shards' alignment (1: saved by one rank, by a 32-bit run, or before 8-bit shards
    were aligned)."""

    @property
    def blocks_in_order(self) -> bool:
        """An absmax saved so is the parameter's blocks in order ([Note: 8-bit state...])."""
        return self.world_size == 1 or self.align % BLOCK == 0


def _align(engine: CheckpointedEngine) -> int:
    return shard_align(engine.config.optimizer.eight_bit)


def _read_optim(
    spans: SpanReader, name: str, rec: OffloadParam, comm: Any, saved: _Saved, align: int
) -> torch.Tensor:
    """This rank's padded share of the saved optimizer tensor `name` (see [Note: 8-bit
    state in checkpoints])."""
    if not name.endswith(ABSMAX):
        t = _read_own(spans, OPTIM + name, rec, comm)
        if name.endswith(".exp_avg") and t.dtype == torch.uint8:
            lo, hi = _span(rec, comm)
            t[hi - lo :] = ZERO_CODE_SIGNED  # the padding's moment is zero
        return t
    blocks = block_count(rec.shard.numel)
    if not saved.blocks_in_order:  # its blocks follow its own shards
        w, r = comm.world_size, comm.rank
        if (saved.world_size, saved.align) == (w, align):
            return spans.read(OPTIM + name, blocks * w, r * blocks, (r + 1) * blocks)
        raise ValueError(
            f"the checkpoint's 8-bit optimizer state was saved by {saved.world_size} ranks "
            f"before 8-bit shards were aligned to {BLOCK} elements: its quantization blocks "
            f"follow each old shard, so it loads under {saved.world_size} ranks into 32-bit "
            "state only; resume with that many ranks and --optim adamw --convert-optim-state, "
            "then save (a 32-bit checkpoint loads under any world size)"
        )
    first = comm.rank * rec.shard.numel // BLOCK if comm.world_size > 1 else 0
    total = spans.saved_numel(OPTIM + name)
    lo, hi = min(first, total), min(first + blocks, total)  # past the end: padding, 0
    return spans.read(OPTIM + name, total, lo, hi, pad_to=blocks)


def _resharded(state: dict, by_name: dict, saved: _Saved, world: int, align: int) -> dict:
    """The optimizer's JSON state with its slot sizes as this world size has them: a slot
    holds a padded shard, whose size depends on the world size (and the alignment). A slot
    whose saved size is not its parameter's shard as saved is left so (the optimizer then
    names it)."""
    same = (saved.world_size, saved.align) == (world, align)
    if same or not isinstance(state, dict) or "slots" not in state:
        return state
    slots = []
    for entry in state["slots"]:
        name, numel = entry
        rec = by_name.get(name)
        full = _full_numel(rec) if rec is not None else -1
        if rec is not None and numel == shard_numel(full, saved.world_size, saved.align):
            numel = shard_numel(full, world, align)
        slots.append([name, numel])
    return {**state, "slots": slots}


def _restore_rng(ckpt: checkpoint.Checkpoint, comm: Any) -> None:
    """Each rank continues its own random streams; a rank the saved run did not have (more
    ranks now) starts from rank 0's."""
    rank = comm.rank if comm.rank < ckpt.world_size else 0
    if ckpt.world_size != comm.world_size and comm.rank == 0:
        logger.warning(
            "checkpoint %s was saved by %d rank(s) and is loaded by %d: the weights and "
            "optimizer state are exact; the random streams (dropout) of ranks the saved run "
            "did not have start from rank 0's",
            ckpt.path, ckpt.world_size, comm.world_size,
        )  # fmt: skip
    rng = ckpt.rng_state(rank)
    if rng:
        checkpoint.restore_rng_state(rng)


def full_weights(rec: OffloadParam):
    """A thunk for a parameter's weights that reads its home when the writer reaches it (one
    parameter in memory at a time; with several ranks every rank's shard, gathered)."""
    return lambda: rec.read_full().view(rec.shape)


def save_16bit(engine: CheckpointedEngine, save_dir: str | os.PathLike, save_filename: str) -> str:
    """See `Engine.save_16bit_model`: every rank calls it, rank 0 writes."""
    if not engine.config.zero_optimization.gather_16bit_weights_on_model_save:
        raise ValueError(
            "save_16bit_model: zero_optimization.stage3_gather_16bit_weights_on_model_save "
            "is false; set it to true, or export a checkpoint with "
            "`infinity export CKPT --out DIR`"
        )
    engine.parts.coordinator.check_between_iterations("save_16bit_model")
    comm = engine.comm
    dtype = engine.parts.records[0].dtype
    dtype = dtype if dtype in model16.SIXTEEN_BIT else torch.bfloat16
    weights = [(r.name, full_weights(r)) for r in engine.parts.records]
    if comm.rank != 0:  # the gathers are collectives: take part, write nothing
        for _, gather in weights:
            gather()
        comm.barrier()  # returns once rank 0 has written the file
        return str(Path(save_dir) / save_filename)
    path = model16.save_16bit_model(
        weights + list(model16.persistent_buffers(engine.module)),
        save_dir,
        save_filename,
        dtype=dtype,
        config_json=model16.model_config_json(engine.module, dtype),
    )
    if comm.world_size > 1:
        comm.barrier()
    logger.info("saved 16-bit model weights to %s", path)
    return str(path)
