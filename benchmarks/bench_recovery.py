"""Durability in-process: recovery time, snapshot size, and how long a snapshot stalls the loop.

    python benchmarks/bench_recovery.py [--keys 1000000]

Prints numbers, asserts nothing. A server's CPU and journal bytes per request in each fsync
mode are load measurements: ``kvmeta bench --launch durable --server-arg=--fsync=MODE``
(``--launch memory`` for the in-memory baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta._types import PoolId  # noqa: E402
from kvmeta.core.pool import Pool  # noqa: E402
from kvmeta.store.disk.codec import (  # noqa: E402
    HEADER,
    Commit,
    NewPool,
    Remove,
    encode_record,
)
from kvmeta.store.disk.history import write_head  # noqa: E402
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend  # noqa: E402
from kvmeta.store.disk.memory import MemoryStore  # noqa: E402
from kvmeta.store.disk.recovery import install, recover  # noqa: E402
from kvmeta.store.disk.snapshot import capture, write_snapshot  # noqa: E402

PID = PoolId("s", 0, "kv")


def _keys(n: int) -> list[str]:
    return [f"{i:064x}" for i in range(n)]


def _recover(directory: Path) -> tuple[str, int]:
    """How long recovery took, and its CPU (on a busy machine the wall time mostly measures
    the other processes); the keys recovered."""
    started, cpu = time.perf_counter(), time.process_time()
    state = recover(directory, repair=False)
    install(MemoryStore(), state, directory)
    took = f"{time.perf_counter() - started:.2f} s ({time.process_time() - cpu:.2f} s CPU)"
    return took, state.keys


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
    write_head(snap_dir, 0)  # as a server's data directory has (store.disk.history)
    stall_ms = image.capture_seconds * 1e3
    print(f"snapshot of {n:,} keys: event loop paused {stall_ms:.1f} ms to copy;")
    print(f"  walk+encode+write+fsync in a thread {write_s:.2f} s, file {_mb(snap_dir)} MB")
    took, count = _recover(snap_dir)
    print(f"recovery from snapshot: {count:,} keys in {took}  (target < 5 s)")
    journal_dir = scratch / "journal"
    journal_dir.mkdir()
    with open(journal_dir / "journal-000000000001.log", "wb") as fh:
        fh.write(HEADER + encode_record(NewPool(PID, n)))
        for i in range(0, n, 64):
            fh.write(encode_record(Commit(PID, entries[i : i + 64])))
    took, count = _recover(journal_dir)
    print(f"recovery from journal only (64-key commits): {count:,} keys in {took}")
    # The engine cycle after a snapshot: each 64-key commit reuses the pages of 64 keys the
    # snapshot holds, evicted just before (removals of keys only the snapshot names).
    turned = snap_dir / "journal-000000000001.log"
    fresh = [f"{i:064x}" for i in range(n, n + n // 128 * 64)]
    with open(turned, "wb") as fh:
        fh.write(HEADER)
        for i in range(0, len(fresh), 64):
            fh.write(encode_record(Remove(PID, entries[i : i + 64])))
            pages = range(i, min(i + 64, len(fresh)))
            fh.write(encode_record(Commit(PID, [(fresh[p], p) for p in pages])))
    took, count = _recover(snap_dir)
    print(
        f"recovery from the snapshot and a journal turning over half of it "
        f"({_mb_file(turned)} MB): {count:,} keys in {took}"
    )


async def _live_snapshot(n: int, directory: Path) -> tuple[float, float, float]:
    """(copy stall, longest event-loop gap while the snapshot ran, snapshot seconds)."""
    store = MemoryStore()
    backend = LocalBackend(store, DurabilityOptions(data_dir=directory, snapshot_interval=0))
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
    assert backend.disk is not None
    stall = backend.disk.snapshot_stall_max
    await backend.close()
    return stall, max(gaps), took


def bench_live_snapshot(n: int, scratch: Path) -> None:
    directory = scratch / "live"
    stall, gap, took = asyncio.run(_live_snapshot(n, directory))
    print(
        f"live snapshot of {n:,} keys: copy stall {stall * 1e3:.1f} ms, longest event-loop gap "
        f"{gap * 1e3:.1f} ms (1 ms ticker) over {took:.2f} s of snapshotting"
    )


def _mb_file(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.0f}"


def _mb(directory: Path) -> str:
    return f"{sum(p.stat().st_size for p in directory.iterdir()) / 1e6:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench_recovery.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--keys", type=int, default=1_000_000, help="keys in the pool (default: %(default)s)"
    )
    parser.add_argument(
        "--no-live", action="store_true", help="skip the live snapshot's loop-stall measurement"
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvmeta-bench-"))
    try:
        bench_recovery(args.keys, scratch)
        if not args.no_live:
            bench_live_snapshot(args.keys, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
