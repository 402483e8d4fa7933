"""``benchmarks/compare_lua.py``: two revisions' pool scripts side by side in one valkey-server,
end to end at a tiny size (the scripts' place in the tree, the per-round ratios).

No timing assertions (the machine is shared): only that every figure was measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_compares_head_with_the_working_tree_round_by_round(tmp_path: Path) -> None:
    out = tmp_path / "lua.json"
    rounds = 2
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "compare_lua.py"),
            "--old=HEAD",
            "--new=WORKTREE",
            "--pages=256",
            "--cycles=3",
            f"--rounds={rounds}",
            f"--json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for variant in ("evict", "fresh"):
        for side in ("old", "new"):
            assert len(result[f"{variant}:{side}"]["rounds"]) == rounds
        ratio = result[f"{variant}:ratio:op mean"]
        assert len(ratio["values"]) == rounds
        assert ratio["min"] <= ratio["median"] <= ratio["max"]
        # (cycle/4 counts the stat clock's 10 ms ticks: a round this short may read none,
        # which leaves that round without a ratio, or the figure without any)
        ticks = result[f"{variant}:ratio:cycle/4"]
        assert ticks is None or ticks["min"] <= ticks["median"] <= ticks["max"]
    assert "evict    new/old per round, op mean: median" in proc.stdout, proc.stdout
