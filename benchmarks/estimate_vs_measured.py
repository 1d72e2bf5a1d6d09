"""Claim: `infinity estimate` predicts the bytes of a run exactly and its peak RSS and step
time within 20%, on the runs `benchmarks/bigger_than_ram.py` recorded on this machine.

For each `bigger_than_ram_*.json` given: the model shape (LoRA included) and the config it
recorded, the disk rates its `bench aio` measured and the CPU-Adam rate its probe measured.
The compute (the model cut to one layer, and a block per further layer, forward and backward
at its tokens), the engine's cost per module, the norm and copy rates are those the run
probed just before each step it compares (the medians), so the estimate meets the load the
step met; records made before those probes are probed here (or take the rates of an earlier
output with `--probes-from`). Then the estimate against the record: NVMe bytes read and
written per step (optimizer, parameter and gradient traffic), the host buffers
`memory_stats()` reported, peak RSS and the step's wall time (the medians of the steps after
the first), and for records with the engine's telemetry the copies and the waits for
parameter reads. One JSON record per run, with the rates used, so `tests/test_estimate.py`
replays them without probing; the BENCHMARKS.md table is printed at the end:

    flock /work/bench.lock python benchmarks/estimate_vs_measured.py \\
        benchmarks/results/bigger_than_ram_*.json \\
        --json benchmarks/results/estimate_vs_measured_2026-11-23_run2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch
from bench_record import machine, write_json

from infinity.config import Config
from infinity.estimate import Rates, estimate, hardware, model_shape
from infinity.estimate.result import Estimate
from infinity.models import LlamaConfig

_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "tie_word_embeddings",
)


def shape_of(record: dict):
    m = record["model"]
    cfg = LlamaConfig(**{k: m[k] for k in _SHAPE_KEYS}, max_position_embeddings=4096)
    return model_shape(cfg, lora_r=int(record["args"].get("lora_r", 0)))


def rates_of(record: dict, probed: dict) -> Rates:
    """The run's own disk and CPU-Adam figures, with the probed compute, norm and copy rates."""
    aio, adam = record["bench_aio"], record["cpu_adam"]
    return Rates(
        device="cpu",
        gpu=None,
        compute_s=probed["compute_s"],
        adam_numel_per_s=adam["numel"] / adam["median_s"],
        norm_bytes_per_s=probed["norm_bytes_per_s"],
        copy_bytes_per_s=probed["copy_bytes_per_s"],
        nvme_read_bps=aio["best_read_gbps"] * 1e9,
        nvme_write_bps=aio["best_write_gbps"] * 1e9,
        sources={"record": "bench aio and CPU-Adam of the run; compute, norm, copies probed"},
        module_overhead_s=probed.get("module_overhead_s", 0.0),
        gather_copy_bytes_per_s=probed.get("gather_copy_bytes_per_s", 0.0),
        fresh_copy_bytes_per_s=probed.get("fresh_copy_bytes_per_s", 0.0),
    )


def estimate_record(record: dict, probed: dict) -> Estimate:
    seq = int(record["args"]["seq_len"])
    shape, config = shape_of(record), dict(record["config"])
    if not record.get("staging_outlier_buffer"):
        # Runs recorded before an outlier parameter had its own staging buffer sized every
        # buffer for the largest parameter.
        zero = config.setdefault("zero_optimization", {})
        param = dict(zero.get("offload_param") or {})
        if param.get("buffer_size", "auto") == "auto":
            param["buffer_size"] = max(p.numel for p in shape.params)
        config["zero_optimization"] = {**zero, "offload_param": param}
    # Runs recorded before the gradients could be kept in 16 bits summed them in fp32.
    zero = config.setdefault("zero_optimization", {})
    optim = {
        **(zero.get("offload_optimizer") or {}),
        "half_gradients": bool(record.get("half_gradients")),
    }
    config["zero_optimization"] = {**zero, "offload_optimizer": optim}
    return estimate(
        shape,
        Config.load(config),
        rates_of(record, probed),
        seq_len=seq,
        activation_checkpointing=bool(record["model"]["activation_checkpointing"]),
        runtime_bytes=int(record["rss_bytes"]["baseline_peak"]),
        ram_bytes=int(record["machine"]["ram_bytes"]),
        # Runs recorded before the fp32 gradients could spill to NVMe kept them in one
        # host buffer: their stats have no gradient traffic.
        grads_spill=any("nvme_grad_bytes" in k for k in record["memory_stats"]),
        # Runs recorded before gathers aliased their host homes copied them.
        aliases=bool(record.get("gathers_alias_host", False)),
        # ... and before new buffers were recycled, into newly allocated memory.
        recycles="recycled_buffers_reused" in record,
    )


