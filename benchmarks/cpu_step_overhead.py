"""Claim: on the CPU device, an Infinity training step (ZeRO-3, parameters and optimizer on
"cpu", fp32) of an 81M GPT-2 at 2 x 128 tokens costs at most 1.05x plain PyTorch with the same
CPU-Adam (`infinity.optim.CPUAdam`).

Peers in one process on the same batches, interleaved round by round (the order rotates each
round so none always runs after another): plain PyTorch + CPUAdam (the claim's peer), the
engine as configured by default ("default": parameters above 100k elements are gathered
again at every forward and backward, each gather aliasing its host home), the same with
gathers that copy as on a GPU ("copying": `CpuAccelerator(alias_host=False)`, the engine
before gathers aliased), and with the model kept gathered ("kept": a persistence threshold
above the largest parameter, which the 1e9 live budget holds), and optionally plain PyTorch
+ `AdamW(foreach=True)`. Each step is timed
whole and by phase (forward, backward, optimizer step; the engine's own breakdown through
`wall_clock_breakdown`), so the JSON says where the extra time goes; `--profile N` adds the
engine's hottest Python functions over N more steps (cProfile). The live budget is the
config's (`--budget`, default DeepSpeed's 1e9 elements: the whole model fits).

    PYTHONPATH=$PWD flock /work/bench.lock python benchmarks/cpu_step_overhead.py \\
        --rounds 12 --profile 2 --json benchmarks/results/cpu_step_overhead_2026-11-23.json
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import logging
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch
from bench_record import machine, write_json
from transformers import GPT2Config, GPT2LMHeadModel

import infinity
from infinity.accelerator import CpuAccelerator
from infinity.optim import CPUAdam

LR, WEIGHT_DECAY = 1e-4, 0.01
PHASES = ("forward", "backward", "step")


def gpt2(args) -> GPT2LMHeadModel:
    """GPT-2 with distilgpt2's shape (81.9M parameters, tied embeddings), no dropout so the
    peers compute the same losses."""
    cfg = GPT2Config(
        vocab_size=args.vocab,
        n_positions=1024,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def engine_config(args, persistence: int | None = None) -> dict:
    """The engine's config; `persistence` sets stage3_param_persistence_threshold (None:
    the default, 100k elements)."""
    zero = {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "stage3_max_live_parameters": args.budget,
    }
    if persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "wall_clock_breakdown": True,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
    }


class Plain:
    """Plain PyTorch forward/backward and an optimizer, timed by phase."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def __call__(self, ids: torch.Tensor) -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return loss.item(), {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}


# The engine's breakdown (`wall_clock_breakdown()`) names of the phases the peers share.
_ENGINE_PHASES = {"forward_seconds": "forward", "backward_seconds": "backward",
                  "optimizer_seconds": "step"}  # fmt: skip


