"""Hugging Face transformers models, which the engine was not written for, train exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import VOCAB, batches, config, max_rel_diff, run_engine, run_reference
from _hf_models import ARCHS, causal_lm_loss, hf_model, reference_losses, write_model_dir
from _hf_models import batches as hf_batches

import infinity
from infinity.models import hf_auto
from infinity.zero import Phase

transformers = pytest.importorskip("transformers")


def _gpt2():
    return hf_model(transformers, "gpt2", vocab=VOCAB)


def _llama():
    return hf_model(transformers, "llama", vocab=VOCAB, tie_word_embeddings=True)


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss  # a ModelOutput, keyword arguments in


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_hf_causal_lm_parity(make, checkpointing):
    torch.manual_seed(0)
    model = make()
    if checkpointing:  # the newer name where transformers has it (the old one is deprecated)
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    model.train()
    data = batches(4, seed=30)
    ref, _ = run_reference(model, data, loss_of=_hf_loss)
    budget = sum(p.numel() for p in model.parameters()) // 3
    cfg = config(stage3_max_live_parameters=budget)
    got, engine = run_engine(model, data, cfg, loss_of=_hf_loss)
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)
    stats = engine.memory_stats()
    # The bound: the budget plus the largest unit (a module's own parameters).
    assert stats["peak_live_param_numel"] <= budget + engine.parts.coordinator.largest_unit
    assert stats["budget_overruns"] == 0


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_plain_loss_backward_with_activation_checkpointing(make):
    """`loss.backward()` instead of `engine.backward(loss)`: the same losses, the iteration
    ends from autograd (nothing stays gathered), recomputation included."""
    torch.manual_seed(0)
    model = make()
    model.activation_checkpointing_enable()
    model.train()
    data = batches(4, seed=31)
    ref, _ = run_reference(model, data, loss_of=_hf_loss)
    engine = infinity.initialize(copy.deepcopy(model), config())
    got = []
    for ids in data:
        loss = _hf_loss(engine, ids)
        loss.backward()
        assert engine.parts.coordinator.phase is Phase.IDLE  # ended by autograd
        assert engine.memory_stats()["live_param_numel"] == 0
        engine.step()
        got.append(loss.item())
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_trains_like_plain_pytorch(tmp_path, arch):
    """A saved model directory of each architecture, built by `from_pretrained` under
    infinity.init: accumulation 2, clipping on, the same losses and gradient norms as
    PyTorch + AdamW. Half the architectures use a plain `(loss / 2).backward()`."""
    model_dir = write_model_dir(transformers, arch, tmp_path)
    plain = list(ARCHS).index(arch) % 2 == 1
    cfg = config(stage3_max_live_parameters=8000)
    cfg.update(gradient_accumulation_steps=2, gradient_clipping=0.5)
    data = hf_batches(6, seed=7)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    ref, ref_norms, _ = reference_losses(
        ref_model, data, accum=2, clip=0.5, lr=1e-2, weight_decay=0.01
    )
    engine = infinity.initialize(hf_auto.from_pretrained(model_dir, cfg), cfg)
    assert type(engine.module) is type(ref_model)  # transformers' own class
    got, norms = [], []
    for i in range(0, len(data), 2):
        total = 0.0
        for ids, labels in data[i : i + 2]:
            loss = causal_lm_loss(engine(input_ids=ids).logits, labels)
            if plain:
                (loss / 2).backward()
            else:
                engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        got.append(total)
        norms.append(engine.get_global_grad_norm())
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)
    assert max_rel_diff(norms, ref_norms) < 1e-5, (norms, ref_norms)
    assert min(ref_norms) > 0.5  # clipping was active


def test_fp16_plain_backward_applies_the_loss_scale():
    """fp16: `loss.backward()` on the model's own (fp32) loss scales its gradient exactly as
    `engine.backward(loss)` does, so steps, norms and the loss scale agree bit for bit."""
    torch.manual_seed(0)
    model = _llama()
    cfg = config()
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    data = batches(3, seed=5)
    runs = []
    for plain in (False, True):
        engine = infinity.initialize(copy.deepcopy(model), cfg)
        record = []
        for ids in data:
            loss = engine(input_ids=ids, labels=ids).loss
            loss.backward() if plain else engine.backward(loss)
            engine.step()
            record.append((loss.item(), engine.get_global_grad_norm(), engine.loss_scale))
        runs.append(record)
    assert runs[0] == runs[1]
    assert runs[0][0][2] == 2.0**12 and all(n > 0 for _, n, _ in runs[0])


def test_step_boundary_overrides_the_count():
    torch.manual_seed(0)
    cfg = config()
    cfg["gradient_accumulation_steps"] = 4
    engine = infinity.initialize(_gpt2(), cfg)
    ids = batches(1, seed=3)[0]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step(boundary=True)  # a short last window: the optimizer runs now
    assert engine.global_steps == 1 and engine.micro_steps == 4
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step(boundary=False)
    assert engine.global_steps == 1 and engine.micro_steps == 5


def test_backward_without_scaling_by_accumulation():
    """`engine.backward(loss / 2, scale_wrt_gas=False)` is `engine.backward(loss)` at
    accumulation 2 (the HF Trainer's division, DeepSpeed's keyword)."""
    torch.manual_seed(0)
    model = _gpt2()
    cfg = config()
    cfg["gradient_accumulation_steps"] = 2
    data = batches(4, seed=8)
    norms = []
    for divided in (False, True):
        engine = infinity.initialize(copy.deepcopy(model), cfg)
        for ids in data:
            loss = engine(input_ids=ids, labels=ids).loss
            if divided:
                engine.backward(loss / 2, scale_wrt_gas=False)
            else:
                engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == 2
    assert abs(norms[0] - norms[1]) <= 1e-6 * norms[0]


class _Body(torch.nn.Module):
    """A checkpointed block that reads another module's weight (not its own)."""

    def __init__(self, embed: torch.nn.Embedding) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        object.__setattr__(self, "owner", embed)  # a reference, not a submodule

    def forward(self, x):
        return torch.tanh(self.fc(x)) @ self.owner.weight.t()  # (B, T, VOCAB)


class _TiedInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.body = _Body(self.embed)

    def forward(self, ids, labels):
        logits = torch.utils.checkpoint.checkpoint(self.body, self.embed(ids), use_reentrant=False)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_plain_backward_recomputation_gathers_weights_used_outside_their_module():
    """After a plain `loss.backward()` the recomputed block runs without the engine's
    torch-function mode on autograd's thread state: the hooks enter it for the block."""
    torch.manual_seed(0)
    model = _TiedInside()
    data = batches(3, seed=4)
    ref, _ = run_reference(model, data)
    engine = infinity.initialize(copy.deepcopy(model), config())
    got = []
    for ids in data:
        loss = engine(ids, ids)
        loss.backward()
        engine.step()
        got.append(loss.item())
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)