def measured(record: dict) -> dict:
    """The record's figures the estimate predicts (steady steps: after the first)."""
    later = _later(record)
    last = later[-1]
    fwd_bwd = last["fwd_bwd_nvme"]
    reads = last["step_bytes_read"] + sum(v for k, v in fwd_bwd.items() if k.endswith("_read"))
    writes = last["step_bytes_written"] + sum(
        v for k, v in fwd_bwd.items() if k.endswith("_written")
    )
    out = {
        "nvme_read_bytes_per_step": reads,
        "nvme_write_bytes_per_step": writes,
        "host_bytes": record["memory_stats"]["host_bytes"],
        "peak_rss_bytes": record["summary"]["peak_rss_bytes"],
        "step_seconds": statistics.median(s["wall_s"] for s in later),
        "optimizer_step_seconds": statistics.median(s["optimizer_step_s"] for s in later),
        "fwd_bwd_seconds": statistics.median(s["fwd_bwd_s"] for s in later),
    }
    if all("telemetry" in s for s in later):  # runs recorded with the engine's breakdown
        for key in ("copy_seconds", "nvme_param_wait_seconds", "gather_wait_seconds"):
            out[key] = statistics.median(s["telemetry"][key] for s in later)
    return out


def predicted(est: Estimate) -> dict:
    j = est.as_json()
    return {
        "nvme_read_bytes_per_step": j["nvme_read_bytes_per_step"],
        "nvme_write_bytes_per_step": j["nvme_write_bytes_per_step"],
        "host_bytes": j["host_bytes"],
        "peak_rss_bytes": j["peak_rss_bytes"],
        "step_seconds": j["step_seconds"],
        "optimizer_step_seconds": est.times.optimizer_step_s,
        "fwd_bwd_seconds": est.times.micro_step_s,
        # against the engine's telemetry, where the record has it
        "copy_seconds": est.times.copies_s,
        "nvme_param_wait_seconds": est.times.read_wait_s,
    }


def recorded_probe(record: dict, earlier: dict | None = None) -> dict | None:
    """The rates the run probed just before each of the steps compared (the same model, under
    the load each step met): their medians. None for runs recorded without them. A rate the
    run did not probe comes from `earlier` (the same record's rates in a `--probes-from`
    output), else is probed now."""
    probes = [s["estimate_probe"] for s in _later(record) if s.get("estimate_probe")]
    if not probes:
        return None
    keys = ("compute_s", "norm_bytes_per_s", "copy_bytes_per_s", "module_overhead_s",
            "fresh_copy_bytes_per_s", "gather_copy_bytes_per_s")  # fmt: skip
    out = {k: statistics.median(p[k] for p in probes) for k in keys if k in probes[0]}
    out["engine_probe_run_sized"] = bool(probes[0].get("engine_probe_run_sized"))
    for k in ("module_overhead_s", "fresh_copy_bytes_per_s"):
        if k not in out and k in (earlier or {}):
            out[k] = earlier[k]
    if "module_overhead_s" not in out:  # runs recorded before the engine's hooks were probed
        out["module_overhead_s"] = _module_overhead_s(record)
    if "fresh_copy_bytes_per_s" not in out:  # ... or copies into new memory
        out["fresh_copy_bytes_per_s"] = hardware.probe_fresh_copy_bytes_per_s()
    return out | {"source": "record"}


def _module_overhead_s(record: dict) -> float:
    """The tiny model's figure, as the runs recorded before the probe had the run's sizes
    measured it (see [Note: probing at the run's sizes] in infinity/run/engine_costs.py)."""
    from infinity.run.engine_costs import probe_engine_costs

    return probe_engine_costs(
        _dtype(record),
        lora_r=int(record["args"].get("lora_r", 0)),
        checkpointing=bool(record["model"]["activation_checkpointing"]),
    ).module_overhead_s


