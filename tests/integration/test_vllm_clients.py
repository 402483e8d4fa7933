"""vLLM's client classes: the HF3FS connector's save/exists/load cycle across two TP ranks with
real page files, through the HTTP client (real server) and the in-process client; errors,
timeouts, retries and auto re-initialise."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from kvmeta.core.invariants import check_pool
from kvmeta.errors import InvalidRequest, KvmetaError, NotInitialized, ServerUnavailable
from kvmeta.vllm import (
    Hf3fsGlobalMetadataClient,
    Hf3fsLocalMetadataClient,
    Hf3fsMetadataInterface,
)
from tests.support import Server, ServerProcess, silent_server, unused_port


@pytest.fixture
def server(app_server: Server) -> Server:
    """The tests taking ``server`` check what requests get back: it runs in this process."""
    return app_server


PAGE = 4096
PAGES_PER_RANK = 32
INIT_ERROR = "Invalid initialization parameters: "


def md5_chain(n: int, salt: str = "") -> list[str]:
    """32-hex MD5 prefix chains, as vLLM's connector makes its block keys."""
    keys, prev = [], salt
    for i in range(n):
        prev = hashlib.md5(f"{prev}_{i}".encode()).hexdigest()
        keys.append(prev)
    return keys


def shard(key: str, rank: int) -> bytes:
    """The bytes rank ``rank`` holds for ``key``: different per rank, like TP shards."""
    return (f"{rank}:{key};".encode() * (PAGE // 34 + 1))[:PAGE]


class Worker:
    """One TP worker as the connector drives it: its own client and page file."""

    def __init__(self, client: Hf3fsMetadataInterface, directory: Path, rank: int) -> None:
        self.client = client
        self.rank = rank
        self.path = directory / f"hf3fs_vllm_data_file_{rank}"
        with open(self.path, "wb") as f:
            f.truncate(PAGES_PER_RANK * PAGE)
        self.fd = os.open(self.path, os.O_RDWR)
        client.initialize(rank, os.path.getsize(self.path) // PAGE)

    def save(self, keys: list[str], fail: bool = False) -> list[int]:
        """allocate -> write at page * PAGE -> confirm; a failed write releases every page."""
        results = self.client.allocate_pages_for_keys(self.rank, [(k, "") for k in keys])
        assert [k for k, _ in results] == keys
        pages = [p for _, p in results]
        assert all(p >= 0 for p in pages), results
        if fail:
            self.client.confirm_write_for_keys(self.rank, [], pages)
            return pages
        for key, page in zip(keys, pages, strict=True):
            os.pwrite(self.fd, shard(key, self.rank), page * PAGE)
        self.client.confirm_write_for_keys(self.rank, list(zip(keys, pages, strict=True)), [])
        return pages

    def load(self, keys: list[str]) -> list[bytes]:
        pages = self.client.get_key_locations(self.rank, keys)
        assert all(p is not None for p in pages), pages
        return [os.pread(self.fd, PAGE, p * PAGE) for p in pages if p is not None]

    def close(self) -> None:
        os.close(self.fd)


def hit_length(flags: list[bool]) -> int:
    return next((i for i, f in enumerate(flags) if not f), len(flags))


def vllm_cycle(clients: Callable[[], Hf3fsMetadataInterface], directory: Path) -> None:
    scheduler = clients()
    scheduler.initialize(0, role="scheduler")
    workers = [Worker(clients(), directory, rank) for rank in (0, 1)]
    w0, w1 = workers
    keys = md5_chain(24, salt=str(directory))
    try:
        # Request 1: both ranks save 8 blocks; the scheduler then sees 8 hits.
        for w in workers:
            w.save(keys[:8])
        assert hit_length(scheduler.batch_key_exists(keys[:12])) == 8
        # Request 2 re-saves the 8 and adds 4: rank 0 succeeds, rank 1's write fails and it
        # releases every page it was given, including the 8 that hold stored keys.
        w0.save(keys[:12])
        stored_pages_1 = w1.client.get_key_locations(1, keys[:8])
        failed = w1.save(keys[:12], fail=True)
        assert failed[:8] == stored_pages_1  # stored keys were handed their own pages
        for page in failed[8:]:  # a torn write left garbage in the new pages
            os.pwrite(w1.fd, b"\xff" * PAGE, page * PAGE)
        assert scheduler.batch_key_exists(keys[:12]) == [True] * 8 + [False] * 4
        # Rank 1 retries with more blocks; its stored pages must not be handed out again.
        retry = w1.save(keys[8:20])
        assert not set(retry) & {p for p in stored_pages_1 if p is not None}
        w0.save(keys[12:20])
        assert hit_length(scheduler.batch_key_exists(keys)) == 20
        # Load: every rank reads back exactly its own shard of every block.
        for w in workers:
            got = w.load(keys[:20])
            assert got == [shard(k, w.rank) for k in keys[:20]]
            pages = w.client.get_key_locations(w.rank, keys[:20])
            assert len(set(pages)) == 20  # one page per key
        # clear drops the keys but keeps the workers registered.
        scheduler.clear()
        assert not any(scheduler.batch_key_exists(keys))
        for w in workers:
            w.save(keys[:4])
        assert scheduler.batch_key_exists(keys[:5]) == [True] * 4 + [False]
    finally:
        for w in workers:
            w.close()


@pytest.fixture
def http_clients(server: Server) -> Iterator[Callable[[], Hf3fsGlobalMetadataClient]]:
    made: list[Hf3fsGlobalMetadataClient] = []

    def make() -> Hf3fsGlobalMetadataClient:
        made.append(Hf3fsGlobalMetadataClient(server.url))
        return made[-1]

    yield make
    for client in made:
        client.close()


def test_vllm_cycle_two_ranks_through_http_client(
    http_clients: Callable[[], Hf3fsGlobalMetadataClient], tmp_path: Path
) -> None:
    vllm_cycle(http_clients, tmp_path)


def test_vllm_cycle_two_ranks_through_local_client(tmp_path: Path) -> None:
    shared = Hf3fsLocalMetadataClient()
    vllm_cycle(lambda: shared, tmp_path)


class StockShapedClient(Hf3fsMetadataInterface):
    """Talks exactly as vLLM's stock client does: a bare ``requests`` session whose adapter
    retries 5xx on POST, JSON bytes in, ``raise_for_status``, 204 -> {}, results unconverted."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.session = requests.Session()
        retry = Retry(
            total=3,
            backoff_factor=0.3,
            status_forcelist=[500, 502, 503, 504],
            allowed_methods=["POST"],
        )
        self.session.mount("http://", HTTPAdapter(max_retries=retry))

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        resp = self.session.post(
            f"{self.base_url}/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp.raise_for_status()
        return {} if resp.status_code == 204 or not resp.content else resp.json()

    def initialize(
        self, rank: int, num_pages: int = 0, role: str = "worker", *, world_size: int | None = None
    ) -> None:
        self._post(f"rank/{rank}/initialize", {"num_pages": num_pages, "role": role})

    def allocate_pages_for_keys(self, rank: int, keys: Any) -> Any:
        return self._post("keys/batch_allocate", {"rank": rank, "keys": keys}).get("results", {})

    def confirm_write_for_keys(
        self, rank: int, key_confirmations: Any, pages_to_release: Any = None
    ) -> None:
        body = {
            "rank": rank,
            "confirmations": key_confirmations,
            "pages_to_release": pages_to_release or [],
        }
        self._post("keys/confirm_write", body)

    def batch_key_exists(self, keys: Any) -> Any:
        return self._post("keys/batch_exists", {"keys": keys}).get("exists", [])

    def get_key_locations(self, rank: int, keys: Any) -> Any:
        return self._post("keys/get_locations", {"rank": rank, "keys": keys}).get("locations", [])

    def clear(self) -> None:
        self._post("clear", {})


def test_vllm_cycle_two_ranks_with_stock_shaped_client(
    server: ServerProcess, tmp_path: Path
) -> None:
    made: list[StockShapedClient] = []

    def make() -> StockShapedClient:
        made.append(StockShapedClient(server.url))
        return made[-1]

    try:
        vllm_cycle(make, tmp_path)
        # An uninitialised rank is a 404 the stock adapter does not retry, not a retried 500.
        with pytest.raises(requests.HTTPError) as info:
            made[0].get_key_locations(9, ["a"])
        assert info.value.response.status_code == 404
        assert info.value.response.raw.retries.history == ()  # answered once, not retried
    finally:
        for client in made:
            client.session.close()


def test_signatures_match_vllm_client() -> None:
    assert Hf3fsGlobalMetadataClient().base_url == "http://localhost:18000"
    expected = {
        "initialize": ["rank", "num_pages", "role", "world_size"],
        "allocate_pages_for_keys": ["rank", "keys"],
        "confirm_write_for_keys": ["rank", "key_confirmations", "pages_to_release"],
        "batch_key_exists": ["keys"],
        "get_key_locations": ["rank", "keys"],
    }
    for cls in (Hf3fsGlobalMetadataClient, Hf3fsLocalMetadataClient):
        for name, params in expected.items():
            sig = inspect.signature(getattr(cls, name))
            assert list(sig.parameters)[1:] == params, (cls, name)
        init = inspect.signature(cls.initialize).parameters
        assert init["num_pages"].default == 0 and init["role"].default == "worker"
    params = inspect.signature(Hf3fsGlobalMetadataClient).parameters
    assert list(params)[:3] == ["base_url", "max_retries", "timeout"]
    assert params["max_retries"].default == 3


@pytest.fixture(params=["http", "local"])
def client(request: pytest.FixtureRequest) -> Iterator[Hf3fsMetadataInterface]:
    if request.param == "local":
        yield Hf3fsLocalMetadataClient()
        return
    server: Server = request.getfixturevalue("server")
    http = Hf3fsGlobalMetadataClient(server.url)
    yield http
    http.close()


def test_not_initialized_in_both(client: Hf3fsMetadataInterface) -> None:
    client.initialize(4, role="scheduler")  # registers nothing
    for call in (
        lambda: client.allocate_pages_for_keys(4, [("a", "")]),
        lambda: client.confirm_write_for_keys(4, [], [0]),
        lambda: client.get_key_locations(4, ["a"]),
    ):
        with pytest.raises(NotInitialized, match="^Rank 4 not initialized") as info:
            call()
        assert "'worker'" in str(info.value) or '"worker"' in str(info.value)
        assert isinstance(info.value, RuntimeError)
    assert client.batch_key_exists(["a"]) == [False]  # no rank: no error, nothing exists


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((0,), "got 0"),
        ((0, -2), "got -2"),
        ((0, True), "got true (a boolean)"),
        ((0, "8"), 'got "8"'),
        ((0, 8, "Worker"), "did you mean 'worker'"),
        ((0, 8, "leader"), 'unknown role "leader"'),
    ],
)
def test_invalid_initialize_in_both(
    client: Hf3fsMetadataInterface, args: tuple[object, ...], needle: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        client.initialize(*args)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(INIT_ERROR) and needle in message, message
    assert '{"role": "scheduler"}' in message
    with pytest.raises(NotInitialized):
        client.get_key_locations(0, ["a"])


def test_world_size_and_confirm_errors_in_both(client: Hf3fsMetadataInterface) -> None:
    with pytest.raises(InvalidRequest, match="outside `world_size` 1"):
        client.initialize(1, 4, world_size=1)
    client.initialize(0, 4, world_size=2)
    [(_, page)] = client.allocate_pages_for_keys(0, [("a", "")])
    client.confirm_write_for_keys(0, [("a", page)])
    assert client.batch_key_exists(["a"]) == [False]  # rank 1 is required by the pin
    with pytest.raises(InvalidRequest, match="page 9 in `confirmations` is outside"):
        client.confirm_write_for_keys(0, [("b", 9)])
    with pytest.raises(InvalidRequest, match="`pages_to_release`"):
        client.confirm_write_for_keys(0, [], [-1])
    client.initialize(1, 4)
    [(_, page)] = client.allocate_pages_for_keys(1, ["a"])  # a bare key works too
    client.confirm_write_for_keys(1, [("a", page)], None)
    assert client.batch_key_exists(["a"]) == [True]


def test_local_client_is_thread_safe() -> None:
    client = Hf3fsLocalMetadataClient()
    for rank in (0, 1):
        client.initialize(rank, 64)
    keys = md5_chain(200)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                rank = rng.randrange(2)
                batch = rng.sample(keys, 8)
                results = client.allocate_pages_for_keys(rank, [(k, "") for k in batch])
                ok = [(k, p) for k, p in results if p >= 0 and rng.random() < 0.8]
                bad = [p for k, p in results if p >= 0 and (k, p) not in ok]
                client.confirm_write_for_keys(rank, ok, bad)
                client.batch_key_exists(batch)
                client.get_key_locations(rank, batch)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for pool in client._store.pools.values():
        check_pool(pool)
    both = client.batch_key_exists(keys)
    for key, flag in zip(keys, both, strict=True):
        on = [client.get_key_locations(r, [key])[0] is not None for r in (0, 1)]
        assert flag == all(on)


def test_unreachable_server_raises_after_retries() -> None:
    client = Hf3fsGlobalMetadataClient(f"http://127.0.0.1:{unused_port()}", max_retries=2)
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match="is `kvmeta serve` running"):
        client.batch_key_exists(["a"])
    assert time.monotonic() - start >= 0.3  # two backoffs: 0.1 + 0.2
    client.close()


def test_timeout_applies() -> None:
    """A server that accepts but never answers: the client gives up after its timeout."""
    with silent_server() as url:
        client = Hf3fsGlobalMetadataClient(url, max_retries=0, timeout=0.3)
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="Timeout"):
            client.get_key_locations(0, ["a"])
        assert time.monotonic() - start < 5
        client.close()


def test_auto_reinitialize_after_server_restart(
    make_server: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    first = make_server("--in-memory")
    client = Hf3fsGlobalMetadataClient(first.url, auto_reinitialize=True)
    plain = Hf3fsGlobalMetadataClient(first.url)
    client.initialize(1, 8, world_size=2)
    first.stop()
    second = ServerProcess("--in-memory", "--port", str(first.port)).start()
    try:
        with pytest.raises(NotInitialized):
            plain.get_key_locations(1, ["a"])  # without the option the error surfaces
        with caplog.at_level("WARNING"):
            assert client.allocate_pages_for_keys(1, [("a", "")]) == [("a", 0)]
        assert "re-initialising" in caplog.text  # (the new epoch noticed)
        client.confirm_write_for_keys(1, [("a", 0)])
        assert client.batch_key_exists(["a"]) == [False]  # the world_size pin came back too
    finally:
        client.close()
        plain.close()
        second.kill()


def test_one_error_hierarchy() -> None:
    for cls in (InvalidRequest, NotInitialized, ServerUnavailable):
        assert issubclass(cls, KvmetaError) and issubclass(cls, RuntimeError)
