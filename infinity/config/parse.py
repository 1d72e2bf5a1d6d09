"""DeepSpeed JSON <-> typed sections: key names, checks with key paths, and back to a dict.

[Note: keys] Each field is read from any of its keys (the tables are in keys.py; the first key
is the one `to_dict` writes); two keys of one field with different values are an error.
Ignored keys are DeepSpeed settings that do not apply here and change nothing; they are
accepted and logged at debug level.
Unsupported keys are DeepSpeed features Infinity does not implement (see unsupported.py):
refused with the reason unless their value leaves the feature off.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, Literal

from infinity.config.keys import BOUND_REASON, IGNORED, KEYS, MINIMUM, UNSUPPORTED
from infinity.config.scheduler_params import SCHEDULER_PARAMS, check_scheduler_params
from infinity.config.sections import (
    AioConfig,
    ConfigFields,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    section_of,
)
from infinity.config.values import AUTO, suggest, to_float, to_int

logger = logging.getLogger(__name__)


def _table(cls: type) -> type:
    """The class the key tables name for `cls` (`sections.section_of`)."""
    return section_of(cls)


def _json_fields(cls_or_obj: Any) -> list:
    """The fields of a section that are JSON keys (not `ConfigFields.given_keys`)."""
    return [f for f in fields(cls_or_obj) if f.metadata.get("json", True)]


def _keys_of(cls: type) -> dict[str, str]:
    """JSON key -> field name, for every accepted key of `cls`."""
    names = KEYS.get(_table(cls), {})
    return {key: f.name for f in _json_fields(cls) for key in names.get(f.name, (f.name,))}


def given_keys(cls: type, data: Any, prefix: str = "") -> frozenset[str]:
    """The dotted field paths of section `cls` that DeepSpeed-style `data` sets (any alias
    of a key counts as its field; ignored and unsupported keys do not count)."""
    if not isinstance(data, Mapping):
        return frozenset()
    if _table(cls) is OptimizerConfig:
        params, typed = data.get("params"), {"type": data["type"]} if "type" in data else {}
        data = {**(params if isinstance(params, Mapping) else {}), **typed}
    keys, out = _keys_of(cls), set()
    for key, raw in data.items():
        name = keys.get(key)
        if name is None:
            continue
        path, hint = prefix + name, _hints(cls)[name]
        out.add(path)
        if is_dataclass(hint):
            out |= given_keys(hint, raw, path + ".")
        elif isinstance(raw, Mapping):  # the scheduler's params
            out |= {f"{path}.{k}" for k in raw}
    return frozenset(out)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _parse_fields(cls: type, data: Any, path: str, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field values of `cls` from mapping `data`; every key and value is checked."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{path or 'config'}: expected an object, got {data!r}")
    keys, ignored = _keys_of(cls), IGNORED.get(_table(cls), frozenset())
    unsupported = UNSUPPORTED.get(_table(cls), {})
    values: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, raw in data.items():
        where = _join(path, str(key))
        if key in ignored:
            logger.debug("%s: a DeepSpeed setting that does not apply here; ignored", where)
            continue
        if key in unsupported:
            if not unsupported[key].accepts(raw):
                raise ValueError(unsupported[key].message(where, raw))
            logger.debug("%s: a DeepSpeed feature left off, as Infinity has it", where)
            continue
        name = keys.get(key)
        if name is None or name in skip:
            known = sorted(k for k, n in keys.items() if n not in skip) + sorted(ignored)
            homes = [home for home in _homes(str(key)) if home != path]
            if homes:
                at = " or ".join(repr(h) if h else "the top level" for h in homes)
                raise ValueError(
                    f"{where}: unknown key here; it is a key of {at}: move it to "
                    f"{_join(homes[0], str(key))!r}"
                )
            raise ValueError(f"{where}: unknown key{suggest(str(key), known + list(unsupported))}")
        value = _convert(raw, _hints(cls)[name], where)
        _check_minimum(cls, name, value, where)
        if name in values and values[name] != value:
            shown = "" if is_dataclass(value) else f" ({values[name]!r} and {value!r})"
            raise ValueError(
                f"{path or 'config'}: {seen[name]!r} and {key!r} are the same setting, given "
                f"with different values{shown}; keep one of them"
            )
        values[name], seen[name] = value, key
    return values


def _section_in(hint: Any) -> type | None:
    """The section class a field's type hint holds (itself, or in an Optional), or None."""
    if is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if is_dataclass(a)), None)


