"""Packed fixed-length sequences in a deterministic shuffled order, with an exact position.

Sequence i is tokens[i*L : i*L + L + 1] (L = seq_len): inputs are its first L tokens and
labels its last L, so sequences share their boundary token and no token is wasted. Each
epoch visits every sequence once in an order drawn from (seed, epoch) alone, so the order
needs no state beyond `DataState(epoch, index)`, which a checkpoint stores and restores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(kw_only=True, slots=True)
class DataState:
    """Where the stream is: the next position `index` in epoch `epoch`'s order."""

    epoch: int = 0
    index: int = 0


class PackedDataset:
    """Batches of (input_ids, labels), each (micro_batch, seq_len) int64, in a seeded order.

    With `world_size` > 1, each global step takes micro_batch * world_size sequences and rank
    r gets its contiguous slice; all ranks share one DataState.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        source: str = "data",
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_sequences = self._count_sequences()
        if self.num_sequences == 0:
            raise ValueError(self._too_little(source))
        self.state = DataState()
        self.tokenizer = None
        """The tokenizer that produced `tokens`, when known (set by open_dataset)."""
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def _count_sequences(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def _too_little(self, source: str) -> str:
        return (
            f"{source} has {len(self.tokens)} tokens, fewer than one sequence needs "
            f"(seq_len + 1 = {self.seq_len + 1}); lower --seq-len or use more data"
        )

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of sequence indices for `epoch` (cached for the current one)."""
        if epoch != self._order_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._order = rng.permutation(self.num_sequences)
            self._order_epoch = epoch
        return self._order

    def sequence(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence `i`'s (inputs, labels), each (seq_len,): labels[t] follows inputs[t]."""
        seq = self.sequence(i)
        return seq[:-1], seq[1:]

    def positions(self, start: int, stop: int) -> np.ndarray | None:
        """Position ids of tokens [start, stop) when they are not simply 0, 1, 2, ... in each
        sequence (packed examples restart theirs); None for text."""
        return None

    def tail(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(inputs, labels) of the tokens past the last full sequence, each (T,) with
        T < seq_len, or None when they hold no label: what an evaluation pass reads after
        the sequences so that every token after the first is a label once."""
        rest = np.asarray(self.tokens[self.num_sequences * self.seq_len :], dtype=np.int64)
        return (rest[:-1], rest[1:]) if len(rest) >= 2 else None

    def _take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            order = self.order(self.state.epoch)
            k = min(n - len(out), self.num_sequences - self.state.index)
            out.extend(order[self.state.index : self.state.index + k].tolist())
            self.state.index += k
            if self.state.index == self.num_sequences:
                self.state.epoch += 1
                self.state.index = 0
        return out

    def next_batch(self, micro_batch: int, *, with_positions: bool = False) -> tuple:
        """This rank's next (input_ids, labels), each (micro_batch, seq_len); advances state.
        `with_positions`: also the position ids, (micro_batch, seq_len), or None where they
        are the plain 0, 1, 2, ... (`positions`)."""
        if micro_batch <= 0:
            raise ValueError(f"micro_batch must be positive, got {micro_batch}")
        picks = self._take(micro_batch * self.world_size)
        mine = picks[self.rank * micro_batch : (self.rank + 1) * micro_batch]
        inputs, labels = zip(*(self.pair(i) for i in mine), strict=True)
        batch = torch.from_numpy(np.stack(inputs)), torch.from_numpy(np.stack(labels))  # (B, L)
        return (*batch, self.batch_positions(mine)) if with_positions else batch

    def batch_positions(self, indices) -> torch.Tensor | None:
        """The position ids of sequences `indices`, (len, seq_len), or None (`positions`)."""
        L = self.seq_len
        rows = [self.positions(i * L, i * L + L) for i in indices]
        return None if rows[0] is None else torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict:
        """JSON-able position plus what it is valid for (checked by load_state_dict)."""
        return {
            **dataclasses.asdict(self.state),
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_sequences": self.num_sequences,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, d: dict) -> None:
        for key in ("seed", "seq_len", "num_sequences", "num_tokens"):
            mine = self.state_dict()[key]
            if d.get(key) != mine:
                raise ValueError(
                    f"the checkpoint's data position was saved with {key}={d.get(key)} but the "
                    f"data now has {key}={mine}; resume with the same --data, --seq-len and "
                    "--seed (and the same tokenizer) as the saved run"
                )
        if not (0 <= d["index"] < self.num_sequences and d["epoch"] >= 0):
            raise ValueError(f"data position {d} is out of range; the checkpoint is damaged")
        self.state = DataState(epoch=d["epoch"], index=d["index"])
