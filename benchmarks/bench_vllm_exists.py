"""What one large vLLM ``batch_exists`` costs with many ranks registered, and what it does to
everybody else's requests meanwhile: a launched ``kvmeta serve`` (a tokens file with two
tenants), one tenant with ``--ranks`` worker ranks sending a ``--keys``-key batch (65,536
7-character keys: a 0.6 MB body), while a prober sends ``GET /health`` and the other tenant's
small ``batch_exists`` back to back and records each one's latency.

    python benchmarks/bench_vllm_exists.py [--mode memory|redis] [--ranks 2048]
        [--keys 65536] [--stored 0] [--repeat 5] [--src OTHER_CHECKOUT/src]

``--stored N`` stores the batch's first N keys on every rank first (the walk's worst case:
those keys cost a lookup on every rank); 0 asks for keys no rank has. ``--src`` serves another
checkout's source, for a before/after comparison. Prints medians with their spread over the
repeats; asserts nothing.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import msgspec  # noqa: E402

from kvmeta.bench.launch import LaunchedServer  # noqa: E402

BIG = "bench-big-tenant-token-0123456789"
OTHER = "bench-other-tenant-token-012345678"
_TOKENS = f"""
[[tokens]]
token = "{BIG}"
tenant = "big"
rights = ["read", "write", "admin"]

[[tokens]]
token = "{OTHER}"
tenant = "other"
rights = ["read", "write", "admin"]
"""


class _Conn:
    """One keep-alive connection with one token."""

    def __init__(self, url: str, token: str) -> None:
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        self.address = (host, int(port))
        self.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def reconnect(self) -> None:
        self.conn.close()
        self.conn = http.client.HTTPConnection(*self.address, timeout=600)

    def call(self, method: str, path: str, body: bytes = b"") -> Any:
        self.conn.request(method, path, body, self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status} {data[:300]!r}")
        return msgspec.json.decode(data) if data else None

    def post(self, path: str, obj: Any) -> Any:
        return self.call("POST", path, msgspec.json.encode(obj))


def _fill(conn: _Conn, ranks: int, keys: list[str], pages: int) -> None:
    for rank in range(ranks):
        conn.post(f"/rank/{rank}/initialize", {"role": "worker", "num_pages": pages})
        if keys:
            got = conn.post("/keys/batch_allocate", {"rank": rank, "keys": keys})["results"]
            conn.post("/keys/confirm_write", {"rank": rank, "confirmations": got})


class _Prober(threading.Thread):
    """``/health`` and the other tenant's small ``batch_exists``, back to back, timed."""

    def __init__(self, url: str, keys: list[str]) -> None:
        super().__init__(daemon=True)
        self.health = _Conn(url, OTHER)
        self.other = _Conn(url, OTHER)
        self.body = msgspec.json.encode({"keys": keys})
        self.samples: list[tuple[str, float, float]] = []  # (what, start, end), perf_counter
        self.errors: list[str] = []  # e.g. a 503: Redis busy with one long script
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for what, conn, method, path, body in (
                ("health", self.health, "GET", "/health", b""),
                ("other", self.other, "POST", "/keys/batch_exists", self.body),
            ):
                start = time.perf_counter()
                try:
                    conn.call(method, path, body)
                except (OSError, RuntimeError) as exc:
                    self.errors.append(str(exc)[:160])
                    conn.reconnect()
                self.samples.append((what, start, time.perf_counter()))


@dataclass
class _Run:
    seconds: float  # the big batch_exists
    health: float  # the longest /health that overlapped it
    other: float  # the longest batch_exists of the other tenant that overlapped it
    baseline: float  # the median probe before it
    overlapped: int  # probes that overlapped it
    failed: bool  # the big batch_exists itself failed
    errors: list[str]  # probes that failed


def _one_run(url: str, body: bytes, other_keys: list[str]) -> _Run:
    big = _Conn(url, BIG)
    prober = _Prober(url, other_keys)
    prober.start()
    time.sleep(0.3)  # probes alone, for the baseline
    start = time.perf_counter()
    failed = False
    try:
        big.call("POST", "/keys/batch_exists", body)
    except (OSError, RuntimeError) as exc:  # e.g. Redis busy with one long script: 503
        failed = True
        prober.errors.append(f"the batch_exists itself: {str(exc)[:160]}")
    end = time.perf_counter()
    time.sleep(0.05)
    prober.stop.set()
    prober.join()
    during = [(w, e - s) for w, s, e in prober.samples if s < end and e > start]
    return _Run(
        end - start,
        max((t for w, t in during if w == "health"), default=0.0),
        max((t for w, t in during if w == "other"), default=0.0),
        statistics.median(e - s for _, s, e in prober.samples if e < start),
        len(during),
        failed,
        prober.errors,
    )


def _spread(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"median {statistics.median(ms):.1f} ms (min {ms[0]:.1f}, max {ms[-1]:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("memory", "redis"), default="memory")
    parser.add_argument("--ranks", type=int, default=2048)
    parser.add_argument("--keys", type=int, default=65536)
    parser.add_argument("--stored", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--src", default=None, help="serve this checkout's src/ instead")
    args = parser.parse_args()

    keys = [f"k{i:06d}" for i in range(args.keys)]
    body = msgspec.json.encode({"keys": keys})
    with tempfile.TemporaryDirectory(prefix="kvmeta-bench-") as tmp:
        tokens = Path(tmp, "tokens.toml")
        tokens.write_text(_TOKENS)
        tokens.chmod(0o600)
        extra = ["--auth-file", str(tokens), "--read-lease", "0"]
        with LaunchedServer(args.mode, extra, args.src) as server:
            setup = time.perf_counter()
            _fill(_Conn(server.url, BIG), args.ranks, keys[: args.stored], max(args.stored, 8))
            other_keys = [f"other-{i}" for i in range(64)]
            _fill(_Conn(server.url, OTHER), 1, other_keys, 64)
            print(
                f"{args.mode}: {args.ranks} ranks, batch_exists of {args.keys} keys "
                f"({len(body) / 1e6:.2f} MB), {args.stored} of them stored on every rank "
                f"(set up in {time.perf_counter() - setup:.0f} s)"
            )
            runs = [_one_run(server.url, body, other_keys) for _ in range(args.repeat)]
    print(f"  batch_exists:                       {_spread([r.seconds for r in runs])}")
    print(f"  longest concurrent /health:         {_spread([r.health for r in runs])}")
    print(f"  longest concurrent other tenant's:  {_spread([r.other for r in runs])}")
    print(f"  probe before it (median per run):   {_spread([r.baseline for r in runs])}")
    print(f"  probes answered during it:          {[r.overlapped for r in runs]}")
    failed = sum(r.failed for r in runs)
    errors = [e for r in runs for e in r.errors]
    if failed:
        print(f"  the batch_exists failed in {failed} of {len(runs)} runs")
    if errors:
        print(f"  {len(errors)} requests failed, e.g. {errors[-1]}")


if __name__ == "__main__":
    main()
