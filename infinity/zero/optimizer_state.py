"""The partitioned optimizer's state as checkpoints see it: per-slot tensors, in the
optimizer's state format, and the explicit conversion between 32-bit and 8-bit state.

Owns the names and sizes of a slot's saved state tensors ("<slot>.master", ".exp_avg",
".exp_avg_sq", and with 8-bit moments ".exp_avg_absmax", ".exp_avg_sq_absmax": one fp32
per block of 256 of the slot's elements, which start on a block boundary), reading one slot's
share of a field from the state tier, and writing loaded tensors back one sub-group at a
time. It does not own the tier nor the step (`optimizer.py`).

[Note: converting the optimizer state] A checkpoint's state resumes only in its own format:
8-bit moments are not 32-bit ones, and silently reading one as the other would change the
run. With `optimizer.params.convert_state` (`--convert-optim-state`) the load converts
instead: 32-bit moments are quantized per block (as a step would), 8-bit ones dequantized.
The master weights are fp32 in both and load unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infinity.config import OptimizerConfig
from infinity.optim import adam_step_flat
from infinity.optim.adam8 import adam8_step_flat
from infinity.optim.quant8 import dequantize, quantize
from infinity.swap.state_format import StateFormat
from infinity.utils.quant_blocks import BLOCK, block_count

if TYPE_CHECKING:
    from infinity.zero.optimizer import PartitionedOptimizer

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (field, signed map)


def state_format(optimizer: OptimizerConfig) -> StateFormat:
    """The state format of an optimizer config (type "AdamW8bit": 8-bit moments)."""
    return StateFormat.ADAMW_8BIT if optimizer.eight_bit else StateFormat.ADAMW


def saved_fields(fmt: StateFormat) -> tuple[str, ...]:
    """The per-slot tensors a checkpoint holds for state of format `fmt`."""
    return tuple(name for name, _, _ in fmt.fields(0))


def field_span(field: str, a: int, b: int) -> tuple[int, int]:
    """Elements [a, b) of a slot or sub-group in `field`'s own elements (blocks for an absmax;
    `a` is a block boundary)."""
    if field.endswith("_absmax"):
        return a // BLOCK, block_count(b)
    return a, b


def field_numel(field: str, numel: int) -> int:
    return field_span(field, 0, numel)[1]


def field_dtype(fmt: StateFormat, field: str) -> torch.dtype:
    return next(dtype for name, dtype, _ in fmt.fields(0) if name == field)


def read_slot(opt: PartitionedOptimizer, slot: int, field: str) -> torch.Tensor:
    """Slot `slot`'s share of `field`, read from the tier sub-group by sub-group."""
    lo, hi = opt.slot_span(slot)
    out = torch.empty(field_numel(field, hi - lo), dtype=field_dtype(opt.format, field))
    layout = opt.layout
    for g in layout.sub_groups_of(slot):
        start, stop = layout.range(g)
        a, b = max(lo, start), min(hi, stop)
        fa, fb = field_span(field, a - start, b - start)
        oa = field_span(field, a - lo, b - lo)[0]
        out[oa : oa + fb - fa] = opt.state_tier.read_range(g, field, fa, fb)
    return out


def check_format(saved: StateFormat, configured: StateFormat, convert: bool) -> None:
    """Raises unless a checkpoint of `saved` state may load into `configured` state."""
    if saved is configured or convert:
        return
    raise ValueError(
        f"the checkpoint's optimizer state is {saved.value} ({_words(saved)}) but this run's "
        f"optimizer is {configured.value} ({_words(configured)}); resume with the same "
        f"optimizer ({_switches(saved)}), or convert the state explicitly with "
        f"--convert-optim-state (config: optimizer.params.convert_state true), which "
        f"{'quantizes' if configured.eight_bit else 'dequantizes'} the moments once"
    )


def _switches(fmt: StateFormat) -> str:
    """The optimizer `fmt` is, as each entry point spells it (CLI, config, HF Trainer)."""
    kind, trainer = ("AdamW8bit", "adamw_bnb_8bit") if fmt.eight_bit else ("AdamW", "adamw_torch")
    return f"--optim {fmt.value}; config optimizer.type {kind!r}; Trainer optim={trainer!r}"


def _words(fmt: StateFormat) -> str:
    return "8-bit blockwise moments" if fmt.eight_bit else "32-bit moments"


