"""Small models and a reference loop shared by the engine tests.

`run_reference` trains a plain copy with torch.optim.AdamW; `run_engine` trains through
`infinity.initialize`. Both see the same batches, so their losses can be compared step by step.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.models.config import LlamaConfig
from infinity.models.llama import LlamaForCausalLM

VOCAB = 64
SMALL_LLAMA = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=120,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
"""A Llama shape with grouped-query attention, for the model and export tests."""


def random_ids(vocab: int, B: int = 2, T: int = 17, seed: int = 0) -> torch.Tensor:
    """(B, T) token ids below `vocab`."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def tiny_gpt(*, layers: int = 2, hidden: int = 32, checkpointing: bool = True) -> nn.Module:
    """A GPT-style Llama with tied embeddings."""
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    model.set_gradient_checkpointing(checkpointing)
    return model


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.register_buffer("gain", torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x))) * self.gain


class Zoo(nn.Module):
    """Every awkward case at once, each switchable.

    `shared` is called twice per forward; the output projection uses the embedding matrix
    from outside its module; blocks may run under activation checkpointing (reentrant or
    not); `lora` adds frozen base weights; `fail_at` makes forward raise on demand.
    """

    def __init__(self, d: int = 16, n: int = 3, *, ckpt: str | None = None, lora=False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.shared = nn.Linear(d, d)
        self.proj = LoRALinear(d, d) if lora else nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.ckpt = ckpt
        self.fail = False
        self.skip: set[int] = set()
        """Indices of blocks to bypass (a different branch through the model)."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.shared(self.embed(ids))
        for i, block in enumerate(self.blocks):
            if i in self.skip:
                continue
            if self.ckpt and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = block(x)
            if self.fail:
                raise RuntimeError("injected failure")
        x = self.proj(self.shared(torch.tanh(x)))
        logits = F.linear(self.norm(x), self.embed.weight)  # tied, outside its module
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batches(n: int, *, batch: int = 2, seq: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def config(**zero) -> dict:
    """A DeepSpeed-style config; `zero` overrides zero_optimization keys."""
    z = {
        "stage": 3,
        "stage3_max_live_parameters": 10**9,
        "stage3_prefetch_bucket_size": 2000,
        "stage3_param_persistence_threshold": 0,
    }
    z.update(zero)
    return {
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": z,
    }


def model_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The loss of the models here: `model(ids, labels)`."""
    return model(ids, ids)


def run_reference(
    model: nn.Module,
    data,
    *,
    accum: int = 1,
    clip: float = 0.0,
    before=None,
    loss_of=model_loss,
    **adamw,
):
    """Plain PyTorch: AdamW over the trainable parameters; mean loss per optimizer step.
    `before(i, model)` runs before optimizer step i's micro batches; `loss_of(model, ids)` is
    a micro batch's loss."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=adamw.get("lr", 1e-2), weight_decay=adamw.get("wd", 0.01))
    losses = []
    for i in range(0, len(data), accum):
        if before:
            before(i // accum, model)
        total = 0.0
        for ids in data[i : i + accum]:
            loss = loss_of(model, ids)
            (loss / accum).backward()
            total += loss.item() / accum
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def run_engine(model: nn.Module, data, cfg: dict, *, before=None, loss_of=model_loss):
    """The same loop through an Engine; mean loss per optimizer step, and the engine."""
    engine = infinity.initialize(copy.deepcopy(model), cfg)
    accum = engine.gradient_accumulation_steps
    losses = []
    for i in range(0, len(data), accum):
        if before:
            before(i // accum, engine.module)
        total = 0.0
        for ids in data[i : i + accum]:
            loss = loss_of(engine, ids)
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        losses.append(total)
    return losses, engine


def train_steps(engine, data) -> list[float]:
    """Continue training `engine` on `data` (one micro batch per item); the losses."""
    losses = []
    for ids in data:
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def max_rel_diff(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
