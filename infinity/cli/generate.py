"""`infinity generate SAVE_DIR|EXPORT_DIR --prompt TEXT`: a quick look at what a model says.

Owns the command and its sampling loop (greedy, or temperature with nucleus top-p, seeded).
An export directory (config.json + safetensors, `infinity export`) loads with transformers;
a save dir's newest checkpoint (or one checkpoint directory) is streamed into partitions and
run through the engine's gathered forward with no gradients ([Note: generating from a
checkpoint]). The full sequence is run at each new token (no KV cache): a look, not a server.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from infinity.cli.run_tokenizer import is_bytes, recorded_tokenizer
from infinity.cli.train_flags import add_accept_flag, positive_int

log = logging.getLogger(__name__)

Logits = Callable[[torch.Tensor], torch.Tensor]
"""input_ids [1, T] -> logits [1, T, vocab]."""


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
    with open_model(where, accept_unverified=args.accept_unverified_checkpoint) as logits_of:
        new = sample(
            logits_of,
            ids,
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            args.seed,
            eos_id=getattr(tok, "eos_token_id", None),
        )
    text = tok.decode(new, skip_special_tokens=True)
    print(text if args.chat is not None else args.prompt + text)
    return 0


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
def open_model(where: Path, *, accept_unverified: bool = False) -> Iterator[Logits]:
    """The logits function of an export directory or of a checkpoint."""
    if is_export(where):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        model.eval()
        yield lambda ids: model(input_ids=ids).logits
        return
    with engine_logits(where, accept_unverified) as logits_of:
        yield logits_of


@contextlib.contextmanager
def engine_logits(where: Path, accept_unverified: bool = False) -> Iterator[Logits]:
    """[Note: generating from a checkpoint] The checkpoint's config builds the model under
    `infinity.init` (fp32, parameters in RAM), its weights are streamed into the partitions
    one at a time, as `infinity export` reads them, and the engine's gathered forward runs
    under no_grad: no gradient, no optimizer step. A LoRA checkpoint is refused (export it
    merged, then generate from the export)."""
    import infinity
    from infinity.cli.export import checkpoint_weights, open_checkpoint
    from infinity.config import Config
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
    config = Config.load({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    config = config.resolve(total_num_steps=1)
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(**hf_dict)
    with infinity.init(config):
        model = hf_auto.build(hf_config, init_weights=False)
    sink = copying_sink(model)
    for name, tensor in weights:
        sink(name, tensor)
    engine = infinity.initialize(model, config)
    log.info("generating from %s (step %d)", ckpt.path, ckpt.step)
    model.eval()
    try:
        yield lambda ids: engine(input_ids=ids).logits
    finally:
        engine.close()


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
) -> list[int]:
    """The new token ids after `ids`: greedy at temperature 0, else sampled from the
    softmax of logits / temperature, cut to the nucleus `top_p`; stops after `eos_id`."""
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
