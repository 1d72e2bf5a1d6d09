"""TRL's SFTTrainer on the engine (InfinitySFTTrainer) against the plain SFTTrainer: the same
logged losses and gradient norms over 10 steps of accumulation 2, on chat data with the loss
on the completions (prompt/completion, CPU offload) or the assistant turns (messages, NVMe),
through TRL's fused LM head; the same trained weights and evaluation loss."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _hf_models import hf_model, tokenizer
from test_integrations_hf import INFINITY, _logs

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' has it)")
datasets = pytest.importorskip("datasets")

from infinity.integrations.sft import InfinitySFTTrainer  # noqa: E402

STEPS = 10
# "role:\n" opens each turn and <|endoftext|> closes it; the assistant's turn (its closing
# token included) is marked for TRL's assistant-only loss.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|endoftext|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}"
)


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    monkeypatch.setenv("CI", "1")  # TRL's trainers ping their telemetry unless CI is set


def _tokenizer():
    tok = tokenizer(transformers)
    tok.chat_template = TEMPLATE
    return tok


def _rows(kind: str, n: int = 4 * STEPS, start: int = 0) -> list[dict]:
    rows = []
    for i in range(start, start + n):
        user = {"role": "user", "content": f"what is {i} plus {i % 7}?"}
        answer = {"role": "assistant", "content": f"the quick answer is {i + i % 7}"}
        if kind == "prompt_completion":
            rows.append({"prompt": [user], "completion": [answer]})
        else:
            more = [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "ok"}]
            rows.append({"messages": [user, answer, *more[: 2 * (i % 2)]]})
    return rows


def _args(out, kind: str):
    return trl.SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=0.5,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        bf16=False,  # SFTConfig's default is bf16; the parity is in fp32
        assistant_only_loss=kind == "messages",
    )


def _offload(kind: str, tmp_path) -> dict:
    if kind == "prompt_completion":
        offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    else:
        (tmp_path / "ssd").mkdir()
        nvme = str(tmp_path / "ssd")
        offload = {
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        }
    return {"zero_optimization": {**INFINITY["zero_optimization"], **offload}}


def _rel(a, b):
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize("kind", ["prompt_completion", "messages", "lora"])
def test_sft_matches_the_plain_sft_trainer(tmp_path, kind):
    """`lora`: prompt/completion data, a LoRA adapter made by SFTTrainer (peft_config)."""
    lora = kind == "lora"
    kind = "prompt_completion" if lora else kind
    data = datasets.Dataset.from_list(_rows(kind))
    common = dict(train_dataset=data, peft_config=_lora() if lora else None)
    plain = trl.SFTTrainer(
        model=hf_model(transformers, "llama"),
        args=_args(tmp_path / "plain", kind),
        processing_class=_tokenizer(),
        **common,
    )
    plain.train()
    ours = InfinitySFTTrainer(
        model=hf_model(transformers, "llama"),
        args=_args(tmp_path / "ours", kind),
        processing_class=_tokenizer(),
        infinity_config=_offload(kind, tmp_path),
        **common,
    )
    # The loss covers the completions / the assistant turns only.
    labels = torch.tensor(ours.train_dataset[0]["labels"])
    assert 0 < int((labels != -100).sum()) < labels.numel() // 2
    ours.train()

    engine = ours.engine
    assert engine.global_steps == STEPS  # the engine's optimizer made every step
    assert _rel(_logs(ours, "loss"), _logs(plain, "loss")) < 1e-5
    assert _rel(_logs(ours, "grad_norm"), _logs(plain, "grad_norm")) < 1e-5
    assert _logs(ours, "mean_token_accuracy")  # SFTTrainer's own metrics, from the fused head
    # The head was trained through the engine (its weights live in the engine's homes).
    trained = dict(engine.named_parameters_host())
    reference = dict(plain.model.named_parameters())
    assert trained.keys() == reference.keys()
    for name, p in reference.items():
        torch.testing.assert_close(trained[name].view(p.shape), p, rtol=1e-4, atol=1e-5)
    if not lora:  # a frozen base stays gathered between steps by design, the rest not
        assert engine.memory_stats()["live_param_numel"] == 0

    if kind == "prompt_completion" and not lora:  # evaluation: the fused head on the engine
        held_out = datasets.Dataset.from_list(_rows(kind, n=8, start=100))
        ref = plain.evaluate(held_out)["eval_loss"]
        assert ours.evaluate(held_out)["eval_loss"] == pytest.approx(ref, rel=1e-5)
    ours.end()


def test_an_optimizer_of_ones_own_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs= are not supported"):
        InfinitySFTTrainer(
            model=None, optimizer_cls_and_kwargs=(torch.optim.SGD, {}), infinity_config={}
        )


def test_importing_infinity_does_not_import_trl():
    code = "import sys, infinity, infinity.integrations.hf; assert 'trl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resume_from_a_checkpoint_gives_the_uninterrupted_losses(tmp_path):
    """SFTTrainer's checkpoints (and its model card) with the engine's state in them."""
    data = datasets.Dataset.from_list(_rows("prompt_completion"))
    args = _args(tmp_path / "run", "prompt_completion")
    args.save_strategy, args.save_steps = "steps", 5

    def trainer():
        return InfinitySFTTrainer(
            model=hf_model(transformers, "llama"),
            args=args,
            train_dataset=data,
            processing_class=_tokenizer(),
            infinity_config=_offload("prompt_completion", tmp_path),
        )

    whole = trainer()
    whole.train()
    losses = _logs(whole, "loss")
    checkpoint = tmp_path / "run" / "checkpoint-5"
    assert (checkpoint / "infinity").is_dir() and (tmp_path / "run" / "README.md").is_file()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert _logs(resumed, "loss")[5:] == losses[5:]


def test_an_optimizer_name_the_engine_does_not_run_is_refused(tmp_path):
    args = _args(tmp_path, "text")
    args.optim = "adafactor"
    with pytest.raises(ValueError, match="optim='adafactor'"):
        InfinitySFTTrainer(
            model=hf_model(transformers, "qwen2"),
            args=args,
            train_dataset=datasets.Dataset.from_list(_rows("text")),
            processing_class=_tokenizer(),
            infinity_config=INFINITY,
        )
