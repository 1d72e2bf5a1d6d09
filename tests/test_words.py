"""One word per concept (docs/architecture.md, "Words"; STYLE.md, Conventions 3) as a test:
the retired phrases appear nowhere in the package, its docs or its tests, and the attribute
`.store` is only ever a tier's swap directory.

The scan joins each file's lines first, so a phrase broken across two lines is found too."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

RETIRED = {
    "grad store": "a tier is a tier: 'gradient tier'",
    "gradient store": "a tier is a tier: 'gradient tier'",
    "state store": "a tier is a tier: 'state tier'",
    "parameter store": "a tier is a tier: 'parameter tier'",
    "param store": "a tier is a tier: 'parameter tier'",
    "parameter partition": "a parameter's weights between gathers live in its 'home'",
    "gradient partition": "a slot's gradients are its 'gradient sums'",
    "fp32 partition": "a slot's gradients are its 'gradient sums'",
    "partition_bytes": "the optimizer's weight output is counted as 'weights_bytes'",
}
"""Phrase (whole words, plural too, any case, across line breaks) -> the word that replaced it."""

# The places that name a retired phrase to say it is retired.
ALLOWED = {
    ("partition_bytes", "docs/telemetry.md"),  # the old key is still read: says so
    ("partition_bytes", "tests/test_cli_plot.py"),  # draws a record with the old key
}

# The tiers that own a swap directory (`SwapStore`) as `.store`: no other module has one.
STORE_OWNERS = {
    "infinity/swap/grad_tier.py",
    "infinity/swap/nvme_state.py",
    "infinity/swap/param_tier.py",
}
STORE_ATTR = re.compile(r"(?<!swap)\.store\b")


def _files() -> list[pathlib.Path]:
    files = [*ROOT.joinpath("infinity").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]
    files += [*ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md"]
    here = pathlib.Path(__file__).resolve()
    return sorted(f for f in files if f.resolve() != here and f.is_file())


def _flat(text: str) -> str:
    """The text with each line break and the indentation or comment marks around it made
    one space, so a phrase reads the same wherever the line was wrapped."""
    return re.sub(r"[ \t]*\n[ \t#>|-]*", " ", text).lower()


@pytest.mark.parametrize("phrase", sorted(RETIRED))
def test_no_retired_phrase(phrase):
    found = [
        str(f.relative_to(ROOT))
        for f in _files()
        if re.search(rf"\b{re.escape(phrase)}s?\b", _flat(f.read_text(encoding="utf-8")))
        and (phrase, str(f.relative_to(ROOT))) not in ALLOWED
    ]
    assert not found, f"{phrase!r} in {found}: {RETIRED[phrase]}"


def test_the_scan_sees_a_phrase_split_across_lines():
    assert "state store" in _flat("the NVMe state\n    store at /x")
    assert "state store" in _flat("the NVMe state\n    # store at /x")


def test_store_is_only_a_tiers_swap_directory():
    found = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in ROOT.joinpath("infinity").rglob("*.py")
        if str(f.relative_to(ROOT)) not in STORE_OWNERS
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if STORE_ATTR.search(line)
    ]
    assert not found, (
        f".store outside {sorted(STORE_OWNERS)}: {found}; '.store' is a tier's swap directory "
        "(SwapStore) only: a tier held elsewhere is '.state_tier', '.param_tier' or '.tier'"
    )
    for owner in STORE_OWNERS:  # and each owner holds a SwapStore there
        assert "self.store = store" in (ROOT / owner).read_text(encoding="utf-8")
        assert "store: SwapStore" in (ROOT / owner).read_text(encoding="utf-8")
