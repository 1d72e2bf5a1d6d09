"""`--ram-budget`, `--device-memory` and `--placement` for `infinity train` and `infinity
estimate`: the budgets read and defaulted from the machine, and the placement planner
(`infinity.estimate.placement`) applied to a run's config.

[Note: when the planner decides] With `--nvme` and a config that names neither offload
device, `--placement auto` (the default) lets the planner place each class of tensors within
the RAM budget; `--placement nvme` puts every class on NVMe (the plan before budgets
existed). A config that names `offload_param.device` or `offload_optimizer.device` runs
exactly as written, and so does one at ZeRO stage 0-2 (every parameter stays on the device;
`--nvme` holds the optimizer state). Without `--nvme` everything is in RAM and a budget is
only checked.
"""

from __future__ import annotations

import argparse

from infinity.config import Config
from infinity.estimate.hardware import PROCESS_FLOOR_BYTES, RSS_MARGIN_BYTES
from infinity.estimate.placement import (
    Budget,
    Placement,
    check_budget,
    check_device,
    plan_placement,
)
from infinity.estimate.placement_rungs import GRADS_ON_DEVICE, KEEP, LEAN_BUFFERS, OVERLAP
from infinity.run.options import read_config_file
from infinity.utils.host_memory import available_ram, physical_ram
from infinity.utils.sizes import parse_size

DEFAULT_RAM_SHARE = 0.8
"""Of the RAM available when a run starts (MemAvailable), the share the planner may use by
default; the rest is left to the page cache, the data loader and the rest of the machine."""


def add_placement_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ram-budget",
        type=parse_size,
        metavar="SIZE",
        help="host RAM the run may use (16G, 16GiB, 512M or bytes; default: "
        f"{DEFAULT_RAM_SHARE * 100:.0f}%% of the RAM available at the start, shared by the "
        "ranks of this machine); with --nvme the planner keeps in RAM what fits, the rest on "
        "NVMe",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_size,
        metavar="SIZE",
        help="GPU memory the run may use: the plan's device memory (the live parameters and "
        "the activations) is checked against it; on the CPU device the device memory is "
        "host RAM and --ram-budget covers it",
    )
    parser.add_argument(
        "--placement",
        choices=["auto", "nvme"],
        default="auto",
        help="with --nvme: 'auto' (default) places each class of tensors in RAM or on NVMe "
        "within --ram-budget, 'nvme' puts them all on NVMe; a config that names the offload "
        "devices runs as written",
    )


def planned(args: argparse.Namespace, zero: dict | None = None) -> bool:
    """Whether the planner decides this run's placement (see [Note: when the planner
    decides])."""
    if not getattr(args, "nvme", None) or getattr(args, "placement", "auto") != "auto":
        return False
    zero = _user_zero(args) if zero is None else zero
    if zero.get("stage", 3) != 3:  # parameters resident: --nvme holds the optimizer state
        return False
    named = [(zero.get(k) or {}).get("device") for k in ("offload_param", "offload_optimizer")]
    return not any(named)


def _user_zero(args: argparse.Namespace) -> dict:
    return read_config_file(args).get("zero_optimization") or {}


def tunable_buffers(args: argparse.Namespace, zero: dict | None = None) -> set[str]:
    """The keys of LEAN_BUFFERS, GRADS_ON_DEVICE, KEEP and OVERLAP the run's config leaves
    unset: the planner may set them (see [Note: lean buffers], [Note: gradient sums on the
    device] and [Note: weights kept on the device] in infinity/estimate/placement_rungs.py)."""
    from infinity.config.keys import KEYS
    from infinity.config.sections import ZeroConfig

    zero = _user_zero(args) if zero is None else zero
    # Every spelling a config may use, by the name LEAN_BUFFERS gives (DeepSpeed's first).
    spelled = {names[0]: names for names in KEYS[ZeroConfig].values()}
    unset = set()
    for key in (*LEAN_BUFFERS, GRADS_ON_DEVICE, KEEP, OVERLAP):
        *path, name = key.split(".")
        section = zero
        for part in path:
            section = section.get(part) or {}
        if not any(n in section for n in spelled.get(key, (name,))):
            unset.add(key)
    return unset


