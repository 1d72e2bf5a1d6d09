"""InfinityTrainer against the plain transformers Trainer: the same logged losses, gradient
norms and learning rates; save_model, resume, evaluation and prediction; the config's "auto"
values and their conflicts."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _hf_models import VOCAB, hf_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import infinity  # noqa: E402
from infinity.integrations.hf import ENGINE_TAG, InfinityTrainer  # noqa: E402

STEPS = 10


def _model():
    return hf_model(transformers, "qwen2")


def _dataset(n=48, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=3,
        max_grad_norm=0.5,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


INFINITY = {
    "zero_optimization": {
        "stage": 3,
        "stage3_max_live_parameters": 6000,
        "stage3_param_persistence_threshold": 0,  # nothing stays gathered between steps
    }
}


def _logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer's run: the reference."""
    out = tmp_path_factory.mktemp("plain")
    trainer = transformers.Trainer(model=_model(), args=_args(out), train_dataset=_dataset())
    trainer.train()
    return trainer


def _rel(a, b):
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def test_logged_losses_grad_norms_and_lrs_match_the_plain_trainer(tmp_path, plain):
    trainer = InfinityTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_dataset(), infinity_config=INFINITY
    )
    trainer.train()
    assert trainer.engine.global_steps == STEPS
    assert _rel(_logs(trainer, "loss"), _logs(plain, "loss")) < 1e-5
    assert _rel(_logs(trainer, "grad_norm"), _logs(plain, "grad_norm")) < 1e-5
    assert min(_logs(plain, "grad_norm")) > 0.5  # clipping was active
    lrs = _logs(trainer, "learning_rate")
    assert lrs == pytest.approx(_logs(plain, "learning_rate"), rel=1e-12)
    assert lrs[0] < lrs[2] and lrs[-1] < lrs[3]  # warmup, then decay

    # save_model streams a directory from_pretrained loads, with the engine's weights
    trainer.save_model(tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ours = dict(trainer.engine.named_parameters_host())
    for name, p in back.named_parameters():
        torch.testing.assert_close(p, ours[name].view(p.shape), rtol=0, atol=0, msg=name)
    for name, p in plain.model.named_parameters():  # and those of the plain run, closely
        torch.testing.assert_close(dict(back.named_parameters())[name], p, rtol=1e-4, atol=1e-5)

    # evaluation and prediction run through the engine's gathers
    eval_set = _dataset(8, seed=9)
    ref_eval = plain.evaluate(eval_set)["eval_loss"]
    assert trainer.evaluate(eval_set)["eval_loss"] == pytest.approx(ref_eval, rel=1e-5)
    ref_pred = plain.predict(eval_set).predictions
    pred = trainer.predict(eval_set).predictions
    assert pred.shape == ref_pred.shape
    assert abs(pred - ref_pred).max() < 1e-4
    assert trainer.engine.memory_stats()["live_param_numel"] == 0


def test_resume_from_checkpoint_continues_with_identical_losses(tmp_path):
    args = dict(save_strategy="steps", save_steps=5)
    full = InfinityTrainer(
        model=_model(),
        args=_args(tmp_path / "full", **args),
        train_dataset=_dataset(),
        infinity_config=INFINITY,
    )
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-5"
    assert (ckpt / ENGINE_TAG).is_dir() and (ckpt / "config.json").is_file()
    # The checkpoint's weights are a Hugging Face directory as well.
    transformers.AutoModelForCausalLM.from_pretrained(ckpt)

    resumed = InfinityTrainer(
        model=_model(),
        args=_args(tmp_path / "again", **args),
        train_dataset=_dataset(),
        infinity_config=INFINITY,
    )
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.engine.global_steps == STEPS
    # The history holds the checkpoint's five steps, then the five run now: all identical.
    assert _logs(resumed, "loss") == _logs(full, "loss")
    assert _logs(resumed, "grad_norm") == _logs(full, "grad_norm")
    assert _logs(resumed, "learning_rate") == _logs(full, "learning_rate")


def test_the_engines_own_schedule_takes_its_auto_values_from_the_arguments(tmp_path):
    cfg = {**INFINITY, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}}}
    trainer = InfinityTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_dataset(), infinity_config=cfg
    )
    trainer.train()
    params = trainer.engine.lr_schedule.params
    assert params["total_num_steps"] == STEPS and params["warmup_num_steps"] == 3
    lrs = _logs(trainer, "learning_rate")
    assert lrs == [trainer.engine.lr_schedule.lr_at(s) for s in range(STEPS)]
    assert max(lrs) == pytest.approx(1e-2)


