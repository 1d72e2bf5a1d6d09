"""The `infinity` command: one module (or a few `train_*` ones) per subcommand, parsing its
flags, checking its inputs, driving the library and printing. The training loop of `infinity
train` (data, steps, checkpoints, stops) is here; the engine and everything under it is not."""
