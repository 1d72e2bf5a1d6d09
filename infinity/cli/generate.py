"""`infinity generate SAVE_DIR|EXPORT_DIR --prompt TEXT`: a quick look at what a model says.

Owns the command and its sampling loop (greedy, or temperature with nucleus top-p, seeded).
An export directory (config.json + safetensors, `infinity export`) loads with transformers;
a save dir's newest checkpoint (or one checkpoint directory) is streamed into partitions and
run through the engine's gathered forward with no gradients ([Note: generating from a
checkpoint]). The full sequence is run at each new token (no KV cache): a look, not a server.
The prompt and reply stay within the model's positions ([Note: generating within the
model]) and the reply is printed token by token as it is made.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from infinity.cli.train_flags import add_accept_flag, positive_int
from infinity.run.tokenizer import is_bytes, recorded_tokenizer

log = logging.getLogger(__name__)

Logits = Callable[[torch.Tensor], torch.Tensor]
"""input_ids [1, T] -> logits [1, T, vocab]."""

_READ_TRIES = 5
"""Times the newest checkpoint of a live run is read again when retention removed the one
being read (--keep-last): each try reads the newest there is then."""


class LoadedModel:
    """A model to sample from: its logits function (called as one) and the number of
    positions it takes (`max_position_embeddings`; None where the config names none)."""

    def __init__(self, logits_of: Logits, positions: int | None) -> None:
        self.logits_of = logits_of
        self.positions = positions

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits_of(ids)


def positions_of(config) -> int | None:
    """The positions a transformers config takes (GPT-2 names them n_positions)."""
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(n) if n else None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="sample a continuation from a checkpoint or an exported model",
        description="Sample from a training run's newest checkpoint (SAVE_DIR), one checkpoint "
        "directory, or an `infinity export` directory. Greedy unless --temperature is given.",
    )
    parser.add_argument("model", metavar="SAVE_DIR|EXPORT_DIR", help="where the weights are")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", metavar="TEXT", help="text to continue")
    text.add_argument(
        "--chat",
        metavar="TEXT",
        help="a user message, rendered with the tokenizer's chat template; prints the reply",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a Hugging Face tokenizer directory (default: the export directory's own; a save "
        "dir holds none, so give the model directory it was trained from)",
    )
    parser.add_argument(
        "--byte-tokens",
        action="store_true",
        help="UTF-8 bytes as tokens (a save dir's run says so itself)",
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=64, help="tokens to add (default 64)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (the default) picks the most likely token each time; above 0 samples",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="sample only from the most likely tokens whose probabilities add up to P (0, 1]",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    add_accept_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _check_sampling(args)
    where = Path(args.model).expanduser()
    if not where.is_dir():
        raise ValueError(
            f"{where}: no such directory; give a --save-dir of infinity train, one checkpoint "
            "directory, or an infinity export directory"
        )
    tok = load_tokenizer(args, where)
    ids = prompt_ids(tok, args)
    with open_model(where, accept_unverified=args.accept_unverified_checkpoint) as model:
        max_new = fit_positions(len(ids), args.max_new_tokens, model.positions, where)
        out = Streamer(tok, "" if args.chat is not None else args.prompt)
        sample(
            model,
            ids,
            max_new,
            args.temperature,
            args.top_p,
            args.seed,
            eos_id=getattr(tok, "eos_token_id", None),
            on_token=out.add,
        )
        out.finish()
    return 0


def fit_positions(prompt_len: int, max_new: int, positions: int | None, where: Path) -> int:
    """[Note: generating within the model] A model has `positions` positions (learned ones,
    as GPT-2's, end in an IndexError past them; rotary ones run on, ever slower and out of
    what it was trained on). A prompt that fills them is refused (never cut: which end to
    keep is the user's choice); --max-new-tokens is capped at the positions left, with a
    warning. Returns the tokens to add."""
    if positions is None:
        return max_new
    if prompt_len >= positions:
        raise ValueError(
            f"the prompt is {prompt_len} tokens, and the model in {where} takes "
            f"{positions} positions (max_position_embeddings) for the prompt and the reply "
            f"together; shorten the prompt to at most {positions - 1} tokens"
        )
    room = positions - prompt_len
    if max_new > room:
        log.warning(
            "--max-new-tokens %d capped at %d: the prompt's %d tokens and the reply fill the "
            "model's %d positions (max_position_embeddings)",
            max_new, room, prompt_len, positions,
        )  # fmt: skip
        return room
    return max_new


class Streamer:
    """Prints the reply on stdout as its tokens come (after `head`, the prompt), flushing
    each: the text the new ids decode to so far, less what is printed, holding back a
    character whose UTF-8 bytes are not all there yet."""

    def __init__(self, tok, head: str) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.shown = ""
        print(head, end="", flush=True)

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # a character cut between tokens: wait for the rest of its bytes
        self._show(text)

    def finish(self) -> None:
        self._show(self.tok.decode(self.ids, skip_special_tokens=True), final=True)
        print(flush=True)

    def _show(self, text: str, *, final: bool = False) -> None:
        # A tokenizer may decode a longer reply to other text before the end (it cleans up
        # spaces): what is printed stays, and the end prints what follows the common part.
        common = len(os.path.commonprefix([self.shown, text]))
        if common == len(self.shown) or final:
            print(text[common:], end="", flush=True)
            self.shown = text


def _check_sampling(args: argparse.Namespace) -> None:
    if not args.temperature >= 0:
        raise ValueError(f"--temperature {args.temperature}: give 0 (greedy) or more")
    if args.top_p is not None:
        if not 0 < args.top_p <= 1:
            raise ValueError(f"--top-p {args.top_p} is not in (0, 1]")
        if args.temperature == 0:
            raise ValueError(
                f"--top-p {args.top_p} picks among sampled tokens, and without --temperature "
                "the choice is greedy; add --temperature 1 (or drop --top-p)"
            )


def is_export(where: Path) -> bool:
    """A Hugging Face model directory (config.json and weights), as `infinity export` writes."""
    return (where / "config.json").is_file() and any(where.glob("*.safetensors"))


class ByteTokens:
    """UTF-8 bytes as ids 0-255 (BOS 256, EOS 257), as `infinity train --byte-tokens`."""

    eos_token_id = 257
    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [256, *text.encode("utf-8")]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def load_tokenizer(args: argparse.Namespace, where: Path):
    if args.byte_tokens:
        return ByteTokens()
    directory = Path(args.tokenizer).expanduser() if args.tokenizer else where
    if args.tokenizer is None and not is_export(where):
        recorded = recorded_tokenizer(where)  # the run's own, kept in its save dir
        if recorded is not None:
            return ByteTokens() if is_bytes(recorded) else _auto_tokenizer(recorded)
        raise ValueError(
            f"{where} is a save dir, which holds no tokenizer; pass --tokenizer DIR (the "
            "model directory it was trained from) or --byte-tokens"
        )
    return _auto_tokenizer(directory)


def _auto_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"no tokenizer could be read from {directory} ({exc}); pass --tokenizer DIR"
        ) from None


def prompt_ids(tok, args: argparse.Namespace) -> list[int]:
    if args.chat is None:
        return list(tok(args.prompt)["input_ids"])
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            "--chat: the tokenizer has no chat template (chat_template in "
            "tokenizer_config.json); use --prompt with the text as the model expects it"
        )
    messages = [{"role": "user", "content": args.chat}]
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@contextlib.contextmanager
def open_model(where: Path, *, accept_unverified: bool = False) -> Iterator[LoadedModel]:
    """The model of an export directory or of a checkpoint."""
    if is_export(where):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        model.eval()
        yield LoadedModel(lambda ids: model(input_ids=ids).logits, positions_of(model.config))
        return
    with engine_logits(where, accept_unverified) as loaded:
        yield loaded


@contextlib.contextmanager
def engine_logits(where: Path, accept_unverified: bool = False) -> Iterator[LoadedModel]:
    """[Note: generating from a checkpoint] The checkpoint's config builds the model under
    `infinity.init` (fp32, parameters in RAM), its weights are streamed into the partitions
    one at a time, as `infinity export` reads them, and the engine's gathered forward runs
    under no_grad: no gradient, no optimizer step. A LoRA checkpoint is refused (export it
    merged, then generate from the export). A live run's save dir is read as it stands: the
    newest complete checkpoint, read again (the newest then) if retention removes it
    mid-read; a save in progress is never read (it is not complete until renamed)."""
    import infinity
    from infinity.config import Config

    config = Config.load({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    config = config.resolve(total_num_steps=1)
    for tries_left in range(_READ_TRIES - 1, -1, -1):
        try:
            ckpt, model, positions = _read_checkpoint(where, config, accept_unverified)
            break
        except FileNotFoundError as exc:
            removed = _removed_under_us(where, exc)
            if not removed or not tries_left:
                raise _unreadable(where, exc, removed=removed) from None
            log.info("%s: a checkpoint was removed while it was read; reading the newest", where)
    engine = infinity.initialize(model, config)
    log.info("generating from %s (step %d)", ckpt.path, ckpt.step)
    model.eval()
    try:
        yield LoadedModel(lambda ids: engine(input_ids=ids).logits, positions)
    finally:
        engine.close()


def _read_checkpoint(where: Path, config, accept_unverified: bool = False):
    """(checkpoint, model with its weights, positions) of `where`'s newest checkpoint."""
    import infinity
    from infinity.cli.export import checkpoint_weights, open_checkpoint
    from infinity.models import hf_auto
    from infinity.models.hf_load import copying_sink

    ckpt = open_checkpoint(where, None, accept_unverified=accept_unverified)
    if "base_model" in ckpt.state:  # a LoRA run saves its adapters alone
        raise ValueError(
            f"{ckpt.path} holds LoRA adapters without their base; export it merged "
            f"(infinity export {where} --out DIR --copy-files TOKENIZER_FILES) and generate "
            "from DIR"
        )
    hf_dict, weights = checkpoint_weights(ckpt)
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(**hf_dict)
    with infinity.init(config):
        model = hf_auto.build(hf_config, init_weights=False)
    sink = copying_sink(model)
    for name, tensor in weights:
        sink(name, tensor)
    return ckpt, model, positions_of(hf_config)


def _removed_under_us(where: Path, exc: FileNotFoundError) -> bool:
    """Whether a file went missing because a live run's retention removed the checkpoint
    being read: `where` is a save dir (not one checkpoint directory), which has checkpoints."""
    from infinity.checkpoint import layout
    from infinity.checkpoint.reader import CheckpointNotFoundError

    return not (where / layout.METADATA).is_file() and not isinstance(exc, CheckpointNotFoundError)


def _unreadable(where: Path, exc: FileNotFoundError, *, removed: bool) -> Exception:
    """The error for a save dir with no checkpoint that could be read."""
    from infinity.checkpoint import layout

    if removed:
        return ValueError(
            f"{where}: its checkpoints were removed while they were read, {_READ_TRIES} times "
            "(a live run with a small --keep-last saves faster than they are read); try again, "
            "or copy one checkpoint directory and generate from the copy"
        )
    writing = where.is_dir() and any(p.name.startswith(layout.TMP_PREFIX) for p in where.iterdir())
    if writing:
        return ValueError(
            f"{where} has no complete checkpoint yet: one is being written; try again once the "
            "run has saved it"
        )
    return exc


@torch.no_grad()
def sample(
    logits_of: Logits,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int = 0,
    *,
    eos_id: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The new token ids after `ids`: greedy at temperature 0, else sampled from the
    softmax of logits / temperature, cut to the nucleus `top_p`; stops after `eos_id`.
    `on_token` is called with each new id as it is chosen."""
    if not ids:
        raise ValueError("the prompt tokenized to no ids; give some text")
    gen = torch.Generator().manual_seed(seed)
    seq = torch.tensor([ids], dtype=torch.long)  # [1, T]
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = logits_of(seq)[0, -1].float().cpu()  # [vocab]
        nxt = (
            int(torch.argmax(logits))
            if temperature == 0
            else _draw(logits, temperature, top_p, gen)
        )
        new.append(nxt)
        if on_token is not None:
            on_token(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        if nxt == eos_id:
            break
    return new


def _draw(logits: torch.Tensor, temperature: float, top_p: float | None, gen) -> int:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p is not None and top_p < 1:
        order = torch.argsort(probs, descending=True)
        ranked = probs[order]
        # Keep the most likely tokens until their sum reaches top_p (always the first).
        keep = (torch.cumsum(ranked, 0) - ranked) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], ranked[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
