"""Span arithmetic and reading spans of tensors saved by any number of ranks."""

import pytest
import torch

from infinity.checkpoint import begin_save, load_checkpoint
from infinity.checkpoint.spans import rank_span, shard_numel


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 64, 1001])
def test_spans_tile_the_tensor(numel, world):
    s = shard_numel(numel, world)
    assert s * world >= numel > (s - 1) * world or numel == 0
    spans = [rank_span(numel, world, r) for r in range(world)]
    assert spans[0][0] == 0 and spans[-1][1] == numel
    for (_, hi), (lo, _) in zip(spans, spans[1:], strict=False):
        assert hi == lo
    assert all(hi - lo <= s for lo, hi in spans)


def test_world_one_is_the_whole_tensor():
    assert shard_numel(10, 1) == 10 and rank_span(10, 1, 0) == (0, 10)


def test_tiny_tensor_leaves_high_ranks_empty():
    assert [rank_span(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert [rank_span(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world size"):
        shard_numel(4, 0)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        rank_span(4, 2, 2)


def _save_spans(path, tensors: dict[str, torch.Tensor], world: int, tag="t", align=1):
    """A checkpoint as `world` ranks write it: each rank its unpadded span of every tensor."""
    pending = begin_save(path, tag)
    for rank in range(world):
        entries = []
        for name, t in tensors.items():
            lo, hi = rank_span(t.numel(), world, rank, align)
            entries.append((name, t.reshape(-1)[lo:hi].clone() if world > 1 else t))
        pending.write_shard(rank, entries, rng_state=None)
    pending.commit(step=1, world_size=world)
    return load_checkpoint(path, tag)


@pytest.mark.parametrize("saved", [1, 2, 3])
@pytest.mark.parametrize("now", [1, 2, 4])
def test_any_span_reads_back_under_another_world_size(tmp_path, saved, now):
    tensors = {"w": torch.arange(21, dtype=torch.float32).reshape(3, 7), "b": torch.arange(2.0)}
    ckpt = _save_spans(tmp_path, tensors, saved)
    with ckpt.span_reader() as spans:
        assert spans.world_size == saved
        for name, t in tensors.items():
            n = t.numel()
            for rank in range(now):
                lo, hi = rank_span(n, now, rank)
                s = shard_numel(n, now)
                got = spans.read(name, n, lo, hi, pad_to=s)
                assert got.numel() == s
                torch.testing.assert_close(got[: hi - lo], t.reshape(-1)[lo:hi], rtol=0, atol=0)
                assert not got[hi - lo :].any()  # padding stays zero
            joined = spans.read(name, n, 0, n)
            torch.testing.assert_close(joined, t.reshape(-1), rtol=0, atol=0)


def test_reader_keeps_the_saved_dtype_and_reads_empty_spans(tmp_path):
    ckpt = _save_spans(tmp_path, {"h": torch.arange(3, dtype=torch.bfloat16)}, 4)
    with ckpt.span_reader() as spans:
        assert spans.read("h", 3, 1, 3).dtype == torch.bfloat16
        assert spans.read("h", 3, 3, 3).numel() == 0


def test_reader_refuses_a_different_model(tmp_path):
    ckpt = _save_spans(tmp_path, {"w": torch.arange(10.0)}, 2)
    with ckpt.span_reader() as spans:
        with pytest.raises(ValueError, match=r"2 rank\(s\) saved 10 elements of 'w' .* has 12"):
            spans.read("w", 12, 0, 12)
        with pytest.raises(ValueError, match="rank 0's shard has no 'v'"):
            spans.read("v", 10, 0, 10)
        with pytest.raises(ValueError, match=r"span \[4, 11\) is outside 'w'"):
            spans.read("w", 10, 4, 11)


def test_full_tensor_joins_the_ranks_with_the_saved_shape(tmp_path):
    w = torch.arange(21, dtype=torch.float32).reshape(3, 7)
    pending = begin_save(tmp_path, "t")
    for rank in range(2):
        lo, hi = rank_span(21, 2, rank)
        pending.write_shard(rank, [("param/w", w.reshape(-1)[lo:hi].clone())], rng_state=None)
    pending.commit(step=1, state={"engine": {"shapes": {"w": [3, 7]}}}, world_size=2)
    assert torch.equal(load_checkpoint(tmp_path, "t").full_tensor("param/w"), w)
    one = tmp_path / "one"
    pending = begin_save(one, "t")
    pending.write_shard(0, [("param/w", w)], rng_state=None)
    pending.commit(step=1, world_size=1)
    assert torch.equal(load_checkpoint(one, "t").full_tensor("param/w"), w)


@pytest.mark.parametrize("now", [1, 2, 3])
def test_spans_of_aligned_shards_read_back_under_any_world_size(tmp_path, now):
    """8-bit runs align shards to 256 elements: the reader takes the saved spans from the
    files, whatever rule cut them."""
    w = torch.arange(700, dtype=torch.float32)
    assert rank_span(700, 2, 0, 256) == (0, 512) and rank_span(700, 2, 1, 256) == (512, 700)
    ckpt = _save_spans(tmp_path, {"w": w}, 2, align=256)
    with ckpt.span_reader() as spans:
        for rank in range(now):
            lo, hi = rank_span(700, now, rank, 256)
            assert torch.equal(spans.read("w", 700, lo, hi), w[lo:hi])
