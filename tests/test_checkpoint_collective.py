"""A checkpoint saved by several ranks at once: shards in parallel, a failure on any rank
fails the save on every rank, named, with the previous checkpoint still the latest."""

from __future__ import annotations

import errno
import threading

import torch

from infinity.checkpoint import latest_tag, load_checkpoint, save_checkpoint
from infinity.checkpoint.collective import save_on_all_ranks


class ThreadComm:
    """Ranks as threads of one process: what the save needs of a communicator."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank = rank
        self.world_size = shared["world"]
        self._shared = shared

    def all_gather_object(self, obj):
        box, barrier = self._shared["box"], self._shared["barrier"]
        box[self.rank] = obj
        barrier.wait(timeout=10)
        out = list(box)
        barrier.wait(timeout=10)
        return out


def _run_ranks(world: int, body) -> list:
    shared = {"world": world, "box": [None] * world, "barrier": threading.Barrier(world)}
    results: list = [None] * world

    def run(rank):
        try:
            results[rank] = body(ThreadComm(rank, shared))
        except BaseException as exc:  # the test looks at each rank's outcome
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def _tensors(rank: int):
    return [("x", torch.full((3,), float(rank))), ("y", torch.arange(rank + 1.0))]


def test_every_rank_writes_its_shard(tmp_path):
    out = _run_ranks(
        3,
        lambda c: save_on_all_ranks(
            tmp_path, _tensors(c.rank), comm=c, step=4, state={"k": 1}, tag="t"
        ),
    )
    assert all(p == tmp_path / "t" for p in out)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.world_size == 3 and ckpt.state == {"k": 1} and latest_tag(tmp_path) == "t"
    for rank in range(3):
        assert torch.equal(ckpt.get_tensor("y", rank), torch.arange(rank + 1.0))


def test_a_rank_failing_to_write_fails_the_save_everywhere(tmp_path):
    save_checkpoint(tmp_path, [("x", torch.ones(1))], step=1, tag="before")

    def tensors(rank):
        yield "x", torch.ones(2)
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    out = _run_ranks(
        2, lambda c: save_on_all_ranks(tmp_path, tensors(c.rank), comm=c, step=2, state={}, tag="t")
    )
    assert isinstance(out[1], OSError) and out[1].errno == errno.ENOSPC
    assert isinstance(out[0], OSError) and out[0].errno == errno.ENOSPC
    assert "failed on rank 1 while writing the shards" in str(out[0])
    assert "No space left on device" in str(out[0])
    assert latest_tag(tmp_path) == "before"
    assert not any(p.name.startswith(".tmp.") for p in tmp_path.iterdir())
    assert not (tmp_path / "t").exists()


def test_rank_zero_failing_to_begin_stops_the_others(tmp_path):
    save_checkpoint(tmp_path, [("x", torch.ones(1))], step=1, tag="t")  # `latest`: not replaced
    out = _run_ranks(
        2,
        lambda c: save_on_all_ranks(
            tmp_path, _tensors(c.rank), comm=c, step=2, state=None, tag="t"
        ),
    )
    assert isinstance(out[0], ValueError) and "is the latest" in str(out[0])
    assert isinstance(out[1], ValueError)
    assert "failed on rank 0 while beginning it" in str(out[1])


def test_one_rank_is_the_single_process_save(tmp_path):
    class One:
        rank, world_size = 0, 1

        def all_gather_object(self, obj):
            raise AssertionError("one rank needs no collective")

    a = save_on_all_ranks(tmp_path / "a", _tensors(0), comm=One(), step=1, state={}, tag="t")
    b = save_checkpoint(tmp_path / "b", _tensors(0), step=1, state={}, tag="t")
    assert (a / "rank00000.safetensors").read_bytes() == (b / "rank00000.safetensors").read_bytes()


def test_non_shared_save_dir_is_named(tmp_path):
    def body(c):
        where = tmp_path / ("zero" if c.rank == 0 else "other")
        return save_on_all_ranks(where, _tensors(c.rank), comm=c, step=1, state={}, tag="t")

    out = _run_ranks(2, body)
    assert isinstance(out[1], ValueError) and "file system they share" in str(out[1])
    assert isinstance(out[0], ValueError) and "failed on rank 1" in str(out[0])
    assert latest_tag(tmp_path / "zero") is None
