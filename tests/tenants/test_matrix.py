"""The access matrix: every route of both dialects and the operator routes, for every token
scope and target, answers 2xx or 403 exactly as the scope says; a 403 has the same status and
body whether its target exists or not (no existence oracle).

The routes come from the app's own route list: a route added to kvmeta without an entry in
``CASES`` (and in ``server.access.ROUTE_RULES``) fails ``test_every_route_is_classified``.
Each route runs on its own fresh server (``--in-memory``): phase 1 asks every (token, target)
with nothing created; then every tenant (the default one, teamA, teamB) creates the same pools;
phase 2 asks again. Expected-forbidden answers must be 403 in both phases with identical bodies;
expected-allowed answers must be 2xx in phase 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from kvmeta.config import Settings
from kvmeta.server.access import ROUTE_RULES
from kvmeta.server.runner import build_app
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.support import Server
from tests.tenants.conftest import TOKENS, Client, token

pytestmark = pytest.mark.slow

IN_RANK, OUT_RANK = 3, 42  # the narrow tokens cover ranks 0-9
IN_NS, OUT_NS = "kv", "mamba"  # ... and namespace kv (a_r: kv*)


class Target(NamedTuple):
    rank: int | None
    namespace: str | None


SGLANG_TARGETS = [Target(IN_RANK, IN_NS), Target(OUT_RANK, IN_NS), Target(IN_RANK, OUT_NS)]
RANK_TARGETS = [Target(IN_RANK, None), Target(OUT_RANK, None)]
NO_TARGET = [Target(None, None)]

Build = Callable[[Target], tuple[str, Any]]  # target -> (path, JSON body or None)


class Case(NamedTuple):
    right: str  # read | write | admin | any | operator (the all-access token only)
    targets: list[Target]
    build: Build


def _s(op: str, body: Callable[[Target], dict[str, Any]]) -> Build:
    return lambda t: (f"/{t.rank}/{op}", {**body(t), "namespace": t.namespace})


def _fixed(path: str, body: Any = None) -> Build:
    return lambda t: (path, body)


CASES: dict[tuple[str, str], Case] = {
    # SGLang HiCache
    ("POST", "/{rank}/initialize"): Case(
        "write", SGLANG_TARGETS, _s("initialize", lambda t: {"num_pages": 8})
    ),
    ("POST", "/{rank}/exists"): Case(
        "read", SGLANG_TARGETS, _s("exists", lambda t: {"keys": ["k"]})
    ),
    ("POST", "/{rank}/get_page_indices"): Case(
        "read", SGLANG_TARGETS, _s("get_page_indices", lambda t: {"keys": ["k"]})
    ),
    ("POST", "/{rank}/reserve_and_allocate_page_indices"): Case(
        "write",
        SGLANG_TARGETS,
        _s("reserve_and_allocate_page_indices", lambda t: {"keys": [["k", None]]}),
    ),
    ("POST", "/{rank}/confirm_write"): Case(
        "write",
        SGLANG_TARGETS,
        _s("confirm_write", lambda t: {"written_keys_to_confirm": [], "pages_to_release": []}),
    ),
    ("POST", "/{rank}/delete_keys"): Case(
        "write", SGLANG_TARGETS, _s("delete_keys", lambda t: {"keys": ["k"]})
    ),
    ("POST", "/{rank}/clear"): Case("admin", SGLANG_TARGETS, _s("clear", lambda t: {})),
    # vLLM HF3FS
    ("POST", "/rank/{rank}/initialize"): Case(
        "write", RANK_TARGETS, lambda t: (f"/rank/{t.rank}/initialize", {"num_pages": 8})
    ),
    ("POST", "/keys/batch_allocate"): Case(
        "write",
        RANK_TARGETS,
        lambda t: ("/keys/batch_allocate", {"rank": t.rank, "keys": ["k"]}),
    ),
    ("POST", "/keys/confirm_write"): Case(
        "write",
        RANK_TARGETS,
        lambda t: ("/keys/confirm_write", {"rank": t.rank, "confirmations": []}),
    ),
    ("POST", "/keys/batch_exists"): Case(
        "read", NO_TARGET, _fixed("/keys/batch_exists", {"keys": ["k"]})
    ),
    ("POST", "/keys/get_locations"): Case(
        "read",
        RANK_TARGETS,
        lambda t: ("/keys/get_locations", {"rank": t.rank, "keys": ["k"]}),
    ),
    ("POST", "/clear"): Case("admin", NO_TARGET, _fixed("/clear")),
    ("GET", "/v1/vllm"): Case("admin", NO_TARGET, _fixed("/v1/vllm")),
    ("POST", "/v1/vllm/ranks/{rank}/remove"): Case(
        "admin", RANK_TARGETS, lambda t: (f"/v1/vllm/ranks/{t.rank}/remove", None)
    ),
    ("POST", "/v1/vllm/world_size"): Case(
        "admin", NO_TARGET, _fixed("/v1/vllm/world_size", {"world_size": None})
    ),
    # router reads
    ("POST", "/v1/prefix_match"): Case(
        "read",
        SGLANG_TARGETS,
        lambda t: (
            "/v1/prefix_match",
            {"pools": [{"rank": t.rank, "namespace": t.namespace, "keys": ["k"]}]},
        ),
    ),
    ("GET", "/v1/dump"): Case(
        "read",
        SGLANG_TARGETS,
        lambda t: (f"/v1/dump?rank={t.rank}&namespace={t.namespace}", None),
    ),
    # operator routes
    ("GET", "/openapi.json"): Case("any", NO_TARGET, _fixed("/openapi.json")),
    ("GET", "/metrics"): Case("admin", NO_TARGET, _fixed("/metrics")),
    ("GET", "/v1/pools"): Case("admin", NO_TARGET, _fixed("/v1/pools")),
    ("GET", "/v1/status"): Case("admin", NO_TARGET, _fixed("/v1/status")),
    ("GET", "/v1/check"): Case("operator", NO_TARGET, _fixed("/v1/check")),
    ("GET", "/"): Case("any", NO_TARGET, _fixed("/")),
    ("GET", "/ui"): Case("any", NO_TARGET, _fixed("/ui")),
    ("GET", "/ui/status.js"): Case("any", NO_TARGET, _fixed("/ui/status.js")),
    ("GET", "/ui/status.css"): Case("any", NO_TARGET, _fixed("/ui/status.css")),
}
PUBLIC = {("GET", "/health"), ("GET", "/ready")}  # /ready's detail needs a token: test_tokens
SCOPED_ROUTES = {"/{rank}/", "/rank/{rank}/", "/keys/"}


def app_routes() -> set[tuple[str, str]]:
    settings = Settings(in_memory=True, auth_token="x" * 20)
    app = build_app(settings, Service(LocalBackend(MemoryStore())))
    return set(app.routes())


def test_every_route_is_classified() -> None:
    routes = app_routes() - PUBLIC
    assert routes - set(CASES) == set(), "add these routes to CASES (and to ROUTE_RULES)"
    assert set(CASES) - routes == set(), "these CASES are no longer routes"
    assert routes - set(ROUTE_RULES) == set(), "classify these routes in server.access"


def _has_rank(ranks: str | None, rank: int) -> bool:
    if ranks is None:
        return True
    lo, hi = map(int, ranks.split("-"))
    return lo <= rank <= hi


def _has_namespace(patterns: list[str] | None, namespace: str) -> bool:
    import fnmatch

    return patterns is None or any(fnmatch.fnmatchcase(namespace, p) for p in patterns)


def expected_allowed(name: str, case: Case, target: Target) -> bool:
    """What the scope says, written from the tokens table (not from the server's rules)."""
    if name == "op":
        return True
    _, _, rights, ranks, namespaces = TOKENS[name]
    if case.right == "operator":
        return False
    if case.right != "any" and case.right not in rights:
        return False
    if target.rank is not None and not _has_rank(ranks, target.rank):
        return False
    return target.namespace is None or _has_namespace(namespaces, target.namespace)


NAMES = ["op", *TOKENS]


def _create_everything(url: str) -> None:
    """The same pools in the default tenant and both named tenants."""
    for name in ("op", "a_admin", "b_admin"):
        client = Client(url, token(name))
        for rank in (IN_RANK, OUT_RANK):
            for ns in (IN_NS, OUT_NS):
                r = client.post(f"/{rank}/initialize", {"num_pages": 8, "namespace": ns})
                assert r.status_code == 204, r.text
                client.post(
                    f"/{rank}/reserve_and_allocate_page_indices",
                    {"keys": [["k", None]], "namespace": ns},
                )
            r = client.post(f"/rank/{rank}/initialize", {"num_pages": 8})
            assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", sorted(CASES), ids=lambda r: f"{r[0]} {r[1]}")
def test_route_matrix(
    route: tuple[str, str], make_app: Callable[..., Server], tokens_file: Any
) -> None:
    method, _ = route
    case = CASES[route]
    server = make_app("--in-memory", "--auth-token", token("op"), "--auth-file", str(tokens_file))
    cells = [(name, target) for name in NAMES for target in case.targets]

    def ask(name: str, target: Target) -> tuple[int, str]:
        path, body = case.build(target)
        r = Client(server.url, token(name)).call(method, path, body)
        return r.status_code, r.text

    before = {cell: ask(*cell) for cell in cells}
    _create_everything(server.url)
    problems: list[str] = []
    for cell in cells:
        name, target = cell
        status, body = ask(*cell)
        allowed = expected_allowed(name, case, target)
        where = f"{name} {target}"
        if allowed:
            if not 200 <= status < 300:
                text = f"{where}: expected 2xx, got {status} {body[:200]}"
                problems.append(text)
            continue
        if status != 403:
            problems.append(f"{where}: expected 403, got {status} {body[:200]}")
        elif before[cell] != (status, body):
            problems.append(
                f"{where}: the 403 differs once the target exists: {before[cell]} vs {body}"
            )
        elif "outside this token's scope" not in body or TOKENS[name][1] not in body:
            problems.append(f"{where}: the 403 does not name the token's scope: {body}")
    assert not problems, "\n".join(problems)
