"""The whole run configuration, `Config`: its fields (`sections.ConfigFields`) with the verbs
that read, write and check it.

Owns the public face of the config package: `Config.load` reads a DeepSpeed-style JSON file,
a dict or a Config and records which keys it set; `to_dict` writes it back. It sits over
`parse`, which reads the fields and never this class, and under `resolved`/`resolve`, where
`resolve_run` settles "auto", so the package's imports point one way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from infinity.config.parse import emit, given_keys, parse, read_json
from infinity.config.sections import ConfigFields, SchedulerConfig
from infinity.config.values import AUTO


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Config(ConfigFields):
    """The whole run configuration. Build it with `Config.load(path_or_dict)`."""

    @classmethod
    def load(cls, source: str | os.PathLike | Mapping[str, Any] | Config) -> Config:
        """Read a DeepSpeed-style JSON file, a dict, or copy a Config; validate everything.
        A copied Config keeps its record of the keys the user set (`given_keys`)."""
        if isinstance(source, Config):
            return replace(cls.from_dict(source.to_dict()), given_keys=source.given_keys)
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
        """Build from DeepSpeed keys. ValueError/TypeError name the key path and what is allowed.
        `given_keys` records the fields `data` sets."""
        return replace(parse(cls, data, ""), given_keys=given_keys(cls, data))

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed-style keys, JSON-serializable; `Config.from_dict` reads it back unchanged."""
        return emit(self)

    def validate(self) -> None:
        """Check a Config built in code (load/from_dict already validate)."""
        parse(type(self), self.to_dict(), "")

    def without_global_batch(self) -> Config:
        """A loaded copy whose train_batch_size is derived again: it counts every rank's micro
        batches, and a process that resolves the config for itself alone (to build the model,
        or one rank's estimate) keeps its micro batch and accumulation. `self` is unchanged."""
        return replace(Config.load(self), train_batch_size=AUTO)

    def without_schedule(self) -> Config:
        """A copy with no schedule, for what models memory and time rather than the run (a
        planner's trial, an estimate, a resume's settings): a schedule's "auto" run length
        would wait for data those never read. `self` is unchanged."""
        return replace(self, scheduler=SchedulerConfig())

    def for_local_rank(self, local_rank: int) -> Config:
        """A copy in which each `nvme_path` given as a list (one directory per local rank)
        is this local rank's entry; `self` is unchanged. A single path serves every rank
        (each rank has its own directory under it)."""
        zero = self.zero_optimization
        chosen = {}
        for name in ("offload_param", "offload_optimizer"):
            section = getattr(zero, name)
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
            chosen[name] = replace(section, nvme_path=paths[local_rank])
        return replace(self, zero_optimization=replace(zero, **chosen)) if chosen else self
