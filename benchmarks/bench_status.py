"""What the status page's poll costs: one ``GET /v1/status`` and one background sample, with
1,000 pools, in-process (handler plus JSON encoding), and the longest the loop was held during
a sample: what a request arriving then would wait, measured as the loop thread's CPU time
between two runs of a task that only yields (CPU time, so that other processes taking the
core meanwhile, on a busy machine, do not count).

    python benchmarks/bench_status.py [--pools 1000] [--calls 60]

Prints medians with their spread; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import msgspec  # noqa: E402

from kvmeta.config import Settings  # noqa: E402
from kvmeta.server.http import Request  # noqa: E402
from kvmeta.server.runner import build_app  # noqa: E402
from kvmeta.server.status_page import StatusState  # noqa: E402
from kvmeta.service.limits import RequestLimits  # noqa: E402
from kvmeta.service.ops import Service  # noqa: E402
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore  # noqa: E402


def _spread(times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    return f"median {statistics.median(ms):.2f} ms (min {ms[0]:.2f}, max {ms[-1]:.2f})"


async def _sample_with_stall(state: StatusState, now: float, wall: float) -> tuple[float, float]:
    """One sample's duration and the longest the loop was held (``thread_time`` between the
    runs of a task yielding meanwhile)."""
    gaps = [0.0]
    done = False

    async def ticker() -> None:
        last = time.thread_time()
        while not done:
            await asyncio.sleep(0)
            t = time.thread_time()
            gaps.append(t - last)
            last = t

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = time.perf_counter()
    await state.sample(now=now, wall=wall)
    took = time.perf_counter() - start
    done = True
    await task
    return took, max(gaps)


async def _measure(pools: int, calls: int) -> None:
    limits = RequestLimits(max_pools_per_tenant=max(pools, RequestLimits.max_pools_per_tenant))
    app = build_app(Settings(in_memory=True), Service(LocalBackend(MemoryStore()), limits))
    (state,) = [
        job.__self__
        for job in app.background
        if isinstance(getattr(job, "__self__", None), StatusState)
    ]
    for rank in range(pools):
        body = msgspec.json.encode({"num_pages": 64})
        await app(Request("POST", f"/{rank}/initialize", "", body, None))
    samples, stalls, answers = [], [], []
    for i in range(150):  # a full history, and rates for every pool
        took, stall = await _sample_with_stall(state, 1000.0 + 2 * i, 1e9 + 2 * i)
        samples.append(took)
        stalls.append(stall)
    for _ in range(calls):
        start = time.perf_counter()
        resp = await app(Request("GET", "/v1/status", "", b"", None))
        answers.append(time.perf_counter() - start)
        assert resp.status == 200
    print(
        f"{pools} pools: one sample {_spread(samples)}; longest loop hold in a sample "
        f"{_spread(stalls)}; GET /v1/status {_spread(answers)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    asyncio.run(_measure(args.pools, args.calls))


if __name__ == "__main__":
    main()
