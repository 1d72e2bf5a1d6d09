"""Training data: a text or JSONL file, tokenized once into a memory-mapped token cache,
packed into fixed-length sequences in a seeded order with a resumable position.

    tok = load_tokenizer(tokenizer_dir)    # None: UTF-8 bytes, by explicit choice
    tokens = build_token_cache(path, tok, cache_dir=...)
    data = PackedDataset(tokens, seq_len=..., seed=...)
    input_ids, labels = data.next_batch(micro_batch)
    state = data.state_dict()  # into the checkpoint; data.load_state_dict(state) on resume

Instruction and chat records (`messages`, or `prompt` and `completion`) become an
`ExampleDataset` instead (infinity.data.examples): the same batches, with labels -100 where
the loss is not taken. `open_dataset` picks by the file's first record.

[Note: packed examples] With --pack several examples share a sequence. Their position ids
restart at 0 where each example begins (`ExampleDataset.positions`; `next_batch(...,
with_positions=True)` and `sequential_batches` hand them out) and the CLI passes them to the
model as `position_ids`, with no KV cache: rotary and learned positions then count from each
example's start, and transformers' attention masks (sdpa, eager, flex; flash attention
through its variable-length path) read the restarts as sequence boundaries, so no example
attends to another. A model that ignores `position_ids` would let them.
"""

import logging

from infinity.data.cache import build_token_cache, default_cache_dir
from infinity.data.dataset import DataState, PackedDataset
from infinity.data.examples import ExampleDataset, ExampleOptions, file_kind, open_examples
from infinity.data.source import iter_documents
from infinity.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataState",
    "ExampleDataset",
    "ExampleOptions",
    "HFTokenizer",
    "PackedDataset",
    "Tokenizer",
    "build_token_cache",
    "default_cache_dir",
    "iter_documents",
    "load_tokenizer",
    "open_dataset",
    "open_examples",
]

log = logging.getLogger(__name__)


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
    examples: ExampleOptions | None = None,
) -> PackedDataset:
    """Tokenizer of `tokenizer_dir` (None: UTF-8 bytes), token cache, dataset: the CLI's one
    call. Instruction or chat records give an `ExampleDataset` shaped by `examples`;
    pre-training data (text, or records with a text field) a `PackedDataset`."""
    examples = examples if examples is not None else ExampleOptions()
    tokenizer = load_tokenizer(tokenizer_dir)
    kind = file_kind(data_path, fmt)
    if kind is None:
        if not examples.is_default():
            raise ValueError(
                f"--chat-template, --train-on-prompt, --pack and --overlong shape instruction "
                f"data, but {data_path} is pre-training data (text, or records with a "
                f"{field!r} field, always packed); drop those flags, or give records with "
                "'messages' or 'prompt' and 'completion'"
            )
        tokens = build_token_cache(data_path, tokenizer, cache_dir=cache_dir, fmt=fmt, field=field)
        data = PackedDataset(
            tokens,
            seq_len=seq_len,
            seed=seed,
            rank=rank,
            world_size=world_size,
            source=str(data_path),
        )
    else:
        data = open_examples(
            data_path, tokenizer, seq_len=seq_len, seed=seed, options=examples,
            cache_dir=cache_dir, fmt=fmt, rank=rank, world_size=world_size,
        )  # fmt: skip
        if examples.pack:  # see [Note: packed examples]
            log.info(
                "--pack: several examples per sequence; their position ids restart at each "
                "example, which keeps each example's attention to itself with transformers' "
                "sdpa, eager, flex and flash attention (a model of its own that ignores "
                "position_ids lets them attend to each other); the loss stays on the answers"
            )
    data.tokenizer = tokenizer
    return data
