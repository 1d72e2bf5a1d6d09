"""Claim: an Infinity training step (ZeRO-3, parameters and optimizer offloaded to "cpu", fp32)
costs at most 1.15x the plain PyTorch step with `AdamW(foreach=True)` on a GPT-style model.

Both run in this process on the same batches, interleaved round by round (Infinity, then
PyTorch) after warm-up steps, so machine noise hits both alike. One step = forward, backward,
optimizer step on one batch. The median per-step time of each and their ratio go to JSON with
the machine info and the engine's memory stats.

    PYTHONPATH=$PWD flock /work/bench.lock python benchmarks/step_bench.py \\
        --json benchmarks/results/step_2026-11-22.json
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time

import torch
from bench_record import machine, write_json

import infinity
from infinity.models.config import LlamaConfig
from infinity.models.llama import LlamaForCausalLM


def gpt_config(args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        tie_word_embeddings=True,
    )


def engine_config(args, numel: int) -> dict:
    budget = int(numel * args.budget_fraction) if args.budget_fraction else 10**9
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            "stage3_max_live_parameters": budget,
            "stage3_prefetch_bucket_size": max(1, budget // 4),
            "stage3_param_persistence_threshold": 10 * args.hidden,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-fraction", type=float, default=0.0,
                        help="max_live_parameters as a fraction of the model (0: 1e9)")  # fmt: skip
    parser.add_argument("--json", default="step_bench.json", help="output file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    model = LlamaForCausalLM(gpt_config(args))
    numel = sum(p.numel() for p in model.parameters())
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    engine = infinity.initialize(model, engine_config(args, numel))
    g = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        for _ in range(args.warmup + args.rounds)
    ]

    def infinity_step(ids):
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def torch_step(ids):
        loss = plain(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times: dict[str, list[float]] = {"infinity": [], "torch": []}
    losses: dict[str, list[float]] = {"infinity": [], "torch": []}
    for i, ids in enumerate(data):
        for name, step in (("infinity", infinity_step), ("torch", torch_step)):
            t0 = time.perf_counter()
            losses[name].append(step(ids))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        print(f"round {i}: infinity {times['infinity'][-1:]} torch {times['torch'][-1:]}",
              flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    record = {
        "claim": "infinity step <= 1.15x torch AdamW(foreach=True) step, fp32, offload cpu",
        "model": {
            "params": numel,
            "vocab": args.vocab,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "heads": args.heads,
            "tied_embeddings": True,
        },
        "batch": args.batch,
        "seq": args.seq,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "config": engine_config(args, numel),
        "step_s": times,
        "median_s": med,
        "ratio": med["infinity"] / med["torch"],
        "losses": losses,
        "memory_stats": engine.memory_stats(),
        "machine": {**machine(), "loadavg_end": os.getloadavg()},
    }
    print(f"median step: infinity {med['infinity']:.3f} s, torch {med['torch']:.3f} s, "
          f"ratio {record['ratio']:.3f}")  # fmt: skip
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
