"""Infinity: train models far larger than accelerator memory, ZeRO-Infinity style."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names -> the module that defines them, imported on first use so `import infinity`
# stays cheap (no torch until something needs it).
_LAZY = {
    "Config": "infinity.config",
    "Engine": "infinity.engine",
    "init": "infinity.zero",
    "initialize": "infinity.engine",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'infinity' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
