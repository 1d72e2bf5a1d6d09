"""The settings the placement planner tries besides the config's: leaner staging buffers, a
live set that fills the device, and gradient sums kept on the device. Each candidate
(a "rung") is a dict of config keys under zero_optimization; `infinity.estimate.placement`
plans with each and keeps the best. Pure: sizes in, settings out.

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

[Note: weights kept on the device] Where the config leaves `keep_weights_numel` unset and a
device budget is given, every rung above is also tried with the trainable weights that fit
the device room it leaves (beside its live set, gradient sums and the activations, less
DEVICE_HEADROOM) kept gathered across the micro batches of a step (`_kept_weights`; see
[Note: weights kept across micro batches] in infinity/zero/live_plan.py): each element kept
is copied to the device once a step instead of two or three times a micro batch. Held byte
for byte, a kept weight saves more copies than a gradient sum on the device (2 bytes held
save about 4 per micro batch; 4 bytes of sum save 2 per micro batch and cost 8 at the
step), but the sums also free RAM for optimizer state, which saves NVMe bytes: so the
weights-first split (every trainable weight that fits kept, the sums in what is left) is a
rung of its own, and the planner's order (NVMe bytes first, then host-to-device bytes)
chooses between them.
"""

from __future__ import annotations

from collections.abc import Collection

from infinity.config import Config, ResolvedConfig
from infinity.estimate.shapes import ModelShape
from infinity.estimate.sizing import layout_of
from infinity.swap.split_state import ram_sub_groups
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


LIVE = "stage3_max_live_parameters"
GRADS_ON_DEVICE = "offload_optimizer.gradients_on_device"
"""The device's gradient sums (see [Note: gradient sums on the device]), keyed as
LEAN_BUFFERS; a config that sets it keeps it."""
KEEP = "keep_weights_numel"
"""Trainable weights kept on the device across micro batches (see [Note: weights kept on
the device]), keyed as LEAN_BUFFERS; a config that sets it keeps it."""


OVERLAP = "offload_optimizer.overlap_step"
"""The overlapped optimizer step (see [Note: the overlapped step in the plan]), keyed as
LEAN_BUFFERS; a config that sets it keeps it.

[Note: the overlapped step in the plan] On a GPU, where the config leaves
`offload_optimizer.overlap_step` unset, the planner turns it on for the plan it chose when
the copies it holds (`Sizes.overlap_host_bytes`) fit in the RAM that plan leaves: it never
moves state or gradients to NVMe to make room, since those cost disk bytes at every step
and the overlap saves at most the last backward's length of CPU-Adam. On the CPU device
backward takes the cores the early steps would run on, so it stays off."""


def candidates(
    shape: ModelShape,
    config: Config,
    tunable: Collection[str],
    gpu: bool,
    device_bytes: int,
    acts: int,
    world: int,
) -> list[dict[str, int]]:
    """The buffer and live-set settings to plan with: as configured, then lowered where
    `tunable` lets (see [Note: lean buffers]); on a GPU with a device budget, the host
    buffers lowered or not, each with the live set the device holds (see [Note: resident on
    the device]), with gradient sums on the device, and with both (see [Note: gradient sums
    on the device]); each of those also with the weights its room holds kept, and the
    weights kept first (see [Note: weights kept on the device])."""
    zero = config.to_dict()["zero_optimization"]
    lean = {k: v for k, v in LEAN_BUFFERS.items() if k in tunable and v < _get(zero, k)}
    if gpu:  # the live set is device memory there: lowering it frees no RAM
        lean.pop(LIVE, None)
    base = [{}, lean] if lean else [{}]
    if not (gpu and device_bytes):
        return base
    out = list(base)
    if LIVE in tunable:
        live = _resident_live(shape, config, device_bytes, acts)
        if live > _get(zero, LIVE):
            out += [{**r, LIVE: live} for r in base]
    grads = _device_grads(shape, config, device_bytes, acts, world)
    if GRADS_ON_DEVICE in tunable and grads:
        out += [{**r, GRADS_ON_DEVICE: grads} for r in base]
        live = _resident_live(shape, config, device_bytes, acts, reserved=4 * grads)
        if LIVE in tunable and live > _get(zero, LIVE):
            out += [{**r, GRADS_ON_DEVICE: grads, LIVE: live} for r in base]
    if KEEP in tunable:
        out += _with_kept(shape, config, out, device_bytes, acts, world, GRADS_ON_DEVICE in tunable)
    return out


