"""Caller mistakes the reference servers answer 204/200 keep that reply, but carry an
``X-Kvmeta-Warning`` header saying what happened and the fix, and count in
``kvmeta_caller_warnings_total{kind}``."""

from __future__ import annotations

import re

import pytest
import requests

from tests.support import Server


@pytest.fixture
def server(app_server: Server) -> Server:
    """Every test here checks what requests get back: the server runs in this process."""
    return app_server


def warnings_metric(server: Server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    found = re.findall(r'^kvmeta_caller_warnings_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {kind: float(value) for kind, value in found}


def warning(resp: requests.Response) -> str:
    return resp.headers.get("x-kvmeta-warning", "")


def test_clean_requests_carry_no_warning(server: Server) -> None:
    assert "x-kvmeta-warning" not in server.post("/0/initialize", {"num_pages": 8}).headers
    resp = server.post("/0/exists", {"keys": ["a"], "namespace": "kv"})
    assert resp.json() == {"exists": [False]}
    assert "x-kvmeta-warning" not in resp.headers
    assert warnings_metric(server) == {
        "batch_refused": 0,
        "confirm_refused": 0,
        "size_conflict": 0,
        "unknown_field": 0,
    }


def test_sglang_reinitialise_with_another_size(server: Server) -> None:
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    resp = server.post("/0/initialize", {"num_pages": 16})
    assert resp.status_code == 204
    text = warning(resp)
    assert text.startswith("size_conflict: "), text
    assert "already has 8 pages" in text and "requested 16 is ignored" in text
    assert "namespace 'kv'" in text
    # same size again: nothing to warn about
    assert "x-kvmeta-warning" not in server.post("/0/initialize", {"num_pages": 8}).headers
    assert warnings_metric(server)["size_conflict"] == 1


def test_vllm_reregister_with_another_size(server: Server) -> None:
    assert server.post("/rank/0/initialize", {"num_pages": 8}).status_code == 200
    resp = server.post("/rank/0/initialize", {"num_pages": 9})
    assert resp.status_code == 200
    assert "already has 8 pages" in warning(resp)
    assert "namespace" not in warning(resp)
    assert warnings_metric(server)["size_conflict"] == 1


def test_unknown_field_is_named_with_the_closest_known_one(server: Server) -> None:
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    resp = server.post("/0/exists", {"keys": ["a"], "nmespace": "mamba"})
    assert resp.status_code == 200 and resp.json() == {"exists": [False]}
    text = warning(resp)
    assert "unknown field `nmespace` ignored; did you mean `namespace`?" in text, text
    resp = server.post("/0/confirm_write", {"written_keys_to_confirm": [], "pages_to_relase": [1]})
    assert resp.status_code == 204
    assert "did you mean `pages_to_release`?" in warning(resp)
    resp = server.post("/0/clear", {"namespace": "kv", "force": True})
    assert resp.status_code == 204
    assert "unknown field `force` ignored" in warning(resp)
    assert "did you mean" not in warning(resp)
    # vLLM routes, initialize included
    assert server.post("/rank/0/initialize", {"num_pages": 8}).status_code == 200
    resp = server.post("/rank/1/initialize", {"num_pages": 8, "wrld_size": 2})
    assert resp.status_code == 200
    assert "unknown field `wrld_size` ignored; did you mean `world_size`?" in warning(resp)
    resp = server.post("/keys/batch_exists", {"keys": ["a"], "rank": 0})
    assert resp.json() == {"exists": [False]}
    assert "unknown field `rank` ignored" in warning(resp)
    assert warnings_metric(server)["unknown_field"] == 5


def test_hostile_field_names_cannot_inject_headers(server: Server) -> None:
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    resp = server.post("/0/exists", {"keys": ["a"], "x\r\nX-Evil: 1": 0, "\u00e9" * 5000: 1})
    assert resp.status_code == 200
    assert "x-evil" not in resp.headers
    assert len(warning(resp)) <= 600 and warning(resp).isascii()


def test_refused_confirms_say_how_many_and_why(server: Server) -> None:
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    reply = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    ((_, page),) = reply.json()["indices"]
    resp = server.post(
        "/0/confirm_write", {"written_keys_to_confirm": [["b", page], ["c", (page + 1) % 8]]}
    )
    assert resp.status_code == 204
    text = warning(resp)
    assert text.startswith("confirm_refused: 2 confirm(s) refused"), text
    assert "--reservation-ttl" in text
    # the writer's own confirm is fine
    resp = server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", page]]})
    assert resp.status_code == 204 and "x-kvmeta-warning" not in resp.headers
    # vLLM
    assert server.post("/rank/0/initialize", {"num_pages": 8}).status_code == 200
    reply = server.post("/keys/batch_allocate", {"rank": 0, "keys": [["k", None]]})
    ((_, vpage),) = reply.json()["results"]
    resp = server.post("/keys/confirm_write", {"rank": 0, "confirmations": [["j", vpage]]})
    assert resp.status_code == 204
    assert warning(resp).startswith("confirm_refused: 1 confirm(s) refused")
    assert warnings_metric(server)["confirm_refused"] == 2
