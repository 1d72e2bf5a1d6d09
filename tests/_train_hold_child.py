"""`infinity train` with a pause at a chosen point, so that a test can send a signal there.

usage: _train_hold_child.py HOLD MARKER TRAIN-ARGS...

HOLD is "none", "load" (while the weights are being loaded), "engine" (inside the engine's
start, right after its swap files are laid out) or "save:N" (inside the N-th checkpoint save, after
its first tensor is written). At that point the child creates MARKER and sleeps; the test
then sends its signal. The exit code is `infinity train`'s.
"""

import sys
import time
from pathlib import Path

import infinity.checkpoint.writer as writer
import infinity.models.hf_auto as hf_auto
from infinity.cli.main import main
from infinity.swap.store import SwapStore

hold, marker, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]


def pause() -> None:
    marker.touch()
    time.sleep(120)  # a signal handler raising ends this early


def pausing(fn):
    def wrapper(*args, **kwargs):
        pause()
        return fn(*args, **kwargs)

    return wrapper


if hold == "load":
    hf_auto.load_weights = pausing(hf_auto.load_weights)
elif hold == "engine":
    real_reserve = SwapStore.reserve

    def reserve(self, *args, **kwargs):
        extents = real_reserve(self, *args, **kwargs)
        pause()
        return extents

    SwapStore.reserve = reserve
elif hold.startswith("save:"):
    nth, saves = int(hold.split(":")[1]), []
    real_write_shard = writer.PendingCheckpoint.write_shard

    def write_shard(self, rank, tensors, **kwargs):
        saves.append(self.tag)

        def entries():
            for i, entry in enumerate(tensors):
                yield entry
                if i == 0 and len(saves) == nth:
                    pause()

        return real_write_shard(self, rank, entries(), **kwargs)

    writer.PendingCheckpoint.write_shard = write_shard
elif hold != "none":
    raise SystemExit(f"unknown HOLD {hold!r}")

sys.exit(main(["train", *argv]))
