"""Which elements of a tensor each rank holds, and reading any span back from a checkpoint.

Owns the partitioning arithmetic as checkpoints see it ([Note: spans]) and `SpanReader`, which
assembles elements [lo, hi) of a saved tensor from whichever saved ranks hold them, so a
checkpoint written by W ranks loads under any other world size. It does not know the engine:
callers say which tensor, how many elements it has in full, and which span they want.

[Note: spans] The rule is the engine's (`infinity.zero.shard.shard_of`): world size W, rank
r, a tensor of N elements: the shard size is S = ceil(N / W) and rank r owns elements
[r*S, (r+1)*S) of the tensor flattened and zero-padded to W*S. Its unpadded span is
(min(r*S, N), min((r+1)*S, N)), empty for tiny tensors on high ranks. A rank's checkpoint
shard holds exactly its unpadded span of each tensor (flat; with W == 1 the tensor keeps its
shape, as single-process checkpoints always have), so the spans of ranks 0..W-1 laid end to
end are the whole tensor. A reader takes each saved rank's span from the lengths its file
holds, laid end to end, not from the rule: a checkpoint loads whatever alignment its shards
had (8-bit runs align shards to 256 elements, see `infinity.zero.shard`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from infinity.utils.safetensors_stream import SafetensorsReader
from infinity.zero.shard import shard_of


def shard_numel(numel: int, world_size: int, align: int = 1) -> int:
    """S = ceil(N / W) (rounded up to `align` with several ranks): the elements each rank's
    padded shard holds ([Note: spans])."""
    _check_world(world_size)
    if numel < 0:
        raise ValueError(f"a tensor cannot have {numel} elements")
    return shard_of(numel, world_size, 0, align).numel


def rank_span(numel: int, world_size: int, rank: int, align: int = 1) -> tuple[int, int]:
    """Rank `rank`'s unpadded span (lo, hi) of a tensor of `numel` elements."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    shard_numel(numel, world_size)  # the same checks of numel and world size
    return shard_of(numel, world_size, rank, align).span


def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")


class SpanReader:
    """Reads spans of saved tensors from a checkpoint saved by any number of ranks.

    Holds the shard files it has needed open until closed (a context manager), and reads only
    the bytes of the asked span from each (`get_flat_slice`), so a rank loading its shard of a
    weight never holds the whole weight.
    """

    def __init__(self, path: Path, shard_files: list[Path]) -> None:
        self.path = path
        self.world_size = len(shard_files)
        """The world size the checkpoint was saved with."""
        _check_world(self.world_size)
        self._files = shard_files
        self._open: dict[int, SafetensorsReader] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SpanReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def _reader(self, rank: int) -> SafetensorsReader:
        if rank not in self._open:
            self._open[rank] = self._stack.enter_context(SafetensorsReader(self._files[rank]))
        return self._open[rank]

    def saved_numel(self, key: str) -> int:
        """The elements of saved tensor `key` in full: its spans' lengths summed."""
        total = 0
        for rank in range(self.world_size):
            try:
                total += int(torch.Size(self._reader(rank).shape(key)).numel())
            except KeyError:
                raise ValueError(
                    f"checkpoint {self.path}: rank {rank}'s shard has no {key!r}"
                ) from None
        return total

    def read(
        self, key: str, numel: int, lo: int, hi: int, *, pad_to: int | None = None
    ) -> torch.Tensor:
        """Elements [lo, hi) of saved tensor `key` (N = `numel` elements in full), flat, in
        the saved dtype; zero-padded to `pad_to` elements when given (a padded shard)."""
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"span [{lo}, {hi}) is outside {key!r} ({numel} elements)")
        if pad_to is not None and pad_to < hi - lo:
            raise ValueError(f"pad_to {pad_to} is shorter than the span [{lo}, {hi})")
        saved = self.saved_numel(key)
        if saved != numel:
            raise ValueError(
                f"checkpoint {self.path}: its {self.world_size} rank(s) saved {saved} "
                f"elements of {key!r} in all, but the tensor has {numel}; it was saved from "
                "a different model"
            )
        pieces = []
        dtype = None
        b = 0
        for rank in range(self.world_size):  # the spans lie end to end ([Note: spans])
            reader = self._reader(rank)
            a, b = b, b + int(torch.Size(reader.shape(key)).numel())
            dtype = reader.dtype(key)
            start, stop = max(a, lo), min(b, hi)
            if start < stop:
                pieces.append(reader.get_flat_slice(key, start - a, stop - start))
            if b >= hi:
                break
        out = torch.zeros(hi - lo if pad_to is None else pad_to, dtype=dtype)
        at = 0
        for piece in pieces:
            out[at : at + piece.numel()] = piece
            at += piece.numel()
        return out


__all__ = ["SpanReader", "rank_span", "shard_numel"]
