"""The sample corpus shipped inside the package, for a first run with nothing but the
install (`infinity train --model tiny --nvme DIR` without `--data`): public-domain English
prose (texts/README.md says what it is and where it came from)."""

from __future__ import annotations

from pathlib import Path

SAMPLE_CORPUS = Path(__file__).parent / "texts" / "kjv.txt"
"""Genesis, Ruth and Ecclesiastes in the King James Version (239 KB of ASCII text)."""

SAMPLE_DESCRIPTION = "Genesis, Ruth and Ecclesiastes (King James Version, public domain)"
