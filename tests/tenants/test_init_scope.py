"""SGLang's stock client names its pools ``PoolName.KV``, which means the pool ``kv``: a token's
namespace scope is checked against that normalised name, and a refused initialize creates
nothing, whichever spelling it used."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.support import Server
from tests.tenants.conftest import OPERATOR, Client, tokens_toml, write_tokens

KV_ONLY = "tenant-a-kv-only-0123456"
MAMBA_ONLY = "tenant-a-mamba-only-0123"
SCOPED = {
    "kv": (KV_ONLY, "teamA", ["read", "write"], None, ["kv"]),
    "mamba": (MAMBA_ONLY, "teamA", ["read", "write"], None, ["mamba"]),
}


def _pools(server: Server) -> list[tuple[str, int, str]]:
    reply = Client(server.url, OPERATOR).get("/v1/pools")
    assert reply.status_code == 200, reply.text
    return [(p["tenant"], p["rank"], p["namespace"]) for p in reply.json()["pools"]]


def test_the_scope_is_checked_on_the_normalised_namespace_and_a_403_creates_nothing(
    tmp_path: Path, tenant_app: Callable[..., Server]
) -> None:
    path = write_tokens(tmp_path / "scoped.toml", tokens_toml(tokens=SCOPED))
    server = tenant_app("--in-memory", auth_file=path)
    mamba, kv = Client(server.url, MAMBA_ONLY), Client(server.url, KV_ONLY)
    # Out of scope in either spelling: 403 naming the pool it means, and no pool anywhere.
    for namespace in ("PoolName.KV", "kv"):
        refused = mamba.post("/0/initialize", {"num_pages": 8, "namespace": namespace})
        assert refused.status_code == 403, refused.text
        assert "namespace 'kv'" in refused.json()["detail"]
    assert _pools(server) == []
    # In scope in either spelling: one pool, `kv`, created once and then kept.
    for rank in (0, 1):
        for namespace in ("PoolName.KV", "kv"):
            done = kv.post(f"/{rank}/initialize", {"num_pages": 8, "namespace": namespace})
            assert done.status_code == 204, done.text
    assert _pools(server) == [("teamA", 0, "kv"), ("teamA", 1, "kv")]
    got = kv.post("/0/exists", {"keys": ["x"], "namespace": "PoolName.KV"})
    assert got.status_code == 200 and got.json() == {"exists": [False]}
