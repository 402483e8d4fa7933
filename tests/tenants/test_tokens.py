"""The tokens file: start-up checks, SIGHUP reload, secrets never logged, the request rate
quota (429 with Retry-After, nothing changed) and the per-tenant 403/429 counters."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmeta.errors import ConfigError
from kvmeta.server.access import MAX_RETRY_AFTER, TokenBucket, retry_after
from kvmeta.server.tokens import digest, parse_tokens
from tests.support import SRC, Server, ServerProcess
from tests.tenants.conftest import OPERATOR, TOKENS, Client, token, tokens_toml, write_tokens

A = token("a_admin")


def _serve_fails(*args: str) -> str:
    """Run ``kvmeta serve ARGS``, expect it to refuse to start; its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--in-memory", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0, proc.stderr
    return proc.stderr


# ---------------------------------------------------------------- parsing (no server)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[[tokens]]\ntoken = 'short'\ntenant = 'a'", ["tokens[0].token", "16 characters"]),
        ("[[tokens]]\ntoken = 'x' \n", ["tokens[0].token"]),
        (f"[[tokens]]\ntoken = '{'x' * 20}'\ntenant = 'a b'", ["tokens[0].tenant", "A-Za-z0-9_.-"]),
        (f"[[tokens]]\ntoken = '{'x' * 20}'\ntenant = '{'t' * 65}'", ["1-64"]),
        (
            f"[[tokens]]\ntoken = '{'x' * 20}'\ntenant = 'a'\nrank = '1'",
            ["tokens[0].rank", "known"],
        ),
        (f"[[tokens]]\ntoken = '{'x' * 20}'\ntenant = 'a'\nranks = '7-3'", ["backwards"]),
        (f"[[tokens]]\ntoken = '{'x' * 20}'\ntenant = 'a'\nrights = ['root']", ["rights"]),
        ("[[tokens]]\ntoken_sha256 = 'abc'\ntenant = 'a'", ["token_sha256", "64 hex"]),
        ("[tenants.a]\nrequests_per_second = 0", ["tenants.a.requests_per_second", "0.001 to"]),
        ("[tenants.a]\nburst = 3", ["tenants.a.burst", "requests_per_second"]),
        ("[tenants.a]\nmax_page = 3", ["tenants.a.max_page", "known"]),
        (
            "[tenants.a]\nmax_pools = -1",
            ["tenants.a.max_pools", "0 to 4,294,967,296", "--max-pools-per-tenant"],
        ),
        ("[tenants.a]\nmax_pools = 'many'", ["tenants.a.max_pools", "integer"]),
        ("[[tokens]]\ntoken = abc\n", ["not valid TOML", "line 2"]),
    ],
)
def test_bad_files_name_the_field_and_fix(text: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_tokens(text, "t.toml")
    for name in names:
        assert name in str(exc.value)
    assert "x" * 20 not in str(exc.value)


@pytest.mark.parametrize(
    ("quota", "key", "allowed"),
    [
        ("requests_per_second = 1e-310", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = nan", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = inf", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = -inf", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = -2", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = 1e300", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = '5'", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = true", "requests_per_second", "0.001 to 10,000,000"),
        ("requests_per_second = 5\nburst = 0.5", "burst", "1 to 1,000,000,000"),
        ("requests_per_second = 5\nburst = nan", "burst", "1 to 1,000,000,000"),
        ("requests_per_second = 5\nburst = 1e300", "burst", "1 to 1,000,000,000"),
        ("max_pages = -1", "max_pages", "0 to 9,007,199,254,740,992"),
        ("max_pages = 9223372036854775807", "max_pages", "0 to 9,007,199,254,740,992"),
        ("max_pages = 1.5", "max_pages", "0 to 9,007,199,254,740,992"),
    ],
)
def test_an_absurd_quota_names_the_tenant_the_key_and_the_range(
    quota: str, key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_tokens(f"[tenants.teamA]\n{quota}\n", "t.toml")
    text = str(exc.value)
    assert f"`tenants.teamA.{key}`" in text and allowed in text, text
    assert exc.value.field == "auth_file"


def test_the_edges_of_the_quota_ranges_are_accepted() -> None:
    table = parse_tokens(
        "[tenants.slow]\nrequests_per_second = 0.001\n"
        "[tenants.fast]\nrequests_per_second = 1e7\nburst = 1e9\nmax_pages = 0\n"
    )
    assert table.tenants["slow"].burst == 1.0  # one second of requests, at least one
    assert table.tenants["fast"].requests_per_second == 1e7
    assert table.tenants["fast"].max_pages == 0


def test_retry_after_never_overflows() -> None:
    assert retry_after(0.2) == 1 and retry_after(2.5) == 3
    assert retry_after(1000.0) == 1000
    for wait in (1e300, float("inf"), float("nan")):
        assert retry_after(wait) == MAX_RETRY_AFTER
    # The slowest rate a tokens file may set: its wait is well inside the cap.
    bucket = TokenBucket(rate=0.001, burst=1.0, now=0.0)
    assert bucket.take(0.0) == 0.0
    assert retry_after(bucket.take(0.0)) == 1000


def test_a_digest_entry_works_and_no_secret_is_kept() -> None:
    secret = "digest-only-secret-0123"
    table = parse_tokens(
        f"[[tokens]]\ntoken_sha256 = '{digest(secret.encode()).hex()}'\ntenant = 'a'\n"
        f"[[tokens]]\ntoken = 'another-secret-012345'\ntenant = 'b'\nrights = ['read']"
    )
    scope = table.lookup(secret.encode())
    assert scope is not None and scope.tenant == "a"
    assert table.lookup(b"another-secret-012345").rights == frozenset({"read"})  # type: ignore[union-attr]
    assert table.lookup(b"another-secret-01234") is None
    assert "another-secret" not in repr(table)


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # one token refills in 1/rate s
    assert bucket.take(0.5) == 0.0
    assert bucket.take(100.0) == 0.0  # refilled, but never above burst
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]


# ---------------------------------------------------------------- start-up


def test_a_loose_mode_is_refused_at_start_up(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml(), mode=0o644)
    err = _serve_fails("--auth-file", str(path))
    assert f"chmod 600 {path}" in err and "0644" in err
    assert TOKENS["a_rw"][0] not in err


def test_a_bad_file_is_refused_at_start_up(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml() + "\n[[tokens]]\nranks = 3\n")
    err = _serve_fails("--auth-file", str(path))
    assert "tokens[6]" in err and "token_sha256" in err  # the entry, and what it needs
    missing = _serve_fails("--auth-file", str(tmp_path / "nope.toml"))
    assert "nope.toml" in missing and "--auth-file" in missing


def test_an_absurd_rate_is_refused_at_start_up_in_one_line(tmp_path: Path) -> None:
    quota = "[tenants.teamA]\nrequests_per_second = 1e-310\n"
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml(quota))
    proc = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--in-memory", "--port", "0"]
        + ["--auth-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "`tenants.teamA.requests_per_second`" in proc.stderr
    assert "0.001 to 10,000,000, got 1e-310" in proc.stderr


# ---------------------------------------------------------------- serving


@pytest.mark.slow
def test_an_absurd_rate_at_reload_keeps_the_old_table(
    tmp_path: Path, tenant_server: Callable[..., ServerProcess]
) -> None:
    path = write_tokens(
        tmp_path / "tokens.toml",
        tokens_toml("[tenants.teamA]\nburst = 2\nrequests_per_second = 0.01\n"),
    )
    server = tenant_server("--in-memory", auth_file=path)
    a = Client(server.url, A)
    write_tokens(path, tokens_toml("[tenants.teamA]\nrequests_per_second = 1e-310\n"))
    server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    server.wait_for_log("not reloaded", timeout=30)
    assert "`tenants.teamA.requests_per_second` must be a number from 0.001" in server.log
    # The old quota (0.01/s, burst 2) is in force: a 429 with a finite Retry-After, no 500.
    statuses = [a.get("/openapi.json") for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert statuses[2].headers["Retry-After"] == "100"
    assert server.proc.poll() is None  # type: ignore[union-attr]


@pytest.mark.slow
def test_sighup_reloads_and_a_bad_reload_keeps_the_old_file(
    tmp_path: Path, tenant_server: Callable[..., ServerProcess]
) -> None:
    path = tmp_path / "tokens.toml"
    write_tokens(path, tokens_toml())
    server = tenant_server("--in-memory", auth_file=path)
    new = "newly-added-token-0123456"
    assert Client(server.url, new).get("/openapi.json").status_code == 401
    assert Client(server.url, A).get("/openapi.json").status_code == 200
    # Add a token, drop a_admin: both take effect at once on SIGHUP.
    tokens = {k: v for k, v in TOKENS.items() if k != "a_admin"}
    tokens["new"] = (new, "teamC", ["read"], None, None)
    write_tokens(path, tokens_toml(tokens=tokens))
    server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    server.wait_for_log("reloaded", timeout=30)
    assert Client(server.url, new).get("/openapi.json").status_code == 200
    assert Client(server.url, new).post("/0/initialize", {"num_pages": 4}).status_code == 403
    assert Client(server.url, A).get("/openapi.json").status_code == 401
    # A broken file, then a loose mode: logged, the previous table stays in force.
    write_tokens(path, "[[tokens]]\ntoken = 'abc")
    server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    server.wait_for_log("not reloaded", timeout=30)
    assert Client(server.url, new).get("/openapi.json").status_code == 200
    write_tokens(path, tokens_toml(), mode=0o640)
    server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    server.wait_for_log("chmod 600", timeout=30)
    assert Client(server.url, new).get("/openapi.json").status_code == 200
    assert Client(server.url, A).get("/openapi.json").status_code == 401
    assert server.proc.poll() is None  # type: ignore[union-attr]


@pytest.mark.slow
def test_tokens_are_never_logged(tenant_server: Callable[..., ServerProcess]) -> None:
    server = tenant_server("--in-memory", "--access-log", "--log-level", "debug")
    wrong = "wrong-token-abcdefghijkl"
    for secret in (A, OPERATOR, token("a_r"), wrong):
        c = Client(server.url, secret)
        c.post("/0/initialize", {"num_pages": 4})
        c.post("/99/exists", {"keys": ["k"], "namespace": "kv"})
        c.get("/v1/check")
        c.get("/metrics")
    server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    server.wait_for_log("reloaded", timeout=30)
    assert server.stop() == 0
    log = server.log
    assert "access" in log.lower() or "POST" in log  # the access log did log the requests
    for secret in [OPERATOR, wrong, *(t[0] for t in TOKENS.values())]:
        assert secret not in log


@pytest.mark.slow
def test_over_the_rate_429_with_retry_after_and_nothing_changed(
    tmp_path: Path, tenant_app: Callable[..., Server]
) -> None:
    quota = "[tenants.teamA]\nrequests_per_second = 0.5\nburst = 3\n"
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml(quota))
    server = tenant_app("--in-memory", auth_file=path)
    a = Client(server.url, A)
    b = Client(server.url, token("b_admin"))
    assert a.post("/0/initialize", {"num_pages": 4}).status_code == 204
    assert a.post("/0/exists", {"keys": ["k"]}).json() == {"exists": [False]}
    assert a.post("/0/exists", {"keys": ["k"]}).status_code == 200
    r = a.post("/0/reserve_and_allocate_page_indices", {"keys": [["k", None]]})
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "2"  # one request per 2 s, rounded up
    assert "X-Kvmeta-Epoch" in r.headers
    detail = r.json()["detail"]
    assert "teamA" in detail and "0.5 requests/s" in detail and "burst 3" in detail
    assert "tokens file" in detail
    # Another tenant is not slowed down; the operator neither.
    for _ in range(10):
        assert b.get("/openapi.json").status_code == 200
    assert Client(server.url, OPERATOR).get("/openapi.json").status_code == 200
    # After Retry-After: the refused reserve changed nothing.
    time.sleep(2.2)
    assert a.post("/0/exists", {"keys": ["k"]}).json() == {"exists": [False]}
    pools = Client(server.url, OPERATOR).get("/v1/pools").json()["pools"]
    assert [(p["tenant"], p["reserved"], p["stored"]) for p in pools] == [("teamA", 0, 0)]
    # Counted per tenant, with the 403s.
    assert Client(server.url, token("b_rw")).post("/0/clear").status_code == 403
    metrics = Client(server.url, OPERATOR).get("/metrics").text
    assert 'kvmeta_tenant_rate_limited_total{tenant="teamA"} 1.0' in metrics
    assert 'kvmeta_tenant_forbidden_total{tenant="teamB"} 1.0' in metrics
    # A tenant's admin token sees only its own counters and pools.
    mine = [line for line in b.get("/metrics").text.splitlines() if not line.startswith("#")]
    assert not [line for line in mine if 'tenant="teamA"' in line], mine
    assert not [line for line in mine if line.startswith("kvmeta_http_requests")], mine
    assert 'kvmeta_tenant_forbidden_total{tenant="teamB"} 1.0' in mine


@pytest.mark.slow
def test_401_without_a_known_token(tenant_app: Callable[..., Server]) -> None:
    server = tenant_app("--in-memory")
    assert Client(server.url, None).get("/openapi.json").status_code == 401
    r = Client(server.url, "not-a-token-of-this-server").post("/0/exists", {"keys": []})
    assert r.status_code == 401 and "tokens file" in r.json()["detail"]
    assert Client(server.url, None).get("/health").status_code == 200
    # /ready answers probes; any token of the file (as any route's ANY right) gets the detail.
    for secret in (None, "not-a-token-of-this-server"):
        probe = Client(server.url, secret).get("/ready")
        assert probe.status_code == 200 and probe.json() == {"ready": True}
    for secret in (A, token("b_rw"), OPERATOR):
        assert Client(server.url, secret).get("/ready").json() == {
            "ready": True,
            "backend": "memory",
        }


def test_kvmeta_status_shows_the_tenant_column_when_there_are_tenants() -> None:
    from kvmeta.status import format_table

    pool = {"dialect": "s", "rank": 0, "namespace": "kv", "num_pages": 4, "free": 4}
    pool.update(reserved=0, stored=0, hit_rate=None, size_conflicts=0, counters={})
    plain = format_table("http://h:1", {"server": {}, "pools": [{**pool, "tenant": ""}]})
    assert "TENANT" not in plain
    doc = {"server": {}, "pools": [{**pool, "tenant": "teamA"}, {**pool, "tenant": ""}]}
    lines = format_table("http://h:1", doc).splitlines()
    assert lines[1].startswith("TENANT") and lines[2].startswith("teamA ")
    assert lines[3].startswith("- ")


@pytest.mark.slow
def test_sighup_reaches_every_worker(
    tmp_path: Path, redis_url: str, tenant_server: Callable[..., ServerProcess]
) -> None:
    path = write_tokens(tmp_path / "tokens.toml", tokens_toml())
    server = tenant_server("--backend", redis_url, "--workers", "2", auth_file=path)
    deadline = time.monotonic() + 60
    while server.log.count("kvmeta listening") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    new = "worker-reload-token-012345"
    tokens = dict(TOKENS, new=(new, "teamC", ["read"], None, None))
    write_tokens(path, tokens_toml(tokens=tokens))
    server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    # one start-up line names the file (the first worker's), then one reload line per worker
    while server.log.count("tokens file") < 1 + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.log.count("reloaded") == 2, server.log
    # Fresh connections land on either worker: every one knows the new token.
    assert {Client(server.url, new).get("/openapi.json").status_code for _ in range(20)} == {200}
    assert server.proc.poll() is None  # type: ignore[union-attr]
