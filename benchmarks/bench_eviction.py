"""What each ``--eviction`` policy leaves reachable in a pool behind engines' host caches.

    python benchmarks/bench_eviction.py [--trace FILE.jsonl] [--requests 4000] [--seed 1]
        [--seeds 1] [--policies lru,prefix] [--pool-shares 0.02,0.05,0.10] [--engines 4]
        [--l2-share 0.02] [--src DIR] [--in-process [--hot-share X]] [--send-prefix] [--json]

Replays a trace of requests, each a chain of block ids, through a real ``kvmeta serve
--in-memory --read-lease 0 --eviction X`` (one per policy and pool size, on a free port), as
``--engines`` engines would: each engine holds a private LRU host cache (L2) of ``--l2-share``
of the trace's unique blocks. Per request, on an engine drawn at random: the leading run of
blocks in its L2 is not asked of kvmeta; the rest is asked with ``exists`` (the leading hits
are what kvmeta serves), read with ``get_page_indices``, the remaining pages reserved and
confirmed; the whole request then enters the engine's L2.

Reported per policy and pool size (``--pool-shares`` of the unique blocks): the share of all
pages kvmeta served (leading hits), and the share of stored pages whose parent block is not
stored ("dead": past a miss for every leading-hit lookup), sampled ten times over the replay by
asking ``exists`` for every block seen so far and averaged; with it the server's own
``kvmeta_dead_pages`` at the end (prefix only). With ``--seeds N``, the replay is repeated with
N seeds (which engine serves each request, and the generated trace) and each policy's served
share over the first's is summed up as a median and range: one seed alone can mislead.

The trace is ``--trace`` (JSON lines with chained ``hash_ids``, as Mooncake's FAST'25 traces)
or, without it, generated with the shape of LLM traffic (``generate``): conversations whose
turns extend their earlier requests, shared system prompts and documents with Zipf
popularity. Not a timed test: the numbers are shares of pages, not speeds.

``--in-process`` replays the same requests on a ``core.pool.Pool`` of ``--src`` instead of a
server, with the same results in a fraction of the time; with it, ``--hot-share`` sets
``core.prefix.HOT_SHARE`` (the share of used pages ``prefix`` keeps), to try others.

``--send-prefix`` names each reserve's first key's parent block as its prefix key (the wire's
``[key, prefix_key]`` pairs), as an engine that passes prefix information through would; the
released engines send ``""``, so without it kvmeta learns a parent only from the keys it is
asked for, and the first new page after a request's host-cached blocks has none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
NS = "kv"
# Keys per exists call when sampling what is stored (under the default --max-keys).
_SAMPLE_BATCH = 16384


# ---------------------------------------------------------------------- traces


def read_trace(path: Path, limit: int = 0) -> list[list[int]]:
    """Each line's ``hash_ids`` (Mooncake's format: equal ids are equal blocks, in chain
    order), as chains of block ids unique by prefix: an id seen after another parent than the
    first time is a different block to a prefix cache, so it is renamed."""
    nodes: dict[tuple[int, int], int] = {}
    out: list[list[int]] = []
    with path.open() as lines:
        for line in lines:
            if not line.strip():
                continue
            ids = json.loads(line)["hash_ids"]
            chain, parent = [], -1
            for block in ids:
                parent = nodes.setdefault((parent, block), len(nodes))
                chain.append(parent)
            out.append(chain)
            if limit and len(out) >= limit:
                break
    return out


class _Trie:
    """Block ids unique by prefix: the id of (parent id, label)."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[int, object], int] = {}

    def extend(self, chain: list[int], labels: Iterator[object] | list[object]) -> list[int]:
        out = list(chain)
        parent = out[-1] if out else -1
        for label in labels:
            parent = self.nodes.setdefault((parent, label), len(self.nodes))
            out.append(parent)
        return out


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    """An index 0..n-1, index i with weight 1/(i+1)^s."""
    weights = _zipf_weights(n, s)
    return rng.choices(range(n), cum_weights=weights)[0]


