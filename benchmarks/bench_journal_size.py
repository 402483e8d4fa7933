"""The data directory under sustained load, and restart-to-listening after kill -9.

    python benchmarks/bench_journal_size.py disk [--pool-pages 65536] [--duration 30]
    python benchmarks/bench_journal_size.py restart [--keys 1000000] [--kills 5]

``disk``: ``kvmeta bench --launch durable`` drives the engine cycle while this script samples
the launched server's data directory every 20 ms: its largest total size, the largest snapshot,
the journal budget (``store.disk.compaction``) and the target ``2 x snapshot + budget``, plus the
bench's own CPU per request, req/s and p99.

``restart``: a server on a data directory of ``--keys`` stored keys, under ``kvmeta bench
--url`` load, is killed with SIGKILL at random points of its snapshot cycle; each restart is
timed from exec to its "kvmeta listening" line, with the journal and snapshot bytes it found
and the recovery time it logged.

Prints numbers, asserts nothing. ``--server-arg`` passes flags to ``kvmeta serve`` (e.g.
``--server-arg=--snapshot-journal-bytes=0 --server-arg=--snapshot-journal-ratio=0`` for
time-driven snapshots only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from kvmeta.store.disk.compaction import JournalBudget  # noqa: E402
from kvmeta.store.disk.local import DurabilityOptions  # noqa: E402

_LISTEN_RE = re.compile(r"kvmeta listening on http://([^\s:]+):(\d+)")
_RECOVERED_RE = re.compile(r"recovered .* (\d+) keys .* in ([\d.]+) s")
_DEFAULTS = DurabilityOptions(data_dir=None)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return env


def _flag(args: list[str], name: str, default: float) -> float:
    for arg in args:
        if arg.startswith(name + "="):
            return float(arg.split("=", 1)[1])
    return default


def budget(server_args: list[str], snapshot_bytes: int) -> int:
    """The journal budget the server applies (``store.disk.compaction``), 0: none."""
    cap = int(_flag(server_args, "--snapshot-journal-bytes", _DEFAULTS.snapshot_journal_bytes))
    ratio = _flag(server_args, "--snapshot-journal-ratio", _DEFAULTS.snapshot_journal_ratio)
    return JournalBudget(ratio, cap, snapshot_bytes).limit()


@dataclass
class DirSize:
    """What the data directory held, sampled."""

    total_max: int = 0
    snapshot_max: int = 0
    journal_max: int = 0
    snapshots_seen: set[str] = field(default_factory=set)
    samples: int = 0

    def sample(self, directory: Path) -> tuple[int, int]:
        """(journal bytes, newest snapshot bytes) now."""
        total = journal = snap = 0
        newest = ""
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return 0, 0
        for entry in entries:
            try:
                size = entry.stat().st_size
            except FileNotFoundError:
                continue  # compacted between the listing and the stat
            total += size
            if entry.name.startswith("journal-"):
                journal += size
            elif entry.name.startswith("snapshot-") and entry.name.endswith(".snap"):
                self.snapshots_seen.add(entry.name)
                if entry.name > newest:
                    newest, snap = entry.name, size
        self.total_max = max(self.total_max, total)
        self.snapshot_max = max(self.snapshot_max, snap)
        self.journal_max = max(self.journal_max, journal)
        self.samples += 1
        return journal, snap


def disk_run(args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    """One ``kvmeta bench --launch durable`` run, its data directory sampled."""
    tmp = Path(tempfile.mkdtemp(dir=scratch))
    cmd = [sys.executable, "-m", "kvmeta", "bench", "--launch", "durable", "--json"]
    cmd += ["--pool-pages", str(args.pool_pages), "--duration", str(args.duration)]
    cmd += [f"--server-arg={a}" for a in args.server_arg]
    env = {**_env(), "TMPDIR": str(tmp)}  # the launched server's data directory goes there
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    sizes = DirSize()
    while bench.poll() is None:
        for data in tmp.glob("kvmeta-bench-*/data"):
            sizes.sample(data)
        time.sleep(0.02)
    assert bench.stdout is not None
    report = json.loads(bench.stdout.read())
    result = report["results"][0] if "results" in report else report
    limit = budget(args.server_arg, sizes.snapshot_max)
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "disk_max_mb": sizes.total_max / 1e6,
        "snapshot_max_mb": sizes.snapshot_max / 1e6,
        "journal_max_mb": sizes.journal_max / 1e6,
        "budget_mb": limit / 1e6,
        "target_mb": (2 * sizes.snapshot_max + limit) / 1e6,
        "snapshots": float(len(sizes.snapshots_seen)),
        "cpu_us_per_req": result["cpu_us_per_request"],
        "req_per_s": result["requests_per_s"],
        "p99_us": result["latency_p99_us"],
    }


def disk(args: argparse.Namespace, scratch: Path) -> None:
    runs = [disk_run(args, scratch) for _ in range(args.repeat)]
    print(
        f"disk use, engine cycle, {args.pool_pages} pages, {args.duration:g} s, "
        f"server args {args.server_arg or '(defaults)'}; median [min-max] of {len(runs)} runs"
    )
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(
            f"  {key:16} {statistics.median(values):10.1f}  [{min(values):.1f}-{max(values):.1f}]"
        )


class Server:
    """``kvmeta serve`` on ``data``, timed from exec to its listening line."""

    def __init__(self, data: Path, extra: list[str]) -> None:
        self.data = data
        self.extra = extra
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.listen_seconds = 0.0
        self.recovery_seconds = 0.0
        self.lines: list[str] = []

    def start(self, timeout: float = 120.0) -> Server:
        cmd = [sys.executable, "-m", "kvmeta", "serve", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--data-dir", str(self.data), "--read-lease", "0", *self.extra]
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env()
        )
        listening = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                if len(self.lines) < 2000:
                    self.lines.append(line)
                if m := _RECOVERED_RE.search(line):
                    self.recovery_seconds = float(m.group(2))
                if not listening.is_set() and (m := _LISTEN_RE.search(line)):
                    self.listen_seconds = time.perf_counter() - started
                    self.url = f"http://{m.group(1)}:{m.group(2)}"
                    listening.set()

        threading.Thread(target=read, daemon=True).start()
        if not listening.wait(timeout):
            self.kill()
            raise SystemExit("server did not start:\n" + "".join(self.lines[-20:]))
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def _load(url: str, pages: int, prefill: bool) -> subprocess.Popen[bytes]:
    """The engine cycle on ``url`` until stopped; ``prefill``: fill the pool first."""
    cmd = [sys.executable, "-m", "kvmeta", "bench", "--url", url, "--pool-pages", str(pages)]
    cmd += ["--duration", "3600", "--warmup", "0", *([] if prefill else ["--no-prefill"])]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,
    )


def _stop(load: subprocess.Popen[bytes] | None) -> None:
    """Kill the load's bench and its client processes (its own process group)."""
    if load is not None and load.poll() is None:
        os.killpg(load.pid, signal.SIGKILL)
        load.wait()


