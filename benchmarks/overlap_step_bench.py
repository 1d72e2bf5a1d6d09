"""Claim: with `offload_optimizer.overlap_step` the CPU-Adam of the sub-groups whose gradients
are final runs during the last micro batch's backward (and with `half_gradients` at
accumulation 1 it reads the 16-bit gradients, with no fp32 sums), so the optimizer step after
backward (`engine.step()` at the boundary) is shorter than the serial one, with bitwise the
same losses; the state in RAM and on NVMe.

Four engines on copies of one model (a small Llama preset shape, bf16): state in RAM or on
NVMe (gradient sums in RAM), overlap off or on. Each round runs one optimizer step (forward,
backward, step) on every engine in a rotating order, so the machine's load hits each alike;
per engine the median of the whole iteration and of the boundary `step()` call, and the
losses, which must be equal serial vs overlapped. On a machine with few cores the worker's
Adam competes with backward for them: the step after backward shrinks, the iteration gains
at most what the cores left idle.

    PYTHONPATH=$PWD python benchmarks/overlap_step_bench.py --path /tmp/overlap-bench \\
        --json benchmarks/results/overlap_step.json
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from bench_record import machine, write_json

import infinity
from infinity.models.config import preset
from infinity.models.llama import LlamaForCausalLM

ENGINES = [(tier, overlap) for tier in ("cpu", "nvme") for overlap in (False, True)]


def _name(tier: str, overlap: bool) -> str:
    return f"{'ram' if tier == 'cpu' else 'nvme'}_{'overlap' if overlap else 'serial'}"


def engine_config(args, tier: str, overlap: bool, path: str) -> dict:
    # Off: today's serial step (fp32 gradient sums); on: overlapped, 16-bit gradients.
    # `--same-gradients`: 16-bit gradients on both sides, so only the overlap differs.
    offload = {"device": tier, "overlap_step": overlap,
               "half_gradients": overlap or args.same_gradients}  # fmt: skip
    offload["overlap_numel"] = 10**10
    if tier == "nvme":
        offload |= {"nvme_path": path, "gradients_in_cpu": True}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1e6,  # on, never reached: every early step is kept
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": offload,
            "sub_group_size": int(args.sub_group_size),
        },
    }


def one_step(engine, data) -> tuple[float, float, float]:
    """(iteration seconds, boundary step() seconds, mean loss) of one optimizer step."""
    t0 = time.perf_counter()
    total = 0.0
    for k, ids in enumerate(data):
        loss = engine(ids, ids)
        engine.backward(loss)
        total += loss.item() / len(data)
        if k < len(data) - 1:
            engine.step()
    t1 = time.perf_counter()
    engine.step()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b", help="the shape the overrides shrink")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--sub-group-size", type=float, default=2e6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    same = "16-bit gradients in the serial engines too: only the overlap differs"
    parser.add_argument("--same-gradients", action="store_true", help=same)
    parser.add_argument("--path", default=None, help="NVMe directory (default: a temp dir)")
    parser.add_argument("--json", default="overlap_step.json", help="output file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    shape = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(preset(args.preset, **shape))
    numel = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [
        [
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            for _ in range(args.accum)
        ]
        for _ in range(args.warmup + args.rounds)
    ]
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.path) as path:
        engines = {
            _name(t, o): infinity.initialize(copy.deepcopy(model), engine_config(args, t, o, path))
            for t, o in ENGINES
        }
        del model
        iteration = {n: [] for n in engines}
        step = {n: [] for n in engines}
        losses = {n: [] for n in engines}
        ahead = {n: [] for n in engines}
        names = list(engines)
        for r, batch in enumerate(data):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                it_s, step_s, loss = one_step(engines[n], batch)
                losses[n].append(loss)
                ahead[n].append(engines[n].parts.optimizer.last_timings.get("ahead_sub_groups", 0))
                if r >= args.warmup:
                    iteration[n].append(it_s)
                    step[n].append(step_s)
            print(f"round {r}: " + ", ".join(f"{n} {step[n][-1:]}" for n in names), flush=True)
        stats = {n: e.memory_stats() for n, e in engines.items()}
        sub_groups = engines[names[0]].parts.optimizer.layout.num_sub_groups
        for e in engines.values():
            e.close()
    med = {n: {"iteration_s": statistics.median(iteration[n]), "step_s": statistics.median(step[n])}
           for n in names}  # fmt: skip
    bitwise = {
        tier: losses[_name(tier, False)] == losses[_name(tier, True)] for tier in ("cpu", "nvme")
    }
    record = {
        "claim": "overlap_step: a shorter step() after backward, bitwise the same losses",
        "model": {"preset": args.preset, **shape, "params": numel, "sub_groups": sub_groups},
        "batch": args.batch, "seq": args.seq, "accum": args.accum,
        "sub_group_size": int(args.sub_group_size), "warmup": args.warmup, "rounds": args.rounds,
        "same_gradients": args.same_gradients,
        "iteration_s": iteration, "step_s": step, "median": med, "losses": losses,
        "ahead_sub_groups": ahead, "bitwise_equal_losses": bitwise,
        "overlap_peak_bytes": {n: s.get("optim_overlap_peak_bytes", 0) for n, s in stats.items()},
        "machine": {**machine(args.path), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg()},
    }  # fmt: skip
    for n in names:
        print(f"{n}: iteration {med[n]['iteration_s']:.3f} s, step() {med[n]['step_s']:.3f} s")
    print(f"bitwise equal losses: {bitwise}")
    write_json(record, args.json)
    return 0 if all(bitwise.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
