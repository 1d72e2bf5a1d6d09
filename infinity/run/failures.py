"""What an `infinity train` run says when it stops early or fails, and the errors it raises.

Owns the messages (what failed, the fix, which checkpoint a later run starts from) and the
errno they carry. When a run stops is `infinity.run.stop`'s and `training`'s business.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from infinity.checkpoint import latest_tag
from infinity.run.stop import RunPhase, StopNow

log = logging.getLogger(__name__)


def resume_hint(save_dir: Path, once: str = "") -> str:
    """Which checkpoint a later run starts from, and the command for it."""
    then = f"once {once}, " if once else ""
    tag = latest_tag(save_dir)
    if tag is None:
        return (
            f"There is no checkpoint in {save_dir}: {then}the same command starts "
            "again from the beginning (--save-every N keeps checkpoints along the way)"
        )
    return (
        f"Checkpoint {save_dir / tag} is intact and is the latest: {then}the same "
        "command with --resume continues from it"
    )


def other_rank_failed(ranks, save_dir: Path) -> OSError:
    """Rank 0, when a collective broke: the rank that failed and why, and where to go on from
    (see [Note: one run, several ranks] in ranks.py). `ranks` is the run's `Ranks`."""
    why = ranks.explain(ranks.comm.timeout_s)
    if "--resume" in why:  # the failed rank's own message says where to go on from
        return error(None, f"the run stopped: {why}")
    return error(None, f"the run stopped: {why}. {resume_hint(save_dir, 'it is fixed')}")


def step_failed(save_dir: Path, step: int, exc: OSError) -> OSError:
    """Step `step` failed in the middle (an NVMe transfer, ...): the state is torn, so it is
    not saved; the error names the failure, the fix and where to resume from."""
    code = first_errno(exc)
    once = {
        errno.ENOSPC: "there is free space on that disk (or with --nvme on a larger one)",
        errno.EDQUOT: "the disk quota is raised (or with --nvme elsewhere)",
        errno.EIO: "the device is checked (dmesg), or with --nvme on another disk",
    }.get(code, "the cause is fixed")
    return error(
        code,
        f"step {step} failed and was not saved: "
        f"{str(exc).rstrip('.')}. {resume_hint(save_dir, once)}",
    )


def stopped_at_once(save_dir: Path, stop: StopNow) -> str:
    """The line for a second signal's stop at once, by the phase it landed in."""
    when = {
        RunPhase.STARTING: "before training started",
        RunPhase.TRAINING: "during training (the step in progress is not saved)",
        RunPhase.SAVING: "while saving a checkpoint (that save was abandoned)",
    }.get(stop.phase, "")
    return f"stopped at once by {stop.name} {when}. {resume_hint(save_dir)}"


def first_errno(exc: BaseException | None) -> int | None:
    """The errno of `exc` or of the first exception in its chain that has one."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def close_quietly(engine) -> None:
    """Close the engine after a failure; a second failure while closing is only logged."""
    try:
        engine.close()
    except Exception as exc:
        log.error("closing the engine after a failure: %s", exc)


def error(code: int | None, message: str) -> OSError:
    """An OSError that prints as `message` alone and still carries the errno."""
    err = OSError(message)
    err.errno = code
    return err
