"""Claim: a GPT-style model whose training state is more than twice the RAM the run may use
trains with both offloads on NVMe, peak RSS under the limit, the disk kept busy during the
optimizer step, and that step bound only by the slower of the disk and CPU-Adam.

One run, in this order, on the `--path` directory:
1. `infinity bench aio --json` in a subprocess: the best read and best write GB/s there.
2. CPU-Adam compute in a subprocess (so this process's RSS is not charged for it):
   `adam_step_flat` with fp32 gradients and a bf16 `half_out` over one sub-group-sized
   buffer set, median of repeats, scaled by the model's elements over the buffer's.
3. Here: a Llama-style model (`LlamaForCausalLM`, untied embeddings) of about `--params`
   parameters in bf16, built under `infinity.init`, `infinity.initialize` with
   `offload_param` on `--param-tier` and `offload_optimizer` on NVMe under `--path`, then
   `--steps` steps of batch 1 x `--seq-len` random tokens with activation checkpointing
   (`--lora-r R`: LoRA adapters through peft, the base frozen). Before each step a fresh
   interpreter runs `infinity estimate`'s rate probes of the same model, so the estimate can
   be replayed with rates measured under the load the step met (benchmarks/
   estimate_vs_measured.py).

Definitions (from the steps after the first):
- state = 16-bit weights + fp32 master + exp_avg + exp_avg_sq = 14 bytes per parameter (the
  fp32 gradient sums, 4 more bytes per parameter, stay in RAM and are reported apart).
- optimizer step time = the wall time of `engine.step()` at the accumulation boundary.
- NVMe I/O time = bytes read / best read rate + bytes written / best write rate, with the
  bytes the `nvme_*_bytes_read` / `nvme_*_bytes_written` keys of `engine.memory_stats()`
  grew by during that step, and the rates `bench aio` measured in 1.
- NVMe fraction = NVMe I/O time / optimizer step time (1.0: the step moved its bytes as fast
  as `bench aio`'s best read and write one after the other). Reads are counted when waited
  for, so the first sub-groups that the previous step read ahead (they land during forward
  and backward) count in the step that uses them; `nvme_fraction_no_read_ahead` leaves them
  out (the state of the first buffer_count sub-groups: an upper bound of what was read ahead).
- step ratio = optimizer step time / max(CPU-Adam compute time, NVMe I/O time); the sweep
  ratio puts the sweep alone (`last_timings["adam_s"]`: no gradient norm, no zeroing) on top.
Checks: peak RSS < `--rss-limit-gib`, state > 2x that limit, NVMe fraction >= 0.8, step
ratio <= 1.2. The swap directories are removed at the end (`engine.close()`).

    flock /work/bench.lock python benchmarks/bigger_than_ram.py --path /tmp/btr \\
        --json benchmarks/results/bigger_than_ram.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from bench_record import machine, write_json

_GB = 1e9
_GIB = 1 << 30
_STATE_BYTES_PER_PARAM = 2 + 3 * 4  # bf16 weights + fp32 master, exp_avg, exp_avg_sq
_OPTIM_BUFFERS = 4  # offload_optimizer.buffer_count
_HYPER = {"lr": 1e-4, "weight_decay": 0.01}

log = logging.getLogger("bigger_than_ram")


# -- measurements in subprocesses -------------------------------------------------------------


def bench_aio(path: str, extra: list[str]) -> dict:
    """`infinity bench aio` on `path`: best read / write GB/s and the config section that gave
    the best of both (what `infinity bench aio` prints)."""
    from infinity.cli.bench_aio import best

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "aio.json")
        cmd = [sys.executable, "-m", "infinity.cli.main", "bench", "aio", "--path", path]
        cmd += [*extra, "--json", out]
        log.info("running %s", shlex.join(cmd))
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            records = json.load(f)
    overwrite = [r for r in records if not r["fresh_file"]]
    top = best({"records": overwrite})
    return {
        "command": shlex.join(["infinity", *cmd[3:-2]]),
        "seconds": time.perf_counter() - t0,
        "best_read_gbps": top["read"],
        "best_write_gbps": top["write"],
        "best_aio_section": top["aio"],
        "buffered": any(r["buffered"] for r in records),
        "records": overwrite,
    }


def adam_probe(numel: int, repeats: int) -> dict:
    """Seconds of one `adam_step_flat` over `numel` elements as the optimizer runs it (fp32
    master, gradient and moments, bf16 copy-out); runs in the child process."""
    from infinity.optim import adam_step_flat

    g = torch.Generator().manual_seed(0)
    param, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    half = torch.empty(numel, dtype=torch.bfloat16)
    times = []
    for step in range(1, repeats + 2):  # the first one warms up
        t0 = time.perf_counter()
        adam_step_flat(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=_HYPER["lr"],
            weight_decay=_HYPER["weight_decay"],
            grad_scale=1.0,
            half_out=half,
        )
        times.append(time.perf_counter() - t0)
    return {"numel": numel, "times_s": times[1:], "median_s": statistics.median(times[1:])}


def cpu_adam(numel: int, total_numel: int, repeats: int) -> dict:
    """The probe in a fresh interpreter, scaled to the model: median x total / numel."""
    cmd = [sys.executable, os.path.abspath(__file__), "--adam-probe", str(numel)]
    cmd += ["--adam-repeats", str(repeats)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    rec["total_numel"] = total_numel
    rec["total_s"] = rec["median_s"] * total_numel / numel
    return rec


def estimate_probe(args: argparse.Namespace) -> dict:
    """`infinity estimate`'s rate probes of this run's model (forward and backward of the
    model cut to one layer and of one block; the engine's cost per module; the norm pass; a
    host copy) in a fresh interpreter, so that a replay of the
    run (benchmarks/estimate_vs_measured.py) has rates measured under the run's own load."""
    cmd = [sys.executable, os.path.abspath(__file__), "--estimate-probe", "--params"]
    cmd += [str(args.params), "--vocab", str(args.vocab), "--seq-len", str(args.seq_len)]
    cmd += ["--lora-r", str(args.lora_r), "--path", args.path, "--param-tier", args.param_tier]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _estimate_probe_child(args: argparse.Namespace) -> dict:
    from infinity.estimate import hardware

    t0 = time.perf_counter()
    mcfg = model_config(args.params, args.vocab)
    compute = hardware.probe_compute_s(
        mcfg, 1, args.seq_len, torch.bfloat16, lora_r=args.lora_r, checkpointing=True
    )
    from infinity.run.engine_costs import probe_engine_costs

    costs = probe_engine_costs(
        torch.bfloat16,
        lora_r=args.lora_r,
        checkpointing=True,
        nvme_path=args.path if args.param_tier == "nvme" else None,
        like=mcfg,
    )
    return {
        "compute_s": compute,
        "module_overhead_s": costs.module_overhead_s,
        "gather_copy_bytes_per_s": costs.gather_copy_bytes_per_s,
        "engine_probe_run_sized": costs.run_sized,
        "norm_bytes_per_s": hardware.probe_norm_bytes_per_s(),
        "copy_bytes_per_s": hardware.probe_copy_bytes_per_s(),
        "fresh_copy_bytes_per_s": hardware.probe_fresh_copy_bytes_per_s(),
        "seconds": time.perf_counter() - t0,
        "loadavg": list(os.getloadavg()),
    }


