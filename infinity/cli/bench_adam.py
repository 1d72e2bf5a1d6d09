"""`infinity bench adam`: CPU-Adam throughput next to its peers and the copy bandwidth.

Measures one optimizer step over N fp32 parameters for the engine's flat Adam step (the native
kernel of `adam_step_flat`), its 8-bit step (`adam8_step_flat`), torch AdamW (foreach and
fused) and, where importable, DeepSpeed's DeepSpeedCPUAdam and torchao's AdamW8bit, all on
the same parameters in one run, plus a STREAM-like copy; for each gradient dtype, and for
"step + half-precision copy of the new weights" (ours fused, the peers' step then `copy_`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from infinity.optim import AdamHyper, adam_step_flat, native_adam
from infinity.optim.adam8 import adam8_step_flat
from infinity.utils.fsio import check_output_file
from infinity.utils.quant_blocks import block_count

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PEERS = ("infinity", "infinity-8bit", "torch-fused", "torch-foreach", "deepspeed", "torchao-8bit")
EIGHT_BIT = ("infinity-8bit", "torchao-8bit")
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """What to measure."""

    numel: int = 100_000_000
    """Parameters per step (one flat fp32 buffer)."""
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16", "fp16"])
    """Gradient dtypes to measure."""
    half_dtype: str = "bf16"
    """Dtype of the copy of the new weights in the "step + half copy" rows."""
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    """Implementations to measure (unavailable ones are reported as skipped)."""
    warmup: int = 2
    """Untimed runs before the timed ones."""
    repeats: int = 7
    """Timed runs; the median is reported."""
    threads: int | None = None
    """Threads of the native kernel and of torch (None: their defaults, the usable cores)."""

    def __post_init__(self) -> None:
        if self.numel < 1:
            raise ValueError(f"numel must be >= 1, got {self.numel}")
        for d in self.dtypes:
            if d not in DTYPES:
                raise ValueError(f"dtype {d!r} is not one of {', '.join(DTYPES)}")
        if self.half_dtype not in ("fp16", "bf16"):
            raise ValueError(f"half_dtype must be fp16 or bf16, got {self.half_dtype!r}")
        for p in self.peers:
            if p not in PEERS:
                raise ValueError(f"peer {p!r} is not one of {', '.join(PEERS)}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got {self.repeats}/{self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}; omit it for all cores")


def parse_count(text: str) -> int:
    """'100M' -> 100_000_000 (K, M, G are powers of ten: parameter counts)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    text = text.strip().upper().replace("_", "")
    try:
        if text and text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        value = float(text)  # 25000, or 1e6 as configs write sizes
        if not value.is_integer():
            raise ValueError(text)
        return int(value)
    except (ValueError, OverflowError):
        raise ValueError(
            f"cannot read {text!r} as a count; write e.g. 100M, 1.5G or 25000"
        ) from None


