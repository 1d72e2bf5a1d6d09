"""Write a safetensors file one tensor at a time, never holding more than one in memory.

The safetensors format puts a JSON header (names, dtypes, shapes, byte offsets) before the
data, so a writer that does not know every tensor up front reserves room for the header,
streams the data behind it, and fills the header in at the end, padded with spaces as the
format allows. If the header outgrows the room, the data is moved once (rare; see
`reserve_bytes`). Files are readable by `safetensors.safe_open` and every HF tool.

The writer also computes SHA-256 digests of the header and of the data section as it goes,
so checksumming costs no second pass. `file_digests()` recomputes them from a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable

import torch

from infinity.utils.fsio import fault_point

# safetensors dtype names.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_CHUNK_BYTES = 16 << 20


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (a view, no copy when contiguous)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(
            f"dtype {t.dtype} cannot be stored in safetensors here; "
            f"use one of {sorted(str(d) for d in DTYPE_NAMES)}"
        )
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class StreamingSafetensorsWriter:
    """Append tensors to a new safetensors file; `close()` writes the header and fsyncs.

    Not thread-safe. The file at `path` is created (truncated); callers that need atomicity
    write under a temporary name and rename (see infinity.checkpoint).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        metadata: dict[str, str] | None = None,
        reserve_bytes: int = 64 << 10,
        write: Callable[[int, memoryview], None] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._metadata = dict(metadata or {})
        self._reserve = max(1024, reserve_bytes + (-reserve_bytes) % 8)
        self._entries: dict[str, dict] = {}
        self._data_nbytes = 0
        self._data_hash = hashlib.sha256()
        self._file = open(self.path, "w+b")  # noqa: SIM115 - closed in close()/abort()
        self._file.seek(8 + self._reserve)
        self._closed = False
        self.header_sha256 = ""
        self.data_sha256 = ""
        self.nbytes = 0

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def data_nbytes(self) -> int:
        return self._data_nbytes

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor. Its bytes are written (and may be freed) before this returns."""
        if self._closed:
            raise ValueError(f"{self.path} is already closed; open a new writer")
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is not allowed; use a non-empty string")
        if name in self._entries:
            raise ValueError(
                f"tensor {name!r} was already written to {self.path}; names must be unique"
            )
        data = tensor_bytes(tensor)
        start = self._data_nbytes
        self._file.write(data)
        self._data_hash.update(data)
        self._data_nbytes += data.nbytes
        self._entries[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [start, self._data_nbytes],
        }
        fault_point(f"tensor:{os.path.basename(self.path)}:{name}")

    def _header(self) -> bytes:
        header = dict(self._entries)
        if self._metadata:
            header["__metadata__"] = self._metadata
        return json.dumps(header, separators=(",", ":")).encode()

    def close(self) -> None:
        """Write the header, fsync the file and record digests and size."""
        if self._closed:
            return
        header = self._header()
        if len(header) > self._reserve:
            self._grow_header(len(header))
        padded = header + b" " * (self._reserve - len(header))
        self._file.seek(0)
        self._file.write(struct.pack("<Q", len(padded)))
        self._file.write(padded)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._closed = True
        self.header_sha256 = hashlib.sha256(struct.pack("<Q", len(padded)) + padded).hexdigest()
        self.data_sha256 = self._data_hash.hexdigest()
        self.nbytes = 8 + len(padded) + self._data_nbytes
        fault_point(f"fsync:{os.path.basename(self.path)}")

    def _grow_header(self, needed: int) -> None:
        """Move the data section back so a header of `needed` bytes fits (copy from the end)."""
        new_reserve = needed + (-needed) % 8
        shift = new_reserve - self._reserve
        self._file.flush()
        end = 8 + self._reserve + self._data_nbytes
        pos = end
        while pos > 8 + self._reserve:
            n = min(_CHUNK_BYTES, pos - (8 + self._reserve))
            pos -= n
            chunk = os.pread(self._file.fileno(), n, pos)
            os.pwrite(self._file.fileno(), chunk, pos + shift)
        self._reserve = new_reserve

    def abort(self) -> None:
        """Close without finishing; the partial file is left for the caller to remove."""
        if not self._closed:
            self._file.close()
            self._closed = True


def file_digests(path: str | os.PathLike) -> tuple[str, str, int]:
    """(header_sha256, data_sha256, nbytes) of a safetensors file, read once in chunks."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is {len(prefix)} bytes long: too short for safetensors")
        (n,) = struct.unpack("<Q", prefix)
        header = f.read(n)
        header_hash = hashlib.sha256(prefix + header).hexdigest()
        data_hash = hashlib.sha256()
        total = 8 + len(header)
        while chunk := f.read(_CHUNK_BYTES):
            data_hash.update(chunk)
            total += len(chunk)
    return header_hash, data_hash.hexdigest(), total


_NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


class SafetensorsReader:
    """Read a safetensors file one tensor at a time with plain reads into fresh tensors.

    Why not `safetensors.safe_open`: it memory-maps the file, and every page a loader touches
    stays in the process's resident set until the file is closed, so streaming a 5 GB shard
    shows 5 GB of RSS. Here each tensor is read into its own buffer and nothing else stays.
    The header is checked against the file size, so a truncated file fails on open.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        try:
            self._parse_header()
        except BaseException:
            self._file.close()
            raise

    def _parse_header(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        prefix = self._file.read(8)
        bad = f"{self.path} is not a valid safetensors file"
        if len(prefix) < 8:
            raise ValueError(f"{bad}: {size} bytes is too short (truncated?)")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise ValueError(
                f"{bad}: header of {n} bytes exceeds the file size {size} (truncated?)"
            )
        try:
            header = json.loads(self._file.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{bad}: its header is not valid JSON ({exc})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        end = 0
        for name, e in header.items():
            if e.get("dtype") not in _NAME_DTYPES:
                raise ValueError(f"{bad}: tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
            end = max(end, e["data_offsets"][1])
        if self.data_start + end > size:
            raise ValueError(
                f"{self.path} is truncated: its header needs {self.data_start + end} bytes, the "
                f"file has {size}"
            )
        self._entries = dict(sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]))

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def byte_range(self, name: str) -> tuple[int, int]:
        """Where `name`'s bytes are in the file: [start, stop) from the file's first byte."""
        start, stop = self._entry(name)["data_offsets"]
        return self.data_start + start, self.data_start + stop

    def dtype(self, name: str) -> torch.dtype:
        return _NAME_DTYPES[self._entry(name)["dtype"]]

    def _entry(self, name: str) -> dict:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.path}") from None

    def get_flat_slice(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) of the flattened tensor, reading only those bytes.

        A rank loading its shard of a weight reads just its part, never the whole tensor.
        """
        e = self._entry(name)
        total = int(torch.Size(e["shape"]).numel())
        if start < 0 or numel < 0 or start + numel > total:
            raise ValueError(
                f"slice [{start}, {start + numel}) is outside {name!r} ({total} elements) in "
                f"{self.path}"
            )
        out = torch.empty(numel, dtype=_NAME_DTYPES[e["dtype"]])
        if numel:
            item = out.element_size()
            buf = memoryview(out.view(torch.uint8).numpy())
            offset = self.data_start + e["data_offsets"][0] + start * item
            if os.preadv(self._file.fileno(), [buf], offset) != numel * item:
                raise ValueError(f"{self.path} is truncated inside tensor {name!r}")
        return out

    def get_tensor(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        start, end = e["data_offsets"]
        out = torch.empty(e["shape"], dtype=_NAME_DTYPES[e["dtype"]])
        nbytes = out.numel() * out.element_size()
        if nbytes != end - start:
            raise ValueError(
                f"{self.path}: tensor {name!r} has {end - start} bytes for shape {e['shape']} "
                f"{e['dtype']}; the file is damaged"
            )
        if nbytes:
            buf = memoryview(out.view(-1).view(torch.uint8).numpy())
            got = os.preadv(self._file.fileno(), [buf], self.data_start + start)
            if got != nbytes:
                raise ValueError(f"{self.path} is truncated inside tensor {name!r}")
        return out
