"""SGLang's client classes: the HiCache write/read cycle against real page files, through the
HTTP client (real server) and the in-process client; errors, timeouts, auto re-initialise."""

from __future__ import annotations

import enum
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmeta.errors import InvalidRequest, KvmetaError, NotInitialized, ServerUnavailable
from kvmeta.sglang import (
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


class PoolName(str, enum.Enum):
    KV = "kv"
    MAMBA = "mamba"


def chain_keys(n: int, salt: str = "") -> list[str]:
    """64-hex SHA-256 chain digests, as HiCache makes them."""
    keys, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(f"{prev}:{i}".encode()).hexdigest()
        keys.append(prev)
    return keys


def page_bytes(key: str) -> bytes:
    return (key.encode() * (PAGE // 64 + 1))[:PAGE]


def hicache_cycle(
    client: Hf3fsMetadataInterface,
    path: Path,
    rank: int,
    num_pages: int,
    namespace: str | enum.Enum = "kv",
) -> None:
    """What HiCacheHF3FS does: reserve -> write pages -> confirm -> exists -> get -> read."""
    with open(path, "wb") as f:
        f.truncate(num_pages * PAGE)
    client.initialize(rank, num_pages, namespace)
    keys = chain_keys(num_pages + 8, salt=str(path))
    batches = [keys[i : i + 16] for i in range(0, len(keys), 16)]
    fd = os.open(path, os.O_RDWR)
    try:
        for batch in batches:
            pairs = [(k, prev) for prev, k in zip([None, *batch[:-1]], batch, strict=True)]
            got = client.reserve_and_allocate_page_indices(rank, pairs, namespace)
            assert len(got) == len(batch)
            ok, failed = [], []
            for i, (key, (hit, page)) in enumerate(zip(batch, got, strict=True)):
                if hit or page < 0:
                    continue
                if i == 3:  # a failed write gives its page back
                    failed.append(page)
                    continue
                os.pwrite(fd, page_bytes(key), page * PAGE)
                ok.append((key, page))
            client.confirm_write(rank, ok, failed, namespace)
        # Read path: exists for the hit length, then lookup and read back.
        present = client.exists(rank, keys, namespace)
        stored = [k for k, p in zip(keys, present, strict=True) if p]
        assert 0 < len(stored) <= num_pages
        pages = client.get_page_indices(rank, stored, namespace)
        assert all(p is not None for p in pages)
        assert len(set(pages)) == len(pages)  # one page per key
        for key, page in zip(stored, pages, strict=True):
            assert page is not None
            assert os.pread(fd, PAGE, page * PAGE) == page_bytes(key)
        client.delete_keys(rank, stored[:2], namespace)
        assert client.exists(rank, stored[:3], namespace) == [False, False, True]
        client.clear(rank, namespace)
        assert not any(client.exists(rank, stored, namespace))
    finally:
        os.close(fd)


def test_hicache_cycle_through_http_client(server: Server, tmp_path: Path) -> None:
    client = Hf3fsGlobalMetadataClient(server.url)
    hicache_cycle(client, tmp_path / "data.0.bin", 0, 32)
    hicache_cycle(client, tmp_path / "data.1.bin", 1, 16, PoolName.MAMBA)


def test_hicache_cycle_through_local_client(tmp_path: Path) -> None:
    client = Hf3fsLocalMetadataClient()
    hicache_cycle(client, tmp_path / "data.0.bin", 0, 32)
    hicache_cycle(client, tmp_path / "data.0.mamba.bin", 0, 16, PoolName.MAMBA)


def test_http_not_initialized_keeps_server_message(server: Server) -> None:
    client = Hf3fsGlobalMetadataClient(server.url)
    with pytest.raises(NotInitialized) as info:
        client.exists(5, ["a"])
    assert str(info.value) == (
        "Rank 5 namespace 'kv' not initialized. Please call /5/initialize first."
    )
    assert isinstance(info.value, RuntimeError)


LOCAL_CALLS: dict[str, Callable[[Hf3fsLocalMetadataClient], object]] = {
    "exists": lambda c: c.exists(2, ["a"]),
    "get_page_indices": lambda c: c.get_page_indices(2, ["a"]),
    "reserve": lambda c: c.reserve_and_allocate_page_indices(2, [("a", None)]),
    "confirm_write": lambda c: c.confirm_write(2, [("a", 0)], []),
    "delete_keys": lambda c: c.delete_keys(2, ["a"]),
    "clear": lambda c: c.clear(2),
}


@pytest.mark.parametrize("op", list(LOCAL_CALLS))
def test_local_not_initialized_message(op: str) -> None:
    """The in-process client starts with the sentence SGLang's own in-process client raises
    (engines match on it; its server's differs), then says what to do; still NotInitialized,
    a RuntimeError."""
    client = Hf3fsLocalMetadataClient()
    call = LOCAL_CALLS[op]
    with pytest.raises(NotInitialized) as info:
        call(client)
    assert str(info.value).startswith("Namespace 'kv' for rank 2 not initialized: ")
    assert "initialize(2, " in str(info.value)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(NotInitialized, match=r"^Namespace 'mamba' for rank 2 not initialized"):
        client.exists(2, ["a"], PoolName.MAMBA)
    client.initialize(2, 4)
    call(client)  # initialised: no error


def test_invalid_input_raises_invalid_request_in_both(server: Server) -> None:
    for client in (Hf3fsGlobalMetadataClient(server.url), Hf3fsLocalMetadataClient()):
        with pytest.raises(InvalidRequest, match="num_pages"):
            client.initialize(0, 0)
        client.initialize(0, 4)
        with pytest.raises(InvalidRequest, match="pages_to_release"):
            client.confirm_write(0, [], [99])


def test_unreachable_server_raises_after_retries() -> None:
    client = Hf3fsGlobalMetadataClient(f"http://127.0.0.1:{unused_port()}", max_retries=2)
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match="is `kvmeta serve` running"):
        client.exists(0, ["a"])
    assert time.monotonic() - start >= 0.3  # two backoffs: 0.1 + 0.2
    assert issubclass(ServerUnavailable, RuntimeError)


def test_timeout_applies() -> None:
    """A server that accepts but never answers: the client gives up after its timeout."""
    with silent_server() as url:
        client = Hf3fsGlobalMetadataClient(url, max_retries=0, timeout=0.3)
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="Timeout"):
            client.exists(0, ["a"])
        assert time.monotonic() - start < 5


def test_auto_reinitialize_after_server_restart(
    make_server: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    first = make_server("--in-memory")
    client = Hf3fsGlobalMetadataClient(first.url, auto_reinitialize=True)
    plain = Hf3fsGlobalMetadataClient(first.url)
    client.initialize(0, 8, "kv")
    first.stop()
    second = ServerProcess("--in-memory", "--port", str(first.port)).start()
    try:
        with pytest.raises(NotInitialized):
            plain.exists(0, ["a"])  # without the option the error surfaces
        with caplog.at_level("WARNING"):
            assert client.exists(0, ["a"]) == [False]
        assert "re-initialising" in caplog.text  # (the new epoch noticed)
        got = client.reserve_and_allocate_page_indices(0, [("a", None)])
        assert got == [(False, 0)]
    finally:
        second.kill()


def test_one_error_hierarchy() -> None:
    for cls in (InvalidRequest, NotInitialized, ServerUnavailable):
        assert issubclass(cls, KvmetaError) and issubclass(cls, RuntimeError)
    assert issubclass(InvalidRequest, ValueError)
