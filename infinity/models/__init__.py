"""Models: any transformers causal LM built under `infinity.init` with its weights streamed
in (`hf_auto`, which imports `transformers` when used), a dependency-free Llama with Hugging
Face names and its config (HF config.json keys, presets), streaming load of HF safetensors
and export.
"""

from infinity.models.config import PRESETS, LlamaConfig, load_config, preset
from infinity.models.hf_export import export_hf, parse_dtype
from infinity.models.hf_load import (
    copying_sink,
    expected_shapes,
    from_pretrained_dir,
    materializing_sink,
    param_shapes,
    stream_hf_weights,
    weight_map,
)
from infinity.models.llama import LlamaForCausalLM, init_module

__all__ = [
    "PRESETS",
    "copying_sink",
    "LlamaConfig",
    "LlamaForCausalLM",
    "expected_shapes",
    "export_hf",
    "from_pretrained_dir",
    "init_module",
    "load_config",
    "materializing_sink",
    "param_shapes",
    "parse_dtype",
    "preset",
    "stream_hf_weights",
    "weight_map",
]
