"""Server CPU per request with and without the operator layer (metrics wrapper, auth).

    python benchmarks/bench_ops_overhead.py [BASE_SRC_DIR]
    python benchmarks/bench_ops_overhead.py --inprocess

Starts ``kvmeta serve`` from this checkout (plain, and with --auth-token) and, when given, from
BASE_SRC_DIR (e.g. an export of the commit before the operator layer), drives the SGLang cycle
exists -> reserve -> confirm -> get with 64 keys per request over keep-alive connections from
2 client processes, and prints server CPU microseconds per request read from /proc. Rounds
alternate between servers so drift hits each equally; the median per server is printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "src"
CYCLES = 300  # per client per round; 4 requests per cycle
CLIENTS = 2
ROUNDS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(src: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(src))
    args = [sys.executable, "-m", "kvmeta", "serve", "--in-memory", "--port", str(port), *extra]
    proc = subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/health")
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client(port: int, seed: int, headers: dict[str, str]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port)

    def post(path: str, body: object) -> object:
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        data = resp.read()
        return json.loads(data) if data else None

    for c in range(CYCLES):
        keys = [f"{seed}-{c}-{i:058d}" for i in range(64)]
        post("/0/exists", {"keys": keys})
        res = post("/0/reserve_and_allocate_page_indices", {"keys": [[k, None] for k in keys]})
        pairs = [[k, p] for k, (_, p) in zip(keys, res["indices"], strict=True) if p >= 0]  # type: ignore[index]
        post("/0/confirm_write", {"written_keys_to_confirm": pairs})
        post("/0/get_page_indices", {"keys": keys})
    conn.close()


def measure(proc: subprocess.Popen[bytes], port: int, headers: dict[str, str], rnd: int) -> float:
    before = cpu(proc.pid)
    procs = [
        multiprocessing.Process(target=client, args=(port, rnd * 100 + i, headers))
        for i in range(CLIENTS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return (cpu(proc.pid) - before) / (CYCLES * CLIENTS * 4) * 1e6


def main(base: Path | None) -> None:
    servers: dict[str, tuple[subprocess.Popen[bytes], int, dict[str, str]]] = {}
    port = free_port()
    servers["this checkout"] = (start(HERE, port), port, {})
    port = free_port()
    servers["this checkout, --auth-token"] = (
        start(HERE, port, "--auth-token", "t"),
        port,
        {"Authorization": "Bearer t"},
    )
    if base is not None:
        port = free_port()
        servers["base"] = (start(base, port), port, {})
    for _, port, headers in servers.values():
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("POST", "/0/initialize", json.dumps({"num_pages": 65536}), headers)
        conn.getresponse().read()
        conn.close()
    results: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for rnd in range(ROUNDS):
            for name, (proc, port, headers) in servers.items():
                results[name].append(measure(proc, port, headers, rnd))
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait()
    for name, values in results.items():
        print(f"{name:32s} median {statistics.median(values):6.1f} us/request  {values}")


def inprocess(n: int = 50_000) -> None:
    """Handler CPU per request in this process, with and without the operator layer: the
    precise number (the server measurement above has 10 ms clock ticks and a noisy machine)."""
    sys.path.insert(0, str(HERE))
    from kvmeta.config import Settings
    from kvmeta.server import ops_routes, sglang
    from kvmeta.server.app import App
    from kvmeta.server.http import Request
    from kvmeta.service.ops import Service
    from kvmeta.store.memory import MemoryBackend, MemoryStore

    def build(ops: bool, token: str | None) -> App:
        service = Service(MemoryBackend(MemoryStore()))
        app = App()
        sglang.add_routes(app, service)
        if ops:
            ops_routes.install(app, service, Settings(in_memory=True, auth_token=token))
        drive(app, Request("POST", "/0/initialize", "", b'{"num_pages": 1024}', auth))
        return app

    def drive(app: App, req: Request) -> None:
        try:
            app(req).send(None)
        except StopIteration:
            return
        raise RuntimeError("handler suspended")

    auth = b"Bearer t"
    body = json.dumps({"keys": [f"{i:064x}" for i in range(64)]}).encode()
    req = Request("POST", "/0/exists", "", body, auth)
    apps = {
        "plain App": build(False, None),
        "with ops layer": build(True, None),
        "with ops layer + auth": build(True, "t"),
    }
    best: dict[str, float] = {}
    for _ in range(5):
        for name, app in apps.items():
            start = time.process_time()
            for _ in range(n):
                drive(app, req)
            per = (time.process_time() - start) / n * 1e6
            best[name] = min(best.get(name, per), per)
    for name, value in best.items():
        print(f"in-process /0/exists x64 keys, {name:24s} {value:6.2f} us/request (best of 5)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_ops_overhead.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "base",
        nargs="?",
        type=Path,
        help="src/ directory of another checkout to measure alongside (default: none)",
    )
    parser.add_argument(
        "--inprocess",
        action="store_true",
        help="measure handler CPU in this process instead of servers (default: off)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.inprocess:
        inprocess()
    else:
        main(ARGS.base)
