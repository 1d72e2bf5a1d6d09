"""One ordered pass over a packed token stream, for evaluation.

Owns the validation set's batches: every sequence of a `PackedDataset` in file order (no
shuffle, no position to save), then the tokens past the last full sequence as one shorter
sequence, so that every token after the first is a label exactly once (instruction and chat
examples: every sequence, with its masks). Training's seeded,
resumable order is `infinity.data.dataset`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from infinity.data.dataset import PackedDataset
from infinity.data.examples import ExampleDataset


def sequential_batches(
    data: PackedDataset, micro_batch: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) of `micro_batch` sequences at a time, (B, seq_len) int64, in file
    order; the last full batch may be smaller, and a tail shorter than seq_len comes alone
    as (1, tail_len)."""
    if micro_batch <= 0:
        raise ValueError(f"micro_batch must be positive, got {micro_batch}")
    for first in range(0, data.num_sequences, micro_batch):
        last = min(first + micro_batch, data.num_sequences)
        inputs, labels = zip(*(data.pair(i) for i in range(first, last)), strict=True)
        yield torch.from_numpy(np.stack(inputs)), torch.from_numpy(np.stack(labels))  # (B, L)
    if isinstance(data, ExampleDataset):  # examples: every one is in a sequence already
        return
    start = data.num_sequences * data.seq_len
    tail = np.asarray(data.tokens[start:], dtype=np.int64)
    if len(tail) >= 2:
        seq = torch.from_numpy(tail)[None]  # (1, T+1)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