_ZIPF: dict[tuple[int, float], list[float]] = {}


def _zipf_weights(n: int, s: float) -> list[float]:
    cum = _ZIPF.get((n, s))
    if cum is None:
        total, cum = 0.0, []
        for i in range(n):
            total += 1.0 / (i + 1) ** s
            cum.append(total)
        _ZIPF[(n, s)] = cum
    return cum


def generate(requests_: int, seed: int) -> list[list[int]]:
    """Requests with the shape of LLM traffic: a new conversation starts from one of 20 system
    prompts (4-16 blocks, Zipf popularity), half the time followed by one of 200 documents
    (8-64 blocks, Zipf), then the user's turn (1-8 blocks); a later turn of a live
    conversation (60 % of requests) extends its last request by the answer and the next turn
    (2-12 blocks). Conversations end after 1-10 turns."""
    rng = random.Random(seed)
    trie = _Trie()
    prompts = [rng.randint(4, 16) for _ in range(20)]
    documents = [rng.randint(8, 64) for _ in range(200)]
    live: list[tuple[list[int], int]] = []  # (last chain, turns left)
    fresh = 0
    out: list[list[int]] = []
    for _ in range(requests_):
        if live and rng.random() < 0.6:
            i = rng.randrange(len(live))
            chain, left = live[i]
            labels = [("t", fresh + j) for j in range(rng.randint(2, 12))]
            fresh += len(labels)
            chain = trie.extend(chain, labels)
            if left <= 1:
                live[i] = live[-1]
                live.pop()
            else:
                live[i] = (chain, left - 1)
        else:
            p = _zipf(rng, len(prompts))
            chain = trie.extend([], [("p", p, j) for j in range(prompts[p])])
            if rng.random() < 0.5:
                d = _zipf(rng, len(documents))
                chain = trie.extend(chain, [("d", d, j) for j in range(documents[d])])
            labels = [("t", fresh + j) for j in range(rng.randint(1, 8))]
            fresh += len(labels)
            chain = trie.extend(chain, labels)
            live.append((chain, rng.randint(1, 10)))
        out.append(chain)
    return out


# ---------------------------------------------------------------------- the replay


@dataclass
class Result:
    policy: str
    pool_share: float
    pool_pages: int
    pages: int = 0
    l2: int = 0
    l3: int = 0
    dead_samples: list[float] = field(default_factory=list)
    server_dead: float | None = None

    @property
    def l3_share(self) -> float:
        return self.l3 / self.pages if self.pages else 0.0

    @property
    def dead_share(self) -> float:
        return sum(self.dead_samples) / len(self.dead_samples) if self.dead_samples else 0.0