def load_sub_groups(
    opt: PartitionedOptimizer, get: Callable[[str], torch.Tensor], saved: StateFormat
) -> None:
    """Every slot's state from `get(name)` (saved in format `saved`), written to the tier
    one sub-group at a time in the optimizer's format; the weights become the masters."""
    layout, fmt = opt.layout, opt.format
    try:
        for g in range(layout.num_sub_groups):
            start, stop = layout.range(g)
            state = fmt.empty(stop - start)
            if saved is fmt:
                for slot, a, b in layout.pieces(g):
                    _copy_piece(opt, get, slot, a, b, layout.offsets[slot] + a - start, state)
            else:
                _convert_sub_group(opt, get, g, saved, state)
            opt.state_tier.write(g, state)
            if not opt.aliased:
                out = opt.weights.out(start, stop)
                out.copy_(state.master)
                opt.weights.commit(start, out)
    finally:
        opt.weights.finish()


def _copy_piece(opt, get, slot: int, a: int, b: int, at: int, state) -> None:
    """Slot `slot`'s saved elements [a, b) of every field into `state` at `at`."""
    for field in saved_fields(opt.format):
        src = get_slot(opt, get, slot, field, opt.format)
        sa, sb = field_span(field, a, b)
        da = field_span(field, at, at + b - a)[0]
        getattr(state, field)[da : da + sb - sa] = src[sa:sb]


def _convert_sub_group(opt, get, g: int, saved: StateFormat, state) -> None:
    """Sub-group `g` from state saved in the other format ([Note: converting the optimizer
    state]): fp32 master and moments first, then the moments in the optimizer's format."""
    layout = opt.layout
    start, stop = layout.range(g)
    fp32 = {name: torch.zeros(stop - start) for name in ("master", "exp_avg", "exp_avg_sq")}
    for slot, a, b in layout.pieces(g):
        at = layout.offsets[slot] + a - start
        fp32["master"][at : at + b - a] = get_slot(opt, get, slot, "master", saved)[a:b]
        for field, signed in _MOMENTS:
            values = get_slot(opt, get, slot, field, saved)
            if saved.eight_bit:
                absmax = get_slot(opt, get, slot, f"{field}_absmax", saved)
                values = dequantize(values, absmax, signed)
            fp32[field][at : at + b - a] = values[a:b]
    state.master.copy_(fp32["master"])
    for field, signed in _MOMENTS:
        if opt.format.eight_bit:
            codes, absmax = quantize(fp32[field], signed)
            getattr(state, field).copy_(codes)
            getattr(state, f"{field}_absmax").copy_(absmax)
        else:
            getattr(state, field).copy_(fp32[field])


def get_slot(
    opt: PartitionedOptimizer,
    get: Callable[[str], torch.Tensor],
    slot: int,
    field: str,
    fmt: StateFormat,
) -> torch.Tensor:
    """The saved `field` of slot `slot`, checked (dtype, numel), flat."""
    name = f"{opt.names[slot]}.{field}"
    try:
        t = get(name)
    except KeyError:
        raise ValueError(
            f"no optimizer state {name!r} (slot {slot}) to load; the checkpoint was saved "
            "from another model or without optimizer state"
        ) from None
    want = field_dtype(fmt, field)
    ok = t.dtype == want if want == torch.uint8 else t.is_floating_point()
    if not isinstance(t, torch.Tensor) or not ok:
        raise TypeError(f"optimizer state {name!r} must be a {want} tensor, got {t!r:.80}")
    numel = field_numel(field, opt.slot_numel(slot))
    if t.numel() != numel:
        has = f"has {numel}" if numel == opt.slot_numel(slot) else f"needs {numel} (per block)"
        raise ValueError(
            f"optimizer state {name!r} has {t.numel()} elements but slot {slot} {has}; the "
            "checkpoint is from a different model or partitioning"
        )
    return t.reshape(-1)


def step_run(fmt: StateFormat, state, grad: torch.Tensor, a: int, b: int, **step) -> None:
    """Adam over elements [a, b) of one sub-group's state, in format `fmt` (an 8-bit run
    starts on a block: it starts at a slot)."""
    if not fmt.eight_bit:
        args = (state.exp_avg[a:b], state.exp_avg_sq[a:b])
        adam_step_flat(state.master[a:b], grad[a:b], *args, **step)
        return
    assert a % BLOCK == 0, (a, b)
    blocks = slice(a // BLOCK, block_count(b))
    moments = (state.exp_avg[a:b], state.exp_avg_sq[a:b])
    absmax = (state.exp_avg_absmax[blocks], state.exp_avg_sq_absmax[blocks])
    adam8_step_flat(state.master[a:b], grad[a:b], *moments, *absmax, **step)