class Engine:
    """The engine's step; phases from its own breakdown (all of it is kept, by its names)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self, ids: torch.Tensor) -> tuple[float, dict[str, float]]:
        e = self.engine
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss)
        e.step()
        parts = e.wall_clock_breakdown()
        return loss.item(), parts | {p: parts[k] for k, p in _ENGINE_PHASES.items()}


def _run(peers: dict[str, Callable], data: list[torch.Tensor], warmup: int) -> dict:
    names = list(peers)
    out = {n: {"step_s": [], "cpu_s": [], "phases_s": [], "losses": []} for n in names}
    for i, ids in enumerate(data):
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotate the order each round
            t0, c0 = time.perf_counter(), time.process_time()
            loss, phases = peers[name](ids)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            out[name]["losses"].append(loss)
            if i >= warmup:
                out[name]["step_s"].append(dt)
                out[name]["cpu_s"].append(cpu)
                out[name]["phases_s"].append(phases)
        line = ", ".join(f"{n} {out[n]['step_s'][-1]:.3f}" for n in names if out[n]["step_s"])
        print(f"round {i}: {line}", flush=True)
    return out


def _medians(run: dict) -> dict:
    phases = {p: statistics.median(ph.get(p, 0.0) for ph in run["phases_s"]) for p in PHASES}
    return {"total": statistics.median(run["step_s"]), "cpu": statistics.median(run["cpu_s"]),
            **phases}  # fmt: skip


def _profile(step: Callable, data: list[torch.Tensor], top: int) -> list[dict]:
    """The engine's functions with the most own time over `data` (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    for ids in data:
        step(ids)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, fn), (_, calls, own, cum, _) in stats.items():
        if "/infinity/" in path:
            where = path.split("/infinity/", 1)[1]
            rows.append({"function": f"infinity/{where}:{line}({fn})", "calls": calls,
                         "own_s": own / len(data), "cum_s": cum / len(data)})  # fmt: skip
    rows.sort(key=lambda r: r["own_s"], reverse=True)
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--budget", type=int, default=10**9,
                        help="stage3_max_live_parameters (elements)")  # fmt: skip
    parser.add_argument("--foreach-peer", action="store_true",
                        help="add plain PyTorch + AdamW(foreach=True) for reference")  # fmt: skip
    parser.add_argument("--engines", default="default,copying,kept",
                        help="engine variants: 'default' (persistence threshold 100k, gathers "
                             "alias their homes), 'copying' (the same, gathers copy as on a "
                             "GPU) and 'kept' (threshold above the largest parameter: the "
                             "model stays gathered when it fits the budget)")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0,
                        help="profile the engine over this many more steps")  # fmt: skip
    parser.add_argument("--json", default="cpu_step_overhead.json", help="output file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    model = gpt2(args)
    numel = sum(p.numel() for p in model.parameters())
    peers: dict[str, Callable] = {}
    plain = copy.deepcopy(model)
    opt = CPUAdam(plain.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    peers["torch_cpu_adam"] = Plain(plain, opt)
    if args.foreach_peer:
        ref = copy.deepcopy(model)
        adamw = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        peers["torch_adamw_foreach"] = Plain(ref, adamw)
    largest = max(p.numel() for p in model.parameters())
    # name -> (persistence threshold, whether gathers alias their host homes)
    variants = {"default": (None, True), "copying": (None, False), "kept": (largest + 1, True)}
    configs = {}
    for name in args.engines.split(","):
        if name not in variants:
            parser.error(f"--engines: unknown variant {name!r}; use {', '.join(variants)}")
        persistence, alias = variants[name]
        configs[f"infinity_{name}"] = engine_config(args, persistence)
        accel = CpuAccelerator(alias_host=alias)
        peers[f"infinity_{name}"] = Engine(
            infinity.initialize(
                copy.deepcopy(model), configs[f"infinity_{name}"], accelerator=accel
            )
        )
    del model
    g = torch.Generator().manual_seed(1)
    total = args.warmup + args.rounds + args.profile
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(total)]
    load_start = os.getloadavg()
    runs = _run(peers, data[: args.warmup + args.rounds], args.warmup)
    med = {name: _medians(run) for name, run in runs.items()}
    base = med["torch_cpu_adam"]
    engines = [n for n in peers if n.startswith("infinity_")]
    ratios = {n: med[n]["total"] / base["total"] for n in engines}
    # Process CPU time (both torch threads), and the median of each round's own ratio (the
    # peers of a round run back to back): less swayed than the medians by other jobs.
    cpu_ratios = {n: med[n]["cpu"] / base["cpu"] for n in engines}
    plain_s = runs["torch_cpu_adam"]["step_s"]
    paired = {
        n: statistics.median(a / b for a, b in zip(runs[n]["step_s"], plain_s, strict=True))
        for n in engines
    }
    want = runs["torch_cpu_adam"]["losses"]
    bitwise = {n: runs[n]["losses"] == want for n in engines}
    stats = {n: peers[n].engine.memory_stats() for n in engines}
    within = {n: stats[n]["peak_live_param_numel"] <= args.budget for n in engines}
    extra = {n: {p: med[n][p] - base[p] for p in ("total", *PHASES)} for n in engines}
    if "torch_adamw_foreach" in med:
        foreach = med["torch_adamw_foreach"]["total"]
        ratios |= {f"{n}_vs_adamw_foreach": med[n]["total"] / foreach for n in engines}
    record = {
        "claim": "infinity step <= 1.05x plain torch + the same CPUAdam, fp32, cpu device",
        "model": {
            "kind": "GPT2LMHeadModel",
            "params": numel,
            "vocab": args.vocab,
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
        },
        "batch": args.batch,
        "seq": args.seq,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "configs": configs,
        "alias_host": {f"infinity_{n}": variants[n][1] for n in args.engines.split(",")},
        "median_s": med,
        "ratio": ratios,
        "cpu_time_ratio": cpu_ratios,
        "paired_ratio": paired,
        "losses_bitwise_equal": bitwise,
        "peak_live_within_budget": within,
        "extra_s": extra,
        "engine_breakdown_median_s": {
            n: {
                key: statistics.median(ph.get(key, 0.0) for ph in runs[n]["phases_s"])
                for key in sorted({k for ph in runs[n]["phases_s"] for k in ph} - set(PHASES))
            }
            for n in engines
        },
        "runs": runs,
        "memory_stats": stats,
        "profile": {
            n: _profile(peers[n], data[-args.profile :], 25) if args.profile else []
            for n in engines
        },
        "machine": {**machine(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
    }
    for name, m in med.items():
        parts = ", ".join(f"{p} {m[p]:.3f}" for p in PHASES)
        print(f"{name}: median step {m['total']:.3f} s ({parts})")
    for n in engines:
        print(f"ratio {n} / torch+CPUAdam: {ratios[n]:.3f} (CPU time {cpu_ratios[n]:.3f}, "
              f"median of the rounds' own {paired[n]:.3f}); "
              f"losses bitwise equal: {bitwise[n]}; peak live within the budget: {within[n]}; "
              "extra per phase (s): "
              + ", ".join(f"{p} {v:+.3f}" for p, v in extra[n].items()))  # fmt: skip
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
