"""KV events on vs off at the SGLang batch-64 cycle, side by side in one run.

    python benchmarks/bench_events.py [--launch memory|durable] [--duration 10] [--clients 3]
                                      [--warmup 1] [--pool-pages 65536]
                                      [--repeat 2] [--load saturation|normal|both]
                                      [--load-rate REQ_PER_S] [--capacity-seconds 3]
                                      [--app-cycles 4000] [--replay] [--full-subscriber]
                                      [--json]

Two loads (``--load``): *saturation*, the clients in a closed loop (each sends its next
request as soon as the last is answered: the machine's capacity), and *normal*, the same
clients paced at ``--load-rate`` requests/s in total at random times (``kvmeta bench --rate``;
default half the events-off capacity just measured). At saturation a server whose requests
cost more also serves fewer of them, and on 2 shared cores that changes how many requests each
loop pass serves and how often the server sleeps and wakes with cold caches, so the added
cost is magnified; at a fixed rate both servers serve the same requests per second and their
CPU per request compares like for like.

For each repeat, two fresh ``kvmeta serve`` processes are measured one after the other (in
alternating order: off-on, on-off, ...) with ``kvmeta bench``'s engine cycle (exists, reserve,
confirm, get; batch 64, pool prefilled so every reserve evicts 64 keys): one plain, one with
``--events`` and a subscriber in this process that receives every batch (and decodes them
after the run: ``Counter``; ``--full-subscriber`` decodes each as it arrives). Reported
per setting: requests/s, server CPU µs per request (utime + stime from /proc, all threads,
steadier than wall time on a shared machine), and with events: the change -> subscriber lag
(receive time minus the batch's ``ts``, which is when its first change reached the publisher:
p50/p99/max), blocks (the hashes of stored and removed blocks) and events per second
sustained (median of the 1 s bins of the busy span), and the server's own counters; the CPU
added is given as the ratio of the medians and as the median of the pairs' ratios. Then the
same requests through the app without sockets (``inprocess``), and the publisher alone
(``--capacity-seconds``): changes of 64 keys fed as fast as it takes them, through a real PUB
socket to a subscriber, for its ceiling in blocks/s.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import msgspec  # noqa: E402
import requests  # noqa: E402
import zmq  # noqa: E402

from kvmeta.bench.driver import BenchConfig, run_bench  # noqa: E402
from kvmeta.bench.launch import LaunchedServer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Counter:
    """A SUB socket on a thread: (receive time, events, blocks, lag) of every batch; blocks:
    the block hashes of its BlockStored and BlockRemoved events.

    ``light`` (the cost runs): the thread only receives each payload and keeps it with its
    receive time; the payloads are decoded after the run (``close``), so the figures are the
    same, but a subscriber decoding every batch on this machine's 2 cores (a router's
    subscriber runs on another machine) does not compete with the server for CPU meanwhile.
    ``light=False``: each batch decoded as it arrives."""

    def __init__(self, endpoint: str, light: bool = True) -> None:
        self.samples: list[tuple[float, int, int, float]] = []
        self._received: list[tuple[float, bytes]] = []
        self._light = light
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        keep = self._received.append
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            payload = self._sock.recv_multipart()[2]
            now = time.time()
            if self._light:
                keep((now, payload))
            else:
                self._count(now, payload)

    def _count(self, now: float, payload: bytes) -> None:
        ts, events = msgspec.msgpack.decode(payload)[:2]
        # (blocks stored and removed alike: a BlockRemoved carries only hashes)
        blocks = sum(len(e.get("block_hashes", ())) for e in events)
        self.samples.append((now, len(events), blocks, now - ts))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
        for now, payload in self._received:
            self._count(now, payload)
        self._received.clear()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _sustained(samples: list[tuple[float, int, int, float]], index: int) -> float:
    """Median per-second count of the busy span (first and last second left out)."""
    if not samples:
        return 0.0
    start = samples[0][0]
    bins: dict[int, int] = {}
    for s in samples:
        bins[int(s[0] - start)] = bins.get(int(s[0] - start), 0) + s[index]
    busy = [bins.get(i, 0) for i in range(1, max(bins))]
    return float(statistics.median(busy)) if busy else 0.0


def server_counters(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvmeta_events_") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def one(
    mode: str, events: bool, cfg: BenchConfig, light: bool = True, replay: bool = False
) -> dict[str, Any]:
    extra = ["--read-lease", "0"]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    if events:
        extra += ["--events", endpoint]
        if replay:
            extra += ["--events-replay", f"tcp://127.0.0.1:{free_port()}"]
    counter = None
    with LaunchedServer(mode, extra) as server:
        if events:
            counter = Counter(endpoint, light)
            time.sleep(0.5)
        cfg.url, cfg.server_pid, cfg.data_dir = server.url, server.pid, server.data_dir
        cfg.seed = ""
        result = run_bench(cfg).to_dict()
        done = time.time()
        out: dict[str, Any] = {
            "events": events,
            "requests_per_s": result["requests_per_s"],
            "cpu_us_per_request": result["cpu_us_per_request"],
            "latency_p99_us": result["latency_p99_us"],
            "server_rss_mb": result["server_rss_mb"],
        }
        if counter is not None:
            time.sleep(0.5)
            counter.close()
            # The measured window (prefill and warmup left out): it ends as run_bench returns.
            window = [x for x in counter.samples if done - cfg.duration <= x[0] <= done - 0.5]
            lags = [x[3] for x in window]
            out.update(
                batches=len(counter.samples),
                lag_p50_ms=_pct(lags, 0.5) * 1e3,
                lag_p99_ms=_pct(lags, 0.99) * 1e3,
                lag_max_ms=max(lags, default=0.0) * 1e3,
                blocks_per_s=_sustained(window, 2),
                events_per_s=_sustained(window, 1),
                server=server_counters(server.url),
            )
    return out


# A subscriber in its own process that only receives (``inprocess``).
_RECEIVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.setsockopt(zmq.RCVHWM, 0)
sock.connect(sys.argv[1])
while True:
    sock.recv_multipart()
"""


