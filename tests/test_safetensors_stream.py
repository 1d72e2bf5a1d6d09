"""The streaming safetensors writer and reader, against the safetensors library."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from infinity.utils.safetensors_stream import (
    SafetensorsReader,
    StreamingSafetensorsWriter,
    file_digests,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def _tensors(n):
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        t = torch.randn(i % 5, 3 + i, generator=g) * 4
        out[f"t.{i}"] = t > 0 if DTYPES[i % 6] is torch.bool else t.to(DTYPES[i % 6])
    out["scalar"] = torch.tensor(3.5)
    return out


@pytest.mark.parametrize("reserve", [16, 1 << 16])  # 16: the header outgrows its room
def test_writer_output_reads_in_safetensors_and_our_reader(tmp_path, reserve):
    ts = _tensors(40)
    path = tmp_path / "a.safetensors"
    with StreamingSafetensorsWriter(path, metadata={"format": "pt"}, reserve_bytes=reserve) as w:
        for k, v in ts.items():
            w.add(k, v)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, v in ts.items():
            assert torch.equal(f.get_tensor(k), v), k
    with SafetensorsReader(path) as r:
        assert r.names() == list(ts)
        for k, v in ts.items():
            got = r.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    assert file_digests(path) == (w.header_sha256, w.data_sha256, w.nbytes)
    assert path.stat().st_size == w.nbytes


def test_reader_reads_library_files_and_rejects_damage(tmp_path):
    ts = _tensors(6)
    path = tmp_path / "lib.safetensors"
    save_file({k: v.contiguous() for k, v in ts.items()}, str(path))
    with SafetensorsReader(path) as r:
        assert all(torch.equal(r.get_tensor(k), v) for k, v in ts.items())
        flat = ts["t.3"].reshape(-1)
        for start, numel in [(0, 0), (0, flat.numel()), (5, 7), (flat.numel() - 1, 1)]:
            assert torch.equal(r.get_flat_slice("t.3", start, numel), flat[start : start + numel])
        with pytest.raises(ValueError, match="outside 't.3'"):
            r.get_flat_slice("t.3", 1, flat.numel())
        with pytest.raises(KeyError, match="'nope' is not in"):
            r.get_tensor("nope")
    raw = path.read_bytes()
    path.write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="is truncated"):
        SafetensorsReader(path)
    path.write_bytes(raw[:5])
    with pytest.raises(ValueError, match="too short"):
        SafetensorsReader(path)


def test_writer_rejects_duplicates_and_bad_names(tmp_path):
    with StreamingSafetensorsWriter(tmp_path / "x") as w:
        w.add("a", torch.ones(1))
        with pytest.raises(ValueError, match="already written"):
            w.add("a", torch.ones(1))
        with pytest.raises(ValueError, match="not allowed"):
            w.add("__metadata__", torch.ones(1))
        with pytest.raises(TypeError, match="cannot be stored"):
            w.add("c", torch.ones(1, dtype=torch.complex64))
