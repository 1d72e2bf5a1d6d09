"""The disk space an `infinity train` run needs, printed before it starts and checked.

Owns the formula, per file system (the NVMe swap directory and --save-dir may share one):

- parameters on NVMe: every weight in the model dtype (the frozen base and the trainable
  weights), one page of padding each; while the model is built they sit in build files, and
  the trainable ones' build files live on until `initialize` has written them to their place
  (a frozen one goes as soon as it is moved), so those bytes count twice at the start;
- optimizer states on NVMe: fp32 master, Adam m and v (12 bytes per trainable element) and
  the fp32 gradient sums that spill there (4 bytes);
- checkpoints: the trainable weights in the model dtype + 12 bytes of optimizer state per
  trainable element each (the frozen base is left out), times the number of saves, less the
  bytes of the run's checkpoints already there (a resumed run's: their space is taken, not
  free, and `--keep-last` rotates them out), but never less than one checkpoint.

A run whose disks lack it is refused before anything is built, naming both numbers.
"""

from __future__ import annotations

import math
import os
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from infinity.checkpoint.reader import list_checkpoints
from infinity.config import Config
from infinity.swap.store import find_stale_dirs
from infinity.utils.sizes import FP32_BYTES

_PAGE = 4096
_OPTIM_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq
_OPTIM_BYTES_8BIT = 7  # fp32 master, two uint8 codes, their absmax: 6 + 1/32, rounded up


@dataclass(kw_only=True, slots=True)
class DiskUse:
    """Bytes one run writes under one directory, by what they are."""

    path: Path
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.parts.values())


def trainable_numel(
    shapes: dict[str, tuple[int, ...]], r: int | None, targets: list[str] | None
) -> int:
    """Elements the optimizer holds: every parameter, or with LoRA rank `r` on the linear
    layers named `targets`, r * (in + out) per adapted (out, in) weight."""
    if r is None:
        return sum(math.prod(s) for s in shapes.values())
    wanted = set(targets or [])
    return sum(
        r * (shape[0] + shape[1])
        for name, shape in shapes.items()
        if len(shape) == 2 and name.endswith(".weight") and name.split(".")[-2] in wanted
    )


def plan(
    config: Config,
    shapes: dict[str, tuple[int, ...]],
    *,
    trainable: int,
    save_dir: Path,
    saves: int,
    saved: tuple[int, int] = (0, 0),
) -> list[DiskUse]:
    """What the run writes where: `shapes` are the base model's parameters, `trainable`
    the optimizer's elements (adapters included), `saves` how many checkpoints are kept,
    `saved` (count, bytes) of the checkpoints in `save_dir` already (`checkpoints_on_disk`)."""
    itemsize = {"fp32": 4}.get(config.precision, 2)
    optim_bytes = _OPTIM_BYTES_8BIT if config.optimizer.eight_bit else _OPTIM_BYTES
    zero = config.zero_optimization
    base_numel = sum(math.prod(s) for s in shapes.values())
    full = trainable == base_numel
    n_params = len(shapes)
    uses: list[DiskUse] = []
    if zero.offload_param.device == "nvme":
        numel = base_numel
        if not full:  # the frozen base (max_in_cpu keeps some of it in RAM) and the adapters
            numel += trainable - min(base_numel, zero.offload_param.max_in_cpu)
        weights = numel * itemsize + _PAGE * n_params
        parts = {
            "parameters": weights,
            "trainable build files (while starting)": trainable * itemsize,
        }
        uses.append(DiskUse(path=Path(zero.offload_param.nvme_path), parts=parts))
    on_disk = trainable - min(trainable, zero.offload_optimizer.max_in_cpu)  # at most
    if zero.offload_optimizer.device == "nvme" and on_disk:
        uses.append(
            DiskUse(
                path=Path(zero.offload_optimizer.nvme_path),
                parts={
                    "optimizer states": on_disk * optim_bytes,
                    "gradients": trainable * FP32_BYTES,  # the sums, spilled with the states
                },
            )
        )
    per_ckpt = trainable * (itemsize + optim_bytes)
    count, nbytes = saved
    label = f"{saves} checkpoint(s)" + (f", {count} of them there already" if count else "")
    more = max(min(saves, 1) * per_ckpt, saves * per_ckpt - nbytes)
    uses.append(DiskUse(path=save_dir, parts={label: more}))
    return uses


def checkpoints_on_disk(save_dir: Path) -> tuple[int, int]:
    """(count, bytes) of the complete checkpoints in `save_dir`."""
    tags = list_checkpoints(save_dir)
    files = (f for tag in tags for f in (save_dir / tag).rglob("*") if f.is_file())
    return len(tags), sum(f.stat().st_size for f in files)


def _existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check(uses: list[DiskUse], *, free=None) -> str:
    """One line per file system with what the run needs and what is free; a ValueError
    naming both numbers when a file system lacks room."""
    free = free or (lambda p: shutil.disk_usage(p).free)
    by_fs: dict[int, list[DiskUse]] = defaultdict(list)
    for use in uses:
        by_fs[os.stat(_existing(use.path)).st_dev].append(use)
    lines = []
    for group in by_fs.values():
        need = sum(u.nbytes for u in group)
        where = _existing(group[0].path)
        avail = free(where)
        what = ", ".join(
            f"{name} {_gb(n)} in {u.path}" for u in group for name, n in u.parts.items() if n
        )
        if need > avail:
            raise ValueError(
                f"the run needs {_gb(need)} of disk on the file system of {where} ({what}) but "
                f"only {_gb(avail)} are free there; free space, point --nvme / --save-dir at a "
                "larger disk, or save less often (--save-every)" + _stale_note(group)
            )
        lines.append(f"disk: {_gb(need)} needed on {where} ({what}); {_gb(avail)} free")
    return "\n".join(lines)


def _stale_note(group: list[DiskUse]) -> str:
    """What swap directories of runs that are gone (killed, crashed) hold under the group's
    paths: nothing reuses them, and only their owner removes them at its exit."""
    dirs = sorted({d for u in group for d in find_stale_dirs(str(u.path))})
    if not dirs:
        return ""
    # Blocks, not sizes: what removing them frees (the moments' files are sparse).
    held = sum(f.stat().st_blocks * 512 for d in dirs for f in Path(d).rglob("*") if f.is_file())
    return (
        f". {_gb(held)} there is held by swap directories of runs that are gone (safe to "
        f"remove): {', '.join(dirs)}"
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def checkpoints_kept(steps: int, every: int | None, keep_last: int | None) -> int:
    """Checkpoints on disk at the most: one per --save-every and the last, or with
    --keep-last N, N plus the one being written before the oldest is removed."""
    saves = math.ceil(steps / every) if every else 1
    return saves if keep_last is None else min(saves, keep_last + 1)
