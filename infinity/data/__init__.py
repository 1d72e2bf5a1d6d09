"""Training data: a text or JSONL file, tokenized once into a memory-mapped token cache,
packed into fixed-length sequences in a seeded order with a resumable position.

    tok = load_tokenizer(tokenizer_dir)    # None: UTF-8 bytes, by explicit choice
    tokens = build_token_cache(path, tok, cache_dir=...)
    data = PackedDataset(tokens, seq_len=..., seed=...)
    input_ids, labels = data.next_batch(micro_batch)
    state = data.state_dict()  # into the checkpoint; data.load_state_dict(state) on resume
"""

from infinity.data.cache import build_token_cache, default_cache_dir
from infinity.data.dataset import DataState, PackedDataset
from infinity.data.source import iter_documents
from infinity.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataState",
    "HFTokenizer",
    "PackedDataset",
    "Tokenizer",
    "build_token_cache",
    "default_cache_dir",
    "iter_documents",
    "load_tokenizer",
    "open_dataset",
]


def open_dataset(
    data_path,
    *,
    seq_len: int,
    seed: int,
    tokenizer_dir=None,
    cache_dir=None,
    fmt: str = "auto",
    field: str = "text",
    rank: int = 0,
    world_size: int = 1,
) -> PackedDataset:
    """Tokenizer of `tokenizer_dir` (None: UTF-8 bytes), token cache, packed dataset: the
    CLI's one call."""
    tokenizer = load_tokenizer(tokenizer_dir)
    tokens = build_token_cache(data_path, tokenizer, cache_dir=cache_dir, fmt=fmt, field=field)
    data = PackedDataset(
        tokens, seq_len=seq_len, seed=seed, rank=rank, world_size=world_size, source=str(data_path)
    )
    data.tokenizer = tokenizer
    return data
