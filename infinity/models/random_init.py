"""Random initial weights for a model built without them (a preset), on every core.

Owns `random_init`: Hugging Face's default rule for the weights of a causal LM
(`PreTrainedModel._init_weights`: linear and embedding weights normal(0, initializer_range),
biases zero, the rows of an embedding's padding index zero, norm weights one), applied to
every parameter of a model whose construction skipped its init (`hf_auto.build(...,
init_weights=False)`), with fixed-size chunks spread over threads. It does not decide which
models get random weights (the caller does: a preset has no checkpoint).

[Note: reproducible parallel init] Each chunk of `CHUNK_NUMEL` elements of a parameter
draws from its own generator, seeded from (the run's seed, the parameter's name, the chunk's
index) alone, in fp32, and is then cast to the parameter's dtype. The values therefore
depend on neither the thread count nor the order the chunks run in, nor on what else was
built before (a LoRA adapter, a model with fewer layers shares its layers' weights): the
same seed gives the same bits on any machine with the same torch. They are not the values
one global generator would draw in module order (what transformers' own serial init
produces), but the same distribution. A model with a parameter the rule does not cover
(a module type it does not know) gets transformers' own serial init instead, with a log
line: never a parameter left unset.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

log = logging.getLogger(__name__)

CHUNK_NUMEL = 1 << 22
"""Elements per generator (16 MiB of fp32): small enough to spread a model over the cores,
large enough that seeding costs nothing. Changing it changes the weights."""

Fill = Callable[[torch.Tensor], None]


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The 64-bit seed of chunk `chunk` of parameter `name` (see [Note: reproducible
    parallel init]): a hash, so neighbouring chunks and names draw unrelated streams."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _is_norm(module: nn.Module) -> bool:
    # transformers names its norms per model (LlamaRMSNorm, ...): the class name is the rule.
    name = type(module).__name__
    return "RMSNorm" in name or "LayerNorm" in name or isinstance(module, nn.LayerNorm)


def init_rule(model: nn.Module) -> dict[str, tuple[str, nn.Parameter]] | None:
    """Parameter name -> ("normal" | "zeros" | "ones", parameter) for every unique parameter
    of `model`, or None when a parameter belongs to a module the rule does not know."""
    rule: dict[nn.Parameter, str] = {}
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)) and set(own) <= {"weight", "bias"}:
            kinds = {"weight": "normal", "bias": "zeros"}
        elif _is_norm(module) and set(own) <= {"weight", "bias"}:
            kinds = {"weight": "ones", "bias": "zeros"}
        else:
            return None
        for leaf, p in own.items():
            rule.setdefault(p, kinds[leaf])
    return {name: (rule[p], p) for name, p in model.named_parameters()}


def random_init(model: nn.Module, *, seed: int, std: float, threads: int | None = None) -> bool:
    """Fill every parameter of `model` by Hugging Face's default rule with normal weights of
    `std`, on `threads` threads (default: every core), reproducibly (see [Note: reproducible
    parallel init]). Returns False, touching nothing, when the rule does not cover the model
    (the caller then runs the model's own init)."""
    rule = init_rule(model)
    if rule is None:
        return False
    jobs: list[Callable[[], None]] = []
    for name, (kind, param) in rule.items():
        flat = param.detach().view(-1)
        if kind == "normal":
            for chunk, lo in enumerate(range(0, flat.numel(), CHUNK_NUMEL)):
                piece = flat[lo : lo + CHUNK_NUMEL]
                jobs.append(_normal_job(piece, chunk_seed(seed, name, chunk), std))
        else:
            jobs.append(_constant_job(flat, 0.0 if kind == "zeros" else 1.0))
    _run(jobs, threads or os.cpu_count() or 1)  # the pool's threads (and scratch) end here
    _zero_padding_rows(model)
    return True


_scratch = threading.local()


def _normal_job(piece: torch.Tensor, seed: int, std: float) -> Callable[[], None]:
    def job() -> None:
        gen = torch.Generator().manual_seed(seed)
        if piece.dtype == torch.float32:
            piece.normal_(0.0, std, generator=gen)
            return
        # Drawn in fp32 and rounded once: bf16 weights are the fp32 ones, rounded. One
        # scratch buffer per thread: a fresh 16 MiB each time would fault its pages in anew.
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < piece.numel():
            buf = _scratch.buf = torch.empty(max(piece.numel(), CHUNK_NUMEL))
        piece.copy_(buf[: piece.numel()].normal_(0.0, std, generator=gen))

    return job


def _constant_job(flat: torch.Tensor, value: float) -> Callable[[], None]:
    return lambda: flat.fill_(value)


def _zero_padding_rows(model: nn.Module) -> None:
    """An embedding's padding row is zero (transformers' rule), once its weight is drawn."""
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            module.weight.detach()[module.padding_idx].zero_()


def _run(jobs: list[Callable[[], None]], threads: int) -> None:
    """Run `jobs` on `threads` threads, each op single-threaded (torch's own intra-op
    threads would only compete with them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), ThreadPoolExecutor(max(1, threads)) as pool:
            for f in [pool.submit(_no_grad, job) for job in jobs]:
                f.result()
    finally:
        torch.set_num_threads(before)


def _no_grad(job: Callable[[], None]) -> None:
    with torch.no_grad():  # grad mode is per thread
        job()
