#!/usr/bin/env python3
"""Same as ``kvmeta bench``: drive a dialect S or V server and report CPU per request.

python benchmarks/run_bench.py --launch --dialect s --batch 64 --repeat 3
python benchmarks/run_bench.py --url http://127.0.0.1:18000 --server-pid 1234 --dialect v
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
