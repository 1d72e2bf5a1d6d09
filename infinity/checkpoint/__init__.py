"""Crash-safe, streamed, sharded checkpoints: safetensors for tensors, JSON for the rest.

Owns the on-disk layout (see `layout`), atomic saving (`writer`), verified loading and
finding the checkpoint to resume from (`reader`), who holds a save directory (`lock`),
removing checkpoints on purpose (`retention`), NaN/inf in JSON (`jsonfloat`), the metrics
log (`metrics`) and RNG capture (`rng`). It does not know where tensors live in the engine: the
engine hands it (name, tensor-or-callable) iterators and a JSON-able state dict.
"""

from infinity.checkpoint import layout
from infinity.checkpoint.layout import step_tag
from infinity.checkpoint.lock import SaveDirLock
from infinity.checkpoint.metrics import MetricsLog
from infinity.checkpoint.reader import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointUnverifiedError,
    find_checkpoint,
    latest_tag,
    list_checkpoints,
    load_checkpoint,
)
from infinity.checkpoint.retention import prune, start_over
from infinity.checkpoint.rng import capture_rng_state, restore_rng_state
from infinity.checkpoint.writer import (
    PendingCheckpoint,
    attach_save,
    begin_save,
    clean_stale,
    save_checkpoint,
)

__all__ = [
    "Checkpoint",
    "MetricsLog",
    "CheckpointCorruptError",
    "CheckpointUnverifiedError",
    "CheckpointNotFoundError",
    "PendingCheckpoint",
    "SaveDirLock",
    "attach_save",
    "begin_save",
    "capture_rng_state",
    "clean_stale",
    "find_checkpoint",
    "latest_tag",
    "layout",
    "list_checkpoints",
    "load_checkpoint",
    "prune",
    "restore_rng_state",
    "save_checkpoint",
    "start_over",
    "step_tag",
]
