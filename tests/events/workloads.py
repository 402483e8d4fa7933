"""Workloads the event tests drive through a real server, and the state they leave, asked
back through the same wire (SGLang routes, vLLM's stock client)."""

from __future__ import annotations

import hashlib
import random

import requests

from tests.compat.stock_clients import load

NAMESPACES = ("kv", "mamba")


def page_key(i: int) -> str:
    return hashlib.sha256(f"page {i}".encode()).hexdigest()


def sglang_workload(
    url: str, rng: random.Random, cycles: int
) -> tuple[dict[str, list[str]], dict[str, str | None]]:
    """Chains of pages per namespace on a small pool: commits, evictions, refused confirms,
    releases, deletes and one clear. Returns the keys used per pool and each key's prefix."""
    used: dict[str, list[str]] = {ns: [] for ns in NAMESPACES}
    prefix_of: dict[str, str | None] = {}
    for ns in NAMESPACES:
        r = requests.post(
            f"{url}/0/initialize", json={"num_pages": 40, "namespace": ns}, timeout=30
        )
        assert r.status_code == 204, r.text
    n = 0
    for cycle in range(cycles):
        ns = NAMESPACES[cycle % 2]
        chain: list[tuple[str, str | None]] = []
        prev: str | None = rng.choice(used[ns]) if used[ns] and rng.random() < 0.3 else None
        for _ in range(rng.randint(1, 10)):
            key = page_key(n)
            n += 1
            chain.append((key, prev))
            prefix_of[key] = prev
            prev = key
        if used[ns] and rng.random() < 0.3:
            # A hit, or stored again if it went meanwhile (a page key always has one prefix).
            again = rng.choice(used[ns])
            chain.append((again, prefix_of[again]))
        reply = requests.post(
            f"{url}/0/reserve_and_allocate_page_indices",
            json={"keys": chain, "namespace": ns},
            timeout=30,
        ).json()["indices"]
        pairs = [
            (k, page)
            for (k, _), (hit, page) in zip(chain, reply, strict=True)
            if not hit and page >= 0
        ]
        release: list[int] = []
        if len(pairs) > 2 and rng.random() < 0.3:
            release.append(pairs.pop()[1])  # the engine gave up on the last page
        if pairs and rng.random() < 0.1:
            pairs.append((pairs[0][0], (pairs[0][1] + 1) % 40))  # a foreign page: refused
        r = requests.post(
            f"{url}/0/confirm_write",
            json={"written_keys_to_confirm": pairs, "pages_to_release": release, "namespace": ns},
            timeout=30,
        )
        assert r.status_code in (200, 204), r.text
        used[ns] += [k for k, _ in chain]
        if cycle % 9 == 8:
            gone = rng.sample(used[ns], min(6, len(used[ns]))) + ["never stored"]
            requests.post(f"{url}/0/delete_keys", json={"keys": gone, "namespace": ns}, timeout=30)
        if cycle == cycles // 2:
            requests.post(f"{url}/0/clear", json={"namespace": ns}, timeout=30)
    return used, prefix_of


def sglang_state(url: str, used: dict[str, list[str]]) -> dict[str, set[str]]:
    out = {}
    for ns, keys in used.items():
        keys = sorted(set(keys))
        found = requests.post(f"{url}/0/exists", json={"keys": keys, "namespace": ns}, timeout=30)
        stored = {k for k, hit in zip(keys, found.json()["exists"], strict=True) if hit}
        if stored:
            out[f"s:0:{ns}"] = stored
    return out


def vllm_workload(url: str, rng: random.Random, cycles: int) -> list[str]:
    """Two rank pools with the stock client: commits, evictions (16 pages each), one clear."""
    stock = load("vllm")
    client = stock.Hf3fsGlobalMetadataClient(url)
    used: list[str] = []
    try:
        for rank in (0, 1):
            client.initialize(rank, 16)
        for cycle in range(cycles):
            keys = [
                hashlib.md5(f"{cycle}/{i}".encode()).hexdigest() for i in range(rng.randint(1, 6))
            ]
            for rank in (0, 1):
                pages = client.allocate_pages_for_keys(rank, [(k, "") for k in keys])
                client.confirm_write_for_keys(rank, [(k, p) for k, p in pages if p >= 0])
            used += keys
            if cycle == cycles // 2:
                client._post("clear", {})
    finally:
        client._session.close()
    return used


def vllm_state(url: str, used: list[str]) -> dict[str, set[str]]:
    client = load("vllm").Hf3fsGlobalMetadataClient(url)
    keys = sorted(set(used))
    out = {}
    try:
        for rank in (0, 1):
            found = client.get_key_locations(rank, keys)
            held = {k for k, page in zip(keys, found, strict=True) if page is not None}
            if held:
                out[f"v:{rank}"] = held
    finally:
        client._session.close()
    return out