def _stored(url: str) -> int:
    import requests

    try:
        pools = requests.get(f"{url}/v1/pools", timeout=5).json()["pools"]
    except (requests.RequestException, ValueError, KeyError):
        return 0
    return sum(int(p.get("stored", 0)) for p in pools)


def restart(args: argparse.Namespace, scratch: Path) -> None:
    data = scratch / "data"
    rng = random.Random(args.seed)
    # A restart holds the free pages below each pool's frontier for one reservation TTL
    # (store.disk.recovery): a short one lets the load fill them again between two kills.
    server_args = ["--reservation-ttl", "5", *args.server_arg]
    server = Server(data, server_args).start()
    rows = []
    # A full pool keeps a few batches' worth of pages evicted ahead (store.disk.writeahead): with
    # 1/64 more pages than keys, about ``--keys`` stay stored.
    pages = args.keys + args.keys // 64
    load: subprocess.Popen[bytes] | None = None
    try:
        for kill in range(args.kills):
            load = _load(server.url, pages, prefill=kill == 0)
            deadline = time.monotonic() + 120
            while (
                stored := _stored(server.url)
            ) < args.keys * 0.98 and time.monotonic() < deadline:
                time.sleep(0.2)
            wait = rng.uniform(args.min_wait, args.max_wait)
            time.sleep(wait)
            sizes = DirSize()
            server.kill()
            _stop(load)
            journal, snap = sizes.sample(data)
            server = Server(data, server_args).start()
            rows.append((wait, journal, snap, server.recovery_seconds, server.listen_seconds))
            print(
                f"kill {kill + 1}: {stored} keys, after {wait:4.1f} s of load: "
                f"journal {journal / 1e6:6.1f} MB, "
                f"snapshot {snap / 1e6:5.1f} MB -> recovery {server.recovery_seconds:.2f} s, "
                f"exec to listening {server.listen_seconds:.2f} s",
                flush=True,
            )
    finally:
        server.kill()
        _stop(load)
    listen = [r[4] for r in rows]
    recov = [r[3] for r in rows]
    print(
        f"restart after kill -9, {args.keys} keys, server args {args.server_arg or '(defaults)'}: "
        f"exec to listening median {statistics.median(listen):.2f} s "
        f"[{min(listen):.2f}-{max(listen):.2f}], recovery median {statistics.median(recov):.2f} s "
        f"[{min(recov):.2f}-{max(recov):.2f}], journal at the kill up to "
        f"{max(r[1] for r in rows) / 1e6:.1f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench_journal_size.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("what", choices=("disk", "restart"))
    parser.add_argument(
        "--server-arg", action="append", default=[], help="a kvmeta serve flag, repeatable"
    )
    parser.add_argument("--pool-pages", type=int, default=65536, help="disk: pool size")
    parser.add_argument("--duration", type=float, default=30.0, help="disk: seconds of load")
    parser.add_argument("--repeat", type=int, default=3, help="disk: runs (default 3)")
    parser.add_argument("--keys", type=int, default=1_000_000, help="restart: stored keys")
    parser.add_argument("--kills", type=int, default=5, help="restart: kills (default 5)")
    parser.add_argument("--min-wait", type=float, default=0.0, help="restart: earliest kill, s")
    parser.add_argument("--max-wait", type=float, default=15.0, help="restart: latest kill, s")
    parser.add_argument("--seed", type=int, default=1, help="restart: kill times' seed")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvmeta-bench-journal-"))
    try:
        (disk if args.what == "disk" else restart)(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
