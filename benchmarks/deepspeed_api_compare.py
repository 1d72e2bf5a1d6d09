"""Check: `infinity.deepspeed` answers DeepSpeed's training calls as DeepSpeed itself does.

Runs DeepSpeed's getting-started pattern (`add_config_arguments`, `initialize` with `args`,
`model_parameters` and `training_data`, a WarmupLR from the config, accumulation 2, a tagged
`save_checkpoint` with `client_state`, `load_checkpoint` by tag, by `latest` and from an
empty directory) and records what each call returns: types, values, counters. Run it once
under DeepSpeed (a virtualenv of its own; on a machine without a GPU, `DS_ACCELERATOR=cpu`)
and once under Infinity, then compare:

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python benchmarks/deepspeed_api_compare.py \\
        --impl deepspeed --json /tmp/ds.json
    python benchmarks/deepspeed_api_compare.py --impl infinity --json /tmp/inf.json
    python benchmarks/deepspeed_api_compare.py --diff /tmp/ds.json /tmp/inf.json

The diff lists every probe whose answers differ; docs/deepspeed.md says which differences
are by design. DeepSpeed is never a dependency of the project: it is only run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
    },
    "zero_optimization": {"stage": 0},
}
SCHEDULER_PROBES = ("get_last_lr", "get_lr", "last_batch_iteration", "state_dict")


def shape_of(value: Any) -> Any:
    """A JSON-able description of a returned value: its type, and its value where small."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        return f"{type(value).__name__}:{value}"
    if isinstance(value, float):
        return f"float:{value:.6g}"
    if isinstance(value, (list, tuple)):
        return [shape_of(v) for v in value[:4]]
    if isinstance(value, dict):
        return sorted(value)
    return type(value).__name__


def probe(out: dict, name: str, fn: Any) -> Any:
    """Record `fn()`'s answer under `name`, or the exception it raised."""
    try:
        value = fn()
    except Exception as err:  # the probe records refusals as answers
        out[name] = f"raises {type(err).__name__}"
        return None
    out[name] = shape_of(value)
    return value


def run(impl: str) -> dict:
    if impl == "deepspeed":
        import deepspeed
    else:
        import infinity.deepspeed as deepspeed
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    for key in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(key, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    save_dir = tempfile.mkdtemp()
    config_path = os.path.join(save_dir, "ds_config.json")
    with open(config_path, "w") as f:
        json.dump(DS_CONFIG, f)
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    data = [(torch.randn(8), torch.randn(1)) for _ in range(64)]
    out: dict[str, Any] = {}
    engine, _, loader, scheduler = probe(
        out,
        "initialize",
        lambda: deepspeed.initialize(
            args=args, model=model, model_parameters=model.parameters(), training_data=data
        ),
    )
    out["len(training_dataloader)"] = len(loader)
    for name in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "zero_optimization_stage",
        "get_lr",
    ):
        probe(out, f"engine.{name}() before training", getattr(engine, name))
    probe(out, "engine.train()", engine.train)
    counters = []
    for x, y in loader:
        out.setdefault(
            "boundary before the first backward", engine.is_gradient_accumulation_boundary()
        )
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)).float(), y.float())
        probe(out, "engine.backward(loss)", lambda loss=loss: engine.backward(loss))
        probe(out, "engine.step()", engine.step)
        counters.append([engine.global_steps, engine.global_samples])
    out["[global_steps, global_samples] after each micro batch"] = counters
    probe(out, "engine.get_lr() after training", engine.get_lr)
    for name in SCHEDULER_PROBES:
        attr = getattr(scheduler, name, None)
        out[f"lr_scheduler.{name}"] = (
            "missing" if attr is None else shape_of(attr() if callable(attr) else attr)
        )
    probe(
        out,
        "save_checkpoint(tag, client_state)",
        lambda: engine.save_checkpoint(save_dir, tag="t1", client_state={"epoch": 7}),
    )
    path, state = engine.load_checkpoint(save_dir, tag="t1")
    out["load_checkpoint(tag): path under the save dir"] = os.path.relpath(path, save_dir)
    out["load_checkpoint(tag): client_state['epoch']"] = (state or {}).get("epoch")
    path, _ = engine.load_checkpoint(save_dir)
    out["load_checkpoint(latest): path under the save dir"] = os.path.relpath(path, save_dir)
    probe(out, "load_checkpoint(empty dir)", lambda: engine.load_checkpoint(tempfile.mkdtemp()))
    probe(out, "engine.eval()", engine.eval)
    return out


def diff(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)["answers"]
    with open(b_path) as f:
        b = json.load(f)["answers"]
    differing = [k for k in a if a[k] != b.get(k)]
    for key in differing:
        print(f"{key}\n  {a_path}: {a[key]}\n  {b_path}: {b.get(key)}")
    print(f"{len(a) - len(differing)} of {len(a)} probes answer alike")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=("deepspeed", "infinity"))
    parser.add_argument("--json", help="write the answers here")
    parser.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two --json files")
    opts = parser.parse_args(argv)
    if opts.diff:
        return diff(*opts.diff)
    if opts.impl is None:
        parser.error("give --impl deepspeed|infinity, or --diff A B")
    answers = run(opts.impl)
    version = "unknown"
    if opts.impl == "deepspeed":
        import deepspeed

        version = deepspeed.__version__
    record = {"impl": opts.impl, "version": version, "answers": answers}
    text = json.dumps(record, indent=1)
    if opts.json:
        with open(opts.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
