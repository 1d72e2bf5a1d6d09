"""A config resolved as the estimate resolves it: `infinity.config.resolve_run` with a model
shape's facts (`ModelShape.run_facts`), the function the engine resolves through too."""

from __future__ import annotations

from infinity.config import Config, resolve_run


def resolve_config(config: Config, shape, world_size: int = 1) -> Config:
    return resolve_run(config, shape.run_facts(world_size))
