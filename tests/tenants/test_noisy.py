"""One tenant's churn cannot evict another tenant's pages, and ``kvmeta bench noisy`` runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvmeta.bench.noisy import NoisyConfig, format_noisy, run_noisy
from kvmeta.client.sglang import Hf3fsGlobalMetadataClient
from tests.support import Server
from tests.tenants.conftest import OPERATOR, Client, token

BACKENDS = ["memory", "durable"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_churning_tenant_never_evicts_another_tenants_pages(
    backend: str, tmp_path: Path, tenant_app: Callable[..., Server]
) -> None:
    args = ["--in-memory"] if backend == "memory" else ["--data-dir", str(tmp_path / "d")]
    server = tenant_app(*args, "--read-lease", "0")
    a = Hf3fsGlobalMetadataClient(server.url, auth_token=token("a_admin"))
    b = Hf3fsGlobalMetadataClient(server.url, auth_token=token("b_admin"))
    pages = 64
    a.initialize(0, pages, "kv")
    b.initialize(0, pages, "kv")
    b_keys = [f"b-{i}" for i in range(pages)]  # B's pool exactly full
    got = b.reserve_and_allocate_page_indices(0, [(k, None) for k in b_keys], "kv")
    b.confirm_write(0, [(k, p) for k, (_, p) in zip(b_keys, got, strict=True)], [], "kv")
    # A writes ten times its pool's size: every reserve past the first 64 keys evicts.
    for round_ in range(10):
        keys = [f"a-{round_}-{i}" for i in range(pages)]
        got = a.reserve_and_allocate_page_indices(0, [(k, None) for k in keys], "kv")
        assert all(p >= 0 for _, p in got)
        a.confirm_write(0, [(k, p) for k, (_, p) in zip(keys, got, strict=True)], [], "kv")
    assert b.exists(0, b_keys, "kv") == [True] * pages
    listing = Client(server.url, OPERATOR).get("/v1/pools").json()["pools"]
    pools = {p["tenant"]: p for p in listing}
    assert pools["teamB"]["counters"].get("evictions", 0) == 0
    assert pools["teamA"]["counters"]["evictions"] == 9 * pages


@pytest.mark.slow
def test_bench_noisy_runs_and_reports_both_tenants() -> None:
    # A quota of 2 requests a second: A, at the lowest CPU priority on a loaded host, still
    # sends more than its one-second burst plus its rate while it writes.
    cfg = NoisyConfig(pool_pages=512, duration=1.0, rounds=1, warmup=0.5, a_quota=2)
    result = run_noisy(cfg)
    assert result["b_alone"]["requests"] > 0 and result["b_with_a"]["requests"] > 0
    assert 0.5 < result["b_alone"]["hit_rate"] < 1.0  # the working set is 1.25x the pool
    assert result["a"]["answered_429"] > 0  # A sent over its quota and was limited
    text = format_noisy(result)
    assert "hit rate" in text and "answered 429" in text