def _dtype(record: dict) -> torch.dtype:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(record["model"]["dtype"])
    return dtype or torch.float32


def _later(record: dict) -> list[dict]:
    return record["steps"][1:] or record["steps"]


def probe(record: dict) -> dict:
    shape = shape_of(record)
    seq = int(record["args"]["seq_len"])
    micro = int(record["config"].get("train_micro_batch_size_per_gpu", 1))
    dtype = _dtype(record)
    ckpt = bool(record["model"]["activation_checkpointing"])
    return {
        "compute_s": hardware.probe_compute_s(
            shape.config, micro, seq, dtype, lora_r=shape.lora_r, checkpointing=ckpt
        ),
        "module_overhead_s": _module_overhead_s(record),
        "norm_bytes_per_s": hardware.probe_norm_bytes_per_s(),
        "copy_bytes_per_s": hardware.probe_copy_bytes_per_s(),
        "fresh_copy_bytes_per_s": hardware.probe_fresh_copy_bytes_per_s(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="bigger_than_ram_*.json files")
    p.add_argument("--json", required=True, help="output file")
    p.add_argument(
        "--probes-from",
        metavar="FILE",
        help="an earlier output: its rates for records made without per-step probes are "
        "reused instead of probed again",
    )
    args = p.parse_args(argv)
    probes: dict[str, dict] = {}
    earlier = {}
    if args.probes_from:
        with open(args.probes_from) as f:
            earlier = {run["record"]: run["probed"] for run in json.load(f)["runs"]}
    out = []
    for path in args.records:
        with open(path) as f:
            record = json.load(f)
        rates = recorded_probe(record, earlier.get(path)) or earlier.get(path)
        if rates is None:
            key = json.dumps(record["model"], sort_keys=True) + str(record["args"]["seq_len"])
            key += str(record["args"].get("lora_r", 0))
            if key not in probes:
                probes[key] = probe(record)
            rates = probes[key]
        est = estimate_record(record, rates)
        got, want = predicted(est), measured(record)
        ratio = {k: got[k] / want[k] for k in got if want.get(k)}
        times = dataclasses.asdict(est.times)
        out.append({"record": path, "probed": rates, "estimate": got, "measured": want,
                    "ratio": ratio, "bound": est.bound, "times": times})  # fmt: skip
        print(f"{path}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()), flush=True)
    write_json({"bench": "estimate_vs_measured", "machine": machine(), "runs": out}, args.json)
    print("\n".join(table(out)))
    return 0


def table(runs: list[dict]) -> list[str]:
    """BENCHMARKS.md's rows: estimate / measured for each run."""
    gib, gb = float(1 << 30), 1e9
    rows = [
        "| run | NVMe read / written per step, GB | peak RSS, GiB | step, s | forward+backward, s"
        " | optimizer step, s | probed forward+backward, s |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        e, m, r = run["estimate"], run["measured"], run["ratio"]
        same = all(e[k] == m[k] for k in ("nvme_read_bytes_per_step", "nvme_write_bytes_per_step"))
        nvme = (
            f"{e['nvme_read_bytes_per_step'] / gb:.3f} / {e['nvme_write_bytes_per_step'] / gb:.3f}"
            + (" (**equal**)" if same else f" (measured {m['nvme_read_bytes_per_step'] / gb:.3f}"
               f" / {m['nvme_write_bytes_per_step'] / gb:.3f})")
        )  # fmt: skip
        name = run["record"].split("bigger_than_ram_")[-1].removesuffix(".json")
        rows.append(
            f"| {name} | {nvme} | {e['peak_rss_bytes'] / gib:.2f} / "
            f"{m['peak_rss_bytes'] / gib:.2f} (**{r['peak_rss_bytes']:.2f}**) | "
            f"{e['step_seconds']:.1f} / {m['step_seconds']:.1f} (**{r['step_seconds']:.2f}**) | "
            f"{e['fwd_bwd_seconds']:.1f} / {m['fwd_bwd_seconds']:.1f} | "
            f"{e['optimizer_step_seconds']:.2f} / {m['optimizer_step_seconds']:.2f} | "
            f"{run['probed']['compute_s']:.2f} |"
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
