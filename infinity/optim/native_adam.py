"""Checked entry point to the native CPU-Adam kernel (`infinity._cpu_adam`).

Owns the boundary checks shared by both backends of the flat Adam step (dtype, device,
contiguity, sizes, aliasing: bad buffers raise, they are never silently copied) and the call
into the extension with raw addresses. It does not own the Adam math (see functional.py for
the torch reference), the hyperparameters' checks (see hyper.py) nor optimizer state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from infinity.optim.hyper import AdamHyper, hyper_from

logger = logging.getLogger(__name__)

try:
    from infinity import _cpu_adam as _native
except ImportError:  # built without a compiler: the torch reference takes over
    _native = None
if _native is not None and not hasattr(_native, "HYPER_FIELDS"):
    # Built from sources older than the AdamHyper record: its adam_step takes the fields one
    # by one. Treated as not built (the torch twin runs) until it is rebuilt.
    logger.warning(
        "infinity._cpu_adam is out of date (built before AdamHyper); using the torch Adam. "
        "Rebuild it with `python setup.py build_ext --inplace`"
    )
    _native = None

# Torch dtype -> the kernel's dtype name.
GRAD_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
HALF_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
SIMD_CHOICES = ("auto", "avx512bf16", "avx512vbmi", "avx512", "avx2", "neon", "scalar")
BUILD_HINT = "build it with `python setup.py build_ext --inplace` (needs a C++17 compiler)"


def available() -> bool:
    """True when the native kernel is importable."""
    return _native is not None


def available8() -> bool:
    """True when the native kernel has the 8-bit step."""
    return _native is not None and hasattr(_native, "adam8_step")


def simd_levels() -> list[str]:
    """SIMD levels this CPU can run with the native kernel, fastest first ([] if not built)."""
    return list(_native.simd_levels()) if _native is not None else []


def num_threads() -> int:
    """Threads the native kernel uses per step (1 if it is not built)."""
    return _native.num_threads() if _native is not None else 1


def set_num_threads(n: int) -> None:
    """Sets the threads per native step (default: the cores this process may run on)."""
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    if _native is None:
        raise ValueError(f"infinity._cpu_adam is not built; {BUILD_HINT}")
    _native.set_num_threads(int(n))


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} has layout {t.layout}; CPU-Adam takes dense tensors: "
            f"densify it first ({name}.to_dense())"
        )
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; CPU-Adam needs {allowed}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on {t.device}; CPU-Adam updates CPU tensors: move the optimizer state "
            "to the CPU, or use torch.optim.AdamW(fused=True) on the device"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous; the step "
            f"updates buffers in place, so pass a contiguous tensor (not {name}.contiguous(), "
            "which would update a copy)"
        )
    return t


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_buffers(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    half_out: torch.Tensor | None,
    step: int,
) -> None:
    """Raises TypeError/ValueError unless the buffers are valid for one flat Adam step."""
    n = param.numel() if isinstance(param, torch.Tensor) else 0
    specs = {
        "param": (param, (torch.float32,), n),
        "grad": (grad, tuple(GRAD_DTYPES), n),
        "exp_avg": (exp_avg, (torch.float32,), n),
        "exp_avg_sq": (exp_avg_sq, (torch.float32,), n),
    }
    if half_out is not None:
        specs["half_out"] = (half_out, tuple(HALF_DTYPES), n)
    check_flat(specs, step)


def check_flat(specs: dict[str, tuple[object, tuple[torch.dtype, ...], int]], step: int) -> None:
    """Raises TypeError/ValueError unless each named buffer is a dense contiguous CPU tensor
    of one of its dtypes with its numel, `step` is >= 1, and no written buffer shares memory
    with another buffer (every buffer but "grad" is written)."""
    named = {name: _check_tensor(name, t, dtypes) for name, (t, dtypes, _) in specs.items()}
    numel = named["param"].numel()
    for name, t in named.items():
        want = specs[name][2]
        if t.numel() != want:
            what = "all buffers of one flat Adam step must have the same numel"
            if want != numel:
                what = f"{name} must have {want} for a step over {numel} parameters"
            raise ValueError(f"{name} has {t.numel()} elements but param has {numel}; {what}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (1-based, after this update), got {step!r}")
    if numel == 0:
        return
    # Written buffers must not overlap each other or the gradient.
    written = [n for n in named if n != "grad"]
    for i, a in enumerate(written):
        for b in [*written[i + 1 :], "grad"]:
            (a0, a1), (b0, b1) = _span(named[a]), _span(named[b])
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{a} and {b} share memory; give each its own buffer")


def adam_step_native(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper | None = None,
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
    simd: str = "auto",
    tile_numel: int = 1 << 16,
    stream_half: bool = True,
    **fields: Any,
) -> None:
    """One flat Adam step in the native kernel; buffers must already pass `check_buffers`.

    `hyper` (or its fields as keywords) reaches the kernel as one value. `tile_numel` is the
    work unit handed to a thread; `stream_half` writes `half_out` with non-temporal stores
    when it is aligned (both are tuning knobs with measured defaults).
    """
    hyper = hyper_from(hyper, fields)
    if _native is None:
        raise ValueError(f"backend='native' but infinity._cpu_adam is not built; {BUILD_HINT}")
    if simd not in SIMD_CHOICES:
        raise ValueError(f"simd={simd!r} is not one of {', '.join(SIMD_CHOICES)}")
    _native.adam_step(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        param.numel(),
        GRAD_DTYPES[grad.dtype],
        half_out.data_ptr() if half_out is not None else 0,
        HALF_DTYPES[half_out.dtype] if half_out is not None else "",
        step,
        hyper,
        float(grad_scale),
        simd,
        int(tile_numel),
        bool(stream_half),
    )


def adam8_step_native(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper,
    tables: tuple[torch.Tensor, ...],
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
    simd: str = "auto",
    tile_numel: int = 1 << 16,
) -> None:
    """One flat 8-bit Adam step in the native kernel; the buffers must already pass
    `check_buffers8` (adam8.py) and `tables` are quant8's eight (`native_tables`)."""
    if _native is None or not hasattr(_native, "adam8_step"):
        raise ValueError(f"the native 8-bit Adam is not built; {BUILD_HINT}")
    if simd not in SIMD_CHOICES:
        raise ValueError(f"simd={simd!r} is not one of {', '.join(SIMD_CHOICES)}")
    _native.adam8_step(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        exp_avg_absmax.data_ptr(),
        exp_avg_sq_absmax.data_ptr(),
        param.numel(),
        GRAD_DTYPES[grad.dtype],
        half_out.data_ptr() if half_out is not None else 0,
        HALF_DTYPES[half_out.dtype] if half_out is not None else "",
        step,
        hyper,
        float(grad_scale),
        [t.data_ptr() for t in tables],
        simd,
        int(tile_numel),
    )


def pool_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src with the kernel's thread pool (a STREAM-like copy for the benchmark)."""
    if _native is None:
        raise ValueError(f"infinity._cpu_adam is not built; {BUILD_HINT}")
    for name, t in (("dst", dst), ("src", src)):
        _check_tensor(name, t, (dst.dtype,))
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} elements and src {src.numel()}; sizes must match")
    _native.copy_bytes(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
