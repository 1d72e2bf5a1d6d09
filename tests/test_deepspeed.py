"""`infinity.deepspeed`: DeepSpeed scripts with one changed import. Each row of the porting
table in docs/deepspeed.md has a test here (tests/test_deepspeed_ranks.py: two ranks)."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch
from torch import nn

import infinity.deepspeed as deepspeed

LR = 1e-2


class Net(nn.Module):
    """Returns its loss, as DeepSpeed's getting-started model does. `wide` makes one weight
    bigger than the stage-3 persistence threshold, so stage 3 really gathers and releases."""

    def __init__(self, wide: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(8, wide)
        self.b = nn.Linear(wide, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def batches(n: int, size: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=g), torch.randn(size, 1, generator=g)) for _ in range(n)
    ]


def net(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def torch_losses(data, make_opt, make_sched=None, clip: float = 0.0) -> list[float]:
    model = net()
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    out = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        out.append(loss.item())
    return out


def train(engine, data) -> list[float]:
    out = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def adamw_config(**extra) -> dict:
    return {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        **extra,
    }


def test_getting_started_pattern_matches_torch_and_resumes_from_its_tag(tmp_path):
    # DeepSpeed's getting-started loop, as written for DeepSpeed, but for the import.
    config = adamw_config()
    del config["gradient_clipping"]  # as the getting-started config: DeepSpeed's default
    (tmp_path / "ds.json").write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    cmd_args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")])
    data = batches(6)
    model = net()
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=cmd_args, model=model, model_parameters=model.parameters()
    )
    losses = []
    for step, (x, y) in enumerate(data):
        loss = model_engine(x, y)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
        if step == 2:
            assert model_engine.save_checkpoint(tmp_path / "ck", "mid", client_state={"step": step})
    # The config names no gradient_clipping: DeepSpeed's default clips at norm 1.0.
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)  # noqa: E731
    assert losses == pytest.approx(torch_losses(data, adamw, clip=1.0), abs=1e-5)
    assert losses != pytest.approx(torch_losses(data, adamw), abs=1e-5)  # the clip mattered
    assert model_engine.gradient_clipping() == 1.0

    other = net(seed=7)  # different weights: the checkpoint must bring them back
    resumed, _, _, _ = deepspeed.initialize(args=cmd_args, model=other)
    path, client_sd = resumed.load_checkpoint(tmp_path / "ck", "mid")
    assert client_sd == {"step": 2} and path.endswith("mid")
    assert resumed.global_steps == 3 and resumed.global_samples == 12
    assert train(resumed, data[3:]) == pytest.approx(losses[3:], abs=1e-6)


def test_zero_offload_stage2_fp16_with_client_adamw_and_warmup_lr_learns():
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 5},
        },
        "zero_allow_untested_optimizer": True,
    }
    model = net()
    client = torch.optim.AdamW(model.parameters(), lr=0.02)
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=client, config=config)
    assert engine.fp16_enabled() and engine.zero_optimization_stage() == 2
    assert engine.gradient_accumulation_steps() == 2 and engine.train_batch_size() == 8
    data = batches(1)
    lrs, losses = [], []
    for _ in range(40):
        x, y = data[0]
        assert engine.is_gradient_accumulation_boundary() == (engine.micro_steps % 2 == 1)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    # The config's WarmupLR, answering as DeepSpeed's does (benchmarks/deepspeed_api_compare.py)
    assert sched.get_last_lr() == sched.get_lr() == engine.get_lr()
    applied = engine.global_steps - engine.skipped_steps
    assert applied > 10 and sched.last_batch_iteration == applied - 1
    sched.step()  # the engine's to take: changes nothing
    assert sched.last_batch_iteration == applied - 1 and sched.get_lr() == engine.get_lr()
    assert lrs[-1] == pytest.approx(0.02) and lrs[0] < 0.02
    assert losses[-1] < 0.5 * losses[0]


def test_zero_init_and_gathered_parameters_set_a_weight_the_next_forward_uses():
    config = adamw_config()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = net()
    with deepspeed.zero.GatheredParameters(model.b.weight, modifier_rank=0), torch.no_grad():
        model.b.weight.zero_()
    with deepspeed.zero.GatheredParameters([model.b.bias], modifier_rank=0), torch.no_grad():
        model.b.bias.fill_(0.5)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    x, y = batches(1)[0]
    with torch.no_grad():
        assert engine(x, y).item() == pytest.approx(((0.5 - y) ** 2).mean().item())


def _modify(model) -> None:
    with torch.no_grad():
        model.b.weight.zero_()
        model.a.weight.mul_(0.5)


@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 3},
        {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        {"stage": 3, "offload_optimizer": {"device": "nvme"}},
    ],
    ids=["stage3", "stage2-offload", "stage3-nvme-state"],
)
def test_gathered_parameters_after_initialize_read_and_write_reach_forward_and_step(zero, tmp_path):
    data = batches(5)
    if zero.get("offload_optimizer", {}).get("device") == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(tmp_path)
    model = net(wide=4096)
    engine, *_ = deepspeed.initialize(model=model, config=adamw_config(zero_optimization=zero))
    ref = net(wide=4096)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    losses, ref_losses = train(engine, data[:2]), []
    for x, y in data[:2]:
        ref_losses.append(ref(x, y).item())
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    host = dict(engine.named_parameters_host())
    before = [p.data_ptr() for p in model.parameters()]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # read only
        for name, p in model.named_parameters():
            assert torch.equal(p.detach().cpu(), host[name]), name
        model.b.bias.data.fill_(7.0)  # no modifier_rank: discarded
    with deepspeed.zero.GatheredParameters([model.a.weight, model.b.weight], modifier_rank=0):
        _modify(model)
    _modify(ref)
    assert [p.data_ptr() for p in model.parameters()] == before  # stubs / live buffers back
    x, y = data[2]
    with torch.no_grad():  # the next forward uses the new weights
        assert engine(x, y).item() == pytest.approx(ref(x, y).item(), abs=1e-6)
    losses += train(engine, data[2:])
    for x, y in data[2:]:  # AdamW continued from the modified weights, moments kept
        ref_losses.append(ref(x, y).item())
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    host = dict(engine.named_parameters_host())
    for name, p in ref.named_parameters():
        assert torch.allclose(host[name], p.detach(), atol=1e-5), name
    bad = deepspeed.zero.GatheredParameters(model.b.weight, modifier_rank=1)
    with pytest.raises(ValueError, match="modifier_rank=1 is not a rank of 1"):
        bad.__enter__()
    engine.close()


def test_client_lambda_lr_sets_the_lr_get_lr_returns_and_torch_reaches():
    def lam(step):
        return 1.0 / (1 + step)

    model = net()
    client = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lam)
    engine, opt, _, back = deepspeed.initialize(
        model=model,
        optimizer=client,
        lr_scheduler=sched,
        config={"train_batch_size": 4, "gradient_clipping": 0.0},
    )
    assert back is sched and engine.get_lr() == [LR]
    data = batches(4)
    got = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
        assert engine.get_lr() == [pytest.approx(LR * lam(engine.global_steps))]
        assert opt.param_groups[0]["lr"] == engine.get_lr()[0]
    ref = torch_losses(
        data,
        lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lam),
    )
    assert got == pytest.approx(ref, abs=1e-5)


def test_a_scheduler_callable_builds_on_the_configs_optimizer():
    engine, opt, _, sched = deepspeed.initialize(
        model=net(), config=adamw_config(),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )  # fmt: skip
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and engine.get_lr() == [LR]
    train(engine, batches(2))
    assert engine.get_lr() == [pytest.approx(LR / 4)] and opt.param_groups[0]["lr"] == LR / 4


def _stage_losses(stage: int, offload: str = "cpu") -> tuple[list[float], dict]:
    config = adamw_config(
        zero_optimization={"stage": stage, "offload_optimizer": {"device": offload}}
    )
    model = net(wide=200_000)  # a.weight: 1.6M elements, over the persistence threshold
    engine, *_ = deepspeed.initialize(model=model, config=config)
    losses = train(engine, batches(3))
    stats = engine.memory_stats()
    engine.close()
    return losses, stats


def test_stages_0_1_2_3_give_equal_losses_and_0_2_keep_every_parameter_resident():
    total = sum(p.numel() for p in net(wide=200_000).parameters())
    by_stage = {s: _stage_losses(s) for s in (0, 1, 2, 3)}
    for stage in (0, 1, 2):
        assert by_stage[stage][0] == by_stage[3][0]
        assert by_stage[stage][1]["live_param_numel"] == total  # resident between steps
    assert by_stage[3][1]["live_param_numel"] < total  # stage 3 released the wide layer


def test_stage_keys_that_make_no_sense_below_3_are_refused_or_ignored(caplog):
    nvme = {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ValueError, match="'nvme' needs stage 3.*DeepSpeed ignores the key"):
        deepspeed.initialize(model=net(), config=adamw_config(zero_optimization=nvme))
    keys = {"stage": 1, "stage3_max_live_parameters": 1000, "stage3_prefetch_bucket_size": 5}
    with caplog.at_level(logging.WARNING):
        engine, *_ = deepspeed.initialize(model=net(), config=adamw_config(zero_optimization=keys))
    assert "stage3_max_live_parameters: ignored at stage 1" in caplog.text
    assert "stage3_prefetch_bucket_size: ignored at stage 1" in caplog.text
    train(engine, batches(1))


def test_config_params_and_a_json_path_are_read_and_two_configs_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(adamw_config()))
    engine, *_ = deepspeed.initialize(model=net(), config_params=str(path))
    assert engine.train_batch_size() == 4
    args = argparse.Namespace(deepspeed_config=str(path))
    with pytest.raises(ValueError, match="both as args.deepspeed_config"):
        deepspeed.initialize(args=args, model=net(), config=adamw_config())
    with pytest.raises(ValueError, match="no DeepSpeed config"):
        deepspeed.initialize(model=net())


def test_client_adam_is_l2_decay_and_param_groups_skip_decay_as_torch_does():
    data = batches(4)

    def groups(m):
        return [
            {"params": [m.a.weight, m.b.weight], "weight_decay": 0.1},
            {"params": [m.a.bias, m.b.bias], "weight_decay": 0.0},
        ]

    for cls in (torch.optim.Adam, torch.optim.AdamW):
        model = net()
        client = cls(groups(model), lr=LR, betas=(0.8, 0.99), eps=1e-6)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=client, config={"train_batch_size": 4, "gradient_clipping": 0.0}
        )
        ref = torch_losses(
            data, lambda m, cls=cls: cls(groups(m), lr=LR, betas=(0.8, 0.99), eps=1e-6)
        )
        assert train(engine, data) == pytest.approx(ref, abs=1e-5), cls


def test_model_parameters_groups_and_left_out_parameters():
    model = net()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[model.b.weight, model.b.bias], config=adamw_config()
    )
    before = dict(engine.named_parameters_host())
    assert not model.a.weight.requires_grad  # in no group: frozen
    train(engine, batches(2))
    after = dict(engine.named_parameters_host())
    assert torch.equal(after["a.weight"], before["a.weight"])
    assert not torch.equal(after["b.weight"], before["b.weight"])


def test_unsupported_optimizers_are_refused_with_the_fix():
    model = net()
    with pytest.raises(ValueError, match="optimizer=SGD is not supported.*Adam or AdamW"):
        deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            config={"train_batch_size": 4, "gradient_clipping": 0.0},
        )  # fmt: skip
    with pytest.raises(ValueError, match="amsgrad=True"):
        deepspeed.initialize(
            model=net(), optimizer=torch.optim.Adam(net().parameters(), amsgrad=True),
            config={"train_batch_size": 4, "gradient_clipping": 0.0},
        )  # fmt: skip
    both = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="both to initialize.. and in the config"):
        deepspeed.initialize(model=net(), optimizer=both, config=adamw_config())


def test_training_data_gives_micro_batches_of_this_ranks_share():
    data = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1))
    engine, _, loader, _ = deepspeed.initialize(
        model=net(), training_data=data, config=adamw_config(dataloader_drop_last=True)
    )
    seen = [b[0] for b in loader]
    assert [len(b) for b in seen] == [4, 4]  # micro batch 4, the last 2 dropped
    assert loader.sampler.num_replicas == 1 and loader.sampler.rank == 0


def test_engine_names(tmp_path, caplog):
    engine, opt, _, _ = deepspeed.initialize(model=net(), config=adamw_config())
    assert engine.device == torch.device("cpu") and engine.local_rank == 0
    assert engine.global_rank == 0 and engine.world_size == engine.dp_world_size == 1
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.gradient_clipping() == 0.0 and engine.train_batch_size() == 4
    assert engine.module.training and not engine.eval().module.training
    assert engine.train().module.training
    assert engine.train_micro_batch_size_per_gpu() == 4 and engine.zero_optimization()
    train(engine, batches(2))
    assert engine.global_steps == 2 and engine.global_samples == 8
    assert engine.get_global_grad_norm() > 0 and not engine.was_step_skipped()
    assert engine.memory_stats()["world_size"] == 1  # the engine's own names pass through
    assert engine.load_checkpoint(tmp_path / "none") == (None, None)
    engine.save_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck" / "global_step2").is_dir()
    with caplog.at_level(logging.WARNING):
        assert engine.save_checkpoint(tmp_path / "ck", "keep", save_latest=False)
    assert "save_latest=False): ignored" in caplog.text
    assert engine.load_checkpoint(tmp_path / "ck", "global_step2")[0].endswith("global_step2")
    assert engine.load_checkpoint(tmp_path / "ck")[0].endswith("keep")  # the latest
    opt.zero_grad()
    with pytest.raises(NotImplementedError, match="engine.step"):
        opt.step()


def test_what_is_not_implemented_says_what_to_do():
    engine, *_ = deepspeed.initialize(model=net(), config=adamw_config())
    for call, fix in [
        (lambda: deepspeed.pipe, "data-parallel ranks only"),
        (lambda: deepspeed.moe, "mixture-of-experts"),
        (lambda: deepspeed.launcher, "torchrun"),
        (lambda: deepspeed.ops, "CPU-Adam runs inside the engine"),
        (lambda: deepspeed.checkpointing, "torch.utils.checkpoint"),
        (lambda: deepspeed.init_inference, "infinity generate"),
        (lambda: deepspeed.utils, "zero_to_fp32.*GatheredParameters"),
        (lambda: engine.backward(engine(*batches(1)[0]), retain_graph=True), "one forward"),
        (lambda: deepspeed.comm.all_gather, "torch.distributed"),
        (lambda: engine.train_batch, "pipeline"),
        (lambda: engine.no_sync().__enter__(), "stage 3's gradient partitioning"),
        (lambda: engine.load_checkpoint("x", load_module_only=True), "infinity export"),
        (lambda: engine.step(lr_kwargs={"a": 1}), "client torch lr scheduler"),
        (lambda: deepspeed.initialize(model=net(), config={}, mpu=object()), "data-parallel"),
    ]:
        with pytest.raises(NotImplementedError, match=fix):
            call()


def test_comm_calls_on_one_process():
    deepspeed.init_distributed()
    assert deepspeed.comm.get_rank() == 0 and deepspeed.comm.get_world_size() == 1
    assert deepspeed.comm.get_local_rank() == 0 and deepspeed.comm.is_initialized()
    t = torch.ones(3)
    deepspeed.comm.all_reduce(t, op=deepspeed.comm.ReduceOp.SUM)
    deepspeed.comm.barrier()
    assert torch.equal(t, torch.ones(3))
    with pytest.raises(ValueError, match="world_size=4 but the environment says 1"):
        deepspeed.init_distributed(world_size=4)


def test_fp16_float32_input_without_auto_cast_is_one_error_naming_the_key():
    config = adamw_config(fp16={"enabled": True})
    engine, *_ = deepspeed.initialize(model=net(), config=config)
    x, y = batches(1)[0]
    with pytest.raises(TypeError, match=r"argument\[0\] is a float32 tensor.*fp16.*auto_cast"):
        engine(x, y)
    loss = engine(x.half(), y.half())  # fp16 inputs run
    engine.backward(loss)
    engine.step()


def test_a_client_schedulers_state_resumes_with_the_checkpoint(tmp_path):
    def run(model, steps, load=False):
        client = torch.optim.AdamW(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=client,
            lr_scheduler=sched,
            config={"train_batch_size": 4, "gradient_clipping": 0.0},
        )
        if load:
            engine.load_checkpoint(tmp_path / "ck")
        losses = train(engine, steps)
        return engine, losses, [engine.get_lr()[0]]

    data = batches(4)
    _, whole, lr_whole = run(net(), data)
    first, _, _ = run(net(), data[:2])
    first.save_checkpoint(tmp_path / "ck")
    _, rest, lr_rest = run(net(seed=5), data[2:], load=True)
    assert rest == pytest.approx(whole[2:], abs=1e-6) and lr_rest == lr_whole == [LR / 16]


def test_model_parameters_groups_with_the_configs_optimizer_decay_as_torch():
    def groups(m):
        return [
            {"params": [m.a.weight, m.b.weight], "weight_decay": 0.1},
            {"params": [m.a.bias, m.b.bias], "weight_decay": 0.0},
        ]

    data = batches(4)
    model = net()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups(model), config=adamw_config()
    )
    ref = torch_losses(data, lambda m: torch.optim.AdamW(groups(m), lr=LR))
    assert train(engine, data) == pytest.approx(ref, abs=1e-5)


def test_model_parameters_take_single_tensor_groups_and_an_auto_decay():
    model = net()
    config = {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
    }
    config["optimizer"]["params"]["weight_decay"] = "auto"
    groups = [{"params": model.b.weight}, {"params": model.b.bias, "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["b.weight", "b.bias"]
    assert len(train(engine, batches(2))) == 2


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_at_stages_0_and_1_accumulates_as_without_it_and_refuses_a_step_inside(stage):
    # DeepSpeed's accumulation pattern: every micro batch but the last inside no_sync().
    config = adamw_config(
        train_batch_size=4, gradient_accumulation_steps=2, zero_optimization={"stage": stage}
    )
    data = batches(4, size=2)
    plain, *_ = deepspeed.initialize(model=net(), config=config)
    engine, *_ = deepspeed.initialize(model=net(), config=config)
    for i, (x, y) in enumerate(data):
        plain.backward(plain(x, y))
        plain.step()
        if i % 2 == 0:
            with engine.no_sync():
                engine.backward(engine(x, y))
                with pytest.raises(RuntimeError, match="inside no_sync"):
                    engine.step()
        else:
            engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == plain.global_steps == 2
    for a, b in zip(engine.module.parameters(), plain.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_training_dataloader_and_monitor_are_deepspeeds_attributes():
    data = [(torch.randn(8), torch.randn(1)) for _ in range(8)]
    engine, _, loader, _ = deepspeed.initialize(
        model=net(), config=adamw_config(), training_data=data
    )
    assert engine.training_dataloader is loader and len(loader) == 2
    bare, *_ = deepspeed.initialize(model=net(), config=adamw_config())
    assert bare.training_dataloader is None
    assert engine.monitor.enabled is False  # no monitor block: DeepSpeed's is off too
    engine.monitor.write_events([("Train/loss", 1.0, 0)])


@pytest.mark.parametrize(("kind", "fix"), [("OneCycle", "OneCycleLR"), ("LRRangeTest", "LambdaLR")])
def test_deepspeed_schedulers_not_run_here_are_refused_naming_the_torch_scheduler(kind, fix):
    config = adamw_config(scheduler={"type": kind, "params": {}})
    with pytest.raises(ValueError, match=rf"scheduler.type: DeepSpeed's '{kind}'.*lr_scheduler="):
        deepspeed.initialize(model=net(), config=config)
    with pytest.raises(ValueError, match=fix):
        deepspeed.initialize(model=net(), config=config)


def test_bf16_float32_input_is_one_error_naming_the_cast_not_a_dtype_mismatch_inside():
    # DeepSpeed 0.19.8 (and this engine before) stopped inside the first layer with
    # "mat1 and mat2 must have the same dtype, but got Float and BFloat16".
    engine, *_ = deepspeed.initialize(model=net(), config=adamw_config(bf16={"enabled": True}))
    x, y = batches(1)[0]
    with pytest.raises(TypeError, match=r"argument\[0\] is a float32 tensor.*bf16.*bfloat16"):
        engine(x, y)
    loss = engine(x.bfloat16(), y.bfloat16())  # bf16 inputs run
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1


def test_deepspeeds_checkpoint_and_data_types_blocks_are_read_not_unknown():
    # DeepSpeed 0.19.8 accepts both blocks; they were refused as "unknown key".
    for key, same, other in [
        ("checkpoint", {"tag_validation": "Warn"}, {"tag_validation": "Fail"}),
        ("data_types", {"grad_accum_dtype": "fp32"}, {"grad_accum_dtype": "bf16"}),
    ]:
        engine, *_ = deepspeed.initialize(model=net(), config=adamw_config(**{key: same}))
        train(engine, batches(1))
        with pytest.raises(ValueError, match=rf"{key}: a section is not supported by Infinity"):
            deepspeed.initialize(model=net(), config=adamw_config(**{key: other}))


def test_no_optimizer_anywhere_warns_what_steps_instead(caplog):
    # DeepSpeed 0.19.8 initializes, then refuses backward(): "must provide optimizer".
    with caplog.at_level(logging.WARNING):
        engine, *_ = deepspeed.initialize(model=net(), config={"train_batch_size": 4})
    assert "no optimizer" in caplog.text and "AdamW at lr 1e-3" in caplog.text
    assert engine.get_lr() == [1e-3]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        deepspeed.initialize(model=net(), config=adamw_config())
    assert "no optimizer" not in caplog.text
