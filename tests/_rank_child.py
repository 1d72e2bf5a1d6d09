"""`infinity train` with one rank failing on purpose, for the multi-rank failure tests.

usage (under torchrun): _rank_child.py RANK STEP KIND TRAIN-ARGS...

On rank RANK, optimizer step STEP fails: KIND "raise" raises a ValueError as a bug in the
step would, "disk" an OSError(EIO) as a failed NVMe read does, "hang" sleeps (a stuck disk).
Every other rank, and every other step, runs the real command unchanged.
"""

import errno
import os
import sys
import time

import infinity.run.training as train_run
from infinity.cli.main import main

rank, at, kind, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]

if int(os.environ.get("RANK", "0")) == rank:
    real = train_run.TrainRun._one_step

    def one_step(engine, data, micro, accum):
        if engine.global_steps + 1 == at:
            if kind == "raise":
                raise ValueError("the step's input is broken on purpose")
            if kind == "disk":
                raise OSError(errno.EIO, "Input/output error (on purpose)")
            time.sleep(3600)
        return real(engine, data, micro, accum)

    train_run.TrainRun._one_step = staticmethod(one_step)

sys.exit(main(argv))
