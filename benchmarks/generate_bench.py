"""Claim: `infinity generate` on an export (transformers' `generate()`, KV cache) makes 64
tokens at least 5x faster than the loop it replaced, which ran the whole sequence through
the model for each new token.

A randomly initialized Llama of the given shape (default 1.1B: TinyLlama's) is written as
an export (config.json + safetensors, as `infinity export` writes) and loaded as
`infinity generate` loads it (fp32). Each round, alternating: greedy `ExportModel.generate`
(the command's path) and the old loop (`decode` over a forward that keeps no cache, so each
token runs the prompt and every token so far, the model called as before). Both make the
same tokens (checked). Reports seconds per reply of each, tokens/s and the ratio.

    python benchmarks/generate_bench.py --workdir /tmp/gen-bench --new-tokens 64 \\
        --json benchmarks/results/generate_1b.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_record import machine, write_json

from infinity.cli.generate_model import Sampling, decode, open_model


def write_export(args: argparse.Namespace, where: Path) -> int:
    """A random Llama of `args`' shape saved to `where` in bf16; returns its parameters."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(where)
    return sum(p.numel() for p in model.parameters())


def timed(fn) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(args: argparse.Namespace) -> dict:
    where = Path(args.workdir) / "export"
    params = write_export(args, where)
    start = time.perf_counter()
    ids = torch.randint(3, args.vocab, (args.prompt_tokens,), generator=torch.Generator())
    ids = ids.tolist()
    rows: dict[str, list[float]] = {"generate": [], "loop": []}
    tokens: dict[str, list[int]] = {}
    with open_model(where) as model:
        load_s = time.perf_counter() - start

        def loop_forward(seq, cache):  # the replaced loop: model(input_ids=seq).logits
            return model.model(input_ids=seq).logits, None

        ways = {
            "generate": lambda: model.generate(ids, args.new_tokens, Sampling()),
            "loop": lambda: decode(loop_forward, ids, args.new_tokens, Sampling()),
        }
        model.generate(ids, 2, Sampling())  # warm-up
        order = ["generate", "loop"] * args.rounds + ["generate"]
        for name in order:
            seconds, tokens[name] = timed(ways[name])
            rows[name].append(seconds)
            print(f"{name}: {seconds:.2f} s", flush=True)
    same = tokens["generate"] == tokens["loop"]
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "claim": "generate on an export (KV cache) vs the full-sequence loop it replaced",
        "params": params,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "made_tokens": len(tokens["generate"]),
        "same_tokens": same,
        "load_s": load_s,
        "seconds": rows,
        "median_s": med,
        "tokens_per_s": {k: len(tokens[k]) / v for k, v in med.items()},
        "speedup": med["loop"] / med["generate"],
        "machine": machine(args.workdir),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="where the export is written (removed after)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="loop runs (generate runs one more)")
    p.add_argument("--json", help="write the record here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    try:
        record = run(args)
    finally:
        shutil.rmtree(Path(args.workdir) / "export", ignore_errors=True)
    print(
        f"{record['params'] / 1e9:.2f}B, prompt {args.prompt_tokens}, {record['made_tokens']} "
        f"tokens: generate {record['median_s']['generate']:.1f} s, loop "
        f"{record['median_s']['loop']:.1f} s, {record['speedup']:.1f}x, same tokens: "
        f"{record['same_tokens']}"
    )
    if args.json:
        write_json(record, args.json)
    return 0 if record["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