def inprocess(
    batch: int, pool_pages: int, cycles: int, chunk: int | None = None
) -> dict[str, float]:
    """Server CPU per request of the S cycle without HTTP sockets (as ``kvmeta bench core``'s
    app figure), events off vs on: the same recorded requests (prefix chains, as SGLang sends;
    ``core_bench.sglang_script``) replayed on two identically prefilled apps, one with a
    publisher on a real PUB socket, a subscriber process connected (receiving only). The apps
    take turns every ``chunk`` cycles (default: what the real server does in one gather window,
    at about 1,600 cycles a second), the on app's turn ending with its batch sent, so a machine
    that slows down meanwhile slows both alike. ``process_time`` counts every thread (ZeroMQ's
    I/O thread too). Reported: the CPU of all turns per request, and the median of the
    per-turn ratios."""
    import asyncio
    import gc
    import subprocess

    from kvmeta.bench.core_bench import sglang_script
    from kvmeta.config import Settings
    from kvmeta.events.publisher import _GATHER, Publisher
    from kvmeta.server.http import Request, render
    from kvmeta.server.runner import build_app, build_backend
    from kvmeta.service.ops import Service

    def app_with(events: bool) -> tuple[Any, Publisher | None]:
        settings = Settings(in_memory=True, read_lease=0.0)
        backend = build_backend(settings)
        service = Service(backend)
        app = build_app(settings, service)
        pub = None
        if events:
            pub = Publisher(f"tcp://127.0.0.1:{free_port()}")
            backend.set_change_listener(pub.on_changes)
            service.reserve_observer = pub.note_reserve

        def call(path: str, body: bytes) -> bytes:
            coro = app(Request("POST", path, "", body, None))
            try:
                coro.send(None)
            except StopIteration as stop:
                return render(stop.value, True)
            raise RuntimeError("suspended")

        return call, pub

    script, setup = sglang_script(batch, pool_pages, cycles, "events", chains=True)
    if chunk is None:
        chunk = max(1, round(_GATHER * 1600))

    async def measure() -> tuple[list[float], list[float]]:
        apps = [app_with(False), app_with(True)]
        on_pub = apps[1][1]
        assert on_pub is not None
        receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, on_pub.endpoint])
        for call, pub in apps:
            if pub is not None:
                pub.start(asyncio.get_running_loop())
            for path, body in script[:setup]:
                call(path, body)
        # The prefilled pools out of the cyclic GC's sight: a full collection walks both apps'
        # heaps (tens of ms) and would bill all of it to the app whose turn it lands in.
        gc.collect()
        gc.freeze()
        await asyncio.sleep(0.05)
        turns: list[list[float]] = [[], []]
        step = 4 * chunk
        clock = time.process_time
        for start in range(setup, len(script) - step + 1, step):
            part = script[start : start + step]
            for which, (call, pub) in enumerate(apps):
                t0 = clock()
                for path, body in part:
                    call(path, body)
                if pub is not None:
                    pub.flush()
                turns[which].append(clock() - t0)
            await asyncio.sleep(0)  # (a flush is never due: each turn sent its batch)
        for _, pub in apps:
            if pub is not None:
                pub.close()
        receiver.kill()
        receiver.wait()
        gc.unfreeze()
        return turns[0], turns[1]

    off, on = asyncio.run(measure())
    requests_ = 4 * chunk * len(off)
    ratios = [b / a for a, b in zip(off, on, strict=True) if a > 0]
    return {
        "off_us": sum(off) / requests_ * 1e6,
        "on_us": sum(on) / requests_ * 1e6,
        "added_percent": 100 * (sum(on) / sum(off) - 1),
        "median_turn_added_percent": 100 * (statistics.median(ratios) - 1),
        "chunk": chunk,
    }


