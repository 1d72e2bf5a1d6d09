"""One training run as a library: what `infinity train` does, reachable from Python.

Owns a run from its options to its exit code: the inputs checked (`inputs`), the flags laid
over the JSON config (`options`, `schedule`), the ranks joined and agreed (`ranks`,
`agree`), the save directory's ownership (`savedir`), the placement plan (`placement`), the
disk check (`disk`), the data (`data`), the steps and their records (`step`, `report`),
evaluation (`evaluation`), stops and failures (`stop`, `failures`), all in the order
`TrainRun` sets them up (`training`); `launch.train` starts one. The engine and everything
under it is not here; the command line (`infinity.cli`) parses flags, calls it and prints.
"""
