"""SIZE arguments, one reading for every command: `16G` and `16GiB` are 2**30 bytes each,
`16GB` is 10**9, `512M`, `128K`, or a plain number of bytes (`--ram-budget`,
`--device-memory`, `export --max-shard-size`, `bench aio --size` and `--block-size`)."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip

FP32_BYTES = 4
"""Bytes of one fp32 element: the gradient sums, the masters and moments. The one copy of this
number, here at the bottom of the layers so every tier, planner and estimate can import it."""


def parse_size(text: str) -> int:
    """Bytes of a SIZE (see above); argparse.ArgumentTypeError naming the text otherwise."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write it as 16G or 16GiB (2**30 bytes), 16GB (10**9), "
            "512M, or a number of bytes"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size, e.g. 16G")
    return value