# -- the model and the engine config ----------------------------------------------------------


def model_config(params: float, vocab: int):
    """A Llama shape of about `params` parameters: depth ~ width / 100 (GPT-3-like), SwiGLU
    width 8/3 x hidden, heads of 128 (64 when narrow), untied embeddings of at most `vocab`
    rows and at most a quarter of the parameters (so no single tensor dominates)."""
    from infinity.models import LlamaConfig

    # A layer holds ~12 h^2 parameters, so with h / 100 layers: params ~ 12.4 h^3 / 100.
    hidden = max(64, round((params * 100 / 12.4) ** (1 / 3) / 64) * 64)
    head_dim = 128 if hidden % 128 == 0 and hidden >= 1024 else 64
    vocab = min(vocab, max(256, int(params / 4 / (2 * hidden)) // 64 * 64))

    def shape(layers: int):
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=math.ceil(8 * hidden / 3 / 128) * 128,
            num_hidden_layers=layers,
            num_attention_heads=hidden // head_dim,
            max_position_embeddings=4096,
        )

    per_layer = shape(2).num_params - shape(1).num_params
    base = shape(1).num_params - per_layer
    return shape(max(1, round((params - base) / per_layer)))


def engine_config(args: argparse.Namespace, mcfg, aio: dict) -> dict:
    """Both offloads under --path (the parameters on --param-tier), bf16, a live budget of
    two layers (or of two of the largest tensor, when larger) and a prefetch bucket of one."""
    h, i = mcfg.hidden_size, mcfg.intermediate_size
    layer = 4 * h * h + 3 * h * i + 2 * h
    largest = max(mcfg.vocab_size * h, h * i)
    offload_param: dict = {"device": args.param_tier}
    if args.param_tier == "nvme":
        offload_param["nvme_path"] = args.path
        if args.param_buffer_count:
            offload_param["buffer_count"] = args.param_buffer_count
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": dict(_HYPER)},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": int(args.sub_group_size),
            "offload_param": offload_param,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": args.path,
                "buffer_count": _OPTIM_BUFFERS,
            },
            "stage3_max_live_parameters": 2 * max(layer, largest),
            "stage3_prefetch_bucket_size": layer,
        },
        "aio": aio,
    }