def capacity(seconds: float) -> dict[str, float]:
    """The publisher alone: how many blocks per second it encodes and sends."""
    import asyncio

    from kvmeta._types import PoolId
    from kvmeta.events.publisher import Publisher
    from kvmeta.store.changes import REASON_CAPACITY, REMOVED, STORED, Change

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(endpoint, encoding="map")
    counter = Counter(endpoint)
    time.sleep(0.5)
    pool = PoolId("s", 0, "kv")
    keys = [f"{i:064x}" for i in range(64 * 1024)]

    async def feed() -> tuple[int, float]:
        pub.start(asyncio.get_running_loop())
        sent, n = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(16):  # one loop pass: 16 confirms and 16 evictions of 64 keys
                chunk = tuple(keys[(n % 1024) * 64 : (n % 1024 + 1) * 64])
                pub.note_reserve(
                    pool, [(k, p) for p, k in zip((None, *chunk), chunk, strict=False)]
                )
                pub.on_changes([Change(pool, STORED, chunk)])
                pub.on_changes([Change(pool, REMOVED, chunk, REASON_CAPACITY)])
                sent += 128
                n += 1
            await asyncio.sleep(0)
        return sent, time.perf_counter() - t0

    sent, took = asyncio.run(feed())
    time.sleep(1.0)
    pub.close()
    counter.close()
    received = sum(s[2] for s in counter.samples)
    return {"blocks_per_s": sent / took, "received_share": received / sent}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Server CPU per request, events off vs on: medians of each, and the median of the
    pairs' ratios (each pair ran back to back)."""
    off = [r["cpu_us_per_request"] for r in runs if not r["events"]]
    on = [r["cpu_us_per_request"] for r in runs if r["events"]]
    pairs = []
    for a, b in zip(runs[::2], runs[1::2], strict=True):
        off_run, on_run = (b, a) if a["events"] else (a, b)
        pairs.append(100 * (on_run["cpu_us_per_request"] / off_run["cpu_us_per_request"] - 1))
    return {
        "off_us": statistics.median(off),
        "on_us": statistics.median(on),
        "added_percent": 100 * (statistics.median(on) / statistics.median(off) - 1),
        "pairs": pairs,
        "median_pair_percent": statistics.median(pairs),
    }


def pairs(args: argparse.Namespace, rate: float) -> list[dict[str, Any]]:
    """``--repeat`` pairs of runs, events off and on, at ``rate`` requests/s (0: closed
    loop), in alternating order (off-on, on-off, ...): a machine that speeds up or slows down
    meanwhile favours neither setting."""
    runs = []
    for i in range(args.repeat):
        for events in (False, True) if i % 2 == 0 else (True, False):
            cfg = cycle_config(args, rate)
            runs.append(one(args.launch, events, cfg, not args.full_subscriber, args.replay))
    return runs


def cycle_config(args: argparse.Namespace, rate: float) -> BenchConfig:
    """The SGLang batch-64 cycle of every run, at ``rate`` requests/s (0: closed loop)."""
    return BenchConfig(
        dialect="s",
        batch=64,
        pool_pages=args.pool_pages,
        clients=args.clients,
        duration=args.duration,
        warmup=args.warmup,
        rate=rate,
    )


