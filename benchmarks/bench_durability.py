"""Durability benchmark: recovery, snapshot stall, CPU per request per fsync mode, journal bytes.

    python benchmarks/bench_durability.py [--keys 1000000] [--cycles 300] [--clients 3]

Prints numbers, asserts nothing. CPU per request is the server's user+system time from /proc
divided by requests served, for the SGLang engine cycle (exists, reserve, confirm, get) with 64
keys per request from ``--clients`` client processes; every mode runs in the same invocation so
the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from hashlib import sha256
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import requests  # noqa: E402
from tests.support import ServerProcess  # noqa: E402

from kvmeta._types import PoolId  # noqa: E402
from kvmeta.core.pool import Pool  # noqa: E402
from kvmeta.store.codec import HEADER, encode_record  # noqa: E402
from kvmeta.store.durable import DurabilityOptions, DurableBackend  # noqa: E402
from kvmeta.store.memory import MemoryStore  # noqa: E402
from kvmeta.store.recovery import install, recover  # noqa: E402
from kvmeta.store.snapshot import capture, write_snapshot  # noqa: E402

PID = PoolId("s", 0, "kv")


def _keys(n: int) -> list[str]:
    return [f"{i:064x}" for i in range(n)]


def _recover(directory: Path) -> tuple[float, int]:
    started = time.perf_counter()
    state = recover(directory, repair=False)
    install(MemoryStore(), state, directory)
    return time.perf_counter() - started, state.keys


def bench_recovery(n: int, scratch: Path) -> None:
    keys = _keys(n)
    entries = list(zip(keys, range(n), strict=True))
    store = MemoryStore()
    store.pools[PID] = Pool.load(n, entries)
    snap_dir = scratch / "snap"
    snap_dir.mkdir()
    image = capture(store)
    started = time.perf_counter()
    write_snapshot(snap_dir, 1, image)
    write_s = time.perf_counter() - started
    stall_ms = image.capture_seconds * 1e3
    print(f"snapshot of {n:,} keys: event loop paused {stall_ms:.1f} ms to copy;")
    print(f"  walk+encode+write+fsync in a thread {write_s:.2f} s, file {_mb(snap_dir)} MB")
    took, count = _recover(snap_dir)
    print(f"recovery from snapshot: {count:,} keys in {took:.2f} s  (target < 5 s)")
    journal_dir = scratch / "journal"
    journal_dir.mkdir()
    with open(journal_dir / "journal-000000000001.log", "wb") as fh:
        fh.write(HEADER + encode_record(("pool", PID, n)))
        for i in range(0, n, 64):
            fh.write(encode_record(("commit", PID, entries[i : i + 64])))
    took, count = _recover(journal_dir)
    print(f"recovery from journal only (64-key commits): {count:,} keys in {took:.2f} s")


async def _live_snapshot(n: int, directory: Path) -> tuple[float, float, float]:
    """(copy stall, longest event-loop gap while the snapshot ran, snapshot seconds)."""
    store = MemoryStore()
    backend = DurableBackend(store, DurabilityOptions(data_dir=directory, snapshot_interval=0))
    await backend.start()
    store.pools[PID] = Pool.from_lru(n, {k: i for i, k in enumerate(_keys(n))})
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    await backend.snapshot()
    took = time.perf_counter() - started
    done = True
    await tick
    stall = backend.snapshot_stall_max
    await backend.close()
    return stall, max(gaps), took


def bench_live_snapshot(n: int, scratch: Path) -> None:
    directory = scratch / "live"
    stall, gap, took = asyncio.run(_live_snapshot(n, directory))
    print(
        f"live snapshot of {n:,} keys: copy stall {stall * 1e3:.1f} ms, longest event-loop gap "
        f"{gap * 1e3:.1f} ms (1 ms ticker) over {took:.2f} s of snapshotting"
    )


def _mb(directory: Path) -> str:
    return f"{sum(p.stat().st_size for p in directory.iterdir()) / 1e6:.0f}"


def _client(url: str, worker: int, cycles: int) -> None:
    ops = {
        op: f"{url}/0/{op}"
        for op in ("exists", "reserve_and_allocate_page_indices", "confirm_write")
    }
    get = f"{url}/0/get_page_indices"
    with requests.Session() as s:
        for c in range(cycles):
            # SGLang's keys are 64-hex-character hashes.
            keys = [sha256(f"w{worker}-{c}-{j}".encode()).hexdigest() for j in range(64)]
            s.post(ops["exists"], json={"keys": keys}).raise_for_status()
            out = s.post(
                ops["reserve_and_allocate_page_indices"], json={"keys": [[k, None] for k in keys]}
            ).json()["indices"]
            pairs = [[k, p] for k, (_, p) in zip(keys, out, strict=True)]
            s.post(ops["confirm_write"], json={"written_keys_to_confirm": pairs}).raise_for_status()
            s.post(get, json={"keys": keys}).raise_for_status()


def bench_mode(flags: list[str], cycles: int, clients: int, scratch: Path) -> tuple[float, float]:
    """(server CPU us per request, journal bytes per request)."""
    cwd = Path(tempfile.mkdtemp(dir=scratch))
    server = ServerProcess(*flags, "--read-lease", "0", cwd=cwd).start()
    try:
        requests.post(server.url + "/0/initialize", json={"num_pages": 65536}).raise_for_status()
        cpu0 = server.cpu_seconds()
        procs = [
            multiprocessing.Process(target=_client, args=(server.url, w, cycles))
            for w in range(clients)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        cpu = server.cpu_seconds() - cpu0
        time.sleep(0.1)  # let "never" mode's writer catch up before measuring bytes
        data = cwd / "kvmeta-data"
        journal = sum(p.stat().st_size for p in data.glob("journal-*.log")) if data.exists() else 0
    finally:
        server.stop()
    n = cycles * clients * 4
    return cpu / n * 1e6, journal / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2, help="runs per mode (median of CPU)")
    parser.add_argument("--skip-recovery", action="store_true", help="only the server modes")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvmeta-bench-"))
    try:
        if not args.skip_recovery:
            bench_recovery(args.keys, scratch)
            bench_live_snapshot(args.keys, scratch)
        modes = {
            "in-memory": ["--in-memory"],
            "fsync never": ["--fsync", "never"],
            "fsync batch": ["--fsync", "batch"],
            "batch 20ms": ["--fsync", "batch", "--fsync-interval", "0.02"],
            "fsync always": ["--fsync", "always"],
        }
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for _ in range(args.repeat):  # interleaved, so load drift hits every mode alike
            for mode, flags in modes.items():
                results[mode].append(bench_mode(flags, args.cycles, args.clients, scratch))
        base = _median([cpu for cpu, _ in results["in-memory"]])
        print(
            f"\nSGLang cycle, 64 keys/request, {args.clients} client processes, "
            f"{args.cycles} cycles each, {args.repeat} runs per mode (median CPU):"
        )
        print(f"{'mode':<14}{'CPU us/request':>16}{'vs in-memory':>14}{'journal B/request':>20}")
        for mode, runs in results.items():
            cpu = _median([c for c, _ in runs])
            print(f"{mode:<14}{cpu:>16.1f}{cpu / base:>13.2f}x{runs[-1][1]:>20.1f}")
        print("(journal bytes per request: averaged over all 4 requests; only confirm writes,")
        print(" one record of 64 (key, page) pairs per confirm)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


if __name__ == "__main__":
    os.environ.pop("KVMETA_DATA_DIR", None)
    main()
