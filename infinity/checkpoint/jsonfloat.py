"""NaN and infinities in strict JSON, for the checkpoint metadata and `metrics.jsonl`.

Strict JSON has no NaN or Infinity, yet an engine's own numbers hold them on a bad step
(an fp16 overflow's gradient norm, a NaN loss). Two conventions, one per file kind:
- checkpoint metadata: a non-finite float is stored as `{"$float": "nan"}` (or "inf",
  "-inf") and read back as the same float, so a state saves and loads exactly;
- metrics.jsonl: number fields stay numbers or null for any parser: a non-finite value is
  written as null and its key listed in the record's "nonfinite" object, e.g.
  `{"step": 7, "grad_norm": null, "nonfinite": {"grad_norm": "inf"}}`.
"""

from __future__ import annotations

import json
import math
from typing import Any

MARK = "$float"
NONFINITE = "nonfinite"


def _encode(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return {MARK: repr(float(obj))}  # 'nan', 'inf' or '-inf'
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


def _decode_object(d: dict) -> Any:
    if len(d) == 1 and MARK in d and d[MARK] in ("nan", "inf", "-inf"):
        return float(d[MARK])
    return d


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON of `obj`, with every non-finite float marked (see the module docstring)."""
    return json.dumps(_encode(obj), allow_nan=False, **kwargs)


def loads(text: str | bytes) -> Any:
    """The inverse of `dumps`: marked floats come back as NaN/inf."""
    return json.loads(text, object_hook=_decode_object)


def metrics_line(record: dict) -> str:
    """One metrics record as a strict JSON line: non-finite top-level numbers become null
    and are named, with their value, under "nonfinite"."""
    out, bad = {}, {}
    for key, value in record.items():
        if key == NONFINITE:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            bad[key] = repr(float(value))
            value = None
        out[key] = value
    if bad:
        out[NONFINITE] = bad
    return json.dumps(out, allow_nan=False)


def metrics_record(line: str) -> dict:
    """A record from `metrics_line` with its non-finite values put back as floats (lines
    written with NaN/Infinity literals by older versions read too)."""
    record = json.loads(line)
    for key, value in record.pop(NONFINITE, {}).items():
        record[key] = float(value)
    return record
