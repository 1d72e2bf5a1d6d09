"""InfinityTrainer with a peft model (save_model and checkpoints write an adapter that peft
loads back) and resuming from an earlier checkpoint in the same output_dir (the later
checkpoints are overwritten, as the plain Trainer does)."""

from __future__ import annotations

import pytest
import torch
from _hf_models import hf_model
from test_integrations_hf import INFINITY, _args, _dataset, _logs

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from infinity.checkpoint import load_checkpoint  # noqa: E402
from infinity.checkpoint.layout import LATEST  # noqa: E402
from infinity.integrations.hf import ENGINE_TAG, InfinityTrainer  # noqa: E402


def _peft_model(base_dir):
    peft = pytest.importorskip("peft")
    hf_model(transformers, "qwen2").save_pretrained(base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(base, config)


def test_a_peft_model_saves_an_adapter_that_peft_loads_back(tmp_path):
    peft = pytest.importorskip("peft")
    model = _peft_model(tmp_path / "base")
    args = _args(tmp_path / "out", max_steps=4, save_strategy="steps", save_steps=2)
    trainer = InfinityTrainer(
        model=model, args=args, train_dataset=_dataset(), infinity_config=INFINITY
    )
    trainer.train()
    trained = {n: t.clone() for n, t in trainer.engine.named_parameters_host() if "lora_" in n}
    assert trained and any(t.abs().sum() > 0 for n, t in trained.items() if "lora_B" in n)
    trainer.save_model(tmp_path / "adapter")
    for where in (tmp_path / "adapter", tmp_path / "out" / "checkpoint-4"):
        assert (where / "adapter_config.json").is_file(), sorted(p.name for p in where.iterdir())
        assert not (where / "model.safetensors").exists()
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        back = peft.PeftModel.from_pretrained(base, where)
        loaded = {n: p for n, p in back.named_parameters() if "lora_" in n}
        assert loaded.keys() == trained.keys()
        for name, p in loaded.items():
            torch.testing.assert_close(p, trained[name].view(p.shape), rtol=0, atol=0)
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(auto(input_ids=ids).logits, back(input_ids=ids).logits)


def test_resuming_from_an_earlier_checkpoint_in_the_same_output_dir_overwrites(tmp_path):
    out = tmp_path / "out"
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3)

    def trainer():
        return InfinityTrainer(
            model=hf_model(transformers, "qwen2"),
            args=_args(out, **kw),
            train_dataset=_dataset(),
            infinity_config=INFINITY,
        )

    full = trainer()
    full.train()
    first = (out / "checkpoint-6" / ENGINE_TAG / "checkpoint.json").stat().st_mtime_ns
    again = trainer()
    again.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert again.engine.global_steps == 6
    assert _logs(again, "loss") == _logs(full, "loss")
    assert (out / "checkpoint-6" / ENGINE_TAG / "checkpoint.json").stat().st_mtime_ns != first
    assert not [p for p in (out / "checkpoint-6").iterdir() if p.name.startswith(".tmp")]
    assert load_checkpoint(out / "checkpoint-6", ENGINE_TAG).step == 6  # it verifies


def test_resume_true_skips_a_checkpoint_whose_save_did_not_finish(tmp_path, caplog):
    """A run killed while saving checkpoint-N leaves the folder without trainer_state.json
    (the Trainer writes it last), or with the engine's state unfinished: the Trainer's own
    pick for resume_from_checkpoint=True, the highest N, failed on it with FileNotFoundError.
    The newest finished one is taken instead, and the run ends as one never stopped."""
    out = tmp_path / "out"

    def trainer():
        return InfinityTrainer(
            model=hf_model(transformers, "qwen2"),
            args=_args(out, max_steps=6, save_strategy="steps", save_steps=2),
            train_dataset=_dataset(),
            infinity_config=INFINITY,
        )

    full = trainer()
    full.train()
    (out / "checkpoint-6" / "trainer_state.json").unlink()  # killed before its last file
    (out / "checkpoint-4" / LATEST).unlink()  # killed inside the engine's save
    again = trainer()
    with caplog.at_level("WARNING", logger="infinity.integrations.hf"):
        again.train(resume_from_checkpoint=True)
    assert "checkpoint-6, checkpoint-4 did not finish saving" in caplog.text
    assert "resuming from checkpoint-2" in caplog.text
    assert again.engine.global_steps == 6
    assert _logs(again, "loss")[-4:] == _logs(full, "loss")[-4:]
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        (out / name / "trainer_state.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"checkpoint-6, checkpoint-4, checkpoint-2 did not "):
        trainer().train(resume_from_checkpoint=True)
