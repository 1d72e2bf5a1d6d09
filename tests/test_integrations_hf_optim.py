"""InfinityTrainer honours TrainingArguments.optim: the AdamW names run 32-bit moments, the
8-bit ones (bitsandbytes' and torchao's) the engine's 8-bit blockwise moments; any other
optimizer is refused with the list."""

from __future__ import annotations

import copy

import pytest
from test_integrations_hf import INFINITY, _args, _dataset, _model

transformers = pytest.importorskip("transformers")

from infinity.integrations.hf import InfinityTrainer  # noqa: E402
from infinity.integrations.hf_config import TRAINER_OPTIMS  # noqa: E402


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "adamw_torch_8bit"])
def test_8_bit_names_train_with_8_bit_moments(tmp_path, optim):
    args = _args(tmp_path, optim=optim, max_steps=3)
    trainer = InfinityTrainer(
        model=_model(), args=args, train_dataset=_dataset(), infinity_config=INFINITY
    )
    assert trainer.infinity_config["optimizer"]["type"] == "AdamW8bit"
    out = trainer.train()
    assert out.training_loss > 0
    assert trainer.engine.parts.optimizer.format.eight_bit


def test_the_default_optim_runs_32_bit_moments(tmp_path):
    trainer = InfinityTrainer(model=_model(), args=_args(tmp_path), infinity_config=INFINITY)
    assert trainer.infinity_config["optimizer"]["type"] == "AdamW"


def test_other_optimizers_and_conflicts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="optim='sgd' is not an optimizer") as err:
        InfinityTrainer(model=_model(), args=_args(tmp_path, optim="sgd"), infinity_config=INFINITY)
    assert all(name in str(err.value) for name in TRAINER_OPTIMS)
    cfg = copy.deepcopy(INFINITY)
    cfg["optimizer"] = {"type": "AdamW"}
    with pytest.raises(ValueError, match="optimizer.type='AdamW' vs TrainingArguments optim"):
        InfinityTrainer(
            model=_model(), args=_args(tmp_path, optim="adamw_torch_8bit"), infinity_config=cfg
        )
