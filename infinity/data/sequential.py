"""One ordered pass over a packed token stream, for evaluation.

Owns the validation set's batches: every sequence of a `PackedDataset` in file order (no
shuffle, no position to save), then the tokens past the last full sequence as one shorter
sequence (`PackedDataset.tail`), so that every token after the first is a label exactly
once; instruction and chat examples keep their masks. Training's seeded, resumable order is
`infinity.data.dataset`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from infinity.data.dataset import PackedDataset


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
    tail = data.tail()
    if tail is not None:
        inputs, labels = (torch.from_numpy(x)[None] for x in tail)  # (1, T) each
        yield inputs, labels
