"""`infinity train` with one rank launched with other flags, for the multi-rank agreement test.

usage (under torchrun): _rank_flags_child.py RANK "EXTRA FLAGS" TRAIN-ARGS...

Rank RANK runs TRAIN-ARGS followed by the space-separated EXTRA FLAGS (a flag given again
wins); every other rank runs TRAIN-ARGS unchanged.
"""

import os
import sys

from infinity.cli.main import main

rank, extra, argv = int(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
if int(os.environ.get("RANK", "0")) == rank:
    argv = [*argv, *extra]
sys.exit(main(argv))
