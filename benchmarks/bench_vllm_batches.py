"""What vLLM's connector strands when a batch does not fit: whole batches against per-key grants.

    python benchmarks/bench_vllm_batches.py [--pages 8192] [--batch 64] [--loads 2]
        [--scattered N] [--eviction prefix|lru] [--step 0.05] [--seconds 600] [--seed 1]
        [--json]

vLLM's HF3FS connector gives up a whole save task when any key of its ``batch_allocate`` gets
``-1``, and neither confirms nor releases the pages the other keys got: they stay reserved until
``--reservation-ttl`` (300 s). kvmeta grants a vLLM batch whole or not at all
(docs/guarantees.md); SGLang's per-key grant is what the batch got before. This replays, on an
in-process ``core.pool.Pool`` with the server's default leases and ``--eviction`` policy, one
rank under a steady load: every ``--step`` seconds a save task of ``--batch`` new keys (the
connector's logic: confirm every page, or on any ``-1`` do nothing more) and ``--loads`` load
tasks, each reading the keys of one of the saves a full pool can still hold, in order, as the
connector loads a request's blocks; or, with ``--scattered N``, one get of N keys of those
saves drawn at random. Each read holds its page for the 5 s read lease, so under enough loads
some batches cannot be placed.

Printed per grant rule: the save tasks that failed, the pages stranded in reservations no
writer will confirm (sampled every simulated second: median and maximum), and the pages
stored at the end. Not a timed test: the numbers are counts, the same on every machine for a
seed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kvmeta.core import EVICTION_POLICIES, RESERVED  # noqa: E402
from kvmeta.core.pool import Pool  # noqa: E402

RESERVATION_TTL = 300.0  # kvmeta serve's defaults
READ_LEASE = 5.0


@dataclass
class Result:
    rule: str
    tasks: int = 0
    failed: int = 0
    stranded: list[int] = field(default_factory=list)  # sampled every simulated second
    stored: int = 0

    def row(self) -> str:
        return (
            f"{self.rule:<8} failed saves {self.failed:>6} of {self.tasks} "
            f"({self.failed / self.tasks:6.1%}); stranded pages median "
            f"{statistics.median(self.stranded):>6.0f}, max {max(self.stranded):>6}; "
            f"stored at the end {self.stored}"
        )


def replay(
    whole: bool,
    eviction: str,
    pages: int,
    batch: int,
    loads: int,
    scattered: int,
    step: float,
    seconds: float,
    seed: int,
) -> Result:
    rng = random.Random(seed)
    policy = EVICTION_POLICIES[eviction]
    pool = Pool(pages, reservation_ttl=RESERVATION_TTL, read_lease=READ_LEASE, policy=policy)
    result = Result("whole" if whole else "per-key")
    abandoned: set[int] = set()  # pages of failed tasks, reserved until their lease ends
    saves: list[list[str]] = []
    window = max(1, pages // batch)
    sample = 0.0
    now = 0.0
    n = 0
    while now < seconds:
        keys = [f"{n}-{i}" for i in range(batch)]
        n += 1
        got = pool.reserve(keys, now, [], whole)
        result.tasks += 1
        if any(page < 0 for _, page in got):
            result.failed += 1  # the connector's _fail_task: no confirm, no release
            abandoned.update(page for hit, page in got if not hit and page >= 0)
        else:
            pool.confirm([(k, p) for k, (_, p) in zip(keys, got, strict=True)], [], now)
            saves.append(keys)
        recent = saves[-window:]  # the saves a full pool can still hold
        if scattered and recent:
            pool.get([rng.choice(rng.choice(recent)) for _ in range(scattered)], now)
        elif recent:
            for _ in range(loads):
                pool.get(rng.choice(recent), now)
        if now >= sample:
            abandoned = {page for page in abandoned if pool.state_of(page) == RESERVED}
            result.stranded.append(len(abandoned))
            sample += 1.0
        now += step
    result.stored = pool.stored_count
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--loads", type=int, default=2, help="load tasks per step")
    parser.add_argument(
        "--scattered", type=int, default=0, help="instead, one get of N random stored keys"
    )
    parser.add_argument("--step", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="prefix")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for whole in (True, False):
        res = replay(
            whole,
            args.eviction,
            args.pages,
            args.batch,
            args.loads,
            args.scattered,
            args.step,
            args.seconds,
            args.seed,
        )
        print(res.row(), file=sys.stderr, flush=True)
        rows.append(res)
    if args.json:
        json.dump([asdict(r) for r in rows], sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
