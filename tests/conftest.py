"""Shared fixtures. Every test runs with no ``KVMETA_*`` variables from the outer environment."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvmeta.lograte import LIMITER
from tests.redis_support import (  # noqa: F401  (shared fixtures)
    own_redis,
    redis_cluster,
    redis_cluster_url,
    redis_sentinel,
    redis_sentinel_url,
    redis_server,
    redis_url,
    replica_pair,
)
from tests.support import STARTS, InProcessServer, ServerProcess

# An object's default repr ("<... at 0x7f...>") in a test id: a new address in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# The files that take longest (a `--durations` profile of the suite), started first, so that
# no worker is left running one of them alone at the end (scripts/test passes xdist
# --no-loadscope-reorder, which keeps this order instead of ordering files by test count).
LONG_FILES = (
    "tests/packaging/test_install.py",
    "tests/integration/test_redis_chunks.py",
    "tests/contract/test_differential.py",
    "tests/integration/test_backend_secrets.py",
    "tests/integration/test_ops_stall.py",
    "tests/integration/test_vllm_http.py",
)


def _start_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse test ids that differ from one process to the next: scripts/test runs the suite in
    pytest-xdist workers, which each collect it and must agree on every id. Then put the long
    files first (a stable sort: every file's own order is kept)."""
    unstable = [item.nodeid for item in items if _ADDRESS.search(item.nodeid)]
    if unstable:
        raise pytest.UsageError(
            f"{len(unstable)} test id(s) carry an object's address, which differs in every "
            f"worker process (first: {unstable[0]}); give the parametrization ids= "
            "(e.g. ids=lambda route: route.pattern)"
        )
    items.sort(key=_start_rank)


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVMETA_"):
            monkeypatch.delenv(name)


_STARTED_BY: dict[str, set[str]] = {"process": set(), "in_process": set()}


@pytest.fixture(autouse=True)
def _count_servers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Note which tests started a ``kvmeta serve`` child process (or an in-process server)."""
    before = dict(STARTS)
    yield
    for kind, count in STARTS.items():
        if count > before[kind]:
            _STARTED_BY[kind].add(request.node.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if any(_STARTED_BY.values()):
        terminalreporter.write_line(
            f"servers: {len(_STARTED_BY['process'])} tests started a kvmeta serve process "
            f"({STARTS['process']} starts), {len(_STARTED_BY['in_process'])} an in-process "
            f"server ({STARTS['in_process']} starts)"
        )


@pytest.fixture(autouse=True)
def _fresh_log_limiter() -> None:
    """Each test's first warning of a kind is logged in full, whatever earlier tests in this
    process logged (``kvmeta.lograte`` counts repeats per kind for 10 s)."""
    LIMITER.reset()


@pytest.fixture
def make_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Start ``kvmeta serve`` with the given flags; every server is stopped after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        cwd = tmp_path_factory.mktemp("server")
        server = ServerProcess(*args, env=env, cwd=cwd).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def server(make_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A fresh in-memory server with short leases."""
    return make_server("--in-memory", "--read-lease", "0")


@pytest.fixture
def make_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., InProcessServer]]:
    """Like ``make_server``, but the server runs in this process (``InProcessServer``): for
    tests that check what a request gets back, not what the process does."""
    started: list[InProcessServer] = []

    def start(*args: str, env: dict[str, str] | None = None) -> InProcessServer:
        server = InProcessServer(*args, env=env, cwd=tmp_path_factory.mktemp("server"))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def app_server(make_app: Callable[..., InProcessServer]) -> InProcessServer:
    """The in-process twin of ``server``: in memory, short leases."""
    return make_app("--in-memory", "--read-lease", "0")
