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


KERNELS = checksum.KERNELS or ("none",)
SIZES = [0, 1, 7, 8, 9, 63, 255, 256, 257, 511, 4096, 16_383, 65_537, 200_003]


@needs_native
def test_the_kernels_include_the_table_and_auto_is_the_fastest():
    assert checksum.KERNELS[0] == "table"
    data = np.frombuffer(b"123456789", dtype=np.uint8)
    for kernel in (*checksum.KERNELS, "auto"):
        assert native.crc32c(data.ctypes.data, 9, 0, kernel) == 0xE3069283
    with pytest.raises(ValueError, match="'sse' is unknown"):
        native.crc32c(data.ctypes.data, 9, 0, "sse")


@needs_native
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 5])  # unaligned starts
def test_every_native_kernel_equals_the_twin(nbytes, offset, kernel):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes + offset, dtype=np.uint8)
    want = crc32c_reference(data[offset:].tobytes())
    address = data.ctypes.data + offset
    assert native.crc32c(address, nbytes, 0, kernel) == want
    for half in (nbytes // 2, 3, 300):  # continued from a CRC, split anywhere
        half = min(half, nbytes)
        first = native.crc32c(address, half, 0, kernel)
        assert native.crc32c(address + half, nbytes - half, first, kernel) == want


@needs_native
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("nbytes", [0, 100, 3 * 4096, 7 * 4096 + 5, 11 * 4096])
def test_chunk_sums_are_the_crc_of_each_chunk(nbytes, kernel):
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    out = np.empty(-(-nbytes // 4096), dtype=np.uint32)
    native.crc32c_chunks(data.ctypes.data, nbytes, 4096, out.ctypes.data, kernel)
    want = [crc32c_reference(data[k : k + 4096].tobytes()) for k in range(0, nbytes, 4096)]
    assert out.tolist() == want
    assert chunk_sums(torch.from_numpy(data), 4096, kernel=kernel).tolist() == want


@pytest.mark.parametrize("nbytes", [4096, 16 << 10, 100_003, (1 << 20) + 12])
def test_by_default_one_byte_changed_anywhere_is_found(nbytes):
    """Every byte is summed: the first, one mid-page, the last of the extent, whatever
    the extent's size."""
    sums, data = ExtentSums(), _buf(nbytes, 4)
    sums.written("f", 8192, data)
    for at in (0, 1, 2048 + 77, nbytes // 2 + 3, nbytes - 1):
        changed = data.clone()
        changed[at] ^= 0x10
        bad = _check(sums, "f", 8192, changed)
        assert bad is not None, f"a byte changed at {at} of {nbytes} went unseen"
        chunk = at // checksum.CHUNK_BYTES * checksum.CHUNK_BYTES
        assert bad.offset == 8192 + chunk and bad.want != bad.got
    assert _check(sums, "f", 8192, data) is None


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


def test_a_read_covering_part_of_a_chunk_checks_it_with_the_rest_read_from_the_file():
    """A parameter of 128 bytes read from the middle of a sub-group's record: its chunk is
    checked whole, the bytes outside the read taken from the file."""
    sums, disk = ExtentSums(chunk_bytes=4096), _buf(3 * 4096, 5)
    sums.written("f", 0, disk)
    asked = []

    def outside(at: int, nbytes: int) -> bytes:
        asked.append((at, nbytes))
        return disk.numpy()[at : at + nbytes].tobytes()

    read = disk[4096 + 1000 : 4096 + 1128].clone()
    expected = sums.expected("f", 4096 + 1000, 128)
    assert sums.verify(expected, 4096 + 1000, read, outside) is None
    assert asked == [(4096, 1000), (4096 + 1128, 4096 - 1128)]
    disk[4096 + 4000] ^= 1  # outside the read, inside its chunk: the chunk changed
    assert sums.verify(expected, 4096 + 1000, read, outside).offset == 4096
    read[5] ^= 1
    assert sums.verify(expected, 4096 + 1000, read, outside).offset == 4096
    assert sums.verify(expected, 4096 + 1000, read) is None  # nothing outside to read
    # A read past a whole chunk into part of the next checks both.
    disk[4096 + 4000] ^= 1
    read = disk[: 4096 + 10].clone()
    read[4096 + 3] ^= 1
    bad = sums.verify(sums.expected("f", 0, 4096 + 10), 0, read, outside)
    assert bad is not None and bad.offset == 4096


@pytest.mark.parametrize("native_path", [True, False], ids=["native", "twin"])
def test_crc32c_of_a_buffer_continues_and_equals_the_twin(monkeypatch, native_path):
    if native_path and not checksum.FAST_CRC32C:
        pytest.skip("infinity._aio is built without crc32c")
    monkeypatch.setattr(checksum, "_NATIVE", native_path and checksum.FAST_CRC32C)
    data = _buf(5001, 7)  # odd size: the kernels' tails
    whole = crc32c_reference(data.numpy().tobytes())
    assert checksum.crc32c(data) == whole
    assert checksum.crc32c(data[1234:], checksum.crc32c(data[:1234])) == whole
    assert checksum.crc32c(data.view(-1)[:0]) == 0
    check = torch.tensor(list(b"123456789"), dtype=torch.uint8)
    assert checksum.crc32c(check) == 0xE3069283  # CRC-32C's standard check value
