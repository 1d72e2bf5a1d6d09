"""Claim: the telemetry every optimizer step records costs a negligible share of the step, and
the engine's profiler ranges cost a flag check while no profiler runs.

The cost is accounted, not A/B-timed (the telemetry has no off switch, and two runs of a
step differ by more than it on a shared machine): a `torch.profiler` pass over one step counts
the engine's ranges (gathers, releases, gradient hooks, Adam sub-groups, ...); each range
costs an off-range check and, for gathers, a `perf_counter()` pair, timed here in a loop;
once per step the engine reads its counters and builds the record (`Engine._measure_step`,
timed around the real call). Their sum per step is compared with the median step time of the
same model. For scale, the cost of an always-on `torch.profiler.record_function` per range is
reported too.

    PYTHONPATH=$PWD flock /work/bench.lock python benchmarks/telemetry_overhead.py \\
        --json benchmarks/results/telemetry_overhead_DATE.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch
from bench_record import machine, write_json

import infinity
from infinity.accelerator import get_accelerator
from infinity.models.config import LlamaConfig
from infinity.models.llama import LlamaForCausalLM


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps after 2 warm-up steps")
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        tie_word_embeddings=True,
    )
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = infinity.initialize(LlamaForCausalLM(cfg), config)
    numel = sum(r.numel for r in engine.parts.records)
    ids = torch.randint(args.vocab, (args.batch, args.seq))

    def step():
        engine.backward(engine(ids, ids))
        engine.step()

    for _ in range(2):
        step()
    ranges = _ranges_per_step(engine, step)
    measure_s = []
    measure = engine._measure_step

    def timed_measure():
        t0 = time.perf_counter()
        out = measure()
        measure_s.append(time.perf_counter() - t0)
        return out

    engine._measure_step = timed_measure
    step_s = []
    for _ in range(args.steps):
        step()
        step_s.append(engine.last_step_telemetry().step_seconds)
    engine.close()

    per_call = _per_call_costs()
    n_ranges = sum(ranges.values())
    n_timed = ranges["infinity::zero::gather"]  # a perf_counter pair each
    overhead_s = (
        statistics.median(measure_s)
        + n_ranges * per_call["range_off_s"]
        + n_timed * per_call["perf_counter_pair_s"]
    )
    record = {
        "model": {"params": numel, "layers": args.layers, "hidden": args.hidden},
        "tokens_per_step": args.batch * args.seq,
        "median_step_s": statistics.median(step_s),
        "median_measure_step_s": statistics.median(measure_s),
        "ranges_per_step": dict(ranges),
        **per_call,
        "telemetry_s_per_step": overhead_s,
        "telemetry_share": overhead_s / statistics.median(step_s),
        "record_function_s_per_step": n_ranges * per_call["record_function_s"],
        "machine": machine(),
    }
    print(json.dumps(record, indent=1))
    if args.json:
        write_json(record, args.json, announce=False)
    return 0


def _ranges_per_step(engine, step) -> collections.Counter:
    """How many times each `infinity::` range opens in one optimizer step."""
    with tempfile.TemporaryDirectory() as out:
        prof = engine.profile(1, out, warmup_steps=0)
        step()
        events = json.loads(Path(prof.path).read_text())["traceEvents"]
    names = (e.get("name", "") for e in events if e.get("ph") == "X")
    return collections.Counter(n for n in names if n.startswith("infinity::"))


def _per_call_costs(number: int = 200_000) -> dict[str, float]:
    accel = get_accelerator()

    def range_off():
        with accel.range("infinity::zero::gather"):
            pass

    def record_function():
        with torch.profiler.record_function("infinity::zero::gather"):
            pass

    def pair():
        t0 = time.perf_counter()
        return time.perf_counter() - t0

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number

    return {
        "range_off_s": best(range_off),
        "record_function_s": best(record_function),
        "perf_counter_pair_s": best(pair),
    }


if __name__ == "__main__":
    sys.exit(main())
