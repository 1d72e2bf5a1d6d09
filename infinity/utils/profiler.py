"""A torch.profiler recording of chosen optimizer steps, written as a Chrome trace: `StepProfiler`.

Owns the profiler's schedule (warm-up steps, then the recorded ones) and the trace file,
written atomically into its directory (a crash mid-write leaves no half trace under the
final name). It does not place ranges: code marks its work with
`infinity.accelerator.profile_range` (`infinity::<component>::<op>`), recorded while a
profiler runs and free otherwise.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from infinity.utils.fsio import fsync_dir

logger = logging.getLogger(__name__)


class StepProfiler:
    """torch.profiler over `steps` optimizer steps after `warmup_steps` (profiled but not
    recorded: the first step traces the execution order and warms caches)."""

    def __init__(
        self,
        steps: int,
        out_dir: str | os.PathLike,
        *,
        warmup_steps: int = 1,
        activities: list[ProfilerActivity] | None = None,
    ) -> None:
        for name, value, least in (("steps", steps, 1), ("warmup_steps", warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"profile: {name} must be an integer >= {least}, got {value!r}")
        self.steps = steps
        self.warmup_steps = warmup_steps
        self.out_dir = Path(out_dir)
        self.activities = activities or [ProfilerActivity.CPU]
        self.path: Path | None = None
        """The trace, once written."""
        self.recorded: tuple[int, int] | None = None
        """The first and last optimizer step in the trace, once written."""
        self.error: str | None = None
        """Why the trace could not be written (a full disk...): training goes on without it."""
        self._prof: torch.profiler.profile | None = None
        self._first = 0
        self._done = 0

    def start(self, global_steps: int) -> None:
        """Begin with the step after `global_steps` (the engine's count so far)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._first = global_steps + 1 + self.warmup_steps
        with warnings.catch_warnings():  # no warm-up was asked for: no warning about it
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(
                wait=0, warmup=self.warmup_steps, active=self.steps, repeat=1
            )
        self._prof = torch.profiler.profile(
            activities=self.activities, schedule=schedule, on_trace_ready=self._write
        )
        self._prof.start()

    def step(self, global_steps: int) -> bool:
        """An optimizer step ended (the engine's count is now `global_steps`); True once the
        profiler has stopped (its trace written, or `error` set)."""
        if self._prof is None:
            return True
        self._done = global_steps
        self._prof.step()
        if global_steps >= self._first + self.steps - 1:
            self.stop()
            return True
        return False

    def stop(self) -> Path | None:
        """Stop now: the steps recorded so far (if any) go into the trace. Idempotent."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()
        return self.path

    def _write(self, prof: torch.profiler.profile) -> None:
        last = max(self._first, self._done)
        name = f"trace-steps-{self._first}-{last}.json"
        path = self.out_dir / name
        tmp = self.out_dir / f".{name}.tmp-{os.getpid()}"
        try:
            prof.export_chrome_trace(str(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(self.out_dir)
        except OSError as exc:  # the run goes on: a lost trace is not a failed step
            tmp.unlink(missing_ok=True)
            self.error = f"could not write {path}: {exc.strerror or exc}"
            logger.error("profile of steps %d-%d: %s", self._first, last, self.error)
            return
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.path, self.recorded = path, (self._first, last)
        logger.info("wrote the profile of steps %d-%d to %s", self._first, last, path)
