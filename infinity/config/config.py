"""The whole run configuration, `Config`: its fields (`sections.ConfigFields`) with the verbs
that read, write, check and resolve it.

Owns the public face of the config package: `Config.load` reads a DeepSpeed-style JSON file,
a dict or a Config; `to_dict` writes it back; `resolve` settles "auto". It sits over the
modules that do the work (`parse`, `resolve`), which read the fields and never this class,
so the package's imports point one way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infinity.config.parse import emit, parse, read_json
from infinity.config.resolve import resolve
from infinity.config.sections import ConfigFields


@dataclass(kw_only=True, slots=True)
class Config(ConfigFields):
    """The whole run configuration. Build it with `Config.load(path_or_dict)`."""

    @classmethod
    def load(cls, source: str | os.PathLike | Mapping[str, Any] | Config) -> Config:
        """Read a DeepSpeed-style JSON file, a dict, or copy a Config; validate everything."""
        if isinstance(source, Config):
            return cls.from_dict(source.to_dict())
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, (str, os.PathLike)):
            return cls.from_dict(read_json(os.fspath(source)))
        raise TypeError(
            f"Config.load: expected a path to a JSON file, a dict or a Config, "
            f"got {type(source).__name__}"
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build from DeepSpeed keys. ValueError/TypeError name the key path and what is allowed."""
        return parse(cls, data, "")

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed-style keys, JSON-serializable; `Config.from_dict` reads it back unchanged."""
        return emit(self)

    def validate(self) -> None:
        """Check a Config built in code (load/from_dict already validate)."""
        parse(Config, self.to_dict(), "")

    def for_local_rank(self, local_rank: int) -> Config:
        """A copy in which each `nvme_path` given as a list (one directory per local rank)
        is this local rank's entry; `self` is unchanged. A single path serves every rank
        (each rank has its own directory under it)."""
        out = Config.from_dict(self.to_dict())
        zero = out.zero_optimization
        for name, section in (
            ("offload_param", zero.offload_param),
            ("offload_optimizer", zero.offload_optimizer),
        ):
            paths = section.nvme_path
            if not isinstance(paths, list):
                continue
            if not 0 <= local_rank < len(paths):
                raise ValueError(
                    f"zero_optimization.{name}.nvme_path lists {len(paths)} director"
                    f"{'y' if len(paths) == 1 else 'ies'} ({paths}) but this is local rank "
                    f"{local_rank}: give one per process on the node, or a single path that "
                    "all ranks share"
                )
            section.nvme_path = paths[local_rank]
        return out

    def resolve(
        self,
        *,
        world_size: int = 1,
        hidden_size: int | None = None,
        total_num_steps: int | None = None,
        warmup_num_steps: int | None = None,
        param_numels: Sequence[int] | None = None,
    ) -> Config:
        """A new Config with every "auto" replaced; `self` is unchanged.

        The batch triple is made consistent (train = micro * accumulation * world_size; any two
        determine the third; one alone: accumulation 1; none: micro 1 and accumulation 1).
        With `hidden_size`, zero sizes follow the Hugging Face integration (prefetch
        0.9*h*h, persistence threshold 10*h). Scheduler "auto"s: warmup_min_lr 0,
        warmup_max_lr the optimizer's lr, warmup_num_steps `warmup_num_steps` (else 1000,
        capped at the total), total_num_steps `total_num_steps` (required if "auto").
        `param_numels` (the model's parameter sizes) size offload_param.buffer_size (see
        `infinity.config.resolve.staging_numel`; else 1e8, DeepSpeed's default).
        Everything else takes its default.
        """
        return resolve(
            self,
            world_size=world_size,
            hidden_size=hidden_size,
            total_num_steps=total_num_steps,
            warmup_num_steps=warmup_num_steps,
            param_numels=param_numels,
        )
