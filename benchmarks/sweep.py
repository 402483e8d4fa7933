#!/usr/bin/env python3
"""Same as ``kvmeta bench sweep``: vary pool size, batch or clients; JSON + PNG with --out.

python benchmarks/sweep.py --sweep pool --launch --repeat 3 --out benchmarks/results/pool
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "sweep", *sys.argv[1:]]))
