"""Any Hugging Face causal LM, built from its own transformers class.

Owns turning a model directory's config.json (or a preset shape) into a
`CausalLMSpec` (the transformers config, the parameter names and shapes, FLOPs per token)
and building the model with `AutoModelForCausalLM` under `infinity.init`, its weights
streamed into the partitions one tensor at a time. The forward is transformers' own code.
`transformers` is imported here only, when a model is described or built.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.config import Config, ResolvedConfig, RunFacts, resolve_run
from infinity.models.config import PRESETS, preset, read_config_json
from infinity.models.hf_load import expected_shapes, load_hf_into
from infinity.models.random_init import random_init
from infinity.zero import init

log = logging.getLogger(__name__)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "building a Hugging Face model needs transformers; install it with "
            "pip install 'infinity-trainer[hf]'"
        ) from None
    return transformers


@dataclass(kw_only=True, slots=True)
class CausalLMSpec:
    """One causal LM: its transformers config and what Infinity needs to know of it."""

    hf_config: Any
    """The `transformers.PretrainedConfig` (its class decides the model class)."""
    model_dir: Path | None = None
    """The directory the weights come from (None: random init, a preset)."""
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Unique parameter names (tied ones once) and shapes, from a meta-device model."""
    embedding_numel: int = 0
    """Elements of the input embedding (a lookup, not a matmul, unless tied to lm_head)."""
    tied: bool = False
    """The output projection shares the input embedding's weight."""

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model's positions cover (None: not stated)."""
        value = getattr(self.hf_config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes.values())

    def train_flops_per_token(self, seq_len: int) -> int:
        """Forward + backward FLOPs per token, PaLM-style (as `LlamaConfig` counts them):
        6 x matmul parameters plus 12 x layers x attention width x seq_len."""
        cfg = self.hf_config
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or self.hidden_size // heads
        matmul = self.num_params - (0 if self.tied else self.embedding_numel)
        return 6 * matmul + 12 * int(cfg.num_hidden_layers) * heads * head_dim * seq_len

    def to_dict(self) -> dict:
        """The config.json content (as `save_pretrained` writes it), without the path it was
        read from: a moved model directory is still the same model."""
        config = self.hf_config.to_dict()
        config.pop("_name_or_path", None)
        return config


def describe(model: str | os.PathLike) -> CausalLMSpec:
    """The spec of a model directory (its config.json) or of a preset name."""
    tf = _transformers()
    if str(model) in PRESETS:
        config = tf.LlamaConfig(**preset(str(model)).to_hf_dict())
        model_dir = None
    else:
        model_dir = Path(model).expanduser()
        read_config_json(model_dir)  # clear errors for a missing directory or config.json
        config = _auto_config(model_dir)
    return _spec(config, model_dir)


def _auto_config(model_dir: Path):
    tf = _transformers()
    try:
        config = tf.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    # transformers validates config values with ValueError, TypeError, KeyError and
    # huggingface_hub's StrictDataclassError (an Exception): all mean a bad config.json.
    except Exception as exc:
        raise ValueError(
            f"{model_dir}/config.json: transformers {tf.__version__} cannot read it ({exc}); "
            "upgrade transformers (pip install -U transformers) if the architecture is newer"
        ) from None
    causal = tf.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in causal:
        raise ValueError(
            f"{model_dir}: model_type {config.model_type!r} has no causal-LM class in "
            f"transformers (AutoModelForCausalLM); Infinity trains causal LMs such as llama, "
            "mistral, qwen2, gemma, phi3 and gpt2"
        )
    return config


def _spec(config, model_dir: Path | None) -> CausalLMSpec:
    try:
        with torch.device("meta"):
            meta = build(config, init_weights=False)
    except (RuntimeError, ValueError, TypeError) as exc:  # e.g. a negative size
        where = f"{model_dir}/config.json" if model_dir is not None else "the preset"
        raise ValueError(
            f"{where}: transformers cannot build {type(config).__name__} from its values "
            f"({exc}); check the sizes in it (hidden_size, num_attention_heads, ...)"
        ) from None
    embed = meta.get_input_embeddings().weight
    out = meta.get_output_embeddings()
    return CausalLMSpec(
        hf_config=config,
        model_dir=model_dir,
        param_shapes=expected_shapes(meta),
        embedding_numel=embed.numel(),
        tied=out is not None and out.weight is embed,
    )


def build(config, *, init_weights: bool = True) -> nn.Module:
    """`AutoModelForCausalLM.from_config(config)` in fp32, with transformers' random init or,
    when the weights will be loaded over it, none (every parameter is then overwritten).
    Call it under `infinity.init` to build the parameters straight into partitions."""
    tf = _transformers()
    from transformers.initialization import no_init_weights

    skip = contextlib.nullcontext() if init_weights else no_init_weights()
    with skip:
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not init_weights:
        model.tie_weights()  # transformers ties inside the init that was skipped
    return model


def aliases(model: nn.Module) -> set[str]:
    """Names under which a tied parameter appears a second time (`lm_head.weight`): a
    checkpoint may carry them, and they are not loaded twice."""
    unique = set(dict(model.named_parameters()))
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - unique


def load_weights(model: nn.Module, model_dir: str | os.PathLike) -> int:
    """Stream the safetensors of `model_dir` into `model`'s parameters in place (under
    `infinity.init`: into the partitions), after checking every name and shape."""
    n = load_hf_into(model_dir, dict(model.named_parameters()), ignore=aliases(model))
    log.info("loaded %d tensors from %s", n, model_dir)
    return n


def from_pretrained(model: str | os.PathLike, config, *, seed: int | None = None) -> nn.Module:
    """Build a model directory's (or preset's) transformers class under `infinity.init(config)`
    and stream its weights into the partitions: the whole model never sits in RAM twice,
    unlike `from_pretrained`. Use it before `infinity.initialize` or `InfinityTrainer`;
    `config` may keep "auto" values (only its precision and pinning matter here). A preset's
    random weights are drawn on every core from `seed` (default: `torch.initial_seed()`; see
    [Note: reproducible parallel init] in infinity/models/random_init.py)."""
    spec = model if isinstance(model, CausalLMSpec) else describe(model)
    # init needs only the dtype and pinning: a schedule's "auto" run length may stay open
    # (a run hands over the config it resolved once). Built without init, nothing is
    # copied: the loader or `random_init` writes every value.
    if not isinstance(config, ResolvedConfig):
        config = resolve_run(Config.load(config), RunFacts(total_num_steps=1))
    with init(config, values=False):
        built = build(spec.hf_config, init_weights=False)
    if spec.model_dir is not None:
        load_weights(built, spec.model_dir)
    else:
        _random_weights(built, torch.initial_seed() if seed is None else seed)
    return built


def _random_weights(model: nn.Module, seed: int) -> None:
    """A preset's weights: the parallel rule where it covers the model, else its own init."""
    std = float(getattr(model.config, "initializer_range", None) or 0.02)
    if not random_init(model, seed=seed, std=std):
        log.info("%s: transformers' own (serial) init", type(model).__name__)
        with torch.no_grad():
            model.init_weights()


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Turn on the model's own activation checkpointing (non-reentrant)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.set_gradient_checkpointing(True)  # Infinity's own Llama
