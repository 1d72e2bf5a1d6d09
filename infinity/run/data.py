"""The data of one training run: the training set and the --eval-data validation set, each
tokenized with the run's tokenizer into the save dir's token cache (rank 0 fills it, the
other ranks read it), the training set checked against the model's vocabulary."""

from __future__ import annotations

import logging
from pathlib import Path

from infinity.data import PackedDataset, open_dataset
from infinity.data.tokenizer import tokenizer_files
from infinity.models import hf_auto
from infinity.run.inputs import tokenizer_dir
from infinity.run.options import RunOptions, example_options
from infinity.run.ranks import Ranks

log = logging.getLogger(__name__)


def train_data(
    args: RunOptions,
    ranks: Ranks,
    save_dir: Path,
    model: hf_auto.CausalLMSpec,
    *,
    seed: int,
) -> PackedDataset:
    """--data as sequences of --seq-len tokens, this rank's share, in the order `seed` gives."""
    data = ranks.main_first(  # rank 0 fills the token cache the others read
        lambda: open_dataset(
            args.data,
            seq_len=args.seq_len,
            seed=seed,
            tokenizer_dir=tokenizer_dir(args),
            cache_dir=save_dir / "tokens",
            field=args.data_field,
            examples=example_options(args),
            rank=ranks.rank,
            world_size=ranks.world_size,
        )
    )
    tok = data.tokenizer
    log.info("tokens: %s", tok.describe())
    own = tokenizer_files(model.model_dir) if model.model_dir is not None else []
    if args.byte_tokens and own:
        log.warning(
            "--byte-tokens: the model's own tokenizer (%s in %s) is not used; a pretrained "
            "model learns little from byte ids it was not trained on",
            ", ".join(own),
            model.model_dir,
        )
    if tok.vocab_size > model.vocab_size:
        raise ValueError(
            f"the tokenizer ({tok.describe()}) has {tok.vocab_size} token ids but the "
            f"model's embedding has {model.vocab_size} rows; use the model's "
            "own tokenizer or a model with a larger vocab_size"
        )
    return data


def eval_data(args: RunOptions, ranks: Ranks, save_dir: Path) -> PackedDataset | None:
    """--eval-data tokenized as the training data (its own token cache), before any
    training: a file with too few tokens fails here; None without --eval-data."""
    if args.eval_data is None:
        return None
    try:
        return ranks.main_first(
            lambda: open_dataset(
                args.eval_data,
                seq_len=args.seq_len,
                seed=0,  # never shuffled: evaluation reads it in order
                tokenizer_dir=tokenizer_dir(args),
                cache_dir=save_dir / "tokens",
                field=args.data_field,
                examples=example_options(args),
            )
        )
    except ValueError as exc:
        raise ValueError(f"--eval-data {args.eval_data}: {exc}") from None
