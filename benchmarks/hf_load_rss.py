"""Peak RSS of loading and exporting a Hugging Face model, against the model's size.

Claim: streaming a HF safetensors directory into a sink (here: a flat "home" file written
with pwrite, as the NVMe swap store would), exporting it back, and saving + loading a
checkpoint from that home keep peak RSS near one tensor above the interpreter's baseline,
far below the model's size in bytes. Peer, in the
same run: `safetensors.torch.load_file` on every shard (the whole state dict in RAM).

Each measurement runs in a fresh subprocess and reads its own peak RSS (VmHWM). Run under the
shared lock:  flock /work/bench.lock python benchmarks/hf_load_rss.py --preset llama-1b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_record import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from infinity.models import (  # noqa: E402
    LlamaForCausalLM,
    expected_shapes,
    export_hf,
    load_config,
    parse_dtype,
    preset,
    stream_hf_weights,
)
from infinity.utils.telemetry import peak_rss_bytes  # noqa: E402

MiB = 1 << 20


def _stored_dtype(config) -> torch.dtype:
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return names[config.torch_dtype or "float32"]


def _meta_model(config):
    with torch.device("meta"):
        return LlamaForCausalLM(config, init_weights=False)


def _layout(shapes: dict, dtype: torch.dtype) -> dict[str, tuple[int, tuple]]:
    """name -> (byte offset in the flat home file, shape)."""
    out, off, item = {}, 0, torch.empty(0, dtype=dtype).element_size()
    for name, shape in shapes.items():
        out[name] = (off, shape)
        off += item * int(torch.Size(shape).numel())
    return out


def make_model_dir(args, model_dir: Path) -> None:
    """A random HF directory written tensor by tensor (never the model in RAM)."""
    config = preset(args.preset)
    dtype = parse_dtype(args.dtype)
    gen = torch.Generator().manual_seed(0)

    def entries():
        for name, shape in expected_shapes(_meta_model(config)).items():

            def make(shape=shape):
                return torch.empty(shape).normal_(0, 0.02, generator=gen).to(dtype)

            yield name, make

    export_hf(entries(), config, model_dir, dtype=dtype, max_shard_bytes=args.max_shard_bytes)


def child_load(model_dir: Path, home: Path) -> dict:
    config = load_config(model_dir)
    shapes = expected_shapes(_meta_model(config))
    baseline = peak_rss_bytes()
    dtype = _stored_dtype(config)
    layout = _layout(shapes, dtype)
    fd = os.open(home, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    def sink(name: str, tensor: torch.Tensor) -> None:
        off, _ = layout[name]
        data = tensor.to(dtype).contiguous().view(-1).view(torch.uint8).numpy()
        os.pwrite(fd, memoryview(data), off)

    t0 = time.perf_counter()
    n = stream_hf_weights(model_dir, shapes, sink, config=config)
    os.fsync(fd)
    os.close(fd)
    return {"baseline_rss_bytes": baseline, "seconds": time.perf_counter() - t0, "tensors": n}


def child_init_load(model_dir: Path) -> dict:
    """`infinity train`'s path with host partitions: the model built under `infinity.init`
    (every parameter born in its partition) and the weights copied into the partitions as
    they stream in. The partitions are the model, so the expected peak is model + one tensor."""
    import infinity
    from infinity.models import copying_sink

    config = load_config(model_dir)
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    dtype = precision[_stored_dtype(config)]
    baseline = peak_rss_bytes()
    t0 = time.perf_counter()
    ds = {"bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}
    with infinity.init(ds):
        model = LlamaForCausalLM(config, init_weights=False)
    n = stream_hf_weights(model_dir, expected_shapes(model), copying_sink(model), config=config)
    return {"baseline_rss_bytes": baseline, "seconds": time.perf_counter() - t0, "tensors": n}


def child_export(model_dir: Path, home: Path, out_dir: Path, max_shard_bytes: int) -> dict:
    config = load_config(model_dir)
    shapes = expected_shapes(_meta_model(config))
    dtype = _stored_dtype(config)
    layout = _layout(shapes, dtype)
    baseline = peak_rss_bytes()
    fd = os.open(home, os.O_RDONLY)
    t0 = time.perf_counter()
    export_hf(
        _home_entries(fd, layout, dtype),
        config,
        out_dir,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
    )
    os.close(fd)
    return {"baseline_rss_bytes": baseline, "seconds": time.perf_counter() - t0}


def _home_entries(fd: int, layout: dict, dtype: torch.dtype, prefix: str = ""):
    """(name, callable) pairs that swap one tensor in from the home file when called."""
    for name, (off, shape) in layout.items():

        def swap_in(off=off, shape=shape):
            t = torch.empty(shape, dtype=dtype)
            os.preadv(fd, [memoryview(t.view(-1).view(torch.uint8).numpy())], off)
            return t

        yield prefix + name, swap_in


def child_ckpt(model_dir: Path, home: Path, save_dir: Path) -> dict:
    """Save a checkpoint streamed from the home file, then load it back (verified) into it."""
    from infinity.checkpoint import load_checkpoint, save_checkpoint

    config = load_config(model_dir)
    shapes = expected_shapes(_meta_model(config))
    dtype = _stored_dtype(config)
    layout = _layout(shapes, dtype)
    baseline = peak_rss_bytes()
    fd = os.open(home, os.O_RDWR)
    t0 = time.perf_counter()
    save_checkpoint(save_dir, _home_entries(fd, layout, dtype), step=1, state={"step": 1})
    t1 = time.perf_counter()
    ckpt = load_checkpoint(save_dir)  # verifies SHA-256 of the shard
    for name, tensor in ckpt.tensors():
        data = tensor.view(-1).view(torch.uint8).numpy()
        os.pwrite(fd, memoryview(data), layout[name][0])
        del tensor, data
    os.close(fd)
    return {
        "baseline_rss_bytes": baseline,
        "save_seconds": t1 - t0,
        "seconds": time.perf_counter() - t0,
    }


def child_peer(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    baseline = peak_rss_bytes()
    t0 = time.perf_counter()
    state = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    # read every byte, as copying the state dict into a model would
    checksum = sum(float(t.sum()) for t in state.values())
    return {
        "baseline_rss_bytes": baseline,
        "seconds": time.perf_counter() - t0,
        "state_bytes": total,
        "checksum": checksum,
    }


def run_child(args, mode: str, model_dir: Path, work: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--model-dir",
        str(model_dir),
        "--workdir",
        str(work),
        "--max-shard-bytes",
        str(args.max_shard_bytes),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--dtype", default="fp32", help="dtype of the HF files: fp32, bf16, fp16")
    p.add_argument("--workdir", default="/tmp/infinity-hf-rss")
    p.add_argument("--max-shard-bytes", type=int, default=1 << 30)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the model directory for reuse")
    p.add_argument("--json", help="also write the JSON record to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    work = Path(args.workdir)

    if args.child:
        model_dir = Path(args.model_dir)
        if args.child == "load":
            rec = child_load(model_dir, work / "home.bin")
        elif args.child == "init_load":
            rec = child_init_load(model_dir)
        elif args.child == "checkpoint":
            shutil.rmtree(work / "ckpt", ignore_errors=True)
            rec = child_ckpt(model_dir, work / "home.bin", work / "ckpt")
        elif args.child == "export":
            shutil.rmtree(work / "export", ignore_errors=True)
            rec = child_export(model_dir, work / "home.bin", work / "export", args.max_shard_bytes)
        else:
            rec = child_peer(model_dir)
        rec["peak_rss_bytes"] = peak_rss_bytes()
        print(json.dumps(rec))
        return

    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"{args.preset}-{args.dtype}"
    if not (model_dir / "config.json").exists():
        t0 = time.perf_counter()
        make_model_dir(args, model_dir)
        print(f"wrote {model_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    config = load_config(model_dir)
    results = {}
    for mode in ("load", "init_load", "export", "checkpoint", "peer_load_file"):
        runs = [run_child(args, mode, model_dir, work) for _ in range(args.repeats)]
        runs.sort(key=lambda r: r["peak_rss_bytes"])
        med = runs[len(runs) // 2]
        med["peak_over_baseline_bytes"] = med["peak_rss_bytes"] - med["baseline_rss_bytes"]
        med["peak_rss_fraction_of_model"] = med["peak_rss_bytes"] / model_bytes
        results[mode] = med
        print(
            f"{mode:15s} peak RSS {med['peak_rss_bytes'] / MiB:8.0f} MiB "
            f"(baseline {med['baseline_rss_bytes'] / MiB:.0f} MiB) = "
            f"{med['peak_rss_fraction_of_model']:.3f} x model, {med['seconds']:.1f} s",
            file=sys.stderr,
        )
    record = {
        "bench": "hf_load_rss",
        "preset": args.preset,
        "dtype": args.dtype,
        "num_params": config.num_params,
        "model_bytes": model_bytes,
        "largest_tensor_bytes": max(
            int(torch.Size(s).numel()) for s in expected_shapes(_meta_model(config)).values()
        )
        * parse_dtype(args.dtype).itemsize,
        "max_shard_bytes": args.max_shard_bytes,
        "repeats": args.repeats,
        "results": results,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(record, indent=1))
    if args.json:
        write_json(record, args.json, announce=False)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
