"""Server CPU per request: vLLM's save/lookup cycle next to SGLang's, on one ``kvmeta serve``.

Each of ``--clients`` processes runs cycles of 64 keys against pools of ``--pages`` pages:
vLLM (batch_allocate, confirm_write, batch_exists, get_locations, alternating TP ranks 0/1) and
SGLang (exists, reserve, confirm, get). Server CPU comes from /proc, so the numbers are steadier
than wall time on a shared machine. Prints medians over ``--rounds`` rounds; no asserts.

    python benchmarks/bench_vllm.py --rounds 3 --cycles 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import ServerProcess  # noqa: E402

KEYS = 64


def vllm_cycles(args: tuple[str, int, int]) -> int:
    url, worker, cycles = args
    with requests.Session() as s:
        for c in range(cycles):
            rank = c % 2
            keys = [f"{worker}-{c // 2}-{i:032d}" for i in range(KEYS)]
            body = {"rank": rank, "keys": [[k, ""] for k in keys]}
            results = s.post(url + "/keys/batch_allocate", json=body).json()["results"]
            conf = {"rank": rank, "confirmations": results, "pages_to_release": []}
            s.post(url + "/keys/confirm_write", json=conf)
            s.post(url + "/keys/batch_exists", json={"keys": keys})
            s.post(url + "/keys/get_locations", json={"rank": rank, "keys": keys})
    return cycles * 4


def sglang_cycles(args: tuple[str, int, int]) -> int:
    url, worker, cycles = args
    with requests.Session() as s:
        for c in range(cycles):
            keys = [f"{worker}-{c}-{i:064d}" for i in range(KEYS)]
            s.post(url + "/0/exists", json={"keys": keys})
            body = {"keys": [[k, None] for k in keys]}
            got = s.post(url + "/0/reserve_and_allocate_page_indices", json=body).json()
            pairs = [[k, p] for k, (_, p) in zip(keys, got["indices"], strict=True)]
            s.post(url + "/0/confirm_write", json={"written_keys_to_confirm": pairs})
            s.post(url + "/0/get_page_indices", json={"keys": keys})
    return cycles * 4


def measure(server: ServerProcess, fn: object, clients: int, cycles: int) -> float:
    before = server.cpu_seconds()
    with Pool(clients) as pool:
        requests_done = sum(pool.map(fn, [(server.url, w, cycles) for w in range(clients)]))
    return (server.cpu_seconds() - before) / requests_done * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=300, help="cycles per client per round")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--pages", type=int, default=65536)
    args = parser.parse_args()
    server = ServerProcess("--in-memory").start()
    try:
        for rank in (0, 1):
            server.post(f"/rank/{rank}/initialize", {"role": "worker", "num_pages": args.pages})
        server.post("/0/initialize", {"num_pages": args.pages})
        v, s = [], []
        for _ in range(args.rounds):
            v.append(measure(server, vllm_cycles, args.clients, args.cycles))
            s.append(measure(server, sglang_cycles, args.clients, args.cycles))
        mv, ms = statistics.median(v), statistics.median(s)
        print(f"server CPU per request, {KEYS} keys, {args.pages} pages, {args.clients} clients")
        print(f"  vLLM cycle   median {mv:7.1f} us  (rounds: {', '.join(f'{x:.1f}' for x in v)})")
        print(f"  SGLang cycle median {ms:7.1f} us  (rounds: {', '.join(f'{x:.1f}' for x in s)})")
        print(f"  ratio vLLM / SGLang: {mv / ms:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
