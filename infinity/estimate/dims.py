"""The few sizes of a model the estimate reads besides its parameters (activations, FLOPs,
the compute probe), from Infinity's `LlamaConfig` or a transformers config of any family.

Owns that one adapter: transformers names the same numbers differently per family (GPT-2's
`n_embd`, `n_layer`, `n_inner`), and the configs map most of them through their
`attribute_map`; what cannot be read is a ValueError naming the family and the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infinity.models import LlamaConfig

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True, slots=True)
class ModelDims:
    """A causal LM's sizes as the estimate uses them."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the MLP (GPT-2: `n_inner`, 4 x hidden when unset)."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    def stand_in(self) -> LlamaConfig:
        """A Llama of the same vocabulary, widths, layers and heads: what the compute probe
        times for a family it has no block of its own for (the matmuls, which dominate,
        are the same sizes; norms, activations and position schemes differ)."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim + self.head_dim % 2,  # rotary needs an even head size
        )


def model_dims(config: LlamaConfig | Any) -> ModelDims:
    """The sizes of `config`: Infinity's `LlamaConfig` or a `transformers.PretrainedConfig`."""
    if isinstance(config, LlamaConfig):
        return ModelDims(
            model_type="llama",
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
        )
    model_type = getattr(config, "model_type", type(config).__name__)
    values = {key: _positive(config, key) for key in _REQUIRED}
    missing = [key for key, value in values.items() if value is None]
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    # GPT-2 names the MLP width n_inner and leaves it None for 4 x hidden
    intermediate = _positive(config, "intermediate_size") or _positive(config, "n_inner")
    if intermediate is None and hasattr(config, "n_inner") and hidden:
        intermediate = 4 * hidden
    if intermediate is None:
        missing.append("intermediate_size")
    if missing:
        raise ValueError(
            f"model_type {model_type!r}: `infinity estimate` cannot read {', '.join(missing)} "
            "from its config (as a positive whole number); it estimates causal LMs whose "
            "config names these sizes, such as llama, qwen2, mistral, gemma, phi3 and gpt2"
        )
    return ModelDims(
        model_type=model_type,
        vocab_size=values["vocab_size"],
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=values["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=_positive(config, "num_key_value_heads") or heads,
        head_dim=_positive(config, "head_dim") or hidden // heads,
    )


def _positive(config: Any, key: str) -> int | None:
    value = getattr(config, key, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value
