"""Claim to test: does Infinity's own Llama (`infinity.models.LlamaForCausalLM`) train faster
through the engine than transformers' `LlamaForCausalLM` of the same shape and weights, with
the same losses? `infinity train` builds the transformers class unless it is measurably better.

Both models get the same weights (transformers' copy is loaded from Infinity's state dict:
the names are the same), the same engine config (ZeRO-3, parameters and optimizer on "cpu",
fp32) and the same batches. Steps are interleaved round by round (ours, then transformers')
after warm-up steps, so machine noise hits both alike. One step = forward, backward,
optimizer step. The median step time of each, their ratio and the largest relative loss
difference go to JSON with the machine info.

    PYTHONPATH=$PWD flock /work/bench.lock python benchmarks/llama_impl_bench.py \\
        --json benchmarks/results/llama_impl_2026-11-23.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
import torch.nn.functional as F
import transformers
from bench_record import machine, write_json

import infinity
from infinity.models import LlamaConfig, LlamaForCausalLM


def engine_config(hidden: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 10 * hidden,
        },
    }


def step(engine, ids, hf: bool) -> tuple[float, float]:
    start = time.perf_counter()
    out = engine(input_ids=ids[:, :-1])
    logits = out.logits if hf else out
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start, loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default="llama_impl.json", help="output file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
    )
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_dict()))
    theirs.load_state_dict(ours.state_dict())
    numel = sum(p.numel() for p in ours.parameters())
    engines = {
        "infinity_llama": infinity.initialize(ours, engine_config(args.hidden)),
        "transformers_llama": infinity.initialize(theirs, engine_config(args.hidden)),
    }
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        for _ in range(args.warmup + args.rounds)
    ]
    times = {name: [] for name in engines}
    losses = {name: [] for name in engines}
    for i, ids in enumerate(batches):
        for name, engine in engines.items():
            seconds, loss = step(engine, ids, hf=name.startswith("transformers"))
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(seconds)
    median = {name: statistics.median(t) for name, t in times.items()}
    a, b = losses["infinity_llama"], losses["transformers_llama"]
    record = {
        "claim": "Infinity's Llama vs transformers' Llama through the engine",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {**machine(), "transformers": transformers.__version__},
        "shape": {k: v for k, v in vars(args).items() if k != "json"},
        "params": numel,
        "median_step_s": median,
        "step_s": times,
        "ratio_infinity_over_transformers": median["infinity_llama"] / median["transformers_llama"],
        "losses": losses,
        "max_rel_loss_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)),
    }
    write_json(record, args.json, announce=False)
    keys = ("params", "median_step_s", "ratio_infinity_over_transformers", "max_rel_loss_diff")
    print(json.dumps({k: record[k] for k in keys}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
