"""`infinity.deepspeed` with a client optimizer of several parameter groups: each group's
lr, betas, eps and weight decay, and a per-group lr schedule, as torch steps them, on the
host and the NVMe state tiers, through a checkpoint (docs/deepspeed.md, porting table)."""

from __future__ import annotations

import pytest
import torch
from test_deepspeed import batches, net, torch_losses, train

import infinity.deepspeed as deepspeed

LAMBDAS = [lambda s: 1.0 / (1 + s), lambda s: 0.5**s, lambda s: 1.0 + 0.1 * s]


def groups(m):
    """Three groups: every hyperparameter differs."""
    return [
        {"params": [m.a.weight], "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8,
         "weight_decay": 0.1},
        {"params": [m.b.weight], "lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6,
         "weight_decay": 0.01},
        {"params": [m.a.bias, m.b.bias], "lr": 5e-2, "betas": (0.5, 0.9), "eps": 1e-4,
         "weight_decay": 0.0},
    ]  # fmt: skip


def zero_config(tier: str, tmp_path) -> dict:
    offload = {"device": "nvme" if tier == "split" else tier}
    if offload["device"] == "nvme":
        (tmp_path / "swap").mkdir(parents=True)
        offload["nvme_path"] = str(tmp_path / "swap")
    zero = {"stage": 3, "offload_optimizer": offload}
    if tier == "split":  # four sub-groups of one slot each: two in RAM, two on NVMe
        offload["max_in_cpu"] = 4096
        zero["sub_group_size"] = 2048
    return {"train_batch_size": 4, "gradient_clipping": 0.0, "zero_optimization": zero}


def ours(model, config, *, cls=torch.optim.AdamW):
    client = cls(groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(client, LAMBDAS)
    engine, opt, _, _ = deepspeed.initialize(
        model=model, optimizer=client, lr_scheduler=sched, config=config
    )
    return engine, opt


def _reference(data, cls=torch.optim.AdamW):
    return torch_losses(
        data, lambda m: cls(groups(m)), lambda o: torch.optim.lr_scheduler.LambdaLR(o, LAMBDAS)
    )


@pytest.mark.parametrize("tier", ["cpu", "nvme", "split"])
def test_groups_lr_betas_eps_decay_and_a_lambda_per_group_match_torch(tier, tmp_path):
    data = batches(5)
    engine, opt = ours(net(), zero_config(tier, tmp_path))
    store = {"cpu": "HostStateTier", "nvme": "NvmeStateTier", "split": "SplitStateTier"}
    assert type(engine.engine.parts.optimizer.state_tier).__name__ == store[tier]
    lrs = [g["lr"] for g in groups(net())]
    assert engine.get_lr() == lrs
    got = []
    for x, y in data:
        got += train(engine, [(x, y)])
        step = engine.global_steps
        want = [lr * lam(step) for lr, lam in zip(lrs, LAMBDAS, strict=True)]
        assert engine.get_lr() == pytest.approx(want) and len(opt.param_groups) == 3
    assert got == pytest.approx(_reference(data), abs=1e-5)


def test_client_adam_groups_are_l2_decay_per_group_as_torch():
    data = batches(4)
    engine, _ = ours(net(), {"train_batch_size": 4, "gradient_clipping": 0.0}, cls=torch.optim.Adam)
    assert train(engine, data) == pytest.approx(_reference(data, torch.optim.Adam), abs=1e-5)


@pytest.mark.parametrize("tier", ["cpu", "nvme", "split"])
def test_a_resume_continues_each_groups_lr_and_state_as_the_uninterrupted_run(tier, tmp_path):
    data = batches(6)
    whole_engine, _ = ours(net(), zero_config(tier, tmp_path / "a"))
    whole = train(whole_engine, data)
    first, _ = ours(net(), zero_config(tier, tmp_path / "b"))
    train(first, data[:3])
    first.save_checkpoint(tmp_path / "ck", "mid")
    resumed, _ = ours(net(seed=9), zero_config(tier, tmp_path / "c"))
    resumed.load_checkpoint(tmp_path / "ck", "mid")
    assert resumed.get_lr() == first.get_lr()
    assert train(resumed, data[3:]) == whole[3:]  # bit for bit
    assert resumed.get_lr() == whole_engine.get_lr()


def test_a_checkpoint_of_other_groups_is_refused_naming_the_fix(tmp_path):
    first, _ = ours(net(), {"train_batch_size": 4, "gradient_clipping": 0.0})
    train(first, batches(1))
    first.save_checkpoint(tmp_path / "ck")
    model = net()
    client = torch.optim.AdamW([{**g, "eps": 1e-3} for g in groups(model)])
    other, *_ = deepspeed.initialize(
        model=model, optimizer=client, config={"train_batch_size": 4, "gradient_clipping": 0.0}
    )
    with pytest.raises(ValueError, match="resume with the same parameter groups"):
        other.load_checkpoint(tmp_path / "ck")


def test_one_group_trains_with_the_same_bits_as_the_configs_optimizer():
    data = batches(4)
    model = net()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=client, config={"train_batch_size": 4, "gradient_clipping": 0.0}
    )
    config = {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }
    plain, *_ = deepspeed.initialize(model=net(), config=config)
    assert train(engine, data) == train(plain, data)
    for (n, p), (_, q) in zip(
        engine.named_parameters_host(), plain.named_parameters_host(), strict=True
    ):
        assert torch.equal(p, q), n


def test_model_parameters_groups_of_other_lrs_are_refused_naming_a_client_optimizer():
    model = net()
    config = {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    for key, value in (("lr", 0.1), ("eps", 1e-3), ("weight_decay", 0.5)):
        params = [{"params": [model.a.weight], key: value}, {"params": [model.b.weight]}]
        if key == "weight_decay":
            params[1]["weight_decay"] = 0.1
        with pytest.raises(ValueError, match="groups have .*pass a client torch.optim.AdamW"):
            deepspeed.initialize(model=model, model_parameters=params, config=config)
