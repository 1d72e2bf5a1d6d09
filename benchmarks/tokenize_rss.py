"""Peak RSS of tokenizing a large plain-text file into the token cache, against its size.

Claim: a text `--data` file is tokenized in pieces sent to the tokenizer in bounded batches
([Note: text pieces] in infinity/data/text.py), so peak RSS stays near that of a JSONL file
whatever the text's size (before: 100 MB of text peaked at 3.1 GB, 2 GB aborted in the Rust
tokenizer). Peer, in the same run: the same text as JSONL, one record per line.

The text is random words from a fixed list in lines of 1-40 words, with a blank line now and
then. Tokenizers: UTF-8 bytes (`bytes`), and a byte-level BPE (GPT-2's pre-tokenizer, 4096
ids) trained by this script on the first MiB of the text (`bpe`), read through transformers
as `infinity train` reads one. Each measurement runs in a fresh subprocess and reads its own
peak RSS (VmHWM).

    PYTHONPATH=$PWD python benchmarks/tokenize_rss.py --size 1G --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infinity.utils.sizes import parse_size  # noqa: E402  (SIZE as every command reads it)

MiB = 1 << 20
_WORDS = " ".join(
    [
        "the of and to in is was for on that with as by at from it an be this are or which",
        "naïve café résumé 日本語 über straße ñandú tokens model offload gradient memory swap",
        "parameter optimizer shard stream piece chunk 1234 2026 don't it's (see) [x] -- ...",
    ]
).split()

_CHILD = """
import json, sys, time
from infinity.data import build_token_cache, load_tokenizer
from infinity.utils.telemetry import peak_rss_bytes
data, tok_dir, cache = sys.argv[1:4]
tok = load_tokenizer(None if tok_dir == "-" else tok_dir)
start = time.perf_counter()
tokens = build_token_cache(data, tok, cache_dir=cache)
seconds = time.perf_counter() - start
print(json.dumps({"n_tokens": len(tokens), "seconds": seconds, "peak_rss_bytes": peak_rss_bytes()}))
"""


def write_text(path: Path, size: int, seed: int = 0) -> None:
    """`size` bytes or a line more of random words, written a few MiB at a time."""
    rng = random.Random(seed)
    written = 0
    with open(path, "wb") as f:
        while written < size:
            lines = [" ".join(rng.choices(_WORDS, k=rng.randint(0, 40))) for _ in range(20_000)]
            block = "\n".join(lines).encode() + b"\n"
            f.write(block)
            written += len(block)


def to_jsonl(text_path: Path, out: Path) -> None:
    """The same text, one JSON record per line."""
    with open(text_path, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for line in src:
            dst.write(json.dumps({"text": line}) + "\n")


def train_bpe(text_path: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(text_path, encoding="utf-8") as f:
        sample = f.read(MiB)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([sample], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(out)


def measure(data: Path, tok_dir: Path | None, cache: Path) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(data), str(tok_dir) if tok_dir else "-", str(cache)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:], "rc": proc.returncode}
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    rec["peak_rss_gib"] = rec["peak_rss_bytes"] / (1 << 30)
    rec["mb_per_s"] = data.stat().st_size / 1e6 / rec["seconds"]
    shutil.rmtree(cache, ignore_errors=True)
    return rec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="bytes of text (1G, 100M, ...)")
    parser.add_argument("--tokenizers", default="bytes,bpe", help="bytes, bpe or both")
    parser.add_argument("--no-jsonl", action="store_true", help="skip the JSONL peer")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/infinity-tokenize-rss"))
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args()
    size = parse_size(args.size)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    text = work / "corpus.txt"
    try:
        write_text(text, size)
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "text_bytes": text.stat().st_size,
            "results": {},
        }
        jsonl = work / "corpus.jsonl"
        if not args.no_jsonl:
            to_jsonl(text, jsonl)
        for name in args.tokenizers.split(","):
            tok_dir = None
            if name == "bpe":
                tok_dir = work / "bpe"
                train_bpe(text, tok_dir)
            record["results"][f"text/{name}"] = measure(text, tok_dir, work / "cache")
            if not args.no_jsonl:
                record["results"][f"jsonl/{name}"] = measure(jsonl, tok_dir, work / "cache")
            print(name, json.dumps(record["results"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = json.dumps(record, indent=1)
    print(out)
    if args.json:
        args.json.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
