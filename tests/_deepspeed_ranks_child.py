"""One rank of tests/test_deepspeed_ranks.py: the same DeepSpeed script at ZeRO stages
0-3 over two gloo ranks, printing each stage's losses and the samples this rank drew."""

from __future__ import annotations

import json

import torch
from torch import nn

import infinity.deepspeed as deepspeed


def _gathered_parameters(rank: int) -> list[float]:
    """What rank 0 writes inside GatheredParameters(modifier_rank=0) reaches rank 1, and
    the next forward of both uses it."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.weight.fill_(2.0)
                model.bias.fill_(1.0)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    with torch.no_grad():
        y = engine(torch.ones(1, 4))
    engine.close()
    return y.flatten().tolist()


def _gathered_after_initialize(rank: int) -> dict:
    """After initialize: a read gives every rank the model's weights; rank 0's write reaches
    both ranks' next forward and step, which continue as torch AdamW from those weights
    (the reference sees the whole batch, each rank half of it)."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,  # the reference is unclipped torch AdamW
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    ref = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    losses, ref_losses, read_ok = [], [], True
    for i, (x, y) in enumerate(data):
        if i == 2:
            host = dict(engine.named_parameters_host())
            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                read_ok = all(torch.equal(p.data, host[n]) for n, p in model.named_parameters())
            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        model[2].weight.mul_(-1.0)
                        model[0].bias.fill_(0.25)
            with torch.no_grad():
                ref[2].weight.mul_(-1.0)
                ref[0].bias.fill_(0.25)
        loss = nn.functional.mse_loss(
            engine(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]
        )
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        deepspeed.comm.all_reduce(t)
        losses.append(t.item() / 2)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(ref_loss.item())
    engine.close()
    return {"read_ok": read_ok, "losses": losses, "ref_losses": ref_losses}


def main() -> None:
    deepspeed.init_distributed()
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    )
    rank = deepspeed.comm.get_rank()
    out = {"rank": rank, "gathered": _gathered_parameters(rank)}
    out["after_initialize"] = _gathered_after_initialize(rank)
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 200_000), nn.Tanh(), nn.Linear(200_000, 1))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage},
        }
        engine, _, loader, _ = deepspeed.initialize(model=model, config=config, training_data=data)
        losses, seen = [], []
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            t = loss.detach().clone()
            deepspeed.comm.all_reduce(t)
            losses.append(t.item())
            seen += x[:, 0].tolist()
        out[f"stage{stage}"] = losses
        out["seen"] = seen
        engine.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
