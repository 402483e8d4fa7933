"""vLLM's own released ``Hf3fsGlobalMetadataClient``, unmodified, against ``kvmeta serve``: the
connector's two-rank save/exists/load cycle and the errors it sees."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compat.stock_clients import load
from tests.integration.test_vllm_clients import vllm_cycle
from tests.support import ServerProcess


@pytest.fixture(scope="module")
def stock() -> types.ModuleType:
    return load("vllm")


@pytest.fixture
def made() -> Iterator[list[Any]]:
    clients: list[Any] = []
    yield clients
    for client in clients:
        client._session.close()


def stock_client(stock: types.ModuleType, server: ServerProcess, made: list[Any]) -> Any:
    client = stock.Hf3fsGlobalMetadataClient(server.url)
    # The stock client has no clear(); the cycle calls it through the client's own _post.
    client.clear = lambda: client._post("clear", {})
    made.append(client)
    return client


def test_stock_client_runs_the_two_rank_cycle(
    stock: types.ModuleType, server: ServerProcess, made: list[Any], tmp_path: Path
) -> None:
    vllm_cycle(lambda: stock_client(stock, server, made), tmp_path)


def test_stock_client_errors_are_4xx_not_retried_500s(
    stock: types.ModuleType, server: ServerProcess, made: list[Any]
) -> None:
    client = stock_client(stock, server, made)
    client.initialize(0, role="scheduler")
    with pytest.raises(RuntimeError, match="404") as info:
        client.allocate_pages_for_keys(0, [("a", "")])
    assert "Failed to connect to metadata server" in str(info.value)
    with pytest.raises(RuntimeError, match="400"):
        client.initialize(0)  # a worker with num_pages=0
    with pytest.raises(RuntimeError, match="400"):
        client.initialize(0, 8, role="Worker")
    client.initialize(0, 8)
    client.initialize(0, 8)  # idempotent
    assert client.allocate_pages_for_keys(0, [("a", ""), ("a", "")]) == [["a", 0], ["a", 0]]
    with pytest.raises(RuntimeError, match="400"):
        client.confirm_write_for_keys(0, [("a", 99)])
    client.confirm_write_for_keys(0, [("a", 0)])
    assert client.batch_key_exists(["a", "b"]) == [True, False]
    assert client.get_key_locations(0, ["a", "b"]) == [0, None]
    with pytest.raises(RuntimeError, match="404"):
        client.get_key_locations(1, ["a"])