def time_interleaved(
    fns: dict[str, Callable[[], None]], warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Timings in seconds of each function, run round-robin (one call of each per round), so
    that load from other processes falls on every candidate alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def machine_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "native": native_adam.available(),
        "simd_levels": native_adam.simd_levels(),
        "native_threads": native_adam.num_threads(),
        # The machine may be shared: the load says how busy it was around the run.
        "loadavg_1m_5m_15m": list(os.getloadavg()),
    }
    try:  # metadata only: importing deepspeed takes seconds
        info["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        info["deepspeed"] = None
    return info


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows (benchmarks' too)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class Buffers:
    """The flat buffers every implementation steps over (shared: one set in RAM)."""

    def __init__(self, numel: int, half_dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)
        self.param = torch.nn.Parameter(torch.randn(numel, generator=gen))
        self.exp_avg = torch.zeros(numel)
        self.exp_avg_sq = torch.zeros(numel)
        self.grad32 = torch.randn(numel, generator=gen)
        self.half = torch.empty(numel, dtype=half_dtype)
        self.grads = {"fp32": self.grad32}
        self._moments8: tuple[torch.Tensor, ...] | None = None

    @property
    def moments8(self) -> tuple[torch.Tensor, ...]:
        """The 8-bit step's codes and absmax (made on first use)."""
        if self._moments8 is None:
            n, nb = self.param.numel(), block_count(self.param.numel())
            self._moments8 = (
                torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                torch.zeros(nb), torch.zeros(nb),
            )  # fmt: skip
        return self._moments8

    def grad(self, dtype: str) -> torch.Tensor:
        if dtype not in self.grads:
            self.grads = {"fp32": self.grad32}  # keep at most one 16-bit copy alive
            self.grads[dtype] = self.grad32.to(DTYPES[dtype])
        return self.grads[dtype]


def _torch_step(buf: Buffers, fused: bool) -> Callable[[], None]:
    kind = dict(fused=True) if fused else dict(foreach=True)
    opt = torch.optim.AdamW([buf.param], **HYPER, **kind)
    opt.state[buf.param] = {
        "step": torch.tensor(0.0),
        "exp_avg": buf.exp_avg,
        "exp_avg_sq": buf.exp_avg_sq,
    }
    return opt.step


def _deepspeed_step(buf: Buffers) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 - optional peer

    opt = DeepSpeedCPUAdam([buf.param], **HYPER, adamw_mode=True)
    opt.state[buf.param] = {
        "step": 0,
        "exp_avg": buf.exp_avg,
        "exp_avg_sq": buf.exp_avg_sq,
    }
    return opt.step


def _torchao_step(buf: Buffers) -> Callable[[], None]:
    from torchao.optim import AdamW8bit  # noqa: PLC0415 - optional peer

    return AdamW8bit([buf.param], **HYPER).step  # compiles on its first step (warm-up)


def _peer_step(name: str, buf: Buffers) -> Callable[[], None]:
    if name == "torchao-8bit":
        return _torchao_step(buf)
    if name == "torch-fused":
        return _torch_step(buf, fused=True)
    if name == "torch-foreach":
        return _torch_step(buf, fused=False)
    return _deepspeed_step(buf)


def _ours(buf: Buffers, dtype: str, half: bool, eight_bit: bool) -> Callable[[], None]:
    grad = buf.grad(dtype)
    counter = [0]
    hyper = AdamHyper.of(**HYPER, adamw_mode=True)  # the peers' settings, as one record
    moments = buf.moments8 if eight_bit else (buf.exp_avg, buf.exp_avg_sq)
    step_fn = adam8_step_flat if eight_bit else adam_step_flat

    def step() -> None:
        counter[0] += 1
        step_fn(buf.param, grad, *moments, step=counter[0], hyper=hyper,
                half_out=buf.half if half else None, backend="native")  # fmt: skip

    return step


def _theirs(name: str, buf: Buffers, dtype: str, half: bool) -> tuple[Callable[[], None], str]:
    """A peer's step, the half copy as a separate `copy_`. A 16-bit gradient is first upcast
    into the fp32 grad: the peers need gradients in the parameter's dtype (torch refuses
    others; DeepSpeed 0.19.8 reads a bf16 gradient of an fp32 parameter as fp32, out of
    bounds, and crashes)."""
    step = _peer_step(name, buf)
    grad16 = buf.grad(dtype) if dtype != "fp32" else None
    buf.param.grad = buf.grad32
    notes = [f"grad {dtype}->fp32 copy_ then step"] if grad16 is not None else ["step"]
    if half:
        notes.append("then half copy_")

    def run() -> None:
        if grad16 is not None:
            buf.grad32.copy_(grad16)
        step()
        if half:
            buf.half.copy_(buf.param.detach())

    return run, " ".join(notes)


def bytes_per_param(dtype: str, half: bool, eight_bit: bool = False) -> int:
    """Logical traffic: read+write param, m, v (24; 12 with 8-bit moments, their absmax
    aside) + read grad (+ write the half copy)."""
    return (12 if eight_bit else 24) + DTYPES[dtype].itemsize + (2 if half else 0)


# STREAM-like copy arrays: far larger than any cache, without doubling the benchmark's RAM.
COPY_MAX_NUMEL = 100_000_000


def copy_fns(numel: int) -> dict[str, Callable[[], None]]:
    """Copies of fp32 arrays (bytes counted: read + write), with torch and with our pool."""
    n = min(numel, COPY_MAX_NUMEL)
    src, dst = torch.ones(n), torch.empty(n)
    fns = {"torch_copy": lambda: dst.copy_(src)}
    if native_adam.available():
        fns["pool_copy"] = lambda: native_adam.pool_copy(dst, src)
    return fns


def _available(name: str) -> str | None:
    """None if the peer can run here, else the reason it cannot."""
    if name == "infinity":
        return None if native_adam.available() else "infinity._cpu_adam is not built"
    if name == "infinity-8bit":
        return None if native_adam.available8() else "infinity._cpu_adam has no 8-bit step"
    if name == "torchao-8bit":
        try:
            from torchao.optim import AdamW8bit  # noqa: F401, PLC0415
        except Exception as exc:  # noqa: BLE001 - any failure means "not available"
            return f"torchao not importable: {exc}"
    if name == "deepspeed":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401, PLC0415
        except Exception as exc:  # noqa: BLE001 - any failure means "not available"
            return f"deepspeed not importable: {exc}"
    return None


@contextlib.contextmanager
def thread_count(threads: int | None) -> Iterator[None]:
    """Runs the block with `threads` native-kernel and torch threads, then restores both."""
    if threads is None:
        yield
        return
    before = (native_adam.num_threads(), torch.get_num_threads())
    if native_adam.available():
        native_adam.set_num_threads(threads)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        if native_adam.available():
            native_adam.set_num_threads(before[0])
        torch.set_num_threads(before[1])


def run(cfg: BenchConfig) -> dict:
    """Measures every (peer, grad dtype, half copy) row; returns one JSON-able record.

    For each gradient dtype and half-copy setting, all implementations and the copies run
    round-robin on the same buffers; each row reports the median of its repeats.
    """
    with thread_count(cfg.threads):
        return _run(cfg)


def _run(cfg: BenchConfig) -> dict:
    record = {"config": asdict(cfg), "machine": machine_info(), "rows": [], "copy": {}}
    buf = Buffers(cfg.numel, DTYPES[cfg.half_dtype])
    copies = copy_fns(cfg.numel)
    copy_times: dict[str, list[float]] = {name: [] for name in copies}
    peers = []
    for name in cfg.peers:
        reason = _available(name)
        if reason is None:
            peers.append(name)
        else:
            record["rows"].append({"impl": name, "skipped": reason})
            log.info("skipping %s: %s", name, reason)
    for dtype in cfg.dtypes:
        for half in (False, True):
            fns, how = dict(copies), {}
            for name in peers:
                if name.startswith("infinity"):
                    fns[name] = _ours(buf, dtype, half, name in EIGHT_BIT)
                    how[name] = "fused"
                else:
                    fns[name], how[name] = _theirs(name, buf, dtype, half)
            log.info("measuring grad %s%s", dtype, " + half copy" if half else "")
            times = time_interleaved(fns, cfg.warmup, cfg.repeats)
            for name in copies:
                copy_times[name] += times.pop(name)
            for name, ts in times.items():
                t = statistics.median(ts)
                nbytes = bytes_per_param(dtype, half, name in EIGHT_BIT) * cfg.numel
                record["rows"].append({
                    "impl": name, "grad": dtype, "half_copy": cfg.half_dtype if half else None,
                    "how": how[name], "median_ms": t * 1e3, "times_ms": [x * 1e3 for x in ts],
                    "params_per_s": cfg.numel / t, "bytes_per_param": nbytes // cfg.numel,
                    "GBps": nbytes / t / 1e9,
                })  # fmt: skip
            buf.param.grad = None
    copy_numel = min(cfg.numel, COPY_MAX_NUMEL)
    for name, ts in copy_times.items():
        record["copy"][f"{name}_GBps"] = 2 * 4 * copy_numel / statistics.median(ts) / 1e9
    record["copy"]["copy_GBps"] = max(record["copy"].values())
    return record


def format_table(record: dict) -> str:
    copy = record["copy"]
    lines = [
        f"numel {record['config']['numel']:,}  machine {record['machine']['cpu']} "
        f"({record['machine']['cores']} cores, {record['machine']['native_threads']} kernel "
        f"threads, {', '.join(record['machine']['simd_levels'])})",
        "copy bandwidth: "
        + ", ".join(f"{k.removesuffix('_GBps')} {v:.1f} GB/s" for k, v in copy.items()),
        f"{'impl':<14}{'grad':<6}{'half':<6}{'ms':>9}{'Gparam/s':>10}{'GB/s':>8}{'%copy':>7}",
    ]
    for r in record["rows"]:
        if "skipped" in r:
            lines.append(f"{r['impl']:<14}{r.get('grad', ''):<6}skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['impl']:<14}{r['grad']:<6}{r['half_copy'] or '-':<6}{r['median_ms']:>9.1f}"
            f"{r['params_per_s'] / 1e9:>10.3f}{r['GBps']:>8.1f}"
            f"{100 * r['GBps'] / copy['copy_GBps']:>6.0f}%"
        )
    return "\n".join(lines)


def _count_arg(text: str) -> int:
    """`parse_count` for argparse, which prints an ArgumentTypeError's message (and only a
    generic one for a ValueError)."""
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("adam", help="CPU-Adam throughput vs torch and DeepSpeed")
    parser.add_argument("--numel", type=_count_arg, default=100_000_000,
                        help="parameters per step, e.g. 100M (default 100M)")  # fmt: skip
    parser.add_argument("--dtype", action="append", choices=list(DTYPES),
                        help="gradient dtype (repeatable; default all)")  # fmt: skip
    parser.add_argument("--half-dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--peer", action="append", choices=list(PEERS),
                        help="implementation to measure (repeatable; default all)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int,
                        help="kernel and torch threads (default: the usable cores)")  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="write the record as JSON here")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.json:
        check_output_file("--json", args.json)
    cfg = BenchConfig(
        numel=args.numel,
        dtypes=args.dtype or ["fp32", "bf16", "fp16"],
        half_dtype=args.half_dtype,
        peers=args.peer or list(PEERS),
        warmup=args.warmup,
        repeats=args.repeats,
        threads=args.threads,
    )
    record = run(cfg)
    print(format_table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 0
