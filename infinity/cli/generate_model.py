"""The models `infinity generate` samples from, and how each makes its tokens.

Owns `Sampling` (the choice of the next token), `open_model` (an export through transformers,
a checkpoint through the engine) and `decode`, the loop a checkpoint's tokens come from.

[Note: one sampler, two paths] An export is a transformers model, and its own `generate()`
makes the tokens (KV cache, its logits warpers, `torch.multinomial` on the global RNG seeded
by --seed): an export gives exactly what transformers gives. A checkpoint runs through the
engine's gathered forward ([Note: generating from a checkpoint]) in `decode`: the prompt
once, then one token at a time against the model's KV cache where the model returns one,
the whole sequence each time where it does not. `decode` chooses a token as `generate()`
does: the same warpers in the same order, softmax, then `torch.multinomial` on the same
seeded RNG, so a save dir and its export give the same tokens wherever their logits agree.
Only the flags decide the sampling: an export's generation_config.json (a model's suggested
temperature, top-k, repetition penalty...) is not applied.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]
"""(input_ids [1, t], cache or None) -> (logits [1, t, vocab], the cache to pass next, or
None where the model keeps none: then the next call gets the whole sequence)."""

OnToken = Callable[[int], None]

_READ_TRIES = 5
"""Times the newest checkpoint of a live run is read again when retention removed the one
being read (--keep-last): each try reads the newest there is then."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen: the most likely one at temperature 0, else drawn from
    softmax(logits / temperature), cut to the `top_k` most likely and then to the nucleus
    `top_p` (None: no cut), on the RNG seeded with `seed`."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generation_config(self, max_new_tokens: int, eos_id: int | None):
        """transformers' GenerationConfig of these flags, each sampling value set, so that
        none is taken from a model's own generation_config.json."""
        from transformers import GenerationConfig

        sampled = dict(
            temperature=self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
        )
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not self.greedy,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            **({} if self.greedy else sampled),
        )

    def warpers(self):
        """The logits warpers `generate()` builds for these flags, in its order (none when
        greedy)."""
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out = LogitsProcessorList()
        if self.greedy:
            return out
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p))
        return out

    @contextlib.contextmanager
    def seeded(self) -> Iterator[None]:
        """The global RNG (the one `generate()` draws from) seeded, restored after."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            yield


class LoadedModel:
    """A model to generate from: `generate(ids, max_new_tokens, sampling, ...)` returns the
    new ids, and `positions` is what it takes (`max_position_embeddings`; None where the
    config names none)."""

    positions: int | None

    def generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        *,
        eos_id: int | None = None,
        on_token: OnToken | None = None,
    ) -> list[int]:
        raise NotImplementedError


class ExportModel(LoadedModel):
    """An export, generated from by transformers' `generate()` ([Note: one sampler, two paths])."""

    def __init__(self, model) -> None:
        from transformers import GenerationConfig

        self.model = model
        self.positions = positions_of(model.config)
        # The global defaults under the flags' values, never the export's suggestions.
        model.generation_config = GenerationConfig()

    @torch.no_grad()
    def generate(self, ids, max_new_tokens, sampling, *, eos_id=None, on_token=None):
        if not ids:
            raise ValueError("the prompt tokenized to no ids; give some text")
        seq = torch.tensor([ids], dtype=torch.long)  # [1, T]
        config = sampling.generation_config(max_new_tokens, eos_id)
        with sampling.seeded():
            out = self.model.generate(
                seq,
                attention_mask=torch.ones_like(seq),
                generation_config=config,
                streamer=None if on_token is None else _Stream(on_token),
            )
        return out[0, seq.shape[1] :].tolist()


class _Stream:
    """transformers' streamer protocol (`put`, `end`) passing each new id to `on_token`: the
    first `put` is the prompt, each later one the batch's new token."""

    def __init__(self, on_token: OnToken) -> None:
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.on_token(int(token))

    def end(self) -> None:
        pass


class EngineModel(LoadedModel):
    """A checkpoint run through the engine's gathered forward, with the model's KV cache
    where it keeps one (`cached`: whether the last forward returned one)."""

    def __init__(self, engine, positions: int | None) -> None:
        import inspect

        self.engine = engine
        self.positions = positions
        self.cached: bool | None = None
        # transformers 5 names the cache `cache`; earlier releases `past_key_values`.
        takes = inspect.signature(engine.module.forward).parameters
        self._cache_key = "cache" if "cache" in takes else "past_key_values"

    def forward(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = self.engine(input_ids=ids, use_cache=True, **{self._cache_key: cache})
        cache = out.get(self._cache_key) if hasattr(out, "get") else None
        self.cached = cache is not None
        return out.logits, cache

    def generate(self, ids, max_new_tokens, sampling, *, eos_id=None, on_token=None):
        return decode(self.forward, ids, max_new_tokens, sampling, eos_id=eos_id,
                      on_token=on_token)  # fmt: skip


@torch.no_grad()
def decode(
    forward: Forward,
    ids: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    *,
    eos_id: int | None = None,
    on_token: OnToken | None = None,
) -> list[int]:
    """The new token ids after `ids`, chosen as `generate()` chooses them ([Note: one
    sampler, two paths]); stops after `eos_id`. `on_token` gets each new id as it is chosen."""
    if not ids:
        raise ValueError("the prompt tokenized to no ids; give some text")
    warpers = sampling.warpers()
    seq = torch.tensor([ids], dtype=torch.long)  # [1, T]
    feed, cache, new = seq, None, []
    with sampling.seeded():
        for _ in range(max_new_tokens):
            logits, cache = forward(feed, cache)
            scores = logits[:, -1].to(dtype=torch.float32, device="cpu", copy=True)  # [1, vocab]
            if sampling.greedy:
                nxt = int(torch.argmax(scores, dim=-1))
            else:
                probs = torch.softmax(warpers(seq, scores), dim=-1)
                nxt = int(torch.multinomial(probs, num_samples=1))
            new.append(nxt)
            if on_token is not None:
                on_token(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
            feed = seq if cache is None else seq[:, -1:]
            if nxt == eos_id:
                break
    return new


def positions_of(config) -> int | None:
    """The positions a transformers config takes (GPT-2 names them n_positions)."""
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(n) if n else None


def is_export(where: Path) -> bool:
    """A Hugging Face model directory (config.json and weights), as `infinity export` writes."""
    return (where / "config.json").is_file() and any(where.glob("*.safetensors"))


@contextlib.contextmanager
def open_model(where: Path, *, accept_unverified: bool = False) -> Iterator[LoadedModel]:
    """The model of an export directory or of a checkpoint."""
    if is_export(where):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        model.eval()
        yield ExportModel(model)
        return
    with engine_model(where, accept_unverified) as loaded:
        yield loaded


@contextlib.contextmanager
def engine_model(where: Path, accept_unverified: bool = False) -> Iterator[EngineModel]:
    """[Note: generating from a checkpoint] The checkpoint's config builds the model under
    `infinity.init` (fp32, parameters in RAM), its weights are streamed into the partitions
    one at a time, as `infinity export` reads them, and the engine's gathered forward runs
    under no_grad: no gradient, no optimizer step. A LoRA checkpoint is refused (export it
    merged, then generate from the export). A live run's save dir is read as it stands: the
    newest complete checkpoint, read again (the newest then) if retention removes it
    mid-read; a save in progress is never read (it is not complete until renamed)."""
    import infinity
    from infinity.config import Config, RunFacts, resolve_run

    config = Config.load({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    config = resolve_run(config, RunFacts(total_num_steps=1))
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
        yield EngineModel(engine, positions)
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