def ram_budget(args: argparse.Namespace, local_ranks: int = 1, here: bool = True) -> Budget:
    """--ram-budget, or the default share of the RAM available now; one rank's share of it
    when `local_ranks` processes share this machine. `here`: the run is on this machine (not
    an estimate for another), so a budget above its RAM is refused."""
    if args.ram_budget is not None:
        total, source = args.ram_budget, f"--ram-budget {_flag_size(args.ram_budget)}"
        machine = physical_ram()
        if here and machine and total > machine:
            raise ValueError(
                f"--ram-budget {total / 2**30:.1f}G is more than this machine's "
                f"{machine / 2**30:.1f} GiB of RAM; give at most that (the default is "
                f"{DEFAULT_RAM_SHARE:.0%} of the RAM available when the run starts)"
            )
    else:
        available = available_ram()
        total = int(available * DEFAULT_RAM_SHARE)
        source = f"{DEFAULT_RAM_SHARE:.0%} of the {available / 2**30:.1f} GiB available"
        if not here:  # an estimate for another machine
            source += " on this machine: give --ram-budget for the one estimated"
    if local_ranks > 1:
        source += f", shared by {local_ranks} ranks"
    return Budget(total // local_ranks, source, margin_bytes=RSS_MARGIN_BYTES)


def plan_run(
    args: argparse.Namespace,
    config: Config,
    hf_config,
    *,
    gpu: bool,
    lora_r: int = 0,
    world_size: int = 1,
    local_ranks: int = 1,
    runtime_bytes: int | None = None,
    device_default: tuple[int, str, int] | None = None,
    here: bool = True,
    given_zero: dict | None = None,
) -> Placement | None:
    """The plan for a run of `hf_config` under `config` (its nvme_path set by --nvme), or
    None where the planner does not decide (see [Note: when the planner decides]; a
    --ram-budget is then checked against the run's peak RSS). `runtime_bytes`: the process
    before the model (default PROCESS_FLOOR_BYTES, a fixed figure: see [Note: a budget is a
    bound] in infinity/estimate/placement.py). `device_default`: the GPU
    memory the run may use without --device-memory, where the figure came from, and the
    GPU's whole memory (a --device-memory above it is refused); `here`:
    the run is on this machine (see `ram_budget`). `given_zero`: the zero_optimization
    section of the config file as the user wrote it (`options.read_config_file`; read from
    --config when not given), whose keys the planner leaves alone."""
    from dataclasses import replace

    from infinity.estimate import model_shape

    limit = _checked_flags(args, gpu, device_default)
    zero = _user_zero(args) if given_zero is None else given_zero
    if not planned(args, zero) and args.ram_budget is None and limit is None:
        return None
    shape = model_shape(hf_config, lora_r=lora_r)
    run = dict(gpu=gpu, seq_len=args.seq_len, checkpointing=bool(args.activation_checkpointing),
               runtime_bytes=PROCESS_FLOOR_BYTES if runtime_bytes is None else runtime_bytes,
               world_size=world_size)  # fmt: skip
    if not planned(args, zero):  # the config places it: its needs are only checked
        if limit is not None:
            check_device(shape, config, limit, f"--device-memory {_flag_size(limit)}", **run)
        if args.ram_budget is not None:
            check_budget(shape, config, ram_budget(args, local_ranks, here), **run)
        return None
    budget = ram_budget(args, local_ranks, here)
    if limit is not None:
        source = f"--device-memory {_flag_size(limit)}"
        budget = replace(budget, device_bytes=limit, device_source=source)
    elif gpu and device_default is not None:
        budget = replace(budget, device_bytes=device_default[0], device_source=device_default[1])
    return plan_placement(shape, config, budget, tunable=tunable_buffers(args, zero), **run)


def _checked_flags(args: argparse.Namespace, gpu: bool, device_default) -> int | None:
    """--device-memory (returned) and --placement checked against the device and --nvme."""
    if getattr(args, "device_memory", None) is not None and not gpu:
        raise ValueError(
            "--device-memory: on the CPU device the device memory is host RAM; give "
            "--ram-budget alone"
        )
    limit = getattr(args, "device_memory", None)
    if limit is not None and device_default is not None and limit > device_default[2]:
        raise ValueError(
            f"--device-memory {_g(limit)} is more than the GPU's "
            f"{device_default[2] / 2**30:.1f} GiB; give at most that (without it the budget "
            f"is {device_default[1]})"
        )
    if getattr(args, "placement", "auto") == "nvme" and not getattr(args, "nvme", None):
        raise ValueError(
            "--placement nvme puts every class of tensors on NVMe, but no --nvme DIR was "
            "given; give --nvme DIR, or leave --placement out (without --nvme everything is "
            "in RAM)"
        )
    return limit


def _flag_size(nbytes: int) -> str:
    """A size as --ram-budget takes it: 16.0G, 720M."""
    return f"{nbytes / 2**30:.1f}G" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f}M"


def _g(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f}G"
