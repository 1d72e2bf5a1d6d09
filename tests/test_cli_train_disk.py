"""The disk space of an `infinity train` run: printed before it starts, counted as the run
really writes it, and a run on a disk without it refused before anything is built."""

from __future__ import annotations

import collections
import math
import re

import pytest
from _train_inputs import train_args, write_inputs

from infinity.checkpoint import load_checkpoint
from infinity.cli.main import main
from infinity.run import disk as train_disk


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("disk"))


def _args(model, data, save_dir, nvme, *extra):
    return train_args(
        model, data, save_dir, *extra, steps=2, nvme=nvme, grad_accum=None, lr=None, seed=None
    )


def test_the_need_is_printed_and_counts_what_the_run_saves(tmp_path, capsys, inputs):
    model, data = inputs
    save = tmp_path / "run"
    assert main(_args(model, data, save, tmp_path, "--lora-r", 4, "--save-every", 1)) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("disk: "))
    assert "parameters" in line and "optimizer states" in line and "2 checkpoint(s)" in line
    assert "free" in line
    ckpt = load_checkpoint(save)
    adapters = sum(
        math.prod(ckpt.get_tensor(n).shape) for n in ckpt.tensor_names() if n.startswith("param/")
    )
    shapes = {k: tuple(v) for k, v in ckpt.state["model"]["param_shapes"].items()}
    targets = ckpt.state["lora"]["resolved_targets"]
    assert train_disk.trainable_numel(shapes, 4, targets) == adapters
    assert train_disk.trainable_numel(shapes, None, None) == sum(
        math.prod(s) for s in shapes.values()
    )


def test_a_disk_without_room_is_refused_naming_both_numbers(tmp_path, capsys, inputs, monkeypatch):
    model, data = inputs
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(train_disk.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 50_000))
    save = tmp_path / "run"
    assert main(_args(model, data, save, tmp_path, "--lora-r", 4)) == 1
    err = capsys.readouterr().err
    assert "the run needs" in err and "only 0.05 MB are free" in err, err
    assert "larger disk" in err
    assert not list(tmp_path.glob("infinity-*")) and not (save / "latest").exists()


def test_plan_by_tier(tmp_path):
    from infinity.config import Config

    shapes = {"a.weight": (100, 50), "b.weight": (100,)}
    cfg = Config.load(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            },
        }
    )
    uses = train_disk.plan(cfg, shapes, trainable=5100, save_dir=tmp_path / "s", saves=3)
    parts = {k: v for u in uses for k, v in u.parts.items()}
    assert parts == {
        "parameters": 5100 * 2 + 2 * 4096,
        "trainable build files (while starting)": 5100 * 2,
        "optimizer states": 5100 * 12,
        "gradients": 5100 * 4,
        "3 checkpoint(s)": 3 * 5100 * 14,
    }
    lora = train_disk.plan(cfg, shapes, trainable=30, save_dir=tmp_path / "s", saves=1)
    parts = {k: v for u in lora for k, v in u.parts.items()}
    assert parts["parameters"] == (5100 + 30) * 2 + 2 * 4096  # the frozen base + adapters
    assert parts["1 checkpoint(s)"] == 30 * 14
    assert train_disk.check(lora, free=lambda p: 10**12).startswith("disk: ")


def test_a_resumed_runs_checkpoints_are_not_counted_twice(tmp_path):
    """A run resumed after a full disk was refused though it had room: the checkpoints it
    had saved were counted as still to be written, on top of the space they take."""
    from infinity.config import Config

    shapes, per = {"a.weight": (100, 50)}, 5000 * 14
    cfg = Config.load({"bf16": {"enabled": True}})

    def need(saved):
        uses = train_disk.plan(cfg, shapes, trainable=5000, save_dir=tmp_path, saves=3, saved=saved)
        return dict(uses[-1].parts)

    assert need((0, 0)) == {"3 checkpoint(s)": 3 * per}
    assert need((2, 2 * per)) == {"3 checkpoint(s), 2 of them there already": per}
    # more there than will be kept (an earlier, larger --keep-last): still room for one
    assert need((5, 5 * per)) == {"3 checkpoint(s), 5 of them there already": per}
    # what is there is measured from the save dir's complete checkpoints only
    for tag, nbytes in (("step1", 300), ("step2", 500)):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "checkpoint.json").write_text("{}")
        (tmp_path / tag / "rank00000.safetensors").write_bytes(b"\0" * nbytes)
    (tmp_path / ".tmp.step3").mkdir()  # an interrupted save is not a checkpoint
    (tmp_path / ".tmp.step3" / "rank00000.safetensors").write_bytes(b"\0" * 999)
    assert train_disk.checkpoints_on_disk(tmp_path) == (2, 300 + 500 + 2 * 2)


def test_a_short_disk_names_the_swap_left_by_runs_that_are_gone(tmp_path):
    """Killed runs leave their swap directories (only a clean exit removes them): a disk
    they fill is refused with what they hold and where, not only 'free space'."""
    import fcntl
    import os

    from infinity.config import Config

    gone = tmp_path / "infinity-pid1" / "rank0"  # a lock nobody holds: its run is gone
    gone.mkdir(parents=True)
    (gone / "lock").write_text("1")
    (gone / "optim.swp").write_bytes(b"\0" * 40_000)
    alive = tmp_path / "infinity-pid2" / "rank0"  # a lock held: a live run's, not named
    alive.mkdir(parents=True)
    fd = os.open(alive / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
        cfg = Config.load({"zero_optimization": {"stage": 3, "offload_optimizer": nvme}})
        uses = train_disk.plan(
            cfg, {"a.weight": (100, 50)}, trainable=5000, save_dir=tmp_path / "s", saves=1
        )
        with pytest.raises(ValueError) as err:
            train_disk.check(uses, free=lambda p: 0)
    finally:
        os.close(fd)
    msg = str(err.value)
    assert re.search(r"0\.0[4-9] MB there is held by swap directories of runs that are gone", msg)
    assert str(gone) in msg and str(alive) not in msg
