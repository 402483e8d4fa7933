#!/usr/bin/env python3
"""Same as ``kvmeta bench core``: the engine cycle on the pool model, no HTTP; bytes per key.

python benchmarks/core_bench.py --out benchmarks/results/core
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "core", *sys.argv[1:]]))
