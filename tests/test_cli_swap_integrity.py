"""One byte changed in a live swap file between two steps of `infinity train --nvme` stops
the run with one error naming the file, the bytes and what to do, before the byte is trained
on: in the parameters' file and in the optimizer state's, at an extent's first byte, in the
middle of a page and at its last byte ([Note: full sums] in infinity/io/checksum.py)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from _train_inputs import TINY, train_args, write_byte_tokenizer

from infinity.checkpoint import list_checkpoints
from infinity.cli.main import main
from infinity.engine import Engine
from infinity.models import LlamaConfig, LlamaForCausalLM, export_hf
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.param_tier import NvmeParamTier

pytestmark = pytest.mark.usefixtures("quiet_root_logger")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("swap_integrity")
    torch.manual_seed(0)
    export_hf(LlamaForCausalLM(LlamaConfig(**TINY)).state_dict().items(), LlamaConfig(**TINY),
              root / "model", dtype="fp32")  # fmt: skip
    write_byte_tokenizer(root / "model")
    data = root / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    config = root / "config.json"  # many small optimizer sub-groups: most are not read ahead
    config.write_text(json.dumps({"zero_optimization": {"sub_group_size": 2000}}))
    return root / "model", data, config


def _flip_after_step_one(monkeypatch, kind: str, at) -> list:
    """After the first optimizer step, change one bit of byte `at(extent)` of a live extent:
    the embedding's in the parameters' file ("param"; 33,280 bytes, not a whole number of
    pages), or the last optimizer sub-group's ("optim"; not read ahead). Returns the
    flipped (path, offset) once done."""
    tiers = {}
    inits = {"param": NvmeParamTier.__init__, "optim": NvmeStateTier.__init__}
    step = Engine.step

    def recording(k):
        def init(self, *a, **kw):
            inits[k](self, *a, **kw)
            tiers[k] = self

        return init

    def flipping_step(self, **kw):
        step(self, **kw)
        if self.global_steps == 1 and not flipped:
            if kind == "param":
                ext = tiers["param"].layout("model.embed_tokens.weight").extent
            else:
                ext = tiers["optim"]._extents[-1]
            fd = os.open(ext.path, os.O_RDWR)
            offset = ext.offset + at(ext)
            os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x20]), offset)
            os.close(fd)
            flipped.append((ext.path, offset))

    flipped: list = []
    monkeypatch.setattr(NvmeParamTier, "__init__", recording("param"))
    monkeypatch.setattr(NvmeStateTier, "__init__", recording("optim"))
    monkeypatch.setattr(Engine, "step", flipping_step)
    return flipped


@pytest.mark.parametrize("kind", ["param", "optim"])
@pytest.mark.parametrize(
    "at",
    [lambda e: 0, lambda e: e.nbytes // 2 // 4096 * 4096 + 1500, lambda e: e.nbytes - 1],
    ids=["first-byte", "mid-page", "last-byte"],
)
def test_a_byte_changed_between_steps_stops_the_run(tmp_path, inputs, monkeypatch, capsys,
                                                    kind, at):  # fmt: skip
    model, data, config = inputs
    nvme, save = tmp_path / "nvme", tmp_path / "run"
    nvme.mkdir()
    flipped = _flip_after_step_one(monkeypatch, kind, at)
    argv = train_args(model, data, save, "--config", config, nvme=nvme, steps=3, save_every=1)
    code = main(argv)
    err = capsys.readouterr().err
    assert flipped, "the run never reached its first step"
    ((path, offset),) = flipped
    assert code == 1 and "Traceback" not in err, err
    assert f"of {path})" in err and "read back other bytes than were written" in err
    lo, hi = map(int, re.search(r"file bytes \[(\d+), (\d+)\)", err).groups())
    assert lo <= offset < hi and hi - lo <= 16 << 10  # the changed 16 KiB is named
    assert "resume from the last checkpoint" in err
    # Nothing after the change was saved (step 1's save may itself be what reads it back).
    assert set(list_checkpoints(save)) <= {"step1"}
