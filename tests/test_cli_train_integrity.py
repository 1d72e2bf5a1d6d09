"""`infinity train --nvme` when live swap state changes under the run: the next read of it
stops the run with an error naming the file and the offset, and the checkpoints written
before stay valid."""

from __future__ import annotations

import json
import os

import pytest
from _train_inputs import train_args, write_inputs

from infinity.checkpoint import load_checkpoint
from infinity.cli.main import main
from infinity.swap.nvme_state import NvmeStateTier


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("integrity"))


def test_a_zeroed_optimizer_swap_file_stops_the_run(tmp_path, capsys, monkeypatch, inputs):
    model, data = inputs
    nvme, save = tmp_path / "nvme", tmp_path / "run"
    nvme.mkdir()
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": 2000}}))
    zeroed = []
    real_sweep = NvmeStateTier.sweep

    def sweep(self, order=None):
        if not zeroed and _latest(save) == 2:
            # Between steps 2 and 3: zero the second half of the live optimizer swap file.
            (path,) = self.store.files("optim")
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.seek(size // 2)
                f.write(bytes(size - size // 2))
            zeroed.append(path)
        return real_sweep(self, order)

    monkeypatch.setattr(NvmeStateTier, "sweep", sweep)
    args = train_args(model, data, save, "--config", config, "--save-every", 1, steps=4,
                      nvme=nvme)  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err
    assert zeroed, "the test never reached step 3"
    assert "step 3 failed and was not saved" in err, err
    assert zeroed[0] in err and "read back other bytes than were written" in err, err
    assert "offset" in err and "resume" in err and "Traceback" not in err, err
    for step in (1, 2):  # the checkpoints written before are whole
        ckpt = load_checkpoint(save, f"step{step}")
        ckpt.verify()
        assert ckpt.state["engine"]["global_steps"] == step
    assert _latest(save) == 2
    assert not list(nvme.iterdir()), "the swap directory is removed"


def _latest(save) -> int:
    """The step of the checkpoint `latest` names in `save` (0 before the first)."""
    try:
        return int((save / "latest").read_text().strip().removeprefix("step"))
    except (FileNotFoundError, ValueError):
        return 0
