"""`infinity generate SAVE_DIR|EXPORT_DIR --prompt TEXT`: a quick look at what a model says.

Owns the command: its flags, the tokenizer and prompt, the positions check and the printing.
The model and its tokens are `generate_model`'s: an export through transformers'
`generate()`, a save dir's newest checkpoint (or one checkpoint directory) through the
engine's gathered forward, both with a KV cache where the model keeps one ([Note: one
sampler, two paths]). The prompt and reply stay within the model's positions ([Note:
generating within the model]) and the reply is printed token by token as it is made.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from infinity.cli.generate_model import Sampling, is_export, open_model
from infinity.cli.train_flags import add_accept_flag, positive_int
from infinity.run.tokenizer import is_bytes, recorded_tokenizer

log = logging.getLogger(__name__)


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
        "--top-k",
        type=positive_int,
        metavar="K",
        help="sample only from the K most likely tokens (with --temperature)",
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
    sampling = _sampling(args)
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
        model.generate(
            ids, max_new, sampling, eos_id=getattr(tok, "eos_token_id", None), on_token=out.add
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


def _sampling(args: argparse.Namespace) -> Sampling:
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
    if args.top_k is not None and args.temperature == 0:
        raise ValueError(
            f"--top-k {args.top_k} picks among sampled tokens, and without --temperature the "
            "choice is greedy; add --temperature 1 (or drop --top-k)"
        )
    return Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )


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
