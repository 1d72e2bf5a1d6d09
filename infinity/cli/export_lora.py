"""`infinity export` of a LoRA checkpoint: the adapter alone, or merged into its base.

A LoRA checkpoint holds the adapters (and optimizer state), not the frozen base; its state
names the base (`base_model`) and the adapters (`lora`, written by `infinity train`). The
adapter export needs only the checkpoint. The merged export streams the base one tensor at a
time from its model directory (the one recorded, or `--base`, checked against the recorded
fingerprints), or rebuilds a random-init preset base from its seed, and adds each adapted
layer's update.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch

from infinity.checkpoint import layout
from infinity.checkpoint.base_model import BASE_MODEL_KEY, check_tensor, describe_dir
from infinity.models import export_hf, hf_auto
from infinity.models.hf_load import iter_hf_tensors, weight_map
from infinity.models.lora import LoraSpec, base_name, is_adapter, merged_weights, write_adapter


def is_lora_checkpoint(ckpt) -> bool:
    return "lora" in ckpt.state


def _trained(ckpt) -> dict[str, torch.Tensor]:
    """Every weight the checkpoint holds (the trainable ones: adapters, small), by peft name."""
    prefix = layout.PARAM_PREFIX
    names = [n for n in ckpt.tensor_names() if n.startswith(prefix)]
    return {n[len(prefix) :]: ckpt.full_tensor(n) for n in names}  # joined across ranks


def export_adapter(ckpt, out: str) -> Path:
    state = ckpt.state["lora"]
    source = (ckpt.state.get(BASE_MODEL_KEY) or {}).get("source") or {}
    return write_adapter(
        out,
        LoraSpec.from_dict(state),
        state["resolved_targets"],
        _trained(ckpt).items(),
        base=source.get("path") or source.get("preset"),
        # A Hugging Face directory loads as a transformers causal LM (a preset does not).
        task_type="CAUSAL_LM" if source.get("path") else None,
    )


def export_merged(ckpt, args: argparse.Namespace, config: dict) -> Path:
    shapes = {n: tuple(s) for n, s in ckpt.state["model"]["param_shapes"].items()}
    trained = _trained(ckpt)
    adapters = {n: t for n, t in trained.items() if is_adapter(n)}
    others = {base_name(n): t for n, t in trained.items() if not is_adapter(n)}

    def base() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in _base_weights(ckpt, args.base, config, shapes):
            yield name, others.get(name, tensor)

    spec = LoraSpec.from_dict(ckpt.state["lora"])
    return export_hf(
        merged_weights(base(), adapters, spec),
        config,
        args.out,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        extra_files=[Path(p) for p in args.copy_files],
    )


def _base_weights(ckpt, override: str | None, config: dict, shapes):
    source = (ckpt.state.get(BASE_MODEL_KEY) or {}).get("source") or {}
    if override is None and "preset" in source:
        return _preset_weights(source, config, shapes)
    model_dir = Path(override or source.get("path") or "")
    if not override and not source.get("path"):
        raise ValueError(
            f"checkpoint {ckpt.path} does not say where its base model is; give --base DIR "
            "(the model directory it was trained from)"
        )
    if not model_dir.is_dir():
        raise ValueError(
            f"the base model directory {model_dir} of checkpoint {ckpt.path} does not exist; "
            "give --base DIR where it is now (or export the adapter alone with --adapter)"
        )
    if source.get("shards") and describe_dir(model_dir)["shards"] != source["shards"]:
        raise ValueError(
            f"{model_dir} is not the base checkpoint {ckpt.path} was trained on (its "
            f"safetensors differ from the recorded fingerprints of {source.get('path')}); give "
            "--base the original model directory"
        )
    files = weight_map(model_dir)
    return _checked(iter_hf_tensors(files, list(shapes)), files, source)


def _checked(tensors, files: dict, source: dict):
    """`tensors`, each checked against the CRC-32 the run recorded as it loaded the base."""
    for name, tensor in tensors:
        check_tensor(source, files[name], name, tensor)
        yield name, tensor


def _preset_weights(source: dict, config: dict, shapes):
    """A preset base rebuilt as `infinity train` built it (same seed, dtype, init path)."""
    spec = hf_auto.describe(source["preset"])
    if spec.param_shapes != shapes:
        raise ValueError(
            f"the checkpoint's model config differs from preset {source['preset']!r}; give "
            "--base DIR with the base model's weights"
        )
    precision = source.get("precision", "fp32")
    cfg = {
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": {"stage": 3, "offload_param": {"pin_memory": False}},
    }
    torch.manual_seed(int(source["seed"]))
    model = hf_auto.from_pretrained(spec, cfg)
    return ((n, p.detach()) for n, p in model.named_parameters())
