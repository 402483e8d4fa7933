"""Pools far larger than what is used: server memory per pool size, and core CPU per request.

Two trees are compared (``--a-src`` and ``--b-src``, each a ``src`` directory, e.g. of a
``git worktree`` of an older commit and of this checkout):

- RSS of an in-memory server, each in its own process, before and after one ``initialize``
  of 2^24, 2^32 and 2^40 pages (with --max-pages/--max-total-pages raised to allow them); a
  refused pool is reported with its status;
- CPU per 64-key engine cycle (exists, reserve, confirm, get on ``core.pool.Pool``) on a
  pool of 2^20 pages, all used, every reserve evicting: rounds alternate between the trees
  so that machine noise hits both alike; the median and the spread over rounds are printed.

    python benchmarks/bench_sparse_pools.py --a-src /tmp/old/src --b-src src
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_LISTEN = re.compile(r"kvmeta listening on http://([^\s:]+):(\d+)")

_CYCLE = r"""
import hashlib, json, sys, time
from kvmeta.core.pool import Pool
pages, batch, cycles = map(int, sys.argv[1:4])
def keys(n, seed):
    last = hashlib.sha256(seed.encode()).digest(); out = []
    for _ in range(n):
        last = hashlib.sha256(last).digest(); out.append(last.hex())
    return out
pool = Pool(pages, read_lease=0.0)
fill = keys(pages, "fill")
for i in range(0, pages, 8192):
    chunk = fill[i : i + 8192]
    got = pool.reserve(chunk, 0.0, [])
    pool.confirm([(k, p) for k, (_, p) in zip(chunk, got)], [], 0.0)
batches = [keys(batch, f"c{i}") for i in range(cycles)]
now = 1.0
t0 = time.process_time()
for ks in batches:
    now += 1e-4
    pool.exists(ks)
    got = pool.reserve(ks, now, [])
    pool.confirm([(k, p) for k, (hit, p) in zip(ks, got) if not hit and p >= 0], [], now)
    pool.get(ks, now)
print(json.dumps({"us_per_cycle": (time.process_time() - t0) / cycles * 1e6}))
"""


def _env(src: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = str(Path(src).resolve())
    return env


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def server_rss(src: str, num_pages: int) -> dict[str, int]:
    """RSS of a fresh in-memory server before and after creating one pool of ``num_pages``."""
    args = [sys.executable, "-m", "kvmeta", "serve", "--in-memory", "--port", "0"]
    args += ["--max-pages", str(1 << 40), "--max-total-pages", str(1 << 41)]
    proc = subprocess.Popen(args, env=_env(src), stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = ""
        deadline = time.monotonic() + 30
        while not url and time.monotonic() < deadline:
            match = _LISTEN.search(proc.stderr.readline())
            if match:
                url = f"http://{match.group(1)}:{match.group(2)}"
        before = _rss_kib(proc.pid)
        request = urllib.request.Request(
            f"{url}/0/initialize",
            data=json.dumps({"num_pages": num_pages}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                status = reply.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        return {"status": status, "rss_before_kib": before, "rss_after_kib": _rss_kib(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cycle_us(src: str, pages: int, batch: int, cycles: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CYCLE, str(pages), str(batch), str(cycles)],
        env=_env(src),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout)["us_per_cycle"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a-src", required=True, help="src directory of the baseline (A)")
    parser.add_argument("--b-src", required=True, help="src directory of the candidate (B)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating CPU rounds")
    parser.add_argument("--pages", type=int, default=1 << 20, help="used pages (CPU rounds)")
    parser.add_argument("--cycles", type=int, default=3000, help="64-key cycles per round")
    args = parser.parse_args()
    trees = {"A": args.a_src, "B": args.b_src}
    print("server RSS after one initialize (KiB; in-memory server)")
    for exp in (24, 32, 40):
        for name, src in trees.items():
            got = server_rss(src, 1 << exp)
            grown = got["rss_after_kib"] - got["rss_before_kib"]
            print(
                f"  2^{exp} pages  {name}: status {got['status']}, RSS {got['rss_after_kib']} "
                f"(+{grown})"
            )
    print(f"core CPU per 64-key cycle, pool of {args.pages} pages all used (us)")
    samples: dict[str, list[float]] = {"A": [], "B": []}
    for rnd in range(args.rounds):
        order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
        for name in order:
            samples[name].append(cycle_us(trees[name], args.pages, 64, args.cycles))
    for name, values in samples.items():
        print(
            f"  {name}: median {statistics.median(values):.1f}, "
            f"min {min(values):.1f}, max {max(values):.1f} over {len(values)} rounds"
        )
    ratios = [b / a for a, b in zip(samples["A"], samples["B"], strict=True)]
    print(
        f"  B/A per round: median {statistics.median(ratios):.3f}, "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
