"""Names and places inside a checkpoint directory; the one spot that knows the layout.

SAVE_DIR/
  latest                      the tag of the newest complete checkpoint (replaced last)
  <tag>/checkpoint.json       metadata: step, engine state, per-rank RNG, shard checksums
  <tag>/rank00000.safetensors one shard per rank, tensors written one at a time
  .tmp.<tag>/                 a save in progress (or a crashed one, removed by the next save)
  .tmp.removed.<tag>/         a checkpoint being removed on purpose (retention, --overwrite)
  .lock                       flock held by the run training in SAVE_DIR (or the process
                              saving into it); records the holder's pid, host and command
  metrics.jsonl               one strict-JSON record per optimizer step (see `metrics`)
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from infinity.checkpoint import jsonfloat

FORMAT = "infinity-checkpoint"
VERSION = 1
LATEST = "latest"
METADATA = "checkpoint.json"
TMP_PREFIX = ".tmp."
LOCK = ".lock"

PARAM_PREFIX = "param/"

# [Note: metadata checksum] checkpoint.json carries a SHA-256 of its own contents (the JSON
# without this key, keys sorted, no spaces), so an edited step or data position is refused
# on load instead of resumed as if true. Whitespace and key order may change; values may
# not. A checkpoint.json without it (written before it existed, or with it deleted) is
# refused unless the caller accepts it unverified (`accept_unverified`, the CLI's
# --accept-unverified-checkpoint); then it loads with a warning.
METADATA_SUM = "metadata_sha256"


def metadata_sum(meta: dict[str, Any]) -> str:
    """The checksum of checkpoint metadata `meta` (its own METADATA_SUM key left out)."""
    body = {k: v for k, v in meta.items() if k != METADATA_SUM}
    text = jsonfloat.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


def check_tag(tag: str) -> str:
    """A tag names a directory: letters, digits, `_.+-`, not starting with '.', not 'latest'."""
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST or len(tag) > 200:
        raise ValueError(
            f"checkpoint tag {tag!r} is not allowed; use letters, digits and '_.+-' "
            f"(not starting with '.', not 'latest'), e.g. 'step100'"
        )
    return tag


def step_tag(step: int) -> str:
    """The default tag for a checkpoint taken after `step` optimizer steps."""
    return f"step{int(step)}"


def shard_name(rank: int) -> str:
    return f"rank{int(rank):05d}.safetensors"


def tmp_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f"{TMP_PREFIX}{tag}"