@functools.cache
def _sections() -> tuple[tuple[str, type], ...]:
    """(key path, class) of every section of the config, the top level ("") first; the
    optimizer's fields are read under its "params"."""
    out, todo = [], [("", ConfigFields)]
    while todo:
        path, cls = todo.pop(0)
        out.append((f"{path}.params" if _table(cls) is OptimizerConfig else path, cls))
        for f in _json_fields(cls):
            inner = _section_in(_hints(cls)[f.name])
            if inner is not None:
                key = KEYS.get(_table(cls), {}).get(f.name, (f.name,))[0]
                todo.append((_join(path, key), inner))
    return tuple(out)


def _homes(key: str) -> list[str]:
    """The key paths of the sections that accept `key` (a key put one level off is told
    where it goes, not matched against unrelated names)."""
    if key in ("type", "params"):  # a key of several sections, too general to place
        return []
    return [path for path, cls in _sections() if key in _keys_of(cls)]


def parse(cls: type, data: Any, path: str) -> Any:
    """An instance of section `cls` from DeepSpeed-style `data` found at key path `path`."""
    special = _PARSERS.get(_table(cls))
    obj = special(cls, data, path) if special else cls(**_parse_fields(cls, data, path))
    after = _AFTER.get(_table(cls))
    if after:
        after(obj, path)
    return obj


