"""Claim: with W ranks, a ZeRO-3 step communicates what ZeRO-3 says it must, and no more:
every parameter all-gathered once in forward and once in backward, every gradient
reduce-scattered once (in "algorithm bytes": the full gathered or reduced buffer, padded to
W shards). Also the step time of 1 and 2 ranks on the CPU (gloo) for the same global batch.

Each world size runs in its own processes (torchrun for W > 1) on the same model, seed and
global batch (each rank takes its slice); rank 0 times each step after warm-up and reads the
communicator's byte counters (`engine.comm.stats()`) around it. The expected figure is
computed from the model's parameter sizes. One JSON file holds a record per world size, the
machine and the command.

    PYTHONPATH=$PWD flock /work/bench.lock python benchmarks/scale_out.py \\
        --json benchmarks/results/scale_out_2026-11-23.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_record import machine, write_json

from infinity.zero.shard import shard_align, shard_of

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast_object", "all_gather_object")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2", help="world sizes to run (default 1,2)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--json", default="scale_out.json", help="output file")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return parser


def _model(args):
    from infinity.models.llama import LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_bench import gpt_config  # the same tied GPT-style Llama as the step claim

    torch.manual_seed(0)
    return LlamaForCausalLM(gpt_config(args))


def engine_config(args, world: int) -> dict:
    """fp32 on the CPU tier; every parameter is gathered where it is used and released after
    (no persistent or reused parameters, a live budget of the two largest parameters), so
    the traffic is ZeRO-3's by definition. Without the budget a model this small stays
    gathered from forward to backward and moves less."""
    largest = max(args.vocab, args.intermediate) * args.hidden
    return {
        "train_micro_batch_size_per_gpu": args.batch // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 2 * largest,
            "stage3_prefetch_bucket_size": largest,
        },
    }


def zero3_bytes(shapes: list[int], world: int, itemsize: int = 4, align: int = 1) -> dict[str, int]:
    """ZeRO-3's traffic per step (accumulation 1) in algorithm bytes: each parameter's padded
    buffer (W shards of ceil(N / W), rounded up to `align`: Infinity's shards are whole rows
    of the global norm, `infinity.zero.shard.shard_align`) all-gathered in forward and in
    backward, its gradient reduce-scattered once."""
    padded = sum(world * shard_of(n, world, 0, align).numel for n in shapes) * itemsize
    return {"all_gather": 2 * padded, "reduce_scatter": padded, "total": 3 * padded}


def worker(args) -> None:
    """One rank: train, time, count; rank 0 writes the record to `args.worker`."""
    import infinity

    logging.basicConfig(level=logging.WARNING)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = _model(args)
    shapes = [p.numel() for p in model.parameters()]
    engine = infinity.initialize(model, engine_config(args, world))
    comm = engine.comm
    rank = comm.rank
    g = torch.Generator().manual_seed(1)
    per_rank = args.batch // world
    times, losses, counted = [], [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        mine = ids[rank * per_rank : (rank + 1) * per_rank]
        comm.barrier()
        before = comm.stats()
        t0 = time.perf_counter()
        loss = engine(mine, mine)
        engine.backward(loss)
        engine.step()
        box = torch.tensor([loss.item()], dtype=torch.float64)
        seconds = time.perf_counter() - t0
        after = comm.stats()
        comm.all_reduce_(box)  # the loss of the global batch, outside the timed step
        losses.append(float(box[0]) / world)
        if step >= args.warmup:
            times.append(seconds)
            counted.append({k: after[k] - before.get(k, 0) for k in after})
    stats = engine.memory_stats()
    comm.barrier()
    engine.close()  # leaves the process group: no rank exits while the other still talks
    if rank != 0:
        return
    per_step = {op: statistics.median(c.get(f"comm_{op}_bytes", 0) for c in counted) for op in OPS}
    expected = zero3_bytes(shapes, world)
    rule = zero3_bytes(shapes, world, align=shard_align(eight_bit=False))
    moved = per_step["all_gather"] + per_step["reduce_scatter"]
    record = {
        "world_size": world,
        "params": sum(shapes),
        "config": engine_config(args, world),
        "step_s": times,
        "median_step_s": statistics.median(times),
        "tokens_per_s": args.batch * args.seq / statistics.median(times),
        "losses": losses,
        "comm_bytes_per_step": per_step,
        "comm_calls_per_step": {
            op: statistics.median(c.get(f"comm_{op}_calls", 0) for c in counted) for op in OPS
        },
        "zero3_bytes_per_step": expected,
        "measured_over_zero3": (moved / expected["total"]) if world > 1 else None,
        "shard_rule_bytes_per_step": rule,
        "measured_over_shard_rule": (moved / rule["total"]) if world > 1 else None,
        "memory_stats": stats,
    }
    Path(args.worker).write_text(json.dumps(record))


def _run_world(args, world: int, out: Path) -> dict:
    own = [str(Path(__file__).resolve()), "--worker", str(out)]
    own += [f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "intermediate", "layers")]
    own += [f"--{k}={getattr(args, k)}" for k in ("heads", "batch", "seq", "warmup", "steps")]
    if world == 1:
        cmd = [sys.executable, *own]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(world), *own]  # fmt: skip
    env = dict(os.environ, INFINITY_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, 2 // world)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"world size {world} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    bad = [w for w in worlds if w < 1 or args.batch % w]
    if bad:
        raise SystemExit(f"--batch {args.batch} must split evenly over world sizes {bad}")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            rec = _run_world(args, world, Path(tmp) / f"w{world}.json")
            records.append(rec)
            bytes_ = rec["comm_bytes_per_step"]
            print(
                f"world {world}: step {rec['median_step_s']:.3f} s, all-gather "
                f"{bytes_['all_gather'] / 1e6:.1f} MB, reduce-scatter "
                f"{bytes_['reduce_scatter'] / 1e6:.1f} MB per step (ZeRO-3: "
                f"{rec['zero3_bytes_per_step']['total'] / 1e6:.1f} MB, with shards of whole "
                f"norm rows {rec['shard_rule_bytes_per_step']['total'] / 1e6:.1f} MB)",
                flush=True,
            )
    result = {
        "claim": "bytes communicated per step == ZeRO-3's (2 all-gathers + 1 reduce-scatter "
        "of the model); step time of 1 and 2 ranks on the CPU (gloo), same global batch",
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "model": {k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers")},
        "batch": args.batch,
        "seq": args.seq,
        "records": records,
        "machine": {**machine(), "loadavg_end": os.getloadavg()},
    }
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
