"""The Llama model configuration, read from and written to Hugging Face `config.json` keys.

Owns the mapping between HF's keys (both the `rope_theta`/`rope_scaling` form and the newer
`rope_parameters` form) and a typed dataclass, plus the named presets used for benchmarks.
It does not import `transformers`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(kw_only=True, slots=True)
class LlamaConfig:
    """Shape and numerics of a Llama-style causal LM (HF `LlamaConfig` keys and defaults)."""

    vocab_size: int = 32000
    """Rows of the token embedding (and of lm_head)."""
    hidden_size: int = 4096
    intermediate_size: int = 11008
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    """Grouped-query attention: key/value heads (None = num_attention_heads)."""
    head_dim: int | None = None
    """None = hidden_size // num_attention_heads."""
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", ...} as in HF."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix (then checkpoints carry no lm_head.weight)."""
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    """The dtype the weights were saved in ("bfloat16", "float16", "float32"), if known."""
    extra: dict = field(default_factory=dict)
    """Keys of config.json this class does not use, written back on export."""

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; only 'silu'")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; use one of "
                f"{SUPPORTED_ROPE_TYPES}"
            )

    @property
    def num_params(self) -> int:
        """Unique parameter count (a tied lm_head counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q * 2 + h * kv * 2
        if self.attention_bias:
            attn += q + 2 * kv + h
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        return emb * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + h

    def train_flops_per_token(self, seq_len: int) -> int:
        """Forward + backward FLOPs per token, PaLM-style: 6 x matmul parameters plus
        12 x layers x attention width x seq_len (attention scores and values, not halved
        for causality). The embedding lookup is free; a tied lm_head is a matmul."""
        matmul = self.num_params - (
            0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        )
        attn = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return 6 * matmul + attn

    @classmethod
    def from_hf_dict(cls, d: dict, *, source: str = "config") -> LlamaConfig:
        """Build from the keys of a Hugging Face config.json."""
        d = dict(d)
        model_type = d.pop("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; Infinity loads "
                f"{SUPPORTED_MODEL_TYPES} (Llama-architecture models such as Llama 2/3, "
                "TinyLlama, Mistral-style without sliding window)"
            )
        rope = d.pop("rope_parameters", None)
        if rope:  # newer HF form: theta and scaling in one dict
            rope = dict(rope)
            d.setdefault("rope_theta", rope.pop("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                d["rope_scaling"] = rope
        scaling = d.get("rope_scaling")
        if scaling and "rope_type" not in scaling and "type" in scaling:
            d["rope_scaling"] = {**scaling, "rope_type": scaling["type"]}
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d.pop("dtype")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k != "dtype"}
        try:
            return cls(**known, extra=extra)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict:
        """The config.json content `transformers.LlamaForCausalLM` reads."""
        d = {k: v for k, v in self.extra.items() if k not in ("architectures", "model_type")}
        d.update(architectures=["LlamaForCausalLM"], model_type="llama")
        for f in dataclasses.fields(self):
            if f.name != "extra":
                d[f.name] = getattr(self, f.name)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        d["rope_parameters"] = rope
        if d["rope_scaling"] is None:
            del d["rope_scaling"]
        if self.torch_dtype:
            d["dtype"] = self.torch_dtype
        return d


def read_config_json(model_dir: str | os.PathLike) -> dict:
    """`model_dir/config.json` as a dict, with errors that name the directory and the fix."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"model directory {model_dir} does not exist; pass a local Hugging Face model "
            f"directory or a preset ({', '.join(PRESETS)})"
        )
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json, so it is not a Hugging Face model directory; "
            "download the model with its config.json (e.g. `huggingface-cli download`), or use "
            f"a preset ({', '.join(PRESETS)})"
        )
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-download it") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds {type(d).__name__}, not a JSON object; re-download it")
    return d


def load_config(model_dir: str | os.PathLike) -> LlamaConfig:
    """Read `model_dir/config.json` as a Llama config."""
    d = read_config_json(model_dir)
    return LlamaConfig.from_hf_dict(d, source=str(Path(model_dir) / "config.json"))


PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-2b": dict(  # 2.1B: the shape benchmarks/bigger_than_ram.py builds for 2.1e9
        vocab_size=32000,
        hidden_size=2560,
        intermediate_size=6912,
        num_hidden_layers=24,
        num_attention_heads=20,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "llama-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "llama-13b": dict(
        vocab_size=32000,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """A named shape (random init) for benchmarks: tiny, llama-1b, llama-2b, llama-7b, llama-13b."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return LlamaConfig(**{**PRESETS[name], **overrides})
