"""Token auth and TLS on a real server: an SGLang client with the token in its URL works and is
refused without it; Bearer works; /health stays open, /ready answers ready or not to anyone and
the detail with the token; the token never reaches the log."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from kvmeta.errors import KvmetaError, Unauthorized
from kvmeta.sglang import Hf3fsGlobalMetadataClient
from tests.redis_support import RedisServer
from tests.support import Server, ServerProcess, self_signed_cert

TOKEN = "s3cret-Token_42"


@pytest.fixture
def authed(make_app: Callable[..., Server]) -> Server:
    return make_app("--in-memory", "--auth-token", TOKEN)


def with_token_in_url(url: str, user: str = "") -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{TOKEN}@{rest}"


def test_sglang_client_with_token_in_url_works(authed: Server) -> None:
    client = Hf3fsGlobalMetadataClient(with_token_in_url(authed.url))
    client.initialize(0, 32)
    [(stored, page)] = client.reserve_and_allocate_page_indices(0, [("k1", None)])
    assert (stored, page) == (False, 0)
    client.confirm_write(0, [("k1", page)], [])
    assert client.exists(0, ["k1", "k2"]) == [True, False]
    assert client.get_page_indices(0, ["k1"]) == [0]
    # any user name works: the token is the password
    other = Hf3fsGlobalMetadataClient(with_token_in_url(authed.url, user="sglang"))
    assert other.exists(0, ["k1"]) == [True]


def test_sglang_client_without_or_with_wrong_token_is_refused(authed: Server) -> None:
    bare = Hf3fsGlobalMetadataClient(authed.url, max_retries=0)
    with pytest.raises(Unauthorized, match="Authentication required"):
        bare.initialize(0, 32)
    wrong = Hf3fsGlobalMetadataClient(authed.url.replace("://", "://:nope@"), max_retries=0)
    with pytest.raises(Unauthorized, match="Invalid authentication token"):
        wrong.exists(0, ["k"])
    assert isinstance(Unauthorized("x"), RuntimeError)  # engines catch RuntimeError
    # nothing was created by the refused calls
    pools = requests.get(authed.url + "/v1/pools", auth=("", TOKEN), timeout=10).json()
    assert pools["pools"] == []


def test_bearer_token_and_401_shape(authed: Server) -> None:
    resp = authed.post("/0/initialize", {"num_pages": 8})
    assert resp.status_code == 401
    assert set(resp.json()) == {"detail"}
    challenge = resp.headers["WWW-Authenticate"]
    assert "Bearer" in challenge and "Basic" in challenge
    ok = authed.post(
        "/0/initialize", {"num_pages": 8}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert ok.status_code == 204
    client = Hf3fsGlobalMetadataClient(authed.url, auth_token=TOKEN)
    assert client.exists(0, ["a"]) == [False]
    for header in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Basic !!!", "Token abc", ""):
        bad = authed.post("/0/exists", {"keys": []}, headers={"Authorization": header})
        assert bad.status_code == 401, header


def test_every_route_but_health_and_ready_needs_the_token(authed: Server) -> None:
    assert requests.get(authed.url + "/health", timeout=10).status_code == 200
    assert requests.get(authed.url + "/ready", timeout=10).status_code == 200
    for path in ("/metrics", "/v1/pools", "/v1/check", "/openapi.json"):
        assert requests.get(authed.url + path, timeout=10).status_code == 401, path
        assert requests.get(authed.url + path, auth=("u", TOKEN), timeout=10).status_code == 200
    for op in ("initialize", "exists", "clear", "confirm_write", "get_page_indices"):
        assert authed.post(f"/0/{op}", {}).status_code == 401, op
    metrics = requests.get(authed.url + "/metrics", auth=("", TOKEN), timeout=10).text
    assert "kvmeta_auth_failures_total" in metrics


def auth_failures(server: Server) -> str:
    text = requests.get(server.url + "/metrics", auth=("", TOKEN), timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("kvmeta_auth_failures_total")]
    return line


def test_ready_answers_a_probe_without_the_token_and_the_detail_with_it(
    authed: Server,
) -> None:
    """A Kubernetes httpGet probe sends no header: it learns ready or not, nothing more."""
    authed.post("/0/initialize", {"num_pages": 8, "namespace": "poolname"}, auth=("", TOKEN))
    failures = auth_failures(authed)
    probe = requests.get(authed.url + "/ready", timeout=10)
    assert probe.status_code == 200 and probe.json() == {"ready": True}
    assert "memory" not in probe.text and "poolname" not in probe.text
    assert auth_failures(authed) == failures  # a probe is not an auth failure
    for auth in (("", TOKEN), ("probe", TOKEN)):
        detailed = requests.get(authed.url + "/ready", auth=auth, timeout=10)
        assert detailed.status_code == 200
        assert detailed.json() == {"ready": True, "backend": "memory"}
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    detailed = requests.get(authed.url + "/ready", headers=bearer, timeout=10)
    assert detailed.json() == {"ready": True, "backend": "memory"}
    for header in (f"Bearer {TOKEN}x", "Basic !!!", "Token abc"):
        wrong = requests.get(authed.url + "/ready", headers={"Authorization": header}, timeout=10)
        assert wrong.status_code == 200 and wrong.json() == {"ready": True}, header
    assert auth_failures(authed) != failures  # a wrong token still counts


def test_not_ready_without_the_token_is_503_and_minimal(
    make_app: Callable[..., Server],
) -> None:
    redis = RedisServer().start()
    try:
        server = make_app("--backend", redis.url, "--auth-token", TOKEN, "--failover-timeout", "1")
        assert requests.get(server.url + "/ready", auth=("", TOKEN), timeout=10).ok
    finally:
        redis.close()  # the backend is gone: not ready
    probe = requests.get(server.url + "/ready", timeout=30)
    assert probe.status_code == 503 and probe.json() == {"ready": False}
    wrong = requests.get(server.url + "/ready", auth=("", "nope"), timeout=30)
    assert wrong.status_code == 503 and wrong.json() == {"ready": False}
    detailed = requests.get(server.url + "/ready", auth=("", TOKEN), timeout=30)
    assert detailed.status_code == 503 and detailed.json()["ready"] is False
    assert "redis" in detailed.json()["detail"]


def test_token_is_never_logged(make_server: Callable[..., ServerProcess]) -> None:
    server = make_server(
        "--in-memory", "--auth-token", TOKEN, "--access-log", "--log-level", "debug"
    )
    server.post("/0/initialize", {"num_pages": 8}, headers={"Authorization": "Bearer wrong"})
    server.post("/0/initialize", {"num_pages": 8}, auth=("", TOKEN))
    server.wait_for_log("POST /0/initialize 204")
    assert "auth: on" in server.log
    assert TOKEN not in server.log
    assert server.stop() == 0
    assert TOKEN not in server.log


def test_token_from_environment(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", env={"KVMETA_AUTH_TOKEN": TOKEN})
    assert server.post("/0/initialize", {"num_pages": 8}).status_code == 401
    assert server.post("/0/initialize", {"num_pages": 8}, auth=("", TOKEN)).status_code == 204


def test_tls_with_token(make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = make_server(
        "--in-memory",
        "--auth-token",
        TOKEN,
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
    )
    assert server.url.startswith("https://")
    server.wait_for_log("tls: on")
    client = Hf3fsGlobalMetadataClient(with_token_in_url(server.url), verify=str(cert))
    client.initialize(0, 8)
    assert client.exists(0, ["a"]) == [False]
    # an unverified certificate is refused by default
    strict = Hf3fsGlobalMetadataClient(with_token_in_url(server.url), max_retries=0)
    with pytest.raises(KvmetaError):
        strict.exists(0, ["a"])
    # plain http to the TLS port does not work
    with pytest.raises(requests.RequestException):
        requests.get(server.url.replace("https://", "http://") + "/health", timeout=5)


def test_plain_requests_with_url_credentials_like_stock_clients(authed: Server) -> None:
    """The stock engine clients are plain `requests.post(base_url + path, json=...)` calls."""
    base = with_token_in_url(authed.url)
    resp = requests.post(base + "/0/initialize", json={"num_pages": 8}, timeout=10)
    assert resp.status_code == 204
    resp = requests.post(base + "/0/exists", json={"keys": ["a"]}, timeout=10)
    assert resp.json() == {"exists": [False]}
    assert requests.post(authed.url + "/0/exists", json={"keys": []}, timeout=10).status_code == 401
