"""SGLang's own released ``Hf3fsGlobalMetadataClient``, unmodified, against ``kvmeta serve``."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmeta.sglang import Hf3fsLocalMetadataClient
from tests.compat.stock_clients import PoolName, load
from tests.integration.test_sglang_clients import hicache_cycle
from tests.support import ServerProcess


@pytest.fixture(scope="module")
def stock() -> types.ModuleType:
    return load("sglang")


def test_stock_client_runs_the_hicache_cycle(
    stock: types.ModuleType, server: ServerProcess, tmp_path: Path
) -> None:
    client = stock.Hf3fsGlobalMetadataClient(server.url)
    hicache_cycle(client, tmp_path / "hicache.0.bin", 0, 32)
    hicache_cycle(client, tmp_path / "hicache.0.mamba.bin", 0, 16, PoolName.MAMBA)
    hicache_cycle(client, tmp_path / "hicache.1.bin", 1, 16)


def test_stock_enum_namespace_is_the_plain_pool_name(
    stock: types.ModuleType, server: ServerProcess
) -> None:
    """The stock client sends ``str(PoolName.KV)`` ('PoolName.KV'); kvmeta files it under 'kv',
    the pool old clients (no namespace) and kvmeta's own client use too."""
    stock_client = stock.Hf3fsGlobalMetadataClient(server.url)
    stock_client.initialize(0, 8, PoolName.KV)
    got = stock_client.reserve_and_allocate_page_indices(0, [("a", None)], PoolName.KV)
    stock_client.confirm_write(0, [("a", got[0][1])], [], PoolName.KV)
    assert server.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [True]}
    assert server.post("/0/exists", {"keys": ["a"], "namespace": "kv"}).json() == {"exists": [True]}


def test_stock_client_sees_not_initialized_as_runtime_error_without_retries(
    stock: types.ModuleType, server: ServerProcess
) -> None:
    client = stock.Hf3fsGlobalMetadataClient(server.url)
    with pytest.raises(RuntimeError, match="404"):
        client.exists(9, ["a"])
    with pytest.raises(RuntimeError, match="400"):
        client.initialize(0, 0)
    client.initialize(0, 4)
    with pytest.raises(RuntimeError, match="400"):
        client.confirm_write(0, [("a", 99)], [])


def test_stock_client_with_token_in_url(
    stock: types.ModuleType, make_server: Callable[..., ServerProcess]
) -> None:
    """--auth-token: the unmodified client works with the token as the URL's password."""
    server = make_server("--in-memory", "--auth-token", "s3cr3t-token")
    host = server.url.removeprefix("http://")
    client = stock.Hf3fsGlobalMetadataClient(f"http://:s3cr3t-token@{host}")
    client.initialize(0, 4)
    assert client.exists(0, ["a"]) == [False]
    refused = stock.Hf3fsGlobalMetadataClient(server.url)
    with pytest.raises(RuntimeError, match="401"):
        refused.exists(0, ["a"])
    wrong = stock.Hf3fsGlobalMetadataClient(f"http://:nope@{host}")
    with pytest.raises(RuntimeError, match="401"):
        wrong.initialize(0, 4)
    assert "s3cr3t-token" not in server.log


def test_in_process_not_initialized_starts_with_the_stock_sentence(
    stock: types.ModuleType,
) -> None:
    """SGLang's own in-process client's error, word for word, begins kvmeta's (advice follows)."""
    with pytest.raises(RuntimeError) as theirs:
        stock.Hf3fsLocalMetadataClient().get_page_indices(3, ["a"], "mamba")
    with pytest.raises(RuntimeError) as ours:
        Hf3fsLocalMetadataClient().get_page_indices(3, ["a"], "mamba")
    assert str(ours.value).startswith(str(theirs.value)), (str(ours.value), str(theirs.value))
