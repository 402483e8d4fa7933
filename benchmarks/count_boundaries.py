"""Count the source-file boundaries one durable SGLang reserve crosses inside the store.

A reserve that has to evict is the longest path through the local backend: the write-ahead
rule, the store, the pool, the journal. How far a reader must follow it is measured here as
the calls from a file under ``src/kvmeta/store`` into another file, of the store or of the
pool model in ``src/kvmeta/core`` (each such call is a store-file boundary crossed, and
crossed back when it returns: "transitions" counts both ways). Calls between the pool
model's own files (the pool asking its eviction policy for a victim) are counted apart,
as "inside core". ``sys.setprofile`` watches the one request's task only (the loop's own
callbacks, such as the journal's flush timer, are other work). Two reserves of a new key,
each on a full pool whose every change is durable:

- ``spare``: a pool large enough to keep spare pages (``store.disk.writeahead``): the reserve
  takes a spare page, then evicts ahead of need to top the spare up;
- ``in place``: a pool too small for a spare: the reserve evicts on the spot, and its reply
  waits until that removal is durable.

    PYTHONPATH=src python benchmarks/count_boundaries.py [--show]

``--show`` prints each crossing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import kvmeta
from kvmeta._types import PoolId
from kvmeta.store.disk.memory import MemoryStore

ROOT = Path(kvmeta.__file__).resolve().parent
SCOPES = (str(ROOT / "store") + "/", str(ROOT / "core") + "/")
POOL = PoolId("s", 0, "kv")
SCENARIOS = {"spare": 256, "in place": 4}


def _backend(directory: Path) -> Any:
    """The durable local backend of whichever tree is on the path."""
    store = MemoryStore(read_lease=0.0)
    try:
        from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
    except ImportError:  # a tree from before the one local backend: its durable class
        durable = importlib.import_module("kvmeta.store.disk.durable")
        options = durable.DurabilityOptions(data_dir=directory, snapshot_interval=0.0)
        return durable.DurableBackend(store, options)
    return LocalBackend(store, DurabilityOptions(data_dir=directory, snapshot_interval=0.0))


def _in_scope(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    name = frame.f_code.co_filename
    return name[len(str(ROOT)) + 1 :] if name.startswith(SCOPES) else None


async def count(pages: int, show: bool) -> list[tuple[str, str, str]]:
    """Each transition of one reserve on a full pool of ``pages``: (event, from, to)."""
    with tempfile.TemporaryDirectory() as tmp:
        backend = _backend(Path(tmp))
        await backend.start()
        try:
            await backend.initialize(POOL, pages)
            step = min(16, pages)
            for i in range(0, pages, step):
                keys = [f"k{j}" for j in range(i, i + step)]
                out = await backend.reserve(POOL, keys)
                await backend.confirm(
                    POOL, [(k, p) for k, (_, p) in zip(keys, out, strict=True)], []
                )
            await backend.journal.wait(backend.journal.seq)
            crossings: list[tuple[str, str, str]] = []
            task: asyncio.Task[Any] | None = None

            def profile(frame: FrameType, event: str, _arg: object) -> None:
                if event not in ("call", "return") or asyncio.current_task() is not task:
                    return
                here, there = _in_scope(frame), _in_scope(frame.f_back)
                if here is None or there is None or here == there:
                    return
                crossings.append(
                    (event, there, here + ":" + frame.f_code.co_name)
                    if event == "call"
                    else (event, here + ":" + frame.f_code.co_name, there)
                )

            task = asyncio.ensure_future(backend.reserve(POOL, ["new-key"]))
            sys.setprofile(profile)
            try:
                out = await task
            finally:
                sys.setprofile(None)
            assert out[0][1] >= 0, out
            if show:
                for event, src, dst in crossings:
                    print(f"  {event:6} {src} -> {dst}")
            return crossings
        finally:
            await backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", action="store_true", help="print each crossing")
    args = parser.parse_args()
    print(f"store and core of {ROOT}:")
    for name, pages in SCENARIOS.items():
        crossings = asyncio.run(count(pages, args.show))
        calls = [src for event, src, _ in crossings if event == "call"]
        store = sum(1 for src in calls if src.startswith("store/"))
        print(
            f"  {name:8}: {store} store-file boundaries, {len(calls) - store} calls inside "
            f"core, {len(crossings)} transitions"
        )


if __name__ == "__main__":
    main()
