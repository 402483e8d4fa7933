"""Both engines' released clients, unmodified, against two ``kvmeta serve`` processes that
share one real redis-server: any server can take any request (scale-out is still drop-in)."""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.compat.stock_clients import load
from tests.integration.test_sglang_clients import hicache_cycle
from tests.integration.test_vllm_clients import vllm_cycle
from tests.support import ServerProcess


@pytest.fixture
def two_servers(
    make_server: Callable[..., ServerProcess], redis_url: str
) -> tuple[ServerProcess, ServerProcess]:
    return (
        make_server("--backend", redis_url, "--read-lease", "0"),
        make_server("--backend", redis_url, "--read-lease", "0"),
    )


def test_stock_sglang_client_across_two_servers(
    two_servers: tuple[ServerProcess, ServerProcess], tmp_path: Path
) -> None:
    stock = load("sglang")
    a, b = (stock.Hf3fsGlobalMetadataClient(s.url) for s in two_servers)
    hicache_cycle(a, tmp_path / "hicache.0.bin", 0, 32)
    a.initialize(1, 8)
    got = a.reserve_and_allocate_page_indices(1, [("k", None)])
    b.confirm_write(1, [("k", got[0][1])], [])  # confirmed through the other server
    assert b.exists(1, ["k"]) == [True]
    assert b.get_page_indices(1, ["k"]) == [got[0][1]]


def test_stock_vllm_client_across_two_servers(
    two_servers: tuple[ServerProcess, ServerProcess], tmp_path: Path
) -> None:
    """The connector's two-rank cycle; scheduler and workers spread over both servers."""
    stock: types.ModuleType = load("vllm")
    made: list[Any] = []
    turn = itertools.cycle(two_servers)

    def client() -> Any:
        c = stock.Hf3fsGlobalMetadataClient(next(turn).url)
        c.clear = lambda: c._post("clear", {})  # the stock client has no clear()
        made.append(c)
        return c

    try:
        vllm_cycle(client, tmp_path)
    finally:
        for c in made:
            c._session.close()
