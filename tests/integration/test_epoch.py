"""The server epoch on the wire: ``X-Kvmeta-Epoch`` on every reply, ``epoch`` in ``/health`` and
``/v1/pools``, what restarts do to it, and kvmeta's clients re-initialising when it changes."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from kvmeta import sglang, vllm
from tests.support import Server, ServerProcess

HEADER = "X-Kvmeta-Epoch"


def _epoch(server: Server) -> str:
    resp = requests.get(server.url + "/health", timeout=30)
    assert resp.status_code == 200
    assert resp.json()["epoch"] == resp.headers[HEADER]
    return resp.headers[HEADER]


def _raw(server: Server, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def test_every_reply_carries_the_epoch(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--max-body-bytes", "4096")
    epoch = _epoch(server)
    assert len(epoch) >= 8
    replies = [
        server.post("/0/initialize", {"num_pages": 4}),  # 204
        server.post("/0/exists", {"keys": ["a"]}),  # 200
        server.post("/1/exists", {"keys": ["a"]}),  # 404 not initialized
        server.post("/0/exists", {"keys": "nope"}),  # 422/400
        server.post("/rank/0/initialize", {"role": "worker", "num_pages": 4}),
        server.post("/keys/batch_exists", {"keys": ["a"]}),
        server.post("/keys/get_locations", {"rank": 9, "keys": ["a"]}),  # 404
        server.post("/0/exists", b"x" * 8192),  # 413 from the HTTP layer
        server.post("/no/such/route", {}),  # 404 unknown path
        requests.get(server.url + "/0/exists", timeout=30),  # 405
        requests.get(server.url + "/ready", timeout=30),
        requests.get(server.url + "/metrics", timeout=30),
        requests.get(server.url + "/openapi.json", timeout=30),
    ]
    pools = requests.get(server.url + "/v1/pools", timeout=30)
    replies.append(pools)
    assert pools.json()["server"]["epoch"] == epoch
    for resp in replies:
        assert resp.headers.get(HEADER) == epoch, (resp.request.url, resp.status_code)
    statuses = {r.status_code for r in replies}
    assert {200, 204, 404, 405, 413} <= statuses
    # Garbage the HTTP parser refuses gets the header too.
    raw = _raw(server, b"NOT HTTP AT ALL\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400")
    assert f"x-kvmeta-epoch: {epoch}\r\n".encode() in raw
    doc = requests.get(server.url + "/openapi.json", timeout=30).json()
    exists = doc["paths"]["/{rank}/exists"]["post"]["responses"]
    assert HEADER in exists["200"]["headers"] and HEADER in exists["404"]["headers"]


def test_refused_token_reply_carries_the_epoch(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--auth-token", "s3cret")
    health = requests.get(server.url + "/health", timeout=30)
    refused = server.post("/0/exists", {"keys": ["a"]})
    assert refused.status_code == 401
    assert refused.headers[HEADER] == health.headers[HEADER] == health.json()["epoch"]


def test_in_memory_restart_changes_the_epoch(make_server: Callable[..., ServerProcess]) -> None:
    first = make_server("--in-memory")
    before = _epoch(first)
    first.stop()
    second = ServerProcess("--in-memory", "--port", str(first.port)).start()
    try:
        assert _epoch(second) != before
    finally:
        second.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_data_dir_restart_keeps_the_epoch(tmp_path: Path, sig: signal.Signals) -> None:
    data = str(tmp_path / "data")
    server = ServerProcess("--data-dir", data, "--fsync", "always").start()
    try:
        before = _epoch(server)
        assert server.post("/0/initialize", {"num_pages": 4}).status_code == 204
        server.stop(sig)
        server = ServerProcess("--data-dir", data).start()
        assert _epoch(server) == before
        assert server.post("/0/exists", {"keys": ["a"]}).status_code == 200  # pool kept
        server.stop()
        other = ServerProcess("--data-dir", str(tmp_path / "other")).start()
        try:
            assert _epoch(other) != before
        finally:
            other.kill()
    finally:
        server.kill()


def test_sglang_client_reinitialises_every_pool_when_the_epoch_changes(
    make_server: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    first = make_server("--in-memory")
    client = sglang.Hf3fsGlobalMetadataClient(first.url, auto_reinitialize=True)
    plain = sglang.Hf3fsGlobalMetadataClient(first.url)
    client.initialize(0, 8, "kv")
    client.initialize(0, 4, "mamba")
    plain.initialize(1, 4, "kv")
    old = client.epoch
    assert old == _epoch(first) == plain.epoch
    first.stop()
    second = ServerProcess("--in-memory", "--port", str(first.port)).start()
    try:
        new = _epoch(second)
        with caplog.at_level("WARNING"):
            assert client.get_page_indices(0, ["a"], "mamba") == [None]
        assert client.epoch == new
        assert old in caplog.text and new in caplog.text
        # One call re-created every pool the client initialised, not only the one it used.
        pools = requests.get(second.url + "/v1/pools", timeout=30).json()["pools"]
        assert sorted((p["namespace"], p["num_pages"]) for p in pools) == [("kv", 8), ("mamba", 4)]
        assert client.reserve_and_allocate_page_indices(0, [("a", None)], "kv") == [(False, 0)]
        # Without the option nothing is re-sent: its pool stays gone.
        with pytest.raises(sglang_not_initialized()):
            plain.exists(1, ["a"])
        assert plain.epoch == new
    finally:
        client.close()
        plain.close()
        second.kill()


def sglang_not_initialized() -> type[Exception]:
    from kvmeta.errors import NotInitialized

    return NotInitialized


def test_vllm_client_reinitialises_on_a_call_that_does_not_fail(
    make_server: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """batch_key_exists answers [False] from an empty server (no 404): only the epoch tells
    the client that its rank registration is gone."""
    first = make_server("--in-memory")
    client = vllm.Hf3fsGlobalMetadataClient(first.url, auto_reinitialize=True)
    plain = vllm.Hf3fsGlobalMetadataClient(first.url)
    client.initialize(0, 8, world_size=1)
    old = client.epoch
    first.stop()
    second = ServerProcess("--in-memory", "--port", str(first.port)).start()
    try:
        assert plain.batch_key_exists(["a"]) == [False]
        assert requests.get(second.url + "/v1/vllm", timeout=30).json()["ranks"] == []
        with caplog.at_level("WARNING"):
            assert client.batch_key_exists(["a"]) == [False]
        assert "epoch" in caplog.text and old in caplog.text
        registry = requests.get(second.url + "/v1/vllm", timeout=30).json()
        assert registry["ranks"] == [0] and registry["world_size"] == 1
        assert client.allocate_pages_for_keys(0, [("a", "")]) == [("a", 0)]
        assert client.epoch == _epoch(second) != old
    finally:
        client.close()
        plain.close()
        second.kill()


def test_same_epoch_resends_nothing(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory")
    client = sglang.Hf3fsGlobalMetadataClient(server.url, auto_reinitialize=True)
    client.initialize(0, 8)
    client.exists(0, ["a"])
    client.exists(0, ["a"])
    counts = requests.get(server.url + "/metrics", timeout=30).text
    wanted = 'kvmeta_http_requests_total{method="POST",route="/{rank}/initialize",status="204"}'
    line = [ln for ln in counts.splitlines() if ln.startswith(wanted)]
    assert line == [wanted + " 1.0"], line
    client.close()


def test_pool_lost_under_the_same_epoch_is_reinitialised_on_not_initialized(
    make_app: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    """The 404 path stays: another client removed this client's rank (the epoch is unchanged)."""
    server = make_app("--in-memory")
    client = vllm.Hf3fsGlobalMetadataClient(server.url, auto_reinitialize=True)
    operator = vllm.Hf3fsGlobalMetadataClient(server.url)
    client.initialize(0, 8)
    epoch = client.epoch
    assert operator.remove_rank(0) is True
    with caplog.at_level("WARNING"):
        assert client.allocate_pages_for_keys(0, [("a", "")]) == [("a", 0)]
    assert "forgot" in caplog.text and "re-initialising with 8 pages" in caplog.text
    assert client.epoch == epoch
    client.close()
    operator.close()


def test_in_process_clients_have_a_fixed_epoch() -> None:
    a, b = sglang.Hf3fsLocalMetadataClient(), vllm.Hf3fsLocalMetadataClient()
    a.initialize(0, 4)
    assert a.epoch == a.epoch and a.epoch != b.epoch and len(a.epoch) == 32


def test_kvmeta_status_shows_the_epoch(make_app: Callable[..., Server]) -> None:
    from tests.integration.test_ops_routes import run_status

    server = make_app("--in-memory")
    out = run_status("--url", server.url)
    assert out.returncode == 0, out.stderr
    assert f"epoch {_epoch(server)}" in out.stdout.splitlines()[0]