def test_auto_values_are_filled_and_conflicts_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "zero_optimization": {"stage": 3},
    }))  # fmt: skip
    trainer = InfinityTrainer(
        model=_model(), args=_args(tmp_path, adam_beta2=0.95), infinity_config=path
    )
    cfg = trainer.infinity_config
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_batch_size"] == 4 and cfg["gradient_clipping"] == 0.5
    assert cfg["optimizer"]["params"]["lr"] == 1e-2
    assert cfg["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.01  # left out: the Trainer's
    # An infinity.Config: values equal to its defaults count as not given, not as conflicts.
    typed = InfinityTrainer(
        model=_model(), args=_args(tmp_path), infinity_config=infinity.Config.load(INFINITY)
    )
    assert typed.infinity_config["gradient_clipping"] == 0.5
    assert typed.infinity_config["zero_optimization"]["stage3_max_live_parameters"] == 6000

    bad = copy.deepcopy(INFINITY)
    bad.update(train_micro_batch_size_per_gpu=4, gradient_clipping=1.0)
    with pytest.raises(ValueError) as err:
        InfinityTrainer(model=_model(), args=_args(tmp_path), infinity_config=bad)
    text = str(err.value)
    want = "train_micro_batch_size_per_gpu=4 vs TrainingArguments per_device_train_batch_size=2"
    assert want in text
    assert "gradient_clipping=1.0" in text and "max_grad_norm=0.5" in text and '"auto"' in text


def test_missing_config_and_foreign_checkpoints_are_refused(tmp_path):
    with pytest.raises(TypeError, match="infinity_config"):
        InfinityTrainer(model=_model(), args=_args(tmp_path))
    trainer = InfinityTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_dataset(), infinity_config=INFINITY
    )
    foreign = tmp_path / "checkpoint-3"
    foreign.mkdir()
    with pytest.raises(ValueError, match="not written by InfinityTrainer"):
        trainer.train(resume_from_checkpoint=str(foreign))


