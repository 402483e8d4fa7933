"""vLLM's own released ``Hf3fsGlobalMetadataClient``, unmodified, against ``kvmeta serve``: the
connector's two-rank save/exists/load cycle and the errors it sees."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.compat.stock_clients import load
from tests.compat.stock_connector import SaveRig, load_connector
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


def _v_pool(server: ServerProcess, rank: int) -> dict[str, Any]:
    reply = requests.get(f"{server.url}/v1/pools", timeout=10)
    reply.raise_for_status()
    (pool,) = [p for p in reply.json()["pools"] if p["dialect"] == "v" and p["rank"] == rank]
    return dict(pool)


def test_a_batch_that_does_not_fit_reserves_nothing(
    stock: types.ModuleType, server: ServerProcess, made: list[Any]
) -> None:
    """The stock client gives up a batch with any -1 and releases nothing: a refused batch
    must leave no reservation behind (else its pages wait out --reservation-ttl)."""
    client = stock_client(stock, server, made)
    client.initialize(0, 4)
    keys = [(f"k{i}", "") for i in range(6)]
    assert [page for _, page in client.allocate_pages_for_keys(0, keys)] == [-1] * 6
    pool = _v_pool(server, 0)
    assert (pool["reserved"], pool["free"]) == (0, 4)
    # The caller is told why, and the refusal is counted.
    reply = server.post("/keys/batch_allocate", {"rank": 0, "keys": keys})
    assert reply.status_code == 200
    assert reply.headers["X-Kvmeta-Warning"].startswith("batch_refused: rank 0 has no room")
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    assert 'kvmeta_refused_batches_total{dialect="v"} 2.0' in metrics
    # Every page is still there for a batch that fits.
    assert sorted(page for _, page in client.allocate_pages_for_keys(0, keys[:4])) == [0, 1, 2, 3]


def test_the_connectors_save_path_strands_no_pages(
    stock: types.ModuleType, server: ServerProcess, made: list[Any]
) -> None:
    """vLLM's released ``_handle_save_task``: a save too big for the rank fails, and after it
    no page is reserved; the next save that fits is stored whole."""
    client = stock_client(stock, server, made)
    client.initialize(0, 4)
    rig = SaveRig(load_connector(), client, rank=0)
    assert rig.save("too-big", [f"block{i}" for i in range(6)]) is False
    assert rig.file.offsets == []  # nothing was written
    assert _v_pool(server, 0)["reserved"] == 0
    blocks = [f"block{i}" for i in range(4)]
    assert rig.save("fits", blocks) is True
    assert client.batch_key_exists(blocks) == [True] * 4
    pool = _v_pool(server, 0)
    assert (pool["reserved"], pool["stored"]) == (0, 4)