class _L2:
    """An engine's host cache: LRU over block ids."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def leading(self, chain: list[int]) -> int:
        n = 0
        for block in chain:
            if block not in self.blocks:
                break
            self.blocks.move_to_end(block)
            n += 1
        return n

    def add(self, chain: list[int]) -> None:
        blocks = self.blocks
        for block in chain:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _serve(policy: str, src: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, "-m", "kvmeta", "serve", "--in-memory", "--read-lease", "0"]
    cmd += ["--port", str(port), "--eviction", policy, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"kvmeta serve --eviction {policy} did not become ready on {url}")


class _Server:
    """The replay's requests to a real ``kvmeta serve``."""

    def __init__(self, policy: str, pages: int, src: Path) -> None:
        self.proc, self.url = _serve(policy, src)
        self.http = requests.Session()
        self.post("/0/initialize", {"num_pages": pages, "namespace": NS})

    def post(self, path: str, body: object) -> requests.Response:
        reply = self.http.post(self.url + path, json=body, timeout=60)
        reply.raise_for_status()
        return reply

    def exists(self, keys: list[str]) -> list[bool]:
        found: list[bool] = self.post("/0/exists", {"keys": keys, "namespace": NS}).json()["exists"]
        return found

    def get(self, keys: list[str]) -> None:
        self.post("/0/get_page_indices", {"keys": keys, "namespace": NS})

    def store(self, keys: list[str], parent: str | None) -> None:
        body = {
            "keys": [[k, parent if i == 0 else None] for i, k in enumerate(keys)],
            "namespace": NS,
        }
        got = self.post("/0/reserve_and_allocate_page_indices", body).json()["indices"]
        pairs = [[k, p] for k, (hit, p) in zip(keys, got, strict=True) if not hit and p >= 0]
        self.post("/0/confirm_write", {"written_keys_to_confirm": pairs, "namespace": NS})

    def dead(self) -> float | None:
        return _server_dead(self.http, self.url)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class _Pool:
    """The same requests on an in-process ``core.pool.Pool`` (``--in-process``)."""

    def __init__(self, policy: str, pages: int, src: Path) -> None:
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
        from kvmeta.core import EVICTION_POLICIES
        from kvmeta.core.pool import Pool

        self.pool = Pool(pages, read_lease=0.0, policy=EVICTION_POLICIES[policy])
        self.now = 0.0

    def exists(self, keys: list[str]) -> list[bool]:
        return self.pool.exists(keys)

    def get(self, keys: list[str]) -> None:
        self.now += 0.001
        self.pool.get(keys, self.now)

    def store(self, keys: list[str], parent: str | None) -> None:
        got = self.pool.reserve(keys, self.now, [], parent=parent)
        pairs = [(k, p) for k, (hit, p) in zip(keys, got, strict=True) if not hit and p >= 0]
        self.pool.confirm(pairs, [], self.now)

    def dead(self) -> float | None:
        dead = getattr(self.pool.policy, "dead", None)
        return None if dead is None else float(dead)

    def close(self) -> None:
        pass


