"""Benchmark scripts, one per measured claim (BENCHMARKS.md cites them with their commands).

Run as files (`python benchmarks/x.py`) or as modules (`python -m benchmarks.x`). Their shared
module is imported as `bench_record`: a file's own folder is on sys.path, and this package
puts it there for the module form.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