def print_phase(title: str, runs: list[dict[str, Any]]) -> None:
    print(title)
    for r in runs:
        line = (
            f"  events {'on ' if r['events'] else 'off'}  {r['requests_per_s']:8,.0f} req/s  "
            f"{r['cpu_us_per_request']:6.1f} us CPU/request  p99 {r['latency_p99_us']:6.0f} us"
            f"  RSS {r['server_rss_mb']:4.0f} MB"
        )
        if r["events"]:
            line += (
                f"  | {r['blocks_per_s']:9,.0f} blocks/s {r['events_per_s']:7,.0f} events/s"
                f"  lag p50 {r['lag_p50_ms']:.2f} p99 {r['lag_p99_ms']:.2f} "
                f"max {r['lag_max_ms']:.1f} ms"
            )
        print(line)
    cpu = summary(runs)
    print(
        f"  CPU per request: off {cpu['off_us']:.1f} us, on {cpu['on_us']:.1f} us (medians): "
        f"{cpu['added_percent']:+.1f} %; median of the {len(cpu['pairs'])} pairs' ratios "
        f"{cpu['median_pair_percent']:+.1f} % (pairs: "
        + " / ".join(f"{p:+.0f}" for p in cpu["pairs"])
        + " %)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", default="memory", choices=("memory", "durable"))
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds of load before each measured window (default: %(default)s)",
    )
    parser.add_argument(
        "--pool-pages",
        type=int,
        default=65536,
        help="pages in the pool, prefilled so every reserve evicts (default: %(default)s)",
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--load",
        default="both",
        choices=("saturation", "normal", "both"),
        help="saturation: the clients in a closed loop (the machine's capacity); normal: "
        "paced at --load-rate; both: saturation, then normal (default: %(default)s)",
    )
    parser.add_argument(
        "--load-rate",
        type=float,
        default=0.0,
        metavar="REQ_PER_S",
        help="the normal load (default: half the events-off requests/s at saturation, "
        "measured in this run; with --load normal, by one events-off run first)",
    )
    parser.add_argument("--capacity-seconds", type=float, default=3.0)
    parser.add_argument("--app-cycles", type=int, default=4000, help="the app-alone cycles")
    parser.add_argument(
        "--full-subscriber",
        action="store_true",
        help="decode every batch as it arrives (default: keep the payloads, decode after the run)",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="the events-on servers also answer replays (--events-replay): they keep the "
        "replay buffer (default: off, as the server's default)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    phases: dict[str, dict[str, Any]] = {}
    capacity_rps = 0.0
    if args.load in ("saturation", "both"):
        runs = pairs(args, 0.0)
        phases["saturation"] = {"rate": 0.0, "runs": runs, "cpu": summary(runs)}
        capacity_rps = statistics.median(r["requests_per_s"] for r in runs if not r["events"])
    if args.load in ("normal", "both"):
        rate = args.load_rate
        if not rate:
            if not capacity_rps:
                capacity_rps = one(args.launch, False, cycle_config(args, 0.0))["requests_per_s"]
            rate = round(capacity_rps / 2)
        runs = pairs(args, rate)
        phases["normal"] = {"rate": rate, "runs": runs, "cpu": summary(runs)}
    cap = capacity(args.capacity_seconds) if args.capacity_seconds > 0 else {}
    app = inprocess(64, args.pool_pages, args.app_cycles)
    if args.json:
        print(json.dumps({**phases, "capacity": cap, "app": app}, indent=2))
        return
    head = f"SGLang batch-64 cycle, {args.launch}, {args.clients} clients, {args.duration:.0f} s"
    if args.replay:
        head += ", events with replay"
    for name, phase in phases.items():
        load = "closed loop" if not phase["rate"] else f"paced at {phase['rate']:,.0f} req/s"
        print_phase(f"{head}, {name} load ({load}):", phase["runs"])
    print(
        f"app alone (no HTTP, turns of {app['chunk']} cycles interleaved): "
        f"off {app['off_us']:.1f} us, "
        f"on {app['on_us']:.1f} us CPU per request: {app['added_percent']:+.1f} % "
        f"(median of the turns {app['median_turn_added_percent']:+.1f} %)"
    )
    if cap:
        print(
            f"publisher alone: {cap['blocks_per_s']:,.0f} blocks/s encoded and sent "
            f"({100 * cap['received_share']:.0f} % received by one subscriber)"
        )


if __name__ == "__main__":
    main()
