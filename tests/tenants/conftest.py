"""Shared pieces of the tenant tests: a tokens file with a few scopes, and servers using it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support import InProcessServer, Server, ServerProcess

OPERATOR = "operator-token-0123456789"  # --auth-token: all access, tenant ""

# name -> (token, tenant, rights, ranks, namespaces); None: the key is left out (all)
TOKENS: dict[str, tuple[str, str, list[str], str | None, list[str] | None]] = {
    "a_rw": ("tenant-a-rw-0123456789", "teamA", ["read", "write"], "0-9", ["kv"]),
    "a_r": ("tenant-a-r-01234567890", "teamA", ["read"], "0-9", ["kv*"]),
    "a_admin": ("tenant-a-admin-0123456", "teamA", ["read", "write", "admin"], None, None),
    "a_adm_only": ("tenant-a-adm-only-0123", "teamA", ["admin"], "0-9", ["kv"]),
    "b_rw": ("tenant-b-rw-0123456789", "teamB", ["read", "write"], None, None),
    "b_admin": ("tenant-b-admin-0123456", "teamB", ["read", "write", "admin"], None, None),
}


def tokens_toml(extra_tenants: str = "", tokens: dict[str, Any] | None = None) -> str:
    lines = [extra_tenants]
    for token, tenant, rights, ranks, namespaces in (tokens or TOKENS).values():
        lines += [
            "[[tokens]]",
            f'token = "{token}"',
            f'tenant = "{tenant}"',
            f"rights = {rights!r}",
        ]
        if ranks is not None:
            lines.append(f'ranks = "{ranks}"')
        if namespaces is not None:
            lines.append(f"namespaces = {namespaces!r}")
        lines.append("")
    return "\n".join(lines).replace("'", '"')


def write_tokens(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Client:
    """Requests to one server with one token."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        self.headers = bearer(token) if token else {}

    def call(self, method: str, path: str, body: Any = None) -> requests.Response:
        return requests.request(
            method, self.url + path, json=body, headers=self.headers, timeout=30
        )

    def post(self, path: str, body: Any = None) -> requests.Response:
        return self.call("POST", path, body)

    def get(self, path: str) -> requests.Response:
        return self.call("GET", path)


def token(name: str) -> str:
    return OPERATOR if name == "op" else TOKENS[name][0]


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    return write_tokens(tmp_path / "tokens.toml", tokens_toml())


@pytest.fixture
def tenant_server(
    tokens_file: Path,
) -> Iterator[Callable[..., ServerProcess]]:
    """Start ``kvmeta serve --auth-token OPERATOR --auth-file tokens.toml ARGS``."""
    started: list[ServerProcess] = []

    def start(*args: str, auth_file: Path | None = None) -> ServerProcess:
        flags = ["--auth-token", OPERATOR, "--auth-file", str(auth_file or tokens_file)]
        server = ServerProcess(*flags, *args).start(timeout=60)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def tenant_app(tokens_file: Path) -> Iterator[Callable[..., Server]]:
    """``tenant_server``'s server in this process (``InProcessServer``), for the tests that
    check what each token's requests get back."""
    started: list[InProcessServer] = []

    def start(*args: str, auth_file: Path | None = None) -> Server:
        flags = ["--auth-token", OPERATOR, "--auth-file", str(auth_file or tokens_file)]
        server = InProcessServer(*flags, *args)
        started.append(server)
        return server.start(timeout=60)

    yield start
    for server in started:
        server.stop()
