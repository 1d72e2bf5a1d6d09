"""Value helpers shared by the config modules: "auto", numbers from JSON, key suggestions."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

AUTO = "auto"
"""Marks a value derived later from the model or the world size (see `resolve_run`)."""


def left_open(node: Mapping[str, Any], key: str) -> bool:
    """Whether a raw (JSON) config object `node` leaves `key` to be derived: left out, or
    "auto". What the flag and integration layers ask before laying a value over a file's."""
    return key not in node or node[key] == AUTO


def leave_open(node: dict[str, Any], key: str) -> None:
    """Mark `key` of a raw config object `node` to be derived ("auto") unless it is set."""
    node.setdefault(key, AUTO)


def suggest(name: str, known) -> str:
    """A message suffix naming the closest of `known` ("did you mean ..."), or ""."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def to_float(value: Any, path: str, or_auto: str = "") -> float:
    """A finite number; numeric strings ("1e-4") are accepted, booleans are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{path}: expected a number{or_auto}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise TypeError(f"{path}: expected a number{or_auto}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{path}: {value!r} is not finite; give a finite number")
    return number


def to_int(value: Any, path: str, or_auto: str = "") -> int:
    """An integer; integral floats (JSON's 5e8) and numeric strings ("1e5") are accepted."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bool) or not isinstance(value, (float, str)):
        raise TypeError(f"{path}: expected an integer{or_auto}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise TypeError(f"{path}: expected an integer{or_auto}, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise TypeError(f"{path}: expected an integer{or_auto}, got {value!r}")
    return int(number)
