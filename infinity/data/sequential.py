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
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(input_ids, labels, position_ids) of `micro_batch` sequences at a time, (B, seq_len)
    int64, in file order; the last full batch may be smaller, and a tail shorter than
    seq_len comes alone as (1, tail_len). position_ids is None where they are the plain
    0, 1, 2, ... (`PackedDataset.positions`: packed examples restart theirs)."""
    if micro_batch <= 0:
        raise ValueError(f"micro_batch must be positive, got {micro_batch}")
    for first in range(0, data.num_sequences, micro_batch):
        last = min(first + micro_batch, data.num_sequences)
        inputs, labels = zip(*(data.pair(i) for i in range(first, last)), strict=True)
        batch = torch.from_numpy(np.stack(inputs)), torch.from_numpy(np.stack(labels))  # (B, L)
        yield (*batch, data.batch_positions(range(first, last)))
    tail = data.tail()
    if tail is not None:
        inputs, labels = (torch.from_numpy(x)[None] for x in tail)  # (1, T) each
        start = data.num_sequences * data.seq_len
        positions = data.positions(start, start + inputs.shape[1])
        yield inputs, labels, None if positions is None else torch.from_numpy(positions)[None]
