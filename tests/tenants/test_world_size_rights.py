"""Which vLLM ranks make a block complete is the tenant's setting: a worker's ``write`` token
may pin the first world size through ``/rank/{rank}/initialize`` or repeat it (vLLM's workers
initialize with whatever token they run with), but only an ``admin`` token may move it. A
refused initialize is a 403 naming the fix, and registers nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import Server
from tests.tenants.conftest import Client, token


@pytest.fixture(params=["memory", "durable", "redis"])
def server(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    tenant_app: Callable[..., Server],
) -> Server:
    if request.param == "memory":
        return tenant_app("--in-memory")
    if request.param == "durable":
        return tenant_app("--data-dir", str(tmp_path / "data"), "--fsync", "never")
    return tenant_app("--backend", request.getfixturevalue("redis_url"))


def _init(client: Client, rank: int, world_size: int | None = None) -> tuple[int, str]:
    body: dict[str, object] = {"role": "worker", "num_pages": 8}
    if world_size is not None:
        body["world_size"] = world_size
    resp = client.post(f"/rank/{rank}/initialize", body)
    return resp.status_code, resp.text


def _registry(admin: Client) -> tuple[int | None, list[int]]:
    view = admin.get("/v1/vllm").json()
    return view["world_size"], view["ranks"]


def test_a_write_token_pins_the_first_world_size_and_only_an_admin_moves_it(
    server: Server,
) -> None:
    worker = Client(server.url, token("a_rw"))
    admin = Client(server.url, token("a_admin"))

    assert _init(worker, 0, 2)[0] == 200  # the first world size: the stock start-up
    assert _init(worker, 1, 2)[0] == 200  # the same one again
    assert _init(worker, 1)[0] == 200  # none: nothing to change
    assert _registry(admin) == (2, [0, 1])

    status, text = _init(worker, 3, 4)
    assert status == 403, text
    assert "would change this tenant's vLLM world size from 2" in text
    assert "needs the 'admin' right" in text
    assert "Initialize with `world_size` 2 (or without it)" in text
    assert "POST /v1/vllm/world_size" in text
    assert _registry(admin) == (2, [0, 1])  # refused whole: rank 3 not registered either

    assert _init(admin, 0, 4)[0] == 200  # an admin token moves it
    assert _registry(admin) == (4, [0, 1])
    assert _init(worker, 2, 4)[0] == 200  # and workers follow the new one
    assert _init(worker, 1, 2)[0] == 403  # but cannot move it back

    # Unpinned by an admin, the next worker start-up pins it again.
    assert admin.post("/v1/vllm/world_size", {"world_size": None}).status_code == 200
    assert _init(worker, 3, 4)[0] == 200
    assert _registry(admin) == (4, [0, 1, 2, 3])


def test_the_rule_is_per_tenant(server: Server) -> None:
    assert _init(Client(server.url, token("a_rw")), 0, 2)[0] == 200
    b_worker = Client(server.url, token("b_rw"))
    assert _init(b_worker, 0, 8)[0] == 200  # teamB's first world size, not teamA's
    assert _registry(Client(server.url, token("b_admin"))) == (8, [0])
    assert _registry(Client(server.url, token("a_admin"))) == (2, [0])
