"""The collective-sequence check: what each rank issued in one optimizer step, compared.

Every collective on every rank must be issued in the same order with the same sizes, or the
job hangs (or, worse, pairs the wrong buffers). With the check on, each rank records one
`Collective` (op, numel, dtype) per call and keeps a running hash; at the end of each
optimizer step the ranks exchange their hashes and, when they differ, their sequences, and
`CollectiveMismatchError` names the first position where they part. It owns no transport:
the caller passes the object exchange to use.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable
from typing import NamedTuple

ENV_VAR = "INFINITY_COMM_CHECK"
"""0/unset: off. 1: compare the hashes at the end of each optimizer step. 2: also compare
each collective before it is issued (slow: one extra exchange per collective), so a
mismatch is reported instead of hanging until the timeout."""


class CheckLevel(enum.IntEnum):
    """How much of the collective sequence is checked across ranks (see `ENV_VAR`)."""

    OFF = 0
    STEP = 1
    """Hash each optimizer step's sequence and compare the hashes at its end."""
    CALL = 2
    """Also compare each collective's description before it is issued."""


def level_from_env() -> CheckLevel:
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "0", "false", "off", "no"):
        return CheckLevel.OFF
    if raw in ("1", "true", "on", "yes", "step"):
        return CheckLevel.STEP
    if raw in ("2", "call"):
        return CheckLevel.CALL
    raise ValueError(
        f"{ENV_VAR}={raw!r} is not a check level; use 0 (off), 1 (compare each optimizer "
        "step's collective sequence across ranks) or 2 (also compare every collective)"
    )


class Collective(NamedTuple):
    """One collective as the check sees it."""

    op: str
    numel: int
    dtype: str

    def __str__(self) -> str:
        return f"{self.op}({self.numel} x {self.dtype})"


class CollectiveMismatchError(RuntimeError):
    """The ranks issued different collective sequences (see `CollectiveLog`)."""


class CollectiveLog:
    """This rank's collectives since the last `reset` and a running hash of them."""

    def __init__(self) -> None:
        self.entries: list[Collective] = []
        self._hash = hashlib.blake2b(digest_size=16)

    def record(self, c: Collective) -> None:
        self.entries.append(c)
        self._hash.update(f"{c.op}:{c.numel}:{c.dtype};".encode())

    def digest(self) -> str:
        return self._hash.hexdigest()

    def reset(self) -> None:
        self.entries.clear()
        self._hash = hashlib.blake2b(digest_size=16)

    def compare(self, exchange: Callable[[object], list], what: str) -> None:
        """Compare with every rank through `exchange` (an all-gather of a Python object);
        raise `CollectiveMismatchError` at the first difference. Every rank raises, so none
        is left waiting in the next collective."""
        summaries = exchange((self.digest(), len(self.entries)))
        if all(s == summaries[0] for s in summaries):
            return
        sequences = exchange([tuple(c) for c in self.entries])
        raise CollectiveMismatchError(describe_mismatch(sequences, what))


def describe_mismatch(sequences: list[list[tuple]], what: str) -> str:
    """The first position at which the ranks' sequences differ, and each rank's op there."""
    longest = max(len(s) for s in sequences)
    for pos in range(longest):
        at = [Collective(*s[pos]) if pos < len(s) else None for s in sequences]
        if any(a != at[0] for a in at):
            ops = "; ".join(
                f"rank {r}: {a if a is not None else 'nothing (its sequence ended)'}"
                for r, a in enumerate(at)
            )
            return (
                f"the ranks issued different collectives in {what}: at collective #{pos} "
                f"{ops} (sequence lengths {[len(s) for s in sequences]}). Every rank must "
                "gather, reduce and prefetch the same parameters in the same order; a decision "
                "taken from timing or from rank-local data is the usual cause"
            )
    return f"the ranks' collective hashes differ in {what} but their sequences are equal"
