"""Capture and restore random-number-generator states as JSON (no pickle).

Covers Python's `random`, NumPy's legacy global generator, torch's CPU generator and, when
the accelerator offers `get_rng_state()`/`set_rng_state(state)` (a uint8 tensor, as torch's
device generators use), the device generator. Byte states travel as base64 strings.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch

from infinity.accelerator import get_accelerator


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict:
    """Every RNG state of this process as a JSON-able dict."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": _b64(torch.get_rng_state()),
    }
    accel = get_accelerator()
    if accel.name != "cpu" and hasattr(accel, "get_rng_state"):
        state["accelerator"] = {"name": accel.name, "state": _b64(accel.get_rng_state())}
    return state


def restore_rng_state(state: dict) -> None:
    """Put back the states from `capture_rng_state()` so the same random numbers follow."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        n = state["numpy"]
        np.random.set_state(
            (
                n["kind"],
                np.asarray(n["keys"], dtype=np.uint32),
                n["pos"],
                n["has_gauss"],
                n["cached_gaussian"],
            )
        )
        torch.set_rng_state(_unb64(state["torch_cpu"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"checkpoint RNG state is incomplete or malformed ({exc!r}); the metadata file was "
            "edited or written by another tool: restore it or load without RNG state"
        ) from exc
    dev = state.get("accelerator")
    accel = get_accelerator()
    if dev and accel.name == dev["name"] and hasattr(accel, "set_rng_state"):
        accel.set_rng_state(_unb64(dev["state"]))
