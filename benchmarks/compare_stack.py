#!/usr/bin/env python3
"""Serving-stack decision: the same kvmeta app on our server vs on uvicorn (raw ASGI).

Both run in-memory with read leases off, on fresh processes, interleaved; prints medians of
server CPU per request and the ratio. Needs uvicorn: ``pip install '.[bench]'``.

    python benchmarks/compare_stack.py --repeat 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvmeta.bench.driver import BenchConfig, run_bench  # noqa: E402
from kvmeta.bench.launch import Launch, run_on  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _uvicorn_run(cfg: BenchConfig) -> dict:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    cmd = [sys.executable, "-m", "uvicorn", "benchmarks.asgi_app:app", "--http", "httptools"]
    cmd += ["--loop", "uvloop", "--no-access-log", "--log-level", "warning", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("uvicorn did not start") from None
                time.sleep(0.1)
        cfg.url, cfg.server_pid, cfg.seed = f"http://127.0.0.1:{port}", proc.pid, ""
        return run_bench(cfg).to_dict()
    finally:
        proc.terminate()
        proc.wait(10)


def _kvmeta_run(cfg: BenchConfig) -> dict:
    return run_on(cfg, Launch("memory", ["--read-lease", "0"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0)
    args = parser.parse_args()
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("compare_stack.py runs uvicorn, which is not installed: pip install '.[bench]'")
        return 2
    runs: dict[str, list[float]] = {"kvmeta server/http.py": [], "uvicorn raw ASGI": []}
    for _ in range(args.repeat):
        for label, fn in (
            ("kvmeta server/http.py", _kvmeta_run),
            ("uvicorn raw ASGI", _uvicorn_run),
        ):
            cfg = BenchConfig(batch=64, pool_pages=65536, clients=3, duration=args.duration)
            runs[label].append(fn(cfg)["cpu_us_per_request"])
    base = statistics.median(runs["kvmeta server/http.py"])
    for label, cpu in runs.items():
        med = statistics.median(cpu)
        print(f"{label:>22}: median {med:6.1f} us CPU/request ({med / base:.2f}x)  runs {cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
