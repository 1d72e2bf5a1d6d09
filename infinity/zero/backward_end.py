"""`OnceAtBackwardEnd`: a flush that runs when the running backward finishes, queued at
most once per backward by whichever gradient hook comes first.

The gradient paths that batch their work (`GradOffload`'s staged copies, `GradReducer`'s
buckets) must finish it before anyone reads the slots; autograd's `queue_callback` runs a
function once the whole backward is done. Outside a backward (a hook called directly)
nothing can be queued: the owner's explicit flush, which the engine calls before every
optimizer step, does the work then.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class OnceAtBackwardEnd:
    """Runs `fn` at the end of the running backward; `arm` queues it at most once."""

    __slots__ = ("_fn", "armed")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self.armed = False
        """Queued for the end of the running backward (cleared when it runs, or by
        `disarm` when the owner flushes first)."""

    def arm(self) -> None:
        if self.armed:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._run)
        except RuntimeError:  # not inside a backward: the owner flushes explicitly
            return
        self.armed = True

    def disarm(self) -> None:
        """The owner flushed: a callback still queued finds nothing left to do."""
        self.armed = False

    def _run(self) -> None:
        self.armed = False
        self._fn()