# -- training ---------------------------------------------------------------------------------


def _proc_status(key: str) -> int:
    """A /proc/self/status entry in bytes (`RssAnon`, which the package does not read; the
    peak and current RSS come from `infinity.utils.telemetry.peak_rss_bytes` and
    `infinity.estimate.result.current_rss`)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _nvme(stats: dict) -> dict[str, int]:
    return {k: v for k, v in stats.items() if k.startswith("nvme_")}


def _delta(before: dict, after: dict) -> dict[str, int]:
    """How much each NVMe counter (bytes read / written, microseconds waited) grew."""
    return {k: v - before.get(k, 0) for k, v in _nvme(after).items()}


def _bytes(delta: dict, suffix: str) -> int:
    return sum(v for k, v in delta.items() if k.endswith(suffix))


def train(engine, args: argparse.Namespace, vocab: int, *, probes: bool = True) -> list[dict]:
    """`--steps` steps of batch 1 x seq_len random tokens; per step: times and the NVMe
    counters' growth during forward+backward and during the optimizer step (and, with
    `probes`, the estimate's rate probes taken just before it)."""
    from infinity.utils.telemetry import peak_rss_bytes

    g = torch.Generator().manual_seed(1)
    steps = []
    for n in range(args.steps):
        ids = torch.randint(0, vocab, (1, args.seq_len), generator=g)
        # the rates under the load this step is about to meet
        probe = estimate_probe(args) if probes else None
        s0 = engine.memory_stats()
        t0 = time.perf_counter()
        loss = engine(ids, ids)
        engine.backward(loss)
        t1 = time.perf_counter()
        s1 = engine.memory_stats()
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        s2 = engine.memory_stats()
        step_nvme = _delta(s1, s2)
        rec = {
            "step": n + 1,
            "loss": float(loss.detach()),
            "fwd_bwd_s": t1 - t0,
            "optimizer_step_s": t3 - t2,
            "wall_s": (t1 - t0) + (t3 - t2),
            "optimizer_timings_s": dict(engine.parts.optimizer.last_timings),
            "step_bytes_read": _bytes(step_nvme, "bytes_read"),
            "step_bytes_written": _bytes(step_nvme, "bytes_written"),
            "step_nvme": step_nvme,
            "fwd_bwd_nvme": _delta(s0, s1),
            "peak_rss_bytes": peak_rss_bytes(),
            "estimate_probe": probe,
            # where forward and backward went (gather waits, copies, NVMe waits), to set
            # against the estimate's components
            "telemetry": dataclasses.asdict(engine.last_step_telemetry()),
        }
        steps.append(rec)
        print(
            f"step {n + 1}: loss {rec['loss']:.4f}, forward+backward {rec['fwd_bwd_s']:.2f} s, "
            f"optimizer step {rec['optimizer_step_s']:.2f} s (sweep "
            f"{rec['optimizer_timings_s'].get('adam_s', float('nan')):.2f} s), NVMe read "
            f"{rec['step_bytes_read'] / _GB:.2f} GB, written "
            f"{rec['step_bytes_written'] / _GB:.2f} GB",
            flush=True,
        )
    return steps


