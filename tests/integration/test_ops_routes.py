"""Operator routes on a real server: health, ready, Prometheus metrics, /v1/pools, /v1/check,
``kvmeta status``, start-up logging, the access log and the second-engine warning."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import SRC, Server, ServerProcess


@pytest.fixture
def server(app_server: Server) -> Server:
    """The tests taking ``server`` check what requests get back: it runs in this process."""
    return app_server


def get(server: Server, path: str) -> requests.Response:
    return requests.get(server.url + path, timeout=10)


def cycle(
    server: Server, rank: int = 0, ns: str = "kv", auth: tuple[str, str] | None = None
) -> None:
    """Pool of 4 pages: store 3 keys, one lookup hit and one miss, one evicting reserve."""

    def post(path: str, body: dict[str, Any]) -> requests.Response:
        return server.post(path, body, auth=auth)

    assert post(f"/{rank}/initialize", {"num_pages": 4, "namespace": ns}).status_code == 204
    keys = [["a", None], ["b", None], ["c", None]]
    r = post(f"/{rank}/reserve_and_allocate_page_indices", {"keys": keys, "namespace": ns})
    pages = [p for _, p in r.json()["indices"]]
    pairs = [[k[0], p] for k, p in zip(keys, pages, strict=True)]
    body = {"written_keys_to_confirm": pairs, "namespace": ns}
    assert post(f"/{rank}/confirm_write", body).status_code == 204
    post(f"/{rank}/get_page_indices", {"keys": ["a", "zz"], "namespace": ns})
    post(f"/{rank}/exists", {"keys": ["a", "b", "q"], "namespace": ns})
    body = {"keys": [["d", None], ["e", None]], "namespace": ns}
    post(f"/{rank}/reserve_and_allocate_page_indices", body)


def test_health_and_ready(server: Server) -> None:
    health = get(server, "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.headers["content-type"] == "application/json"
    ready = get(server, "/ready")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "backend": "memory"}
    assert server.post("/health", {}).status_code == 405


def test_pools_show_occupancy_hit_rate_and_settings(server: Server) -> None:
    cycle(server)
    server.post("/0/initialize", {"num_pages": 99})  # size conflict: kept 4, warned
    server.wait_for_log("re-initialised with num_pages=99")
    doc = get(server, "/v1/pools").json()
    assert doc["server"]["read_lease"] == 0.0 and doc["server"]["auth"] is False
    assert doc["server"]["limits"]["max_keys"] == 65536
    [pool] = doc["pools"]
    assert (pool["dialect"], pool["rank"], pool["namespace"]) == ("s", 0, "kv")
    assert (pool["num_pages"], pool["free"], pool["reserved"], pool["stored"]) == (4, 0, 2, 2)
    assert pool["occupancy"] == 0.5
    assert pool["hit_rate"] == 0.5 and pool["exists_hit_rate"] == round(2 / 3, 4)
    assert pool["size_conflicts"] == 1
    assert pool["counters"]["evictions"] == 1 and pool["counters"]["commits"] == 3


def test_check_reports_every_pool_ok(server: Server) -> None:
    cycle(server, 0)
    cycle(server, 1, "mamba")
    assert get(server, "/v1/check").json() == {
        "ok": True,
        "checked": 2,
        "problems": [],
        "supported": True,
    }


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _pool(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted({"dialect": "s", "rank": "0", "namespace": "kv", "tenant": "", **extra}.items())
    )


def test_metrics_scrape_parses_and_counts(server: Server) -> None:
    cycle(server)
    server.post("/0/confirm_write", {"written_keys_to_confirm": [["x", 3]]})  # refused
    server.post("/0/exists", b"{not json")
    resp = get(server, "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    m = _samples(resp.text)
    assert m[("kvmeta_pool_pages", _pool(state="stored"))] == 2
    assert m[("kvmeta_pool_pages", _pool(state="reserved"))] == 2
    assert m[("kvmeta_pool_size_pages", _pool())] == 4
    assert m[("kvmeta_pool_keys", _pool())] == 2
    assert m[("kvmeta_pool_lookups_total", _pool(op="get", result="hit"))] == 1
    assert m[("kvmeta_pool_lookups_total", _pool(op="get", result="miss"))] == 1
    assert m[("kvmeta_pool_lookups_total", _pool(op="exists", result="hit"))] == 2
    assert m[("kvmeta_pool_reservations_total", _pool(outcome="granted"))] == 5
    assert m[("kvmeta_pool_evictions_total", _pool())] == 1
    assert m[("kvmeta_pool_confirms_refused_total", _pool())] == 1
    assert m[("kvmeta_pool_size_conflicts_total", _pool())] == 0
    route = (("method", "POST"), ("route", "/{rank}/exists"))
    assert m[("kvmeta_http_requests_total", (*route, ("status", "200")))] == 1
    assert m[("kvmeta_http_requests_total", (*route, ("status", "400")))] == 1
    assert m[("kvmeta_http_request_duration_seconds_count", route)] == 2
    assert m[("kvmeta_http_request_duration_seconds_bucket", (("le", "+Inf"), *route))] == 2
    assert m[("kvmeta_ready", ())] == 1
    # no key ever becomes a label value
    assert '"a"' not in resp.text and "zz" not in resp.text


def run_status(*args: str, token_env: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = str(SRC)
    if token_env is not None:
        env["KVMETA_AUTH_TOKEN"] = token_env
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "status", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_status_table_json_and_exit_codes(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--auth-token", "tok")
    cycle(server, auth=("", "tok"))
    out = run_status("--url", server.url, "--token", "tok")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "ready" in lines[0] and "auth on" in lines[0]
    assert lines[1].split()[:2] == ["POOL", "PAGES"]
    row = lines[2]
    assert row.startswith("sglang rank 0 kv") and "[##########++++++++++]" in row
    assert "50.0%" in row
    assert run_status("--url", server.url, token_env="tok").returncode == 0
    assert run_status("--url", server.url, token_env="wrong").returncode == 2
    as_json = run_status("--url", server.url.replace("://", "://:tok@"), "--json")
    doc: dict[str, Any] = json.loads(as_json.stdout)
    assert doc["ready"]["ready"] is True and doc["pools"][0]["stored"] == 2
    refused = run_status("--url", server.url)
    assert refused.returncode == 2 and "Authentication required" in refused.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    gone = run_status("--url", f"http://127.0.0.1:{free_port}")
    assert gone.returncode == 2 and "did not answer" in gone.stderr


def test_startup_log_and_json_format(make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--in-memory", "--log-format", "json", "--max-keys", "77")
    server.wait_for_log("tls: off")
    records = [json.loads(line) for line in server.log.splitlines() if line.strip()]
    messages = [r["msg"] for r in records]
    assert all(r["level"] == "info" for r in records)
    assert any(m.startswith("kvmeta listening on http://127.0.0.1:") for m in messages)
    assert "backend: memory" in messages
    assert any("in memory only" in m for m in messages)
    assert any("max_keys=77" in m for m in messages)
    assert any(m.startswith("auth: off") for m in messages)
    server.post("/0/initialize", {"num_pages": 4})
    server.post("/0/exists", {"keys": []})
    assert server.stop() == 0
    # no per-request lines by default: only the pool creation and shutdown were added
    assert not any("/0/exists" in line for line in server.lines)


def test_access_log_opt_in(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--access-log")
    server.post("/0/initialize", {"num_pages": 4})
    server.post("/nope", {})
    server.wait_for_log("POST /nope 404")
    assert "POST /0/initialize 204" in server.log


def _raw_post(url: str, path: str, body: bytes, source: str) -> int:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0)) as s:
        s.sendall(
            b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def test_second_engine_on_same_pool_warns(server: Server) -> None:
    body = b'{"num_pages": 8, "namespace": "kv"}'
    assert _raw_post(server.url, "/3/initialize", body, "127.0.0.1") == 204
    assert _raw_post(server.url, "/3/initialize", body, "127.0.0.1") == 204  # engine restart
    assert "initialised again" not in server.log
    assert _raw_post(server.url, "/3/initialize", body, "127.0.0.2") == 204
    server.wait_for_log("initialised again from 127.0.0.2 (first from 127.0.0.1)")
    assert "WARNING" in server.log
