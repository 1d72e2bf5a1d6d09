"""Integrity through the real CLI: a merged export refuses a base whose tensor changed in the
middle of a shard (past the fingerprint's samples), and a resume refuses a checkpoint.json
whose step or data position was edited, and one without a checksum (an older save, or the sum
deleted) unless --accept-unverified-checkpoint says to load it anyway."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from _train_inputs import train_args, write_byte_tokenizer

from infinity.checkpoint import CheckpointUnverifiedError, layout, load_checkpoint
from infinity.cli.main import main
from infinity.models import LlamaConfig, LlamaForCausalLM, export_hf

pytestmark = pytest.mark.usefixtures("quiet_root_logger")

pytest.importorskip("peft")

# Large enough that the middle of its shard is far from the 64 KiB sampled at each end.
_CONFIG = dict(vocab_size=260, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
               bos_token_id=256, eos_token_id=257)  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_CONFIG))
    export_hf(model.state_dict().items(), LlamaConfig(**_CONFIG), root / "model", dtype="fp32")
    write_byte_tokenizer(root / "model")
    data = root / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return root / "model", data


def _digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _flip_in_the_middle(shard: Path) -> str:
    """Change one byte of the tensor at the middle of the shard's data; returns its name."""
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    middle = (len(raw) - 8 - n) // 2
    name, entry = next(
        (k, e)
        for k, e in header.items()
        if k != "__metadata__" and e["data_offsets"][0] <= middle < e["data_offsets"][1]
    )
    assert 64 << 10 < middle < len(raw) - 8 - n - (64 << 10)
    raw[8 + n + middle] ^= 0x40
    shard.write_bytes(bytes(raw))
    return name


def test_export_refuses_a_base_edited_in_the_middle_of_a_shard(tmp_path, inputs, capsys):
    model, data = inputs
    base = tmp_path / "base"
    base.mkdir()
    for p in model.iterdir():
        (base / p.name).write_bytes(p.read_bytes())
    save = tmp_path / "run"
    argv = train_args(base, data, save, steps=1, lora_r=2)
    assert main(argv) == 0
    assert main(["export", str(save), "--out", str(tmp_path / "ok")]) == 0
    (shard,) = base.glob("*.safetensors")
    name = _flip_in_the_middle(shard)
    capsys.readouterr()
    assert main(["export", str(save), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"tensor {name!r} in {shard} changed" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_edited_checkpoint_json_is_refused_on_resume(tmp_path, inputs, capsys):
    model, data = inputs
    save = tmp_path / "run"
    assert main(train_args(model, data, save, steps=2)) == 0
    meta_path = save / "step2" / layout.METADATA
    meta = json.loads(meta_path.read_text())
    meta["step"] = 1  # resumed as if true, it would run a step again
    meta["state"]["data"]["index"] = 0
    meta_path.write_text(json.dumps(meta, indent=1))
    before = _digest(save)
    capsys.readouterr()
    code = main(train_args(model, data, save, "--resume", steps=4))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert f"{meta_path} does not match its checksum" in err
    assert _digest(save) == before


def _strip_checksum(save: Path, tag: str, **edits) -> Path:
    """Delete checkpoint.json's own checksum (and apply `edits` to it): what an older
    Infinity wrote, or what anyone who edits it and drops the sum leaves."""
    meta_path = save / tag / layout.METADATA
    meta = json.loads(meta_path.read_text())
    del meta[layout.METADATA_SUM]
    meta.update(edits)
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta_path


def test_a_checkpoint_json_without_a_checksum_is_refused_unless_accepted(
    tmp_path, inputs, capsys, caplog
):
    model, data = inputs
    save = tmp_path / "run"
    assert main(train_args(model, data, save, steps=2)) == 0
    meta_path = _strip_checksum(save, "step2", step=1)  # resumed as is, step 2 would rerun
    before = _digest(save)
    flag = "--accept-unverified-checkpoint"
    for argv in (
        train_args(model, data, save, "--resume", steps=4),
        ["export", str(save), "--out", str(tmp_path / "out")],
        ["export", str(save / "step2"), "--out", str(tmp_path / "out")],
        ["generate", str(save), "--prompt", "the", "--byte-tokens", "--max-new-tokens", "2"],
    ):
        capsys.readouterr()
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert f"{meta_path} has no checksum (metadata_sha256)" in err, err
        assert flag in err and "Traceback" not in err
        assert _digest(save) == before and not (tmp_path / "out").exists()
    with pytest.raises(CheckpointUnverifiedError, match="accept_unverified=True"):
        load_checkpoint(save)
    # Accepted, it loads as it says: the user took its step on trust.
    with caplog.at_level(logging.WARNING):
        assert load_checkpoint(save, accept_unverified=True).step == 1
    assert "loaded unverified" in caplog.text
    assert main(["export", str(save), "--out", str(tmp_path / "out"), flag]) == 0
    assert main(train_args(model, data, save, "--resume", flag, steps=3)) == 0
    assert load_checkpoint(save).step == 3  # the new save carries its checksum again
