"""`SAVE_DIR/metrics.jsonl`: one JSON object per optimizer step, appended as training runs.

On resume from a checkpoint taken at step S, the lines of steps after S (written by the
run that died) are dropped first, so the file always reads as one run. The rewrite is
atomic; an append that a crash cut short (a final line without its newline) is dropped too.
Every line is strict JSON: a NaN or infinite value is null, named under "nonfinite" (see
`infinity.checkpoint.jsonfloat`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from infinity.checkpoint.jsonfloat import metrics_line, metrics_record
from infinity.checkpoint.reader import latest_tag
from infinity.utils.fsio import write_file_atomic

FILE = "metrics.jsonl"


class MetricsLog:
    """Append step records (dicts with at least "step") to a JSON-lines file."""

    def __init__(self, save_dir: str | os.PathLike) -> None:
        self.path = Path(save_dir) / FILE

    def append(self, record: dict) -> None:
        if "step" not in record:
            raise ValueError(f"a metrics record needs a 'step', got keys {sorted(record)}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.path, "a") as f:
                f.write(metrics_line(record) + "\n")
        except OSError as exc:
            raise self._append_error(record, exc) from None

    def _append_error(self, record: dict, exc: OSError) -> OSError:
        """The path, the cause and the fix; the checkpoints are not touched (a record cut
        short by the failure is dropped when the run resumes, see `truncate_after`)."""
        fix = {
            errno.ENOSPC: "free space on that file system (or train in a --save-dir on another)",
            errno.EDQUOT: "raise the disk quota (or train in a --save-dir on another disk)",
        }.get(exc.errno, "fix that, then resume")
        tag = latest_tag(self.path.parent)
        where = (
            f"checkpoint {self.path.parent / tag} is intact: {fix}, then run the same command "
            "with --resume to continue from it"
            if tag
            else f"no checkpoint was saved yet: {fix}, then run the same command again"
        )
        err = OSError(
            f"cannot append step {record['step']}'s record to {self.path}: "
            f"{exc.strerror or exc}. Training stopped; {where}"
        )
        err.errno = exc.errno
        return err

    def records(self) -> list[dict]:
        """Every complete record, in order, non-finite values as floats (a torn last line is
        skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().split("\n"):
            try:
                record = metrics_record(line)
            except (ValueError, AttributeError, TypeError):
                continue  # an empty or torn line
            if isinstance(record, dict) and "step" in record:
                out.append(record)
        return out

    def truncate_after(self, step: int) -> int:
        """Keep records with step <= `step` (the checkpoint resumed from); returns how many."""
        kept = [r for r in self.records() if r["step"] <= step]
        write_file_atomic(self.path, "".join(metrics_line(r) + "\n" for r in kept).encode())
        return len(kept)