def _with_kept(shape, config, rungs, device_bytes, acts, world, grads_tunable) -> list[dict]:
    """Each of `rungs` with the weights its room holds kept, then every trainable weight that
    fits kept with the gradient sums in what is left (see [Note: weights kept on the
    device])."""
    out = []
    for r in rungs:
        keep = _kept_weights(shape, config, device_bytes, acts, r)
        if keep:
            out.append({**r, KEEP: keep})
    first = _kept_weights(shape, config, device_bytes, acts, {GRADS_ON_DEVICE: 0})
    if first:
        itemsize = model_dtype(config).itemsize
        grads = _device_grads(shape, config, device_bytes, acts, world, first * itemsize)
        out.append(
            {KEEP: first, GRADS_ON_DEVICE: grads} if grads and grads_tunable else {KEEP: first}
        )
    return out


def _kept_weights(
    shape: ModelShape, config: ResolvedConfig, device_bytes: int, acts: int, rung: dict[str, int]
) -> int:
    """Elements of trainable weights the device keeps beside the live set and gradient sums
    of `rung` (the config's where it sets none): at most every trainable element."""
    itemsize = model_dtype(config).itemsize
    zero = config.to_dict()["zero_optimization"]
    live = min(rung.get(LIVE, _get(zero, LIVE)), shape.numel) * itemsize
    grads = 4 * rung.get(GRADS_ON_DEVICE, _get(zero, GRADS_ON_DEVICE))
    room = _free_device_bytes(shape, config, device_bytes, acts) - live - grads
    return max(0, min(room // itemsize, shape.trainable_numel))


def _free_device_bytes(
    shape: ModelShape, config: ResolvedConfig, device_bytes: int, acts: int
) -> int:
    """The device budget less DEVICE_HEADROOM, the activations, the largest gradient, the
    one unit a gather may exceed the live budget by (see `memory_of`) and the weights the
    config keeps there."""
    itemsize = model_dtype(config).itemsize
    largest = max((p.numel for p in shape.params), default=0)
    kept = min(config.zero_optimization.keep_weights_numel, shape.trainable_numel)
    free = int(device_bytes * (1 - DEVICE_HEADROOM)) - acts - 2 * largest * itemsize
    return free - kept * itemsize


def _resident_live(
    shape: ModelShape, config: ResolvedConfig, device_bytes: int, acts: int, *, reserved: int = 0
) -> int:
    """The largest live set (elements) that fits `device_bytes` beside the activations (and
    `reserved` bytes of gradient sums): see `_free_device_bytes`."""
    itemsize = model_dtype(config).itemsize
    free = _free_device_bytes(shape, config, device_bytes, acts) - reserved
    return max(0, min(free // itemsize, shape.numel))  # no more than the whole model


def _device_grads(
    shape: ModelShape,
    config: ResolvedConfig,
    device_bytes: int,
    acts: int,
    world: int,
    kept: int = 0,
) -> int:
    """Elements of fp32 gradient sums the device holds beside the configured live set (and
    `kept` bytes of weights kept there): the first whole sub-groups that fit (see [Note:
    gradient sums on the device])."""
    itemsize = model_dtype(config).itemsize
    live = min(config.zero_optimization.max_live_parameters, shape.numel) * itemsize
    room = (_free_device_bytes(shape, config, device_bytes, acts) - live - kept) // 4
    numels = layout_of(shape, config, world).sub_group_numels
    return sum(numels[: ram_sub_groups(numels, room)])


def _get(zero: dict, key: str):
    *path, name = key.split(".")
    for part in path:
        zero = zero[part]
    return zero[name]


def set_buffers(zero: dict, buffers: dict[str, int]) -> None:
    for key, value in buffers.items():
        *path, name = key.split(".")
        section = zero
        for part in path:
            section = section.setdefault(part, {})
        section[name] = value
