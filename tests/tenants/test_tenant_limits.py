"""What a tenant may create: its pool count (--max-pools-per-tenant, or its own max_pools), its
pages (its own max_pages, or else its share of --max-total-pages when the tokens file names
several tenants) and the pages of all pools together. Every refusal names the limit and the
fix, creates nothing, and never tells a tenant what other tenants hold."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from tests.support import Server
from tests.tenants.conftest import OPERATOR, Client, token, tokens_toml, write_tokens

A, B = token("a_admin"), token("b_admin")


def _pools(server: Server) -> list[tuple[str, str, int, str, int]]:
    reply = Client(server.url, OPERATOR).get("/v1/pools")
    assert reply.status_code == 200, reply.text
    return [
        (p["tenant"], p["dialect"], p["rank"], p["namespace"], p["num_pages"])
        for p in reply.json()["pools"]
    ]


def _refused(reply: requests.Response, status: int, *parts: str) -> str:
    assert reply.status_code == status, reply.text
    detail: str = reply.json()["detail"]
    for part in parts:
        assert part in detail, detail
    assert "nothing was created" in detail, detail
    return detail


def _init(client: Client, rank: int, pages: int, namespace: str = "kv") -> requests.Response:
    return client.post(f"/{rank}/initialize", {"num_pages": pages, "namespace": namespace})


def test_tenants_without_a_quota_share_the_pages_and_no_refusal_shows_the_others(
    tmp_path: Path, tenant_app: Callable[..., Server]
) -> None:
    # teamA and teamB have no max_pages: each gets half of --max-total-pages 1000.
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml())
    server = tenant_app("--in-memory", "--max-total-pages", "1000", auth_file=path)
    a, b, op = Client(server.url, A), Client(server.url, B), Client(server.url, OPERATOR)
    assert _init(a, 0, 400).status_code == 204
    # teamA cannot take the pages teamB needs: 429 naming its share and how to get more.
    detail = _refused(
        _init(a, 1, 101),
        429,
        "tenant 'teamA'",
        "its share of the server's pages, 500",
        "400 pages in use",
        "max_pages",
    )
    _refused(a.post("/rank/0/initialize", {"num_pages": 101}), 429, "tenant 'teamA'", "500")
    assert "1000" not in detail
    # teamB still gets its whole share, in both dialects.
    assert _init(b, 0, 300).status_code == 204
    assert b.post("/rank/0/initialize", {"num_pages": 200}).ok
    # The operator (no share) fills the rest; a tenant's refusal for the total then names no
    # count of anyone's pages, and nothing was created.
    assert _init(op, 0, 50).status_code == 204
    detail = _refused(_init(a, 1, 90), 400, "--max-total-pages", "tenant 'teamA'")
    for number in ("950", "1040", "1000"):
        assert number not in detail, detail
    assert "in use" not in detail, detail
    assert _pools(server) == [
        ("", "s", 0, "kv", 50),
        ("teamA", "s", 0, "kv", 400),
        ("teamB", "s", 0, "kv", 300),
        ("teamB", "v", 0, "", 200),
    ]
    # The operator's own refusal still shows the whole picture.
    _refused(_init(op, 1, 90), 400, "950 pages are in use", "--max-total-pages 1000")


def test_a_tenants_own_max_pages_wins_over_its_share(
    tmp_path: Path, tenant_app: Callable[..., Server]
) -> None:
    quota = "[tenants.teamA]\nmax_pages = 900\n"
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml(quota))
    server = tenant_app("--in-memory", "--max-total-pages", "1000", auth_file=path)
    assert _init(Client(server.url, A), 0, 800).status_code == 204
    _refused(_init(Client(server.url, B), 0, 501), 429, "its share of the server's pages, 500")
    assert _init(Client(server.url, B), 0, 200).status_code == 204


def test_pools_per_tenant_are_bounded_by_the_flag_and_the_tokens_file(
    tmp_path: Path, tenant_app: Callable[..., Server]
) -> None:
    quota = "[tenants.teamB]\nmax_pools = 1\n"
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml(quota))
    server = tenant_app("--in-memory", "--max-pools-per-tenant", "3", auth_file=path)
    a, b, op = Client(server.url, A), Client(server.url, B), Client(server.url, OPERATOR)
    # Three one-page pools, of both dialects: the fourth is refused, however small.
    for reply in (
        _init(a, 0, 1),
        _init(a, 0, 1, "mamba"),
        a.post("/rank/0/initialize", {"num_pages": 1}),
    ):
        assert reply.ok, reply.text
    before = _pools(server)
    for reply in (_init(a, 1, 1), a.post("/rank/1/initialize", {"num_pages": 1})):
        _refused(reply, 429, "--max-pools-per-tenant 3", "max_pools")
    detail = _refused(_init(a, 1, 1), 429, "tenant 'teamA' pool limit reached", "has 3 pools")
    assert "remove" in detail
    assert _init(a, 1, 1).headers["Retry-After"] == "60"
    assert _pools(server) == before
    # Re-initialising an existing pool creates nothing and still works.
    assert _init(a, 0, 1).status_code == 204
    # teamB's own max_pools (1) wins over the flag.
    assert _init(b, 0, 1).status_code == 204
    _refused(_init(b, 1, 1), 429, "tenant 'teamB'", "its max_pools 1", "tokens file")
    # The operator's tenant counts its own pools only.
    for rank in range(3):
        assert _init(op, rank, 1).status_code == 204
    _refused(_init(op, 3, 1), 429, "the default tenant", "--max-pools-per-tenant 3")
    assert len(_pools(server)) == len(before) + 1 + 3


def test_the_pool_limit_without_a_tokens_file(make_app: Any) -> None:
    server = make_app("--in-memory", "--max-pools-per-tenant", "2")
    url = server.url
    for rank in range(2):
        assert requests.post(f"{url}/{rank}/initialize", json={"num_pages": 1}, timeout=30).ok
    reply = requests.post(f"{url}/2/initialize", json={"num_pages": 1}, timeout=30)
    _refused(reply, 429, "pool limit reached", "--max-pools-per-tenant 2", "raise")
    assert len(requests.get(f"{url}/v1/pools", timeout=30).json()["pools"]) == 2
