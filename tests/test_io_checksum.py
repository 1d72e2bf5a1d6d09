"""Checksums of extents: the native CRC-32C against its Python twin, and what `ExtentSums`
records and checks as writes cover whole, part of, or several recorded ranges."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from infinity.io import checksum
from infinity.io.checksum import ExtentSums, chunk_sums, crc32c_reference

native = pytest.importorskip("infinity._aio")
needs_native = pytest.mark.skipif(
    not hasattr(native, "crc32c"), reason="infinity._aio is built without crc32c"
)


def test_reference_has_the_standard_check_value():
    assert crc32c_reference(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c_reference(b"") == 0
    assert crc32c_reference(b"6789", crc32c_reference(b"12345")) == 0xE3069283


@needs_native
@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 63, 4096, 65537, 200_003])
@pytest.mark.parametrize("offset", [0, 1, 5])  # unaligned starts
def test_native_hardware_and_table_paths_equal_the_twin(nbytes, offset):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes + offset, dtype=np.uint8)
    want = crc32c_reference(data[offset:].tobytes())
    address = data.ctypes.data + offset
    assert native.crc32c(address, nbytes) == want
    assert native.crc32c(address, nbytes, 0, False) == want
    half = nbytes // 2
    assert native.crc32c(address + half, nbytes - half, native.crc32c(address, half)) == want


@needs_native
@pytest.mark.parametrize("hardware", [True, False])
@pytest.mark.parametrize("nbytes", [0, 100, 3 * 4096, 7 * 4096 + 5, 11 * 4096])
def test_chunk_sums_are_the_crc_of_each_chunk(nbytes, hardware):
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    out = np.empty(-(-nbytes // 4096), dtype=np.uint32)
    native.crc32c_chunks(data.ctypes.data, nbytes, 4096, out.ctypes.data, hardware)
    want = [crc32c_reference(data[k : k + 4096].tobytes()) for k in range(0, nbytes, 4096)]
    assert out.tolist() == want
    assert chunk_sums(torch.from_numpy(data), 4096).tolist() == want


def test_without_the_extension_zlib_stands_in(monkeypatch):
    monkeypatch.setattr(checksum, "_NATIVE", False)
    data = torch.arange(10_000, dtype=torch.int32)
    raw = data.numpy().tobytes()
    assert chunk_sums(data, 4096).tolist() == [
        zlib.crc32(raw[k : k + 4096]) for k in range(0, len(raw), 4096)
    ]


def _buf(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _check(sums: ExtentSums, path: str, offset: int, data: torch.Tensor):
    return sums.verify(sums.expected(path, offset, data.numel()), offset, data)


def test_a_read_of_what_was_written_passes_and_a_changed_byte_is_found():
    sums, disk = ExtentSums(chunk_bytes=1024, sample_bytes=4096), _buf(10_000, 0)
    sums.written("f", 500, disk[500:8000])
    assert _check(sums, "f", 500, disk[500:8000]) is None
    assert _check(sums, "f", 0, disk) is None  # a larger read checks the range inside it
    changed = disk.clone()
    changed[3000] ^= 1
    bad = _check(sums, "f", 0, changed)
    assert bad is not None and bad.offset == 500 + 2 * 1024 and bad.nbytes == 1024
    # A read of part of the range checks the chunks it covers whole only.
    assert _check(sums, "f", 3100, changed[3100:5000]) is None
    assert _check(sums, "f", 2548, changed[2548:3572]) is not None
    assert _check(sums, "g", 0, changed) is None  # another file: nothing recorded


def test_partial_writes_update_whole_chunks_and_forget_torn_ones():
    sums, disk = ExtentSums(chunk_bytes=1024, sample_bytes=4096), _buf(8192, 1)
    sums.written("f", 0, disk)
    new = _buf(2048, 2)
    disk[1024:3072] = new  # two whole chunks
    sums.written("f", 1024, new)
    assert _check(sums, "f", 0, disk) is None
    edit = _buf(100, 3)
    disk[5000:5100] = edit  # part of chunk 4: no longer checked until written whole
    sums.written("f", 5000, edit)
    disk[5050] ^= 1  # a change there goes unseen...
    assert _check(sums, "f", 0, disk) is None
    disk[7000] ^= 1  # ...one elsewhere does not
    assert _check(sums, "f", 0, disk).offset == 6144
    sums.forget("f", 6144, 10)
    assert _check(sums, "f", 0, disk) is None


def test_a_write_over_whole_records_replaces_them():
    sums = ExtentSums(chunk_bytes=1024, sample_bytes=4096)
    for k in range(4):
        sums.written("f", k * 3000, _buf(3000, k))
    disk = _buf(12_000, 9)
    sums.written("f", 0, disk)  # covers all four: one record now
    assert _check(sums, "f", 0, disk) is None
    assert len(sums._files["f"]) == 1


@pytest.mark.parametrize("native_path", [True, False])
def test_sampled_sums_cover_the_head_of_every_page(monkeypatch, native_path):
    if native_path and not checksum._NATIVE:
        pytest.skip("infinity._aio is built without crc32c_chunks")
    monkeypatch.setattr(checksum, "_NATIVE", native_path)
    data = np.random.default_rng(3).integers(0, 256, 5 * 4096 + 300, dtype=np.uint8)
    got = chunk_sums(data, 8192, 64).tolist()
    # The CRC of the heads, chained: the twin's CRC-32C natively, zlib's CRC-32 without.
    heads = [
        b"".join(
            data[k + p : k + p + 64].tobytes() for p in range(0, 8192, 4096) if k + p < data.size
        )  # fmt: skip
        for k in range(0, data.size, 8192)
    ]
    crc = crc32c_reference if native_path else zlib.crc32
    assert got == [crc(h) for h in heads]
    sums = ExtentSums(chunk_bytes=8192, sample_bytes=64)
    disk = torch.from_numpy(data.copy())
    sums.written("f", 0, disk)
    disk[4096 + 300] ^= 1  # past the sampled head of its page: not covered
    assert _check(sums, "f", 0, disk) is None
    disk[2 * 4096 + 10] ^= 1  # in a head: found
    assert _check(sums, "f", 0, disk).offset == 8192