def run_engine(args: argparse.Namespace, mcfg, config: dict) -> dict:
    """Build, initialize, train and close; RSS at each stage."""
    import infinity
    from infinity.estimate.result import current_rss
    from infinity.models import LlamaForCausalLM
    from infinity.utils.telemetry import peak_rss_bytes

    rss = {"baseline_peak": peak_rss_bytes()}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with infinity.init(config):
        model = LlamaForCausalLM(mcfg)
        if args.lora_r:  # adapters on every linear layer of the blocks, the base frozen
            from infinity.models.lora import LoraSpec, apply_lora

            model = apply_lora(model, LoraSpec(r=args.lora_r))
    model.set_gradient_checkpointing(True)
    rss["after_model_peak"] = peak_rss_bytes()
    t1 = time.perf_counter()
    engine = infinity.initialize(model, config)
    try:
        rss["after_init_peak"] = peak_rss_bytes()
        t2 = time.perf_counter()
        print(
            f"model built in {t1 - t0:.1f} s, engine initialized in {t2 - t1:.1f} s; peak RSS "
            f"{rss['after_init_peak'] / _GIB:.2f} GiB",
            flush=True,
        )
        steps = train(engine, args, mcfg.vocab_size)
        out = {
            "build_s": t1 - t0,
            "initialize_s": t2 - t1,
            "sub_group_numels": [int(n) for n in engine.parts.optimizer.state_tier.numels],
            "steps": steps,
            "memory_stats": engine.memory_stats(),
            # The estimate's replay: gathers from host homes alias them (no copy, no RAM).
            "gathers_alias_host": engine.accelerator.shares_host_memory,
            # The staging pool gives an outlier parameter its own buffer (swap/pool.py).
            "staging_outlier_buffer": True,
            # ... and those from NVMe land in recycled buffers: how many were handed out again
            # (see infinity/accelerator/recycled.py)
            "recycled_buffers_reused": engine.accelerator.buffers.reused,
            # The gradients were kept in 16 bits (swap/grad_half.py), not as fp32 sums.
            "half_gradients": type(engine.parts.optimizer.grads).__name__ == "HalfGradTier",
        }
    finally:
        engine.close()
    rss["end_peak"] = peak_rss_bytes()
    rss["end_current"] = current_rss()
    out["rss_bytes"] = rss
    return out


# -- the verdict ------------------------------------------------------------------------------


def summarize(args, params: int, aio: dict, adam: dict, result: dict, ram: int) -> dict:
    """Medians over the steps after the first, and the checks."""
    read_bps, write_bps = aio["best_read_gbps"] * _GB, aio["best_write_gbps"] * _GB
    groups = result["sub_group_numels"]
    ahead = 12 * sum(groups[:_OPTIM_BUFFERS])  # what the end of a sweep reads ahead, at most
    later = result["steps"][1:] or result["steps"]
    cols: dict[str, list[float]] = {}
    for s in later:
        r, w = s["step_bytes_read"], s["step_bytes_written"]
        io_s = r / read_bps + w / write_bps
        step_s = s["optimizer_step_s"]
        for key, value in (
            ("nvme_fraction", io_s / step_s),
            (
                "nvme_fraction_no_read_ahead",
                (max(0, r - ahead) / read_bps + w / write_bps) / step_s,
            ),
            ("step_ratio", step_s / max(adam["total_s"], io_s)),
            ("sweep_ratio", s["optimizer_timings_s"]["adam_s"] / max(adam["total_s"], io_s)),
            ("nvme_io_s", io_s),
            ("optimizer_step_s", step_s),
            ("fwd_bwd_s", s["fwd_bwd_s"]),
            ("step_wall_s", s["wall_s"]),
        ):
            cols.setdefault(key, []).append(value)
    med = {k: statistics.median(v) for k, v in cols.items()}
    limit = int(args.rss_limit_gib * _GIB)
    state = params * _STATE_BYTES_PER_PARAM
    peak = result["rss_bytes"]["end_peak"]
    summary = {
        "params": params,
        "state_bytes": state,
        "fp32_grad_bytes_in_ram": 4 * params,
        "rss_limit_bytes": limit,
        "ram_bytes": ram,
        "peak_rss_bytes": peak,
        "steps_used": [s["step"] for s in later],
        "cpu_adam_s": adam["total_s"],
        **med,
    }
    summary["checks"] = {
        "peak_rss_under_limit": peak < limit,
        "state_over_2x_limit": state > 2 * limit,
        "nvme_fraction_at_least_0.8": med["nvme_fraction"] >= 0.8,
        "step_ratio_at_most_1.2": med["step_ratio"] <= 1.2,
    }
    return summary


