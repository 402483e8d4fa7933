"""Two tenants with the same rank and namespace never see each other's keys, on every backend,
through kvmeta's own clients (Bearer) and the engines' way of passing a token (URL password).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from kvmeta.client.sglang import Hf3fsGlobalMetadataClient
from kvmeta.client.vllm import Hf3fsGlobalMetadataClient as VllmClient
from tests.support import Server, ServerProcess
from tests.tenants.conftest import OPERATOR, Client, token


@pytest.fixture(params=["memory", "durable", "redis"])
def server(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    tenant_app: Callable[..., Server],
) -> Server:
    """A server with the tenants' tokens file, once per backend."""
    if request.param == "memory":
        return tenant_app("--in-memory")
    if request.param == "durable":
        return tenant_app("--data-dir", str(tmp_path / "data"), "--fsync", "never")
    return tenant_app("--backend", request.getfixturevalue("redis_url"))


def test_sglang_tenants_with_the_same_pool_names_are_apart(server: Server) -> None:
    a = Hf3fsGlobalMetadataClient(server.url, auth_token=token("a_admin"))
    b = Hf3fsGlobalMetadataClient(server.url, auth_token=token("b_admin"))
    default = Hf3fsGlobalMetadataClient(server.url, auth_token=OPERATOR)
    for client in (a, b, default):
        client.initialize(0, 16, "kv")
    got = a.reserve_and_allocate_page_indices(0, [("secret-a", None)], "kv")
    a.confirm_write(0, [("secret-a", got[0][1])], [], "kv")
    assert a.exists(0, ["secret-a"], "kv") == [True]
    # Same rank, same namespace, other tenant (and the default tenant): nothing there.
    assert b.exists(0, ["secret-a"], "kv") == [False]
    assert b.get_page_indices(0, ["secret-a"], "kv") == [None]
    assert default.exists(0, ["secret-a"], "kv") == [False]
    # B's writes and deletes and clears do not touch A's pool.
    got_b = b.reserve_and_allocate_page_indices(0, [("secret-a", None)], "kv")
    b.confirm_write(0, [("secret-a", got_b[0][1])], [], "kv")
    b.delete_keys(0, ["secret-a"], "kv")
    b.clear(0, "kv")
    assert a.exists(0, ["secret-a"], "kv") == [True]
    # The engines' stock clients: the token as the URL password (HTTP Basic).
    host = server.url.split("://", 1)[1]
    stock = requests.post(
        f"http://:{token('a_admin')}@{host}/0/exists",
        json={"keys": ["secret-a"], "namespace": "kv"},
        timeout=30,
    )
    assert stock.status_code == 200 and stock.json() == {"exists": [True]}
    # Each tenant's metrics show its own pool only; the operator's show all three.
    assert _pool_tenants(server.url, token("b_admin")) == ["teamB"]
    assert _pool_tenants(server.url, OPERATOR) == ["", "teamA", "teamB"]


def _pool_tenants(url: str, bearer_token: str) -> list[str]:
    text = Client(url, bearer_token).get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("kvmeta_pool_size_pages{")]
    return sorted(line.split('tenant="', 1)[1].split('"', 1)[0] for line in lines)


def test_pools_survive_a_restart_apart(
    tmp_path: Path, tenant_server: Callable[..., ServerProcess]
) -> None:
    """Durable backend: after a restart each tenant still has its own pool and keys."""
    data = str(tmp_path / "data")
    server = tenant_server("--data-dir", data, "--fsync", "always")
    for name in ("a_admin", "b_admin"):
        c = Hf3fsGlobalMetadataClient(server.url, auth_token=token(name))
        c.initialize(0, 16, "kv")
        got = c.reserve_and_allocate_page_indices(0, [(f"key-{name}", None)], "kv")
        c.confirm_write(0, [(f"key-{name}", got[0][1])], [], "kv")
    assert server.stop() == 0
    server = tenant_server("--data-dir", data, "--fsync", "always")
    a = Hf3fsGlobalMetadataClient(server.url, auth_token=token("a_admin"))
    b = Hf3fsGlobalMetadataClient(server.url, auth_token=token("b_admin"))
    assert a.exists(0, ["key-a_admin", "key-b_admin"], "kv") == [True, False]
    assert b.exists(0, ["key-a_admin", "key-b_admin"], "kv") == [False, True]


def test_vllm_tenants_have_their_own_registries(server: Server) -> None:
    a = VllmClient(server.url, auth_token=token("a_admin"))
    b = VllmClient(server.url, auth_token=token("b_admin"))
    a.initialize(0, 16)
    b.initialize(0, 16)
    got = a.allocate_pages_for_keys(0, [("secret-a", "")])
    a.confirm_write_for_keys(0, [("secret-a", got[0][1])], [])
    assert a.batch_key_exists(["secret-a"]) == [True]
    assert b.batch_key_exists(["secret-a"]) == [False]
    assert b.get_key_locations(0, ["secret-a"]) == [None]
    b.clear()
    assert a.batch_key_exists(["secret-a"]) == [True]
    # Each registry lists its own ranks: B removing rank 0 leaves A's rank 0 registered.
    assert b.remove_rank(0) is True
    assert a.rank_registry()["ranks"] == [0]
    assert b.rank_registry()["ranks"] == []
