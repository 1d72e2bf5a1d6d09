"""The phases of one iteration (forward, backward) and what each of the coordinator's verbs
expects: the vocabulary of the lifecycle that `infinity.zero.coordinator` drives. Nothing
here changes a phase; only the coordinator's verbs do.
"""

from __future__ import annotations

import enum

__all__ = ["HINTS", "Phase"]


class Phase(enum.Enum):
    """Where the iteration stands. Only the coordinator's verbs change it."""

    IDLE = "idle"
    """No iteration runs: a module called outside the engine gathers and releases its own
    parameters, untraced."""
    FORWARD = "forward"
    """The engine's forward runs; gathers are recorded in execution order."""
    BACKWARD_PENDING = "backward_pending"
    """The forward returned outputs that need gradients; their backward has not begun."""
    BACKWARD = "backward"
    """Gradients flow through the model; gathers continue the recording."""


# What each verb expects, and what to do about it when the phase is another one.
HINTS = {
    "begin_forward": "the engine's forward is not reentrant; run one forward at a time",
    "end_forward": "end_forward closes the forward that begin_forward started",
    "begin_backward": (
        "a gradient reached the model with no engine forward waiting for it: compute the "
        "loss from the outputs of engine(...) and run one backward per forward"
    ),
    "end_backward": "end_backward closes the backward that begin_backward started",
}