def replay(
    trace: list[list[int]],
    policy: str,
    pool_share: float,
    engines: int,
    l2_share: float,
    seed: int,
    src: Path,
    in_process: bool = False,
    send_prefix: bool = False,
) -> Result:
    unique = len({block for chain in trace for block in chain})
    pages = max(1, int(unique * pool_share))
    result = Result(policy, pool_share, pages)
    caches = [_L2(max(1, int(unique * l2_share))) for _ in range(engines)]
    rng = random.Random(seed)
    parent: dict[int, int] = {}
    target = (_Pool if in_process else _Server)(policy, pages, src)
    try:
        every = max(1, len(trace) // 10)
        for n, chain in enumerate(trace, 1):
            for before, block in zip(chain, chain[1:]):  # noqa: B905 - one shorter
                parent.setdefault(block, before)
            cache = caches[rng.randrange(engines)]
            lead = cache.leading(chain)
            rest = [str(b) for b in chain[lead:]]
            result.pages += len(chain)
            result.l2 += lead
            if rest:
                found = target.exists(rest)
                hits = next((i for i, hit in enumerate(found) if not hit), len(found))
                result.l3 += hits
                if hits:
                    target.get(rest[:hits])
                if hits < len(rest):
                    before = lead + hits  # the blocks before the first one to store
                    named = str(chain[before - 1]) if send_prefix and before else None
                    target.store(rest[hits:], named)
            cache.add(chain)
            if n % every == 0:
                result.dead_samples.append(_dead_share(target.exists, parent))
        result.server_dead = target.dead()
    finally:
        target.close()
    return result


def _dead_share(exists: Callable[[list[str]], list[bool]], parent: dict[int, int]) -> float:
    """Stored blocks whose parent block is not stored, over stored blocks (asked by exists)."""
    blocks = list(parent.keys() | set(parent.values()))
    stored: set[int] = set()
    for i in range(0, len(blocks), _SAMPLE_BATCH):
        part = blocks[i : i + _SAMPLE_BATCH]
        found = exists([str(b) for b in part])
        stored.update(b for b, hit in zip(part, found, strict=True) if hit)
    if not stored:
        return 0.0
    dead = sum(1 for b in stored if b in parent and parent[b] not in stored)
    return dead / len(stored)


def _server_dead(http: requests.Session, url: str) -> float | None:
    for line in http.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvmeta_dead_pages{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, help="JSON lines with hash_ids (default: generate)")
    parser.add_argument("--requests", type=int, default=4000, help="requests (0: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds", type=int, default=1, help="replay with seeds --seed.. (engine choice, trace)"
    )
    parser.add_argument("--policies", default="lru,prefix")
    parser.add_argument("--pool-shares", default="0.02,0.05,0.10")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--l2-share", type=float, default=0.02)
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="kvmeta to serve")
    parser.add_argument(
        "--in-process", action="store_true", help="replay on a Pool of --src, no server"
    )
    parser.add_argument("--hot-share", type=float, help="prefix's HOT_SHARE (--in-process)")
    parser.add_argument(
        "--send-prefix", action="store_true", help="name each reserve's first parent block"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.hot_share is not None:
        if not args.in_process:
            parser.error("--hot-share needs --in-process (a server keeps its own)")
        sys.path.insert(0, str(args.src))
        from kvmeta.core import prefix

        prefix.HOT_SHARE = args.hot_share
    policies = args.policies.split(",")
    shares = [float(s) for s in args.pool_shares.split(",")]
    rows: list[tuple[int, Result]] = []
    for seed in range(args.seed, args.seed + args.seeds):
        if args.trace:
            trace = read_trace(args.trace, args.requests)
            name = f"{args.trace.name} (engine seed {seed})"
        else:
            trace = generate(args.requests, seed)
            name = f"generated (seed {seed})"
        unique = len({block for chain in trace for block in chain})
        total = sum(map(len, trace))
        print(
            f"trace: {name}, {len(trace)} requests, {total} pages, {unique} unique blocks; "
            f"{args.engines} engines, L2 {args.l2_share:.0%} each",
            file=sys.stderr,
        )
        for share in shares:
            for policy in policies:
                res = replay(
                    trace,
                    policy,
                    share,
                    args.engines,
                    args.l2_share,
                    seed,
                    args.src,
                    args.in_process,
                    args.send_prefix,
                )
                rows.append((seed, res))
                print(
                    f"pool {share:>5.0%} ({res.pool_pages:>6} pages)  {policy:<7} "
                    f"L3-served {res.l3_share:6.2%}  L2 {res.l2 / res.pages:6.2%}  "
                    f"dead {res.dead_share:6.2%}  (server: {res.server_dead})",
                    file=sys.stderr,
                    flush=True,
                )
    if args.seeds > 1 and len(policies) > 1:
        _summary(rows, policies, shares)
    if args.json:
        json.dump(
            [
                {
                    "seed": seed,
                    "policy": r.policy,
                    "pool_share": r.pool_share,
                    "pool_pages": r.pool_pages,
                    "l3_share": r.l3_share,
                    "l2_share": r.l2 / r.pages,
                    "dead_share": r.dead_share,
                    "server_dead": r.server_dead,
                }
                for seed, r in rows
            ],
            sys.stdout,
            indent=1,
        )
        print()


def _summary(rows: list[tuple[int, Result]], policies: list[str], shares: list[float]) -> None:
    """Each policy's served share over the first policy's, per pool size: the median over the
    seeds and its range (the seeds change which engine serves each request, and so the
    shares: one seed alone can mislead by several per cent)."""
    served = {(seed, r.policy, r.pool_share): r.l3_share for seed, r in rows}
    seeds = sorted({seed for seed, _ in rows})
    base = policies[0]
    for share in shares:
        for policy in policies[1:]:
            ratios = sorted(
                served[(seed, policy, share)] / served[(seed, base, share)]
                for seed in seeds
                if served[(seed, base, share)]
            )
            if not ratios:
                continue
            print(
                f"pool {share:>5.0%}  {policy}/{base} served: median "
                f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}), "
                f"{len(ratios)} seeds",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
