"""Engine checkpoints across world sizes: one rank's files as ever, several ranks' spans
loaded by one rank exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import Zoo, batches, config, train_steps

import infinity
from infinity.checkpoint import begin_save, load_checkpoint
from infinity.checkpoint.spans import rank_span, shard_numel


def _engine(model):
    cfg = config(stage3_param_persistence_threshold=20)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    return infinity.initialize(model, cfg)


def test_one_rank_saves_whole_tensors_in_their_shapes(tmp_path):
    engine = _engine(Zoo())
    train_steps(engine, batches(2, seed=1))
    engine.save_checkpoint(tmp_path, tag="a")
    ckpt = load_checkpoint(tmp_path, "a")
    assert ckpt.world_size == 1
    saved = dict(ckpt.tensors())
    for rec in engine.parts.records:
        assert saved[f"param/{rec.name}"].shape == rec.shape
        for field in ("master", "exp_avg", "exp_avg_sq"):
            assert saved[f"optim/{rec.name}.{field}"].shape == (rec.numel,)


def _as_ranks(src, dst, world: int) -> None:
    """Write checkpoint `src` again as `world` ranks would have saved it: each rank's shard
    holds its unpadded span of every tensor, the optimizer's slots are padded shards."""
    tensors = dict(src.tensors())
    pending = begin_save(dst, src.tag)
    for rank in range(world):
        spans = []
        for name, t in tensors.items():
            lo, hi = rank_span(t.numel(), world, rank)
            spans.append((name, t.reshape(-1)[lo:hi].clone()))
        pending.write_shard(rank, spans, rng_state=src.rng_state(0))
    state = copy.deepcopy(src.state)
    slots = state["optimizer"]["slots"]
    state["optimizer"]["slots"] = [[n, shard_numel(k, world)] for n, k in slots]
    pending.commit(step=src.step, state=state, world_size=world)


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_resumes_what_several_ranks_saved(tmp_path, world):
    torch.manual_seed(0)
    model = Zoo(lora=True)
    model.proj.base.requires_grad_(False)
    data = batches(8, seed=5)
    engine = _engine(copy.deepcopy(model))
    train_steps(engine, data[:4])
    engine.save_checkpoint(tmp_path / "one", tag="s", include_frozen=True)
    expected = train_steps(engine, data[4:])
    _as_ranks(load_checkpoint(tmp_path / "one", "s"), tmp_path / "many", world)

    resumed = _engine(Zoo(lora=True))  # other random weights: all must come from the files
    resumed.load_checkpoint(tmp_path / "many")
    assert train_steps(resumed, data[4:]) == expected
    for (n, a), (_, b) in zip(
        engine.named_parameters_host(), resumed.named_parameters_host(), strict=True
    ):
        assert torch.equal(a, b), n


def test_ranks_checkpoint_from_another_model_is_refused(tmp_path):
    engine = _engine(Zoo())
    engine.save_checkpoint(tmp_path / "one", tag="s")
    _as_ranks(load_checkpoint(tmp_path / "one", "s"), tmp_path / "two", 2)
    other = _engine(Zoo(n=2))
    with pytest.raises(ValueError, match="different model|slot"):
        other.load_checkpoint(tmp_path / "two")
