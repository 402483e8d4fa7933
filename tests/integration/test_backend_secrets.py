"""A ``--backend`` URL's credentials, in every form redis-py and kvmeta read (userinfo user and
password, ``?password=`` and ``?username=``, a unix socket's ``?password=``, a Sentinel
group's ``sentinel_password``), appear on no surface: not in any reply to any token (the
operator's, a tenant's admin or read token, none), healthy or with Valkey frozen (SIGSTOP) or
gone (killed), not in ``kvmeta status`` and not in the server's log.

Real Valkey processes with ``requirepass`` (and an ACL user), so each credential is one the
server really needs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import requests

from tests.redis_support import Node, RedisServer
from tests.support import ServerProcess, child_env

pytestmark = pytest.mark.slow

OPERATOR = "operator-token-0123456789"
ADMIN = "tenant-a-admin-0123456789"
READ = "tenant-a-read-01234567890"
TOKENS = f"""
[[tokens]]
token = "{ADMIN}"
tenant = "teamA"
rights = ["read", "write", "admin"]

[[tokens]]
token = "{READ}"
tenant = "teamA"
rights = ["read"]
"""
# Distinctive, so that finding one anywhere can only mean it leaked.
USER = "acluserQ7x2Lr9V"
PASSWORD = "passwdK3t8Wm4Zp"
SENTINEL_PASSWORD = "sentpwJ5c8Yb1Fe"

GETS = (
    "/v1/pools",
    "/v1/status",
    "/metrics",
    "/health",
    "/ready",
    "/",
    "/v1/check",
    "/v1/dump?rank=0",
)
POSTS = (
    ("/0/initialize", {"num_pages": 4}),
    ("/0/exists", {"keys": ["k"]}),
    ("/0/reserve_and_allocate_page_indices", {"keys": [["k", None]]}),
)


class Backend(NamedTuple):
    """One form of URL and the data node behind it (frozen and killed by the test)."""

    url: str
    secrets: tuple[str, ...]
    data_pid: Callable[[], int]
    kill: Callable[[], None]


@contextlib.contextmanager
def _single(form: str) -> Iterator[Backend]:
    acl = ("--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all")
    valkey = RedisServer(*acl, password=PASSWORD).start()
    where = f"127.0.0.1:{valkey.port}"
    urls = {
        "userinfo": (f"redis://{USER}:{PASSWORD}@{where}/0", (USER, PASSWORD)),
        "userinfo-password": (f"redis://:{PASSWORD}@{where}/0", (PASSWORD,)),
        "query-password": (f"redis://{where}/0?password={PASSWORD}", (PASSWORD,)),
        "query-user": (f"redis://{where}/0?username={USER}&password={PASSWORD}", (USER, PASSWORD)),
        "unix-query": (f"{valkey.unix_url}?password={PASSWORD}&db=0", (PASSWORD,)),
    }
    url, secrets = urls[form]
    try:
        yield Backend(url, secrets, lambda: valkey.pid, valkey.stop)
    finally:
        _thaw(valkey.pid)
        valkey.close()


@contextlib.contextmanager
def _sentinel(root: Path) -> Iterator[Backend]:
    primary = Node(root, "primary", ["--requirepass", PASSWORD], password=PASSWORD).start()
    conf = (
        f"sentinel monitor kvmeta 127.0.0.1 {primary.port} 1\n"
        f"sentinel auth-pass kvmeta {PASSWORD}\n"
        f"requirepass {SENTINEL_PASSWORD}\n"
    )
    try:
        sentinel = Node(root, "sentinel0", [], conf=conf, password=SENTINEL_PASSWORD).start()
    except BaseException:
        primary.kill()
        raise
    url = (
        f"redis+sentinel://:{PASSWORD}@{sentinel.addr}/kvmeta?sentinel_password={SENTINEL_PASSWORD}"
    )
    try:
        yield Backend(url, (PASSWORD, SENTINEL_PASSWORD), lambda: primary.pid, primary.kill)
    finally:
        if primary.alive():
            _thaw(primary.pid)
        primary.kill()
        sentinel.kill()


def _thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _call(url: str, token: str | None, method: str, path: str, body: object) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = requests.request(method, url + path, json=body, headers=headers, timeout=60)
    return f"{token} {method} {path} -> {r.status_code} {dict(r.headers)} {r.text}"


def _status_cli(url: str, token: str, *extra: str) -> str:
    cli = subprocess.run(
        [sys.executable, "-m", "kvmeta", "status", "--url", url, "--token", token, *extra],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    return f"kvmeta status {extra}: {cli.returncode} {cli.stdout} {cli.stderr}"


def _replies(server: ServerProcess) -> list[str]:
    """Every surface's reply to every kind of token, as text, and ``kvmeta status``."""
    calls = [("GET", path, None) for path in GETS] + [("POST", p, b) for p, b in POSTS]
    jobs = [(t, *c) for t in (None, READ, ADMIN, OPERATOR) for c in calls]
    with ThreadPoolExecutor(16) as pool:
        cli = [
            pool.submit(_status_cli, server.url, token, *extra)
            for token in (OPERATOR, ADMIN)
            for extra in ((), ("--json",))
        ]
        out = list(pool.map(lambda job: _call(server.url, *job), jobs))
        return out + [future.result() for future in cli]


def _leaks(texts: list[str], secrets: tuple[str, ...]) -> list[str]:
    return [text for text in texts if any(secret in text for secret in secrets)]


FORMS = ("userinfo", "userinfo-password", "query-password", "query-user", "unix-query", "sentinel")


@pytest.mark.parametrize("form", FORMS)
def test_no_surface_shows_a_backend_credential(form: str, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    source = _sentinel(tmp_path / "nodes") if form == "sentinel" else _single(form)
    with source as backend:
        server = ServerProcess(
            "--backend",
            backend.url,
            "--auth-token",
            OPERATOR,
            "--auth-file",
            str(tokens),
            "--failover-timeout",
            "1",
            "--log-level",
            "debug",
            cwd=tmp_path,
        ).start(timeout=60)
        try:
            healthy = _replies(server)
            assert _leaks(healthy, backend.secrets) == []
            # The operator does see where the backend is, with the credentials hidden.
            status = requests.get(
                server.url + "/v1/status",
                headers={"Authorization": f"Bearer {OPERATOR}"},
                timeout=60,
            ).json()
            assert "***" in status["server"]["backend"], status["server"]
            os.kill(backend.data_pid(), signal.SIGSTOP)
            try:
                frozen = _replies(server)
            finally:
                _thaw(backend.data_pid())
            assert [t for t in frozen if "-> 503" in t], frozen  # the error replies were seen
            assert _leaks(frozen, backend.secrets) == []
            backend.kill()
            gone = _replies(server)
            assert [t for t in gone if "-> 503" in t], gone
            assert _leaks(gone, backend.secrets) == []
        finally:
            server.stop()
        log = server.log
        assert "backend:" in log
        assert [line for line in log.splitlines() if any(s in line for s in backend.secrets)] == []
