"""Migrating from SGLang's reference metadata server: a file that server (as released) saved
after serving SGLang's client (as released) is read back key for key by that same client from
``kvmeta serve --persistence-path FILE``."""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.compat.reference_server import connect, reference_server
from tests.compat.stock_clients import PoolName, load
from tests.integration.test_sglang_clients import chain_keys
from tests.support import ServerProcess

# (rank, pool, pages); each is written more keys than it has pages, so some are evicted.
POOLS = [(0, PoolName.KV, 8), (0, PoolName.MAMBA, 4), (1, PoolName.KV, 8)]


@pytest.fixture(scope="module")
def stock() -> types.ModuleType:
    return load("sglang")


def write(client: Any, rank: int, pool: PoolName, keys: list[str]) -> None:
    """HiCache's write path, four pages at a time; one write in each batch fails and gives
    its page back."""
    for start in range(0, len(keys), 4):
        batch = keys[start : start + 4]
        pairs = [(k, prev) for prev, k in zip([None, *batch[:-1]], batch, strict=True)]
        got = client.reserve_and_allocate_page_indices(rank, pairs, pool)
        written = [(k, page) for k, (hit, page) in zip(batch, got, strict=True) if not hit]
        client.confirm_write(rank, written[1:], [page for _, page in written[:1]], pool)


def test_a_file_saved_by_sglangs_reference_server_reads_back_through_its_client(
    stock: types.ModuleType, make_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    path = tmp_path / "hf3fs_meta.json"
    reference = reference_server(stock, path)
    engine = connect(stock, reference)
    keys, had = {}, {}
    for rank, pool, pages in POOLS:
        engine.initialize(rank, pages, pool)
        keys[rank, pool] = chain_keys(pages * 2, salt=f"{rank}{pool}")
        write(engine, rank, pool, keys[rank, pool])
    for rank, pool, _ in POOLS:
        had[rank, pool] = engine.get_page_indices(rank, keys[rank, pool], pool)
        stored = [page for page in had[rank, pool] if page is not None]
        assert 0 < len(stored) < len(keys[rank, pool])  # some kept, some evicted or failed
    reference.state.save_to_disk()
    # The names it files the pools under: what its client sends, str(PoolName.X).
    assert sorted(json.loads(path.read_text())) == [
        "0:PoolName.KV",
        "0:PoolName.MAMBA",
        "1:PoolName.KV",
    ]

    server = make_server("--persistence-path", str(path))
    client = stock.Hf3fsGlobalMetadataClient(server.url)
    for rank, pool, _ in POOLS:
        pages = had[rank, pool]
        assert client.get_page_indices(rank, keys[rank, pool], pool) == pages, (rank, pool)
        assert client.exists(rank, keys[rank, pool], pool) == [p is not None for p in pages]