def test_a_model_built_under_init_trains_like_the_plain_trainer(tmp_path, plain):
    """A model too large for from_pretrained: built by its transformers class under
    infinity.init with its weights streamed into the partitions, then handed to the Trainer."""
    from infinity.models import hf_auto

    _model().save_pretrained(tmp_path / "base")
    auto = {**INFINITY, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    model = hf_auto.from_pretrained(tmp_path / "base", auto)
    trainer = InfinityTrainer(
        model=model, args=_args(tmp_path / "o"), train_dataset=_dataset(), infinity_config=auto
    )
    trainer.train()
    assert _rel(_logs(trainer, "loss"), _logs(plain, "loss")) < 1e-5


def test_the_trainers_activation_checkpointing_runs_on_the_engine(tmp_path, plain):
    args = _args(tmp_path, max_steps=3, activation_checkpointing=True)
    trainer = InfinityTrainer(
        model=_model(), args=args, train_dataset=_dataset(), infinity_config=INFINITY
    )
    trainer.train()
    assert trainer.model.is_activation_checkpointing
    losses = _logs(trainer, "loss")
    ref = _logs(plain, "loss")[:3]
    assert max(abs(a - b) / b for a, b in zip(losses, ref, strict=True)) < 1e-5


def test_nvme_offload_trains_like_ram_and_end_removes_the_swap_files(tmp_path, plain):
    nvme = tmp_path / "ssd"
    nvme.mkdir()
    cfg = copy.deepcopy(INFINITY)
    cfg["zero_optimization"].update(
        offload_optimizer={"device": "nvme", "nvme_path": str(nvme)},
        offload_param={"device": "nvme", "nvme_path": str(nvme)},
        sub_group_size=10_000,
    )
    trainer = InfinityTrainer(
        model=_model(), args=_args(tmp_path / "o", max_steps=3), train_dataset=_dataset(),
        infinity_config=cfg,
    )  # fmt: skip
    trainer.train()
    assert [p for p in nvme.rglob("*") if p.is_file()]  # the swap files are in use
    ref = _logs(plain, "loss")[:3]
    assert max(abs(a - b) / b for a, b in zip(_logs(trainer, "loss"), ref, strict=True)) < 1e-5
    trainer.save_model(tmp_path / "saved")  # read back from NVMe, one tensor at a time
    trainer.end()
    assert not [p for p in nvme.rglob("*") if p.is_file()]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")


# fp16 from a loss scale of 2^24: the first steps overflow (each halves the scale) and are
# skipped, the later ones step.
FP16 = {**INFINITY, "fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}}


class _Skips(transformers.TrainerCallback):
    """Whether the engine skipped each optimizer step, in order."""

    def __init__(self, trainer):
        self.trainer, self.skipped = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        self.skipped.append(self.trainer.engine.was_step_skipped)


def _fp16_trainer(out, **kw):
    trainer = InfinityTrainer(
        model=_model(), args=_args(out, fp16=True, **kw), train_dataset=_dataset(),
        infinity_config=FP16,
    )  # fmt: skip
    skips = _Skips(trainer)
    trainer.add_callback(skips)
    return trainer, skips


def test_a_step_skipped_on_fp16_overflow_does_not_advance_the_trainers_schedule(tmp_path):
    trainer, skips = _fp16_trainer(tmp_path)
    trainer.train()
    skipped = sum(skips.skipped)
    assert 0 < skipped < STEPS and skips.skipped[0]  # both kinds of step happened
    assert trainer.engine.skipped_steps == skipped
    # Every step counts for the Trainer (as with DeepSpeed): the run is still max_steps long.
    assert trainer.state.global_step == trainer.engine.global_steps == STEPS
    # The lr of each step is the schedule's at the number of steps taken before it.
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    ref = transformers.get_scheduler(
        "linear", ref_opt, num_warmup_steps=3, num_training_steps=STEPS
    )
    want = []
    for was_skipped in skips.skipped:
        want.append(ref.get_last_lr()[0])
        if not was_skipped:
            ref_opt.step()  # (no gradient: only the order torch expects)
            ref.step()
    assert _logs(trainer, "learning_rate") == pytest.approx(want, rel=1e-12)
    assert max(want) > 0.0  # the run got past the warmup's lr of 0
    # What a checkpoint saves of the Trainer's scheduler: the steps taken, not the calls.
    assert trainer.lr_scheduler.state_dict()["last_epoch"] == STEPS - skipped


def test_resume_amid_fp16_overflows_continues_with_identical_steps(tmp_path):
    full, full_skips = _fp16_trainer(tmp_path / "full", save_strategy="steps", save_steps=3)
    full.train()
    assert full_skips.skipped[2] and not all(full_skips.skipped)  # saved while skipping
    resumed, skips = _fp16_trainer(tmp_path / "again", save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert skips.skipped == full_skips.skipped[3:]
    assert resumed.engine.skipped_steps == full.engine.skipped_steps
    assert resumed.engine.loss_scale == full.engine.loss_scale
    assert _logs(resumed, "loss") == _logs(full, "loss")
    assert _logs(resumed, "learning_rate") == _logs(full, "learning_rate")
    assert [repr(n) for n in _logs(resumed, "grad_norm")] == [
        repr(n) for n in _logs(full, "grad_norm")
    ]  # inf / nan on the skipped steps


def test_accelerates_grad_scaler_does_not_scale_the_loss_a_second_time(tmp_path, monkeypatch):
    """On a GPU, fp16 makes accelerate create a GradScaler (not on the CPU: here one is put
    in as accelerate would); the engine's loss scale is the only one, so the run is the same."""
    plain, _ = _fp16_trainer(tmp_path / "plain", max_steps=6)
    plain.train()
    made = transformers.Trainer.create_accelerator_and_postprocess

    def with_scaler(self):
        made(self)
        self.accelerator.scaler = torch.amp.GradScaler("cpu")

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", with_scaler)
    scaled, _ = _fp16_trainer(tmp_path / "scaled", max_steps=6)
    scaled.train()
    assert scaled.accelerator.scaler is None
    assert _logs(scaled, "loss") == _logs(plain, "loss")
    assert [repr(n) for n in _logs(scaled, "grad_norm")] == [
        repr(n) for n in _logs(plain, "grad_norm")
    ]
    assert scaled.engine.loss_scale == plain.engine.loss_scale


@pytest.mark.parametrize("optim", ["adafactor", "sgd", "lion_32bit"])
def test_an_optimizer_name_the_engine_does_not_run_is_refused_with_the_list(tmp_path, optim):
    """The Trainer's optim names what steps the weights; the engine steps them with AdamW,
    so any other name would be dropped: it is refused, listing the names that run."""
    with pytest.raises(ValueError, match=f"optim='{optim}'") as info:
        InfinityTrainer(
            model=_model(),
            args=_args(tmp_path, optim=optim),
            train_dataset=_dataset(),
            infinity_config=INFINITY,
        )
    assert "'adamw_torch', 'adamw_torch_fused'" in str(info.value)


def test_the_optimizer_names_the_engine_runs_train_alike(tmp_path):
    """adamw_torch (named) and adamw_torch_fused (the Trainer's default) are one update."""
    losses = []
    for optim in ("adamw_torch", "adamw_torch_fused"):
        args = _args(tmp_path / optim, optim=optim, max_steps=3)
        trainer = InfinityTrainer(
            model=_model(), args=args, train_dataset=_dataset(), infinity_config=INFINITY
        )
        assert trainer.infinity_config["optimizer"]["type"] == "AdamW"
        trainer.train()
        trainer.end()
        losses.append(_logs(trainer, "loss"))
    assert losses[0] == losses[1] and len(losses[0]) == 3