def _convert(raw: Any, hint: Any, path: str, auto: bool = False) -> Any:
    """`raw` as the type `hint` describes; `auto` says "auto" was also allowed (for messages)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        lists = [a for a in rest if typing.get_origin(a) is list]
        if lists and isinstance(raw, (list, tuple)):  # "X or a list of X"
            return _convert(raw, lists[0], path, auto)
        rest = [a for a in rest if a not in lists]
        if str in rest and len(rest) > 1:  # "X or auto"
            if raw == AUTO:
                return AUTO
            rest.remove(str)
            auto = True
        return _convert(raw, rest[0], path, auto)
    or_auto = " or 'auto'" if auto else ""
    if origin is Literal:
        for allowed in args:
            if isinstance(raw, str) and raw.lower() == allowed.lower():
                return allowed
        allowed_list = ", ".join(repr(a) for a in args)
        hint_text = suggest(raw, args) if isinstance(raw, str) else ""
        raise ValueError(f"{path}: {raw!r} is not one of {allowed_list}{or_auto}{hint_text}")
    if is_dataclass(hint):
        return parse(hint, raw, path)
    if hint is bool:
        if not isinstance(raw, bool):
            raise TypeError(f"{path}: expected true or false{or_auto}, got {raw!r}")
        return raw
    if hint is int:
        return to_int(raw, path, or_auto)
    if hint is float:
        return to_float(raw, path, or_auto)
    if hint is str:
        if isinstance(raw, os.PathLike):
            return os.fspath(raw)
        if not isinstance(raw, str):
            raise TypeError(f"{path}: expected a string, got {raw!r}")
        return raw
    if origin is tuple:
        if not isinstance(raw, (list, tuple)) or len(raw) != len(args):
            raise TypeError(f"{path}: expected a list of {len(args)} numbers{or_auto}, got {raw!r}")
        return tuple(
            _convert(x, a, f"{path}[{i}]") for i, (x, a) in enumerate(zip(raw, args, strict=True))
        )
    if origin is list:
        if not isinstance(raw, (list, tuple)) or not raw:
            raise TypeError(f"{path}: expected a non-empty list, got {raw!r}")
        return [_convert(x, args[0], f"{path}[{i}]") for i, x in enumerate(raw)]
    if origin is dict:
        if not isinstance(raw, Mapping):
            raise TypeError(f"{path}: expected an object, got {raw!r}")
        return dict(raw)
    raise AssertionError(f"no conversion for {hint!r} at {path}")


def _check_minimum(cls: type, name: str, value: Any, path: str) -> None:
    bound = MINIMUM.get((_table(cls), name))
    if bound is None or value is None or value == AUTO:
        return
    low, strict = bound
    if value < low or (strict and value == low):
        need = f"> {low}" if strict else f">= {low}"
        why = BOUND_REASON.get((_table(cls), name))
        raise ValueError(
            f"{path}: {value!r} is out of range; it must be {need}" + (f": {why}" if why else "")
        )


def _parse_optimizer(cls: type, data: Any, path: str) -> OptimizerConfig:
    if not isinstance(data, Mapping):
        raise TypeError(f"{path}: expected an object with 'type' and 'params', got {data!r}")
    for key in data:
        if key not in ("type", "params"):
            raise ValueError(f"{_join(path, key)}: unknown key{suggest(key, ['type', 'params'])}")
    values = _parse_fields(cls, data.get("params", {}), f"{path}.params", skip=("type",))
    if "type" in data:
        kind = data["type"]
        if not (isinstance(kind, str) and kind.lower() in ("adam", "adamw", "adamw8bit")):
            raise ValueError(
                f"{path}.type: {kind!r} is not one of 'Adam', 'AdamW', 'AdamW8bit' (any case); "
                f"Infinity steps the fp32 master weights with CPU-Adam (AdamW8bit: 8-bit "
                f"blockwise moments)"
            )
        values["type"] = _convert(kind, _hints(cls)["type"], f"{path}.type")
    betas = values.get("betas")
    for i, beta in enumerate(betas if isinstance(betas, tuple) else ()):
        if not 0.0 <= beta < 1.0:
            raise ValueError(
                f"{path}.params.betas[{i}]: {beta!r} is out of range; it must be in [0, 1)"
            )
    return cls(**values)


_DEEPSPEED_ONLY_SCHEDULERS = {
    "onecycle": "torch.optim.lr_scheduler.OneCycleLR",
    "lrrangetest": "a torch.optim.lr_scheduler.LambdaLR growing the lr",
}
"""DeepSpeed scheduler types with no schedule here -> the torch scheduler that replaces them."""


def _parse_scheduler(cls: type, data: Any, path: str) -> SchedulerConfig:
    if not isinstance(data, Mapping):
        raise TypeError(f"{path}: expected an object with 'type' and 'params', got {data!r}")
    kind = data.get("type")
    if isinstance(kind, str) and kind.lower() in _DEEPSPEED_ONLY_SCHEDULERS:
        raise ValueError(
            f"{path}.type: DeepSpeed's {kind!r} is not implemented; use one of "
            f"{', '.join(SCHEDULER_PARAMS)}, or with infinity.deepspeed "
            f"pass a torch scheduler as initialize(lr_scheduler=...), e.g. "
            f"{_DEEPSPEED_ONLY_SCHEDULERS[kind.lower()]}, which drives the lr at each step"
        )
    values = _parse_fields(cls, data, path)
    kind, params = values.get("type"), values.get("params", {})
    if kind is None and params:
        raise ValueError(
            f"{path}.params: given without {path}.type; set the type to one of "
            f"{', '.join(SCHEDULER_PARAMS)} or remove the params"
        )
    if kind is not None:
        values["params"] = check_scheduler_params(kind, params, path=f"{path}.params")
    return cls(**values)


def _after_zero(zero: ZeroConfig, path: str) -> None:
    """Stages 0-2 run as stage 3 with every parameter resident ([Note: stages 0-2] in
    resolve.py), which puts no parameter on NVMe."""
    if zero.stage not in (0, 1, 2, 3):
        raise ValueError(
            f"{_join(path, 'stage')}: {zero.stage} is not a ZeRO stage; set it to 0, 1, 2 "
            "or 3 (3 partitions and offloads the parameters as well)"
        )
    if zero.stage == 3:
        return
    if zero.offload_param.device == "nvme":
        raise ValueError(
            f"{_join(path, 'offload_param.device')}: 'nvme' needs stage 3: at stage "
            f"{zero.stage} every parameter stays on the device (DeepSpeed ignores the key "
            "there without a word); set stage 3 to offload the parameters, or remove "
            "offload_param"
        )


def _after_offload(offload: OffloadParamConfig | OffloadOptimizerConfig, path: str) -> None:
    if offload.device == "nvme" and not offload.nvme_path:
        raise ValueError(
            f"{_join(path, 'nvme_path')}: required when {_join(path, 'device')} is 'nvme'; "
            f"set it to a directory on a fast local SSD"
        )
    _in_cpu_needs_nvme(offload, path)
    if isinstance(offload, OffloadOptimizerConfig) and offload.fast_init:
        raise ValueError(
            f"{_join(path, 'fast_init')}: true is not supported by Infinity: there is no "
            f"separate optimizer-state initialization pass to skip (each sub-group's master "
            f"weights and zero moments are written once, pipelined, as the engine starts); "
            f"set it to false or remove it"
        )


def _in_cpu_needs_nvme(offload: OffloadParamConfig | OffloadOptimizerConfig, path: str) -> None:
    """`max_in_cpu` and `gradients_in_cpu` say what of an NVMe tier stays in RAM: with any
    other device everything is in RAM already, so a value that asks for it is a mistake."""
    if offload.device == "nvme":
        return
    keys = ["max_in_cpu"] if offload.max_in_cpu else []
    if isinstance(offload, OffloadOptimizerConfig) and offload.gradients_in_cpu:
        keys.append("gradients_in_cpu")
    if keys:
        named = " and ".join(_join(path, k) for k in keys)
        raise ValueError(
            f"{named}: keep part of an NVMe tier in RAM, but {_join(path, 'device')} is "
            f"{offload.device!r}, which keeps everything in RAM already; remove "
            f"{'them' if len(keys) > 1 else 'it'}, or set the device to 'nvme' (with "
            "nvme_path) to split between RAM and NVMe"
        )


def _after_config(cfg: ConfigFields, path: str) -> None:
    if cfg.fp16.enabled is True and cfg.bf16.enabled is True:
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one of them")


def _parse_aio(cls: type, data: Any, path: str) -> AioConfig:
    if isinstance(data, Mapping) and data.get("use_gds", False) is not False:
        raise ValueError(
            f"{_join(path, 'use_gds')}: {data['use_gds']!r} is not supported; GPUDirect Storage "
            f"is not implemented: set it to false or remove it"
        )
    return cls(**_parse_fields(cls, data, path))


_PARSERS = {
    OptimizerConfig: _parse_optimizer,
    SchedulerConfig: _parse_scheduler,
    AioConfig: _parse_aio,
}
_AFTER = {
    ZeroConfig: _after_zero,
    OffloadParamConfig: _after_offload,
    OffloadOptimizerConfig: _after_offload,
    ConfigFields: _after_config,
}


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return emit(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def emit(obj: Any) -> dict[str, Any]:
    """A section as DeepSpeed-style, JSON-serializable data (the inverse of `parse`)."""
    names = KEYS.get(_table(type(obj)), {})
    out = {names.get(f.name, (f.name,))[0]: _plain(getattr(obj, f.name)) for f in _json_fields(obj)}
    if isinstance(obj, OptimizerConfig):
        return {"type": out.pop("type"), "params": out}
    if isinstance(obj, ConfigFields) and obj.scheduler.type is None and not obj.scheduler.params:
        del out["scheduler"]
    return out


def read_json(path: str) -> Any:
    """The JSON at `path`; errors name the file and, for bad JSON, the line."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=functools.partial(_no_duplicates, path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"config file {path!r} does not exist; give the path of a DeepSpeed-style JSON file"
        ) from None
    except IsADirectoryError:
        raise ValueError(
            f"config file {path!r} is a directory; give the path of a DeepSpeed-style JSON file"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"config file {path!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"config file {path!r} is not JSON text: byte 0x{e.object[e.start]:02x} at offset "
            f"{e.start} is not UTF-8; give a DeepSpeed-style JSON file"
        ) from None


def _no_duplicates(path: str, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of two equal keys silently; a config with both is a mistake.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(
                f"config file {path!r}: key {key!r} appears twice in one object "
                f"({out[key]!r} and {value!r}); keep one"
            )
        out[key] = value
    return out
