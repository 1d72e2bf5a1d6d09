"""The `infinity` command: one module (or a few `train_*` ones) per subcommand, parsing its
flags, checking its inputs, driving the library and printing. The training run of `infinity
train` (data, steps, checkpoints, stops) is not here but in the library, `infinity.run`.

[Note: passive OpenMP waits] The command sets OMP_WAIT_POLICY=PASSIVE unless the environment
sets it, here, before anything imports torch (its OpenMP runtime reads it once, when loaded).
torch's CPU operators run on an OpenMP pool whose idle threads spin between parallel regions;
on a machine whose cores are shared (other jobs, other ranks) the spinning takes the cores
from the work. `infinity train --model tiny --steps 100 --seq-len 128` on the 2-core
development machine at load ~18: 103.6 s wall and 31 s of CPU with the spinning default,
23.5 s and 6 s passive (OMP_NUM_THREADS=1: 22.1 s). The results are the same: it changes when
threads sleep, not what they compute. The library (`import infinity`) leaves it alone.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