def report(summary: dict) -> None:
    s = summary
    print(
        f"state {s['state_bytes'] / _GB:.1f} GB ({s['params']:,} parameters x "
        f"{_STATE_BYTES_PER_PARAM} B) vs RSS limit {s['rss_limit_bytes'] / _GIB:.1f} GiB and "
        f"RAM {s['ram_bytes'] / _GIB:.1f} GiB; fp32 gradients in RAM "
        f"{s['fp32_grad_bytes_in_ram'] / _GB:.1f} GB"
    )
    print(
        f"peak RSS {s['peak_rss_bytes'] / _GIB:.2f} GiB; step {s['step_wall_s']:.2f} s "
        f"(forward+backward {s['fwd_bwd_s']:.2f} s, optimizer {s['optimizer_step_s']:.2f} s)"
    )
    print(
        f"NVMe fraction of bench aio's best {s['nvme_fraction']:.2f} (without the read-ahead "
        f"{s['nvme_fraction_no_read_ahead']:.2f}); optimizer step / max(CPU-Adam "
        f"{s['cpu_adam_s']:.2f} s, NVMe I/O {s['nvme_io_s']:.2f} s) = {s['step_ratio']:.2f} "
        f"(the sweep alone {s['sweep_ratio']:.2f})"
    )
    for name, ok in s["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp/btr", help="NVMe directory (created if missing)")
    p.add_argument("--params", type=float, default=2.1e9, help="target parameter count")
    p.add_argument("--vocab", type=int, default=32000, help="largest vocabulary to use")
    p.add_argument("--param-tier", choices=("nvme", "cpu"), default="nvme")
    p.add_argument(
        "--param-buffer-count",
        type=int,
        default=0,
        help="offload_param.buffer_count with --param-tier nvme (0: the default)",
    )
    p.add_argument("--sub-group-size", type=float, default=2.5e7)
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rss-limit-gib", type=float, default=12.0)
    p.add_argument(
        "--aio-args", default="--size 2G", help="extra arguments of `infinity bench aio` (quoted)"
    )
    p.add_argument(
        "--aio-config",
        choices=("bench", "default"),
        default="bench",
        help="train with the aio section bench aio found best, or the defaults",
    )
    p.add_argument(
        "--malloc",
        choices=("unmap", "default"),
        default="unmap",
        help="'unmap': glibc maps allocations of 4 MiB and more on their own, as infinity "
        "train does (see infinity/utils/host_memory.py); 'default': glibc's own threshold",
    )
    p.add_argument("--adam-repeats", type=int, default=7)
    p.add_argument("--adam-probe", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--estimate-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="bigger_than_ram.json", help="output file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.adam_probe:  # the child of cpu_adam()
        print(json.dumps(adam_probe(args.adam_probe, args.adam_repeats)))
        return 0
    if args.estimate_probe:  # the child of estimate_probe()
        print(json.dumps(_estimate_probe_child(args)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.malloc == "unmap":
        from infinity.utils.host_memory import unmap_large_allocations

        unmap_large_allocations()
    os.makedirs(args.path, exist_ok=True)
    mcfg = model_config(args.params, args.vocab)
    params = mcfg.num_params
    print(
        f"model: {params:,} parameters (hidden {mcfg.hidden_size}, intermediate "
        f"{mcfg.intermediate_size}, {mcfg.num_hidden_layers} layers, "
        f"{mcfg.num_attention_heads} heads, vocab {mcfg.vocab_size})",
        flush=True,
    )
    record: dict = {"bench": "bigger_than_ram", "machine": machine(args.path), "args": vars(args)}
    aio = bench_aio(args.path, shlex.split(args.aio_args))
    print(
        f"bench aio: best read {aio['best_read_gbps']:.2f} GB/s, best write "
        f"{aio['best_write_gbps']:.2f} GB/s",
        flush=True,
    )
    probe_numel = min(math.ceil(args.sub_group_size / 2048) * 2048, params)
    adam = cpu_adam(probe_numel, params, args.adam_repeats)
    print(
        f"CPU-Adam: {adam['median_s'] * 1e3:.1f} ms per {probe_numel:,} elements, "
        f"{adam['total_s']:.2f} s for the model",
        flush=True,
    )
    config = engine_config(
        args, mcfg, aio["best_aio_section"] if args.aio_config == "bench" else {}
    )
    result = run_engine(args, mcfg, config)
    print(
        "estimate probes before each step: forward+backward "
        + " / ".join(f"{s['estimate_probe']['compute_s']:.2f} s" for s in result["steps"]),
        flush=True,
    )
    summary = summarize(args, params, aio, adam, result, record["machine"]["ram_bytes"])
    record.update(
        model={
            "params": params,
            "dtype": "bf16",
            "activation_checkpointing": True,
            **{
                k: getattr(mcfg, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "tie_word_embeddings",
                )
            },
        },
        config=config,
        bench_aio=aio,
        cpu_adam=adam,
        **result,
        summary=summary,
    )
    record["machine"]["loadavg_end"] = os.getloadavg()
    report(summary)
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
