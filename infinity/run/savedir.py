"""What one `infinity train` run may do with its --save-dir, decided before anything is built.

Owns: a fresh run refuses a directory holding complete checkpoints unless --overwrite (which
removes them and metrics.jsonl first); --resume finds the checkpoint to continue from the
way `infinity export` does (`infinity.checkpoint.find_checkpoint`), and refuses settings that
differ from the saved run's, saying which in the user's terms. Holding the directory for the
run's life is `SaveDirClaim`: the lock (`infinity.checkpoint.SaveDirLock`), taken by
`infinity.run.launch.train`, and the check before each step and save that the directory and its
lock file are still the ones the run took.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infinity.checkpoint import (
    Checkpoint,
    CheckpointNotFoundError,
    SaveDirLock,
    latest_tag,
    list_checkpoints,
    load_checkpoint,
    start_over,
)
from infinity.checkpoint.layout import LOCK
from infinity.checkpoint.lock import plain_os_error
from infinity.checkpoint.metrics import FILE as METRICS_FILE
from infinity.models.lora import LoraSpec

if TYPE_CHECKING:
    from infinity.run.options import RunOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunShape:
    """The settings a resumed run must share with the saved one (recorded as state["run"])."""

    dtype: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    seed: int
    world_size: int = 1
    """Ranks (torchrun's processes); each takes micro_batch sequences per micro step."""

    def to_dict(self) -> dict:
        """What the checkpoint records (the data state already holds seq_len and seed)."""
        return {
            "dtype": self.dtype,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "world_size": self.world_size,
        }

    @property
    def per_step(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum * self.world_size


class SaveDirClaim:
    """A run's hold on its --save-dir, from `__enter__` to `__exit__` (a context manager).

    The lock alone cannot keep a run's directory its own: a flock belongs to the lock file,
    so `rm -rf SAVE_DIR` drops it with the directory, and a second run can then create the
    directory again and lock it while the first still trains. So the claim also records
    which directory and which lock file (device and inode) it took, and `check` (before each
    step's record and each save) stops the run with an error naming what happened rather
    than let it write into a directory it no longer holds."""

    def __init__(self, save_dir: Path) -> None:
        self.save_dir = save_dir
        self.lock = SaveDirLock(save_dir)
        self._taken: tuple | None = None
        """(directory, lock file) as (st_dev, st_ino) when the lock was taken."""

    def __enter__(self) -> SaveDirClaim:
        self.lock.acquire()
        self._taken = self._now()
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()

    def _now(self) -> tuple:
        return tuple(_identity(self.save_dir / name) for name in ("", LOCK))

    def check(self) -> None:
        """Raise an OSError if the directory or its lock file is not the one taken."""
        assert self._taken is not None, "check() outside the claim"
        now = self._now()
        if now == self._taken:
            return
        where, lock = now
        if where == _LOOP or lock == _LOOP:
            what, code = (
                "was replaced by a symbolic link that leads back to itself (a loop: "
                f"`ls -l {self.save_dir}` shows it)",
                errno.ELOOP,
            )
        elif where is None:
            what, code = "was removed", errno.ENOENT
        elif where != self._taken[0]:
            what, code = "was removed and made again (another run may be using it)", errno.ESTALE
        else:
            what = f"lost its lock file {LOCK} (removed or replaced: another run may hold it)"
            code = errno.ESTALE if lock is not None else errno.ENOENT
        raise plain_os_error(
            code,
            f"--save-dir {self.save_dir} {what} while this run was training; the run stops "
            "here and writes nothing more there, so that no checkpoint or metrics.jsonl of "
            "another run is replaced or mixed with its own. Start it again in a --save-dir "
            "that no other run uses (with --resume where its checkpoints are)",
        )


_LOOP = (-1, -1)
"""The identity of a path that is a symbolic link loop (ELOOP)."""


def _identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of `path`, None when it does not exist, `_LOOP` when it is a loop of
    symbolic links."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return _LOOP
        raise
    return st.st_dev, st.st_ino


def prepare_fresh(save_dir: Path, args: RunOptions) -> None:
    """A run without --resume: refuse a directory with checkpoints (or, with --overwrite,
    empty it); an earlier metrics.jsonl without any checkpoint is set aside, not appended to.
    (The run's tokenizer is kept there once the run is accepted: `TrainRun._run`.)"""
    _empty_or_refuse(save_dir, overwrite=args.overwrite)


def _empty_or_refuse(save_dir: Path, *, overwrite: bool) -> None:
    tags = list_checkpoints(save_dir)
    if overwrite:
        removed = start_over(save_dir)
        if removed:
            log.warning("--overwrite: removed checkpoint(s) %s of %s", ", ".join(removed), save_dir)
        return
    if tags:
        latest = latest_tag(save_dir)
        newest = latest if latest in tags else tags[-1]
        raise ValueError(
            f"--save-dir {save_dir} holds the checkpoints of an earlier run ({', '.join(tags)}; "
            f"newest {newest}). To continue that run add --resume; to start a new one choose "
            "another --save-dir, or add --overwrite to delete those checkpoints and "
            "metrics.jsonl and start over in this directory"
        )
    metrics = save_dir / METRICS_FILE
    if metrics.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = save_dir / f"metrics.{stamp}.jsonl"
        n = 1
        while aside.exists():
            aside, n = save_dir / f"metrics.{stamp}-{n}.jsonl", n + 1
        metrics.rename(aside)
        log.warning(
            "%s holds the metrics of an earlier run that saved no checkpoint: kept as %s",
            metrics, aside.name,
        )  # fmt: skip


def find_resume(save_dir: Path, *, accept_unverified: bool = False) -> Checkpoint:
    """The checkpoint --resume continues from (metadata read, shards verified on load)."""
    try:
        ckpt = load_checkpoint(save_dir, verify=False, accept_unverified=accept_unverified)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"--resume: no checkpoint to continue from ({exc}); point --save-dir at the "
            "directory the earlier run saved into"
            + ("" if list_checkpoints(save_dir) else ", or drop --resume to start a new run")
        ) from None
    tags = list_checkpoints(save_dir)
    later = tags[tags.index(ckpt.tag) + 1 :]
    if later:
        # Resuming would replace them when the run reaches their steps: not without asking.
        raise ValueError(
            f"--resume: checkpoint(s) {', '.join(later)} in {save_dir} are newer than "
            f"{ckpt.tag} but damaged (their checksums fail), and this run would replace them "
            "when it reaches their steps; move them out of that directory (keep them) and run "
            "again with --resume"
        )
    return ckpt


def check_resume(ckpt: Checkpoint, now: RunShape, *, model: dict, shapes: dict) -> None:
    """Refuse a resume whose model or run settings differ from the saved run's, naming each
    difference and the flag that restores it. Changing only how the same number of sequences
    per step is split into micro batches keeps the data order and schedule: a warning."""
    problems = _model_changes(ckpt, model, shapes)
    saved_dtype = ckpt.state.get("run", {}).get("dtype") or ckpt.state.get("optimizer", {}).get(
        "model_dtype"
    )
    if saved_dtype and saved_dtype != now.dtype:
        problems.append(
            f"precision: the checkpoint was trained in {saved_dtype}, this run asks for "
            f"{now.dtype} (--dtype or the config's fp16/bf16 sections); resume with --dtype "
            f"{saved_dtype}, or to change precision export the weights (`infinity export`) and "
            "start a new run from them in another --save-dir"
        )
    problems += _batch_changes(ckpt, now)
    data = ckpt.state.get("data", {})
    for key, flag in (("seq_len", "--seq-len"), ("seed", "--seed")):
        saved = data.get(key)
        if saved is not None and saved != getattr(now, key):
            problems.append(
                f"{flag}: the checkpoint's run used {saved}, this run {getattr(now, key)}; "
                f"resume with {flag} {saved}"
            )
    if problems:
        raise ValueError(
            f"--resume from {ckpt.path} (step {ckpt.step}): this run differs from the saved "
            "one:\n  - " + "\n  - ".join(problems)
        )


def check_same_adapters(saved: dict | None, now: dict | None, save_dir: Path) -> None:
    """--resume with other LoRA flags than the checkpoint's (`saved`, `now`: the LoRA
    records, None without LoRA) is refused before loading; the same layers named in another
    order, or named where the saved run took the default, are the same adapters."""
    if _unordered(saved) == _unordered(now):
        return

    def flags(state: dict | None) -> str:
        if state is None:
            return "no LoRA"
        spec = LoraSpec.from_dict(state)
        return (
            f"--lora-r {spec.r} --lora-alpha {spec.alpha or spec.r} --lora-dropout "
            f"{spec.dropout} --lora-targets {','.join(state['resolved_targets'])}"
        )

    raise ValueError(
        f"--resume: the checkpoint in {save_dir} was trained with {flags(saved)}, this run "
        f"asks for {flags(now)}; resume with the checkpoint's flags, or use another "
        "--save-dir for a new run"
    )


def _unordered(lora: dict | None) -> dict | None:
    """A LoRA record as what decides the adapters: the layers they are on as a set (the
    targets as named, in whatever order or left to the default, are not compared)."""
    if lora is None:
        return None
    record = {k: v for k, v in lora.items() if k != "targets"}
    record["resolved_targets"] = set(lora.get("resolved_targets") or lora.get("targets") or [])
    return record


def _model_changes(ckpt: Checkpoint, model: dict, shapes: dict) -> list[str]:
    saved = ckpt.state.get("model")
    if not saved or "param_shapes" not in saved:
        return []  # not written by `infinity train`: the engine checks the parameters
    old = {k: tuple(v) for k, v in saved["param_shapes"].items()}
    new = {k: tuple(v) for k, v in shapes.items()}
    what = []
    if gone := sorted(set(old) - set(new)):
        what.append(f"parameters {_few(gone)} are in the checkpoint but not in this model")
    if added := sorted(set(new) - set(old)):
        what.append(f"parameters {_few(added)} are in this model but not in the checkpoint")
    if resized := sorted(k for k in set(old) & set(new) if old[k] != new[k]):
        what.append(
            "shapes differ: "
            + ", ".join(f"{k} {list(old[k])} -> {list(new[k])}" for k in resized[:3])
            + (f" and {len(resized) - 3} more" if len(resized) > 3 else "")
        )
    config = saved.get("config", {})
    model = json.loads(json.dumps(model))  # as saved: tuples become lists
    keys = sorted(k for k in set(config) | set(model) if config.get(k) != model.get(k))
    if not what and not keys:
        return []
    settings = ", ".join(f"{k}: {config.get(k)!r} -> {model.get(k)!r}" for k in keys[:6])
    return [
        "model: "
        + "; ".join(what + ([f"config.json changed ({settings})"] if keys else []))
        + "; resume with the model directory (or preset) the run started with"
    ]


def _batch_changes(ckpt: Checkpoint, now: RunShape) -> list[str]:
    run = ckpt.state.get("run", {})
    micro, accum = run.get("micro_batch"), run.get("grad_accum")
    if micro is None or accum is None:
        return []
    saved = RunShape(
        dtype="", micro_batch=micro, grad_accum=accum, seq_len=0, seed=0,
        world_size=run.get("world_size", 1),
    )  # fmt: skip
    split = (saved.micro_batch, saved.grad_accum, saved.world_size)
    if split == (now.micro_batch, now.grad_accum, now.world_size):
        return []
    if saved.per_step == now.per_step:
        log.warning(
            "resuming with %s where the run had %s: the same %d sequences per optimizer step, "
            "so the data order and schedule are unchanged",
            _split(now), _split(saved), now.per_step,
        )  # fmt: skip
        return []
    return [
        f"batch: the checkpoint's run took {saved.per_step} sequences per optimizer step "
        f"({_split(saved)}), this run {now.per_step} ({_split(now)}); the data position and the "
        "learning-rate schedule count those steps, so resume with any --micro-batch, "
        f"--grad-accum and number of ranks whose product is {saved.per_step}, or start a new "
        "run in another --save-dir"
    ]


def _split(shape: RunShape) -> str:
    """How a run splits its sequences per step, in flags."""
    ranks = f" on {shape.world_size} ranks" if shape.world_size > 1 else ""
    return f"--micro-batch {shape.micro_batch} --grad-accum {shape.grad_accum}{ranks}"


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


__all__ = [
    "RunShape",
    "SaveDirClaim",
    "check_resume",
    "check_same_adapters",
    "find_resume",
    "prepare_fresh",
]
