"""A stray vLLM rank registration through a real ``kvmeta serve``: it no longer hides every
block, it can be removed (``POST /v1/vllm/ranks/{rank}/remove``), the world size can be set and
cleared (``POST /v1/vllm/world_size``), and both survive restarts (journal and snapshot) and
run on Redis."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from kvmeta.client.vllm import Hf3fsGlobalMetadataClient, Hf3fsLocalMetadataClient
from kvmeta.errors import InvalidRequest, NotInitialized
from tests.integration.test_vllm_http import exists, init, save
from tests.support import Server


@pytest.fixture
def server(app_server: Server) -> Server:
    """The tests taking ``server`` check what requests get back: it runs in this process."""
    return app_server


Make = Callable[..., Server]


def index(server: Server) -> dict[str, Any]:
    r = requests.get(server.url + "/v1/vllm", timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def remove(server: Server, rank: int) -> dict[str, Any]:
    r = server.post(f"/v1/vllm/ranks/{rank}/remove")
    assert r.status_code == 200, r.text
    return dict(r.json())


def set_world(server: Server, body: Any) -> requests.Response:
    return server.post("/v1/vllm/world_size", body)


def _stray_then_remove(server: Server) -> None:
    init(server, 0, 8)
    init(server, 1, 8)
    for rank in (0, 1):
        save(server, rank, ["k"])
    init(server, 77, 8)  # once, by mistake
    assert exists(server, ["k", "m"]) == [True, False]
    view = index(server)
    assert view == {
        "world_size": None,
        "ranks": [0, 1, 77],
        "required": [0, 1],
        "ignored": [77],
        "missing": [],
    }
    server.wait_for_log("rank 77")
    pools = requests.get(server.url + "/v1/pools", timeout=30).json()
    assert pools["vllm"]["ignored"] == [77]
    out = remove(server, 77)
    assert out["removed"] is True and out["rank"] == 77 and out["keys_dropped"] == 0
    again = remove(server, 77)
    assert again["removed"] is False and "not registered" in again["message"]
    r = server.post("/keys/batch_allocate", {"rank": 77, "keys": [["a", ""]]})
    assert r.status_code == 404 and r.json()["detail"].startswith("Rank 77 not initialized")
    assert index(server)["ranks"] == [0, 1]


def test_stray_rank_removed_and_gone_after_a_crash_and_a_restart(
    make_server: Make, tmp_path: Path
) -> None:
    server = make_server("--data-dir", str(tmp_path / "data"), "--read-lease", "0")
    _stray_then_remove(server)
    assert set_world(server, {"world_size": 3}).status_code == 200
    assert exists(server, ["k"]) == [False]  # rank 2 required, never registered
    server.stop(signal.SIGKILL)  # no final snapshot: the journal has the removal
    server.start()
    assert index(server)["ranks"] == [0, 1]
    assert index(server)["world_size"] == 3
    r = set_world(server, {"world_size": None})
    assert r.status_code == 200 and r.json()["world_size"] is None
    assert exists(server, ["k"]) == [True]
    assert server.stop() == 0  # final snapshot
    server.start()
    assert index(server) == {
        "world_size": None,
        "ranks": [0, 1],
        "required": [0, 1],
        "ignored": [],
        "missing": [],
    }
    assert exists(server, ["k"]) == [True]
    r = server.post("/keys/get_locations", {"rank": 77, "keys": ["k"]})
    assert r.status_code == 404


def test_stray_rank_on_redis_across_server_restarts(make_server: Make, redis_url: str) -> None:
    server = make_server("--backend", redis_url, "--read-lease", "0")
    _stray_then_remove(server)
    server.stop()
    other = make_server("--backend", redis_url)
    assert index(other)["ranks"] == [0, 1]
    assert exists(other, ["k"]) == [True]


def test_world_size_pins_and_ignores_ranks_beyond_it(server: Server) -> None:
    init(server, 0, 8, world_size=2)
    init(server, 1, 8)
    init(server, 5, 8)
    for rank in (0, 1):
        save(server, rank, ["k"])
    assert exists(server, ["k"]) == [True]
    assert index(server)["ignored"] == [5]
    server.wait_for_log("rank 5")
    r = set_world(server, {"world_size": 6})
    assert r.status_code == 200 and r.json()["world_size"] == 6
    assert index(server)["missing"] == [2, 3, 4]
    assert exists(server, ["k"]) == [False]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "need `world_size`"),
        ({"world_size": 0}, "`world_size` must be an integer > 0 or null"),
        ({"world_size": -2}, "got -2"),
        ({"world_size": "2"}, 'got "2"'),
        ({"world_size": True}, "got true"),
        ({"world_size": 1.5}, "got 1.5"),
        ([2], "JSON object"),
        (b"{", "not valid JSON"),
    ],
)
def test_bad_world_size_is_a_400_naming_the_field(server: Server, body: Any, needle: str) -> None:
    init(server, 0, 8, world_size=1)
    r = set_world(server, body)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert needle in detail and '{"world_size": null}' in detail
    assert index(server)["world_size"] == 1  # nothing changed


def test_bad_rank_and_method(server: Server) -> None:
    r = server.post("/v1/vllm/ranks/abc/remove")
    assert r.status_code == 422 and "`rank` must be an integer" in r.json()["detail"]
    r = requests.get(server.url + "/v1/vllm/ranks/1/remove", timeout=30)
    assert r.status_code == 405
    r = requests.get(server.url + "/v1/vllm/world_size", timeout=30)
    assert r.status_code == 405


def test_admin_routes_need_the_token(make_app: Make) -> None:
    server = make_app("--in-memory", "--auth-token", "s3cret")
    assert server.post("/v1/vllm/ranks/1/remove").status_code == 401
    assert set_world(server, {"world_size": 2}).status_code == 401
    assert requests.get(server.url + "/v1/vllm", timeout=30).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    assert server.post("/v1/vllm/ranks/1/remove", headers=auth).status_code == 200


def test_clients_remove_ranks_and_set_the_world_size(server: Server) -> None:
    remote = Hf3fsGlobalMetadataClient(server.url, auto_reinitialize=True)
    local = Hf3fsLocalMetadataClient()
    try:
        for client in (remote, local):
            client.initialize(0, 8)
            client.initialize(77, 8)
            [(_, page)] = client.allocate_pages_for_keys(0, [("k", "")])
            client.confirm_write_for_keys(0, [("k", page)])
            assert client.batch_key_exists(["k"]) == [True]
            assert client.remove_rank(77) is True
            assert client.remove_rank(77) is False
            # auto_reinitialize must not bring a removed rank back
            with pytest.raises(NotInitialized):
                client.get_key_locations(77, ["k"])
            client.set_world_size(2)
            assert client.batch_key_exists(["k"]) == [False]
            client.set_world_size(None)
            assert client.batch_key_exists(["k"]) == [True]
            with pytest.raises(InvalidRequest, match="world_size"):
                client.set_world_size(0)
    finally:
        remote.close()
