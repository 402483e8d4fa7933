"""The in-process clients and the server run one operations core: for every operation of both
dialects, the same bad input raises the same error class, field and message in-process as
through kvmeta's HTTP client against a real server (in each dialect's own field names; SGLang's
"not initialized" in each of its two clients' own sentences), the
same good input returns the same result, and the caller warnings the server sends as
``X-Kvmeta-Warning`` are logged in-process with the same text."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from kvmeta import sglang, vllm
from kvmeta.errors import KvmetaError, NotInitialized
from kvmeta.service.limits import RequestLimits
from tests.support import InProcessServer, Server

LIMITS = {
    "max_keys": 4,
    "max_key_length": 16,
    "max_namespace_length": 12,
    "max_pages": 100,
    "max_total_pages": 250,
    "max_world_size": 4,
}
FIVE = ["a", "b", "c", "d", "e"]
LONG = "k" * 17
BIG = 2**64  # beyond a signed 64-bit rank

Call = Callable[[Any], Any]

# Every operation of each dialect has at least one bad input here. The first word of a case
# names the client method it exercises (checked by ``test_every_operation_is_covered``).
S_CASES: dict[str, Call] = {
    "initialize num_pages 0": lambda c: c.initialize(1, 0),
    "initialize num_pages -3": lambda c: c.initialize(1, -3),
    "initialize num_pages over --max-pages": lambda c: c.initialize(1, 101),
    "initialize over --max-total-pages": lambda c: c.initialize(1, 51),
    "initialize namespace characters": lambda c: c.initialize(1, 8, "bad ns!"),
    "initialize namespace length": lambda c: c.initialize(1, 8, "n" * 13),
    "exists not initialized": lambda c: c.exists(9, ["a"]),
    "exists too many keys": lambda c: c.exists(0, FIVE),
    "exists long key": lambda c: c.exists(0, [LONG]),
    "get_page_indices not initialized namespace": lambda c: c.get_page_indices(0, ["a"], "mamba"),
    "get_page_indices too many keys": lambda c: c.get_page_indices(0, FIVE),
    "get_page_indices long key": lambda c: c.get_page_indices(0, [LONG]),
    "reserve_and_allocate_page_indices too many keys": lambda c: (
        c.reserve_and_allocate_page_indices(0, [(k, None) for k in FIVE])
    ),
    "reserve_and_allocate_page_indices long key": lambda c: c.reserve_and_allocate_page_indices(
        0, [(LONG, None)]
    ),
    "reserve_and_allocate_page_indices not initialized": lambda c: (
        c.reserve_and_allocate_page_indices(7, [("a", None)])
    ),
    "confirm_write not initialized": lambda c: c.confirm_write(0, [("a", 1)], [], "mamba"),
    "confirm_write page past the end": lambda c: c.confirm_write(0, [("a", 100)], []),
    "confirm_write negative page": lambda c: c.confirm_write(0, [("a", -1)], []),
    "confirm_write release page past the end": lambda c: c.confirm_write(0, [], [0, 100]),
    "confirm_write too many entries": lambda c: c.confirm_write(
        0, [("a", 1), ("b", 2), ("c", 3)], [4, 5]
    ),
    "confirm_write long key": lambda c: c.confirm_write(0, [(LONG, 1)], []),
    "delete_keys long key": lambda c: c.delete_keys(0, [LONG]),
    "delete_keys too many keys": lambda c: c.delete_keys(0, FIVE),
    "delete_keys not initialized": lambda c: c.delete_keys(5, ["a"]),
    "clear not initialized": lambda c: c.clear(0, "mamba"),
}

V_CASES: dict[str, Call] = {
    "initialize num_pages 0": lambda c: c.initialize(1, 0),
    "initialize num_pages over --max-pages": lambda c: c.initialize(1, 101),
    "initialize over --max-total-pages": lambda c: c.initialize(1, 51),
    "initialize role case": lambda c: c.initialize(1, 8, "Worker"),
    "initialize world_size over --max-world-size": lambda c: c.initialize(1, 8, world_size=5),
    "initialize world_size beyond int64": lambda c: c.initialize(1, 8, world_size=2**63 + 5),
    "initialize rank outside world_size": lambda c: c.initialize(3, 8, world_size=2),
    "allocate_pages_for_keys not initialized": lambda c: c.allocate_pages_for_keys(9, [("a", "")]),
    "allocate_pages_for_keys too many keys": lambda c: c.allocate_pages_for_keys(
        0, [(k, "") for k in FIVE]
    ),
    "allocate_pages_for_keys long key": lambda c: c.allocate_pages_for_keys(0, [(LONG, "")]),
    "allocate_pages_for_keys rank beyond int64": lambda c: c.allocate_pages_for_keys(
        2**63, [("a", "")]
    ),
    "confirm_write_for_keys not initialized": lambda c: c.confirm_write_for_keys(9, [("a", 1)]),
    "confirm_write_for_keys rank beyond int64": lambda c: c.confirm_write_for_keys(BIG, [("a", 1)]),
    "confirm_write_for_keys page past the end": lambda c: c.confirm_write_for_keys(0, [("a", 100)]),
    "confirm_write_for_keys release page past the end": lambda c: c.confirm_write_for_keys(
        0, [], [7, -2]
    ),
    "confirm_write_for_keys too many entries": lambda c: c.confirm_write_for_keys(
        0, [("a", 1), ("b", 2), ("c", 3)], [4, 5]
    ),
    "confirm_write_for_keys long key": lambda c: c.confirm_write_for_keys(0, [(LONG, 1)]),
    "batch_key_exists too many keys": lambda c: c.batch_key_exists(FIVE),
    "batch_key_exists long key": lambda c: c.batch_key_exists([LONG]),
    "get_key_locations not initialized": lambda c: c.get_key_locations(9, ["a"]),
    "get_key_locations rank beyond int64": lambda c: c.get_key_locations(-(2**63) - 1, ["a"]),
    "get_key_locations too many keys": lambda c: c.get_key_locations(0, FIVE),
    "get_key_locations long key": lambda c: c.get_key_locations(0, [LONG]),
    "set_world_size zero": lambda c: c.set_world_size(0),
    "set_world_size boolean": lambda c: c.set_world_size(True),
    "set_world_size over --max-world-size": lambda c: c.set_world_size(5),
}

# The rank of dialect S (and of vLLM's initialize and rank removal) travels in the URL path:
# the server refuses an out-of-range one while routing ("Path parameter `rank` ..."), the
# in-process core with the same class and the same sentence after that prefix.
S_PATH_RANK: dict[str, Call] = {
    "initialize": lambda c: c.initialize(BIG, 8),
    "exists": lambda c: c.exists(BIG, ["a"]),
    "reserve_and_allocate_page_indices": lambda c: c.reserve_and_allocate_page_indices(
        -(2**63) - 1, [("a", None)]
    ),
    "confirm_write": lambda c: c.confirm_write(BIG, [("a", 1)], []),
    "get_page_indices": lambda c: c.get_page_indices(BIG, ["a"]),
    "delete_keys": lambda c: c.delete_keys(BIG, ["a"]),
    "clear": lambda c: c.clear(BIG),
}
V_PATH_RANK: dict[str, Call] = {
    "initialize": lambda c: c.initialize(BIG, 8),
    "remove_rank": lambda c: c.remove_rank(BIG),
}

# No bad input exists for these (they take no argument a caller can get wrong).
NO_BAD_INPUT = {"v": {"clear", "rank_registry"}, "s": set()}


def limited_server() -> Iterator[Server]:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
    server = InProcessServer("--in-memory", *flags).start()
    yield server
    server.stop()


# One server per dialect: the page budget counts the pools of both.
s_server = pytest.fixture(scope="module")(limited_server)
v_server = pytest.fixture(scope="module", name="v_server")(limited_server)
fresh_server = pytest.fixture(limited_server)


def error_of(call: Call, client: Any) -> KvmetaError:
    with pytest.raises(KvmetaError) as info:
        call(client)
    return info.value


def stats_of(server: Server) -> Any:
    return requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]


def pair(server: Server, dialect: str) -> tuple[Any, Any]:
    module = sglang if dialect == "s" else vllm
    remote = module.Hf3fsGlobalMetadataClient(server.url, max_retries=0)
    local = module.Hf3fsLocalMetadataClient(limits=RequestLimits(**LIMITS))
    for client in (remote, local):
        client.initialize(0, 100)
        client.initialize(2, 100)
    return remote, local


def same_error(server: Server, dialect: str, call: Call, *, path_rank: bool) -> None:
    remote, local = pair(server, dialect)
    before = stats_of(server)
    over_http, in_process = error_of(call, remote), error_of(call, local)
    assert type(over_http) is type(in_process), (over_http, in_process)
    if path_rank:
        assert str(over_http) == "Path parameter " + str(in_process)
    elif dialect == "s" and isinstance(in_process, NotInitialized):
        # The one sentence SGLang words differently in-process than from its server.
        rank, namespace = in_process.rank, in_process.namespace
        assert rank is not None and namespace is not None
        assert str(in_process) == str(NotInitialized.in_process(rank, namespace))
        assert str(over_http) == str(NotInitialized.for_pool("s", rank, namespace))
    else:
        assert str(over_http) == str(in_process)
    other = "confirmations" if dialect == "s" else "written_keys_to_confirm"
    assert other not in str(in_process)
    assert stats_of(server) == before


@pytest.mark.parametrize("case", list(S_CASES))
def test_sglang_same_error_in_process_and_over_http(s_server: Server, case: str) -> None:
    same_error(s_server, "s", S_CASES[case], path_rank=False)


@pytest.mark.parametrize("case", list(V_CASES))
def test_vllm_same_error_in_process_and_over_http(v_server: Server, case: str) -> None:
    same_error(v_server, "v", V_CASES[case], path_rank=False)


@pytest.mark.parametrize("case", list(S_PATH_RANK))
def test_sglang_path_rank_out_of_range(s_server: Server, case: str) -> None:
    same_error(s_server, "s", S_PATH_RANK[case], path_rank=True)


@pytest.mark.parametrize("case", list(V_PATH_RANK))
def test_vllm_path_rank_out_of_range(v_server: Server, case: str) -> None:
    same_error(v_server, "v", V_PATH_RANK[case], path_rank=True)


@pytest.mark.parametrize("dialect", ["s", "v"])
def test_every_operation_is_covered(dialect: str) -> None:
    module = sglang if dialect == "s" else vllm
    ops = {name for name in vars(module.Hf3fsMetadataInterface) if not name.startswith("_")}
    cases, path = (S_CASES, S_PATH_RANK) if dialect == "s" else (V_CASES, V_PATH_RANK)
    bad = {name.split(" ", 1)[0] for name in cases} | set(path)
    assert ops - bad == NO_BAD_INPUT[dialect]
    good = {name for name, *_ in (S_SCRIPT if dialect == "s" else V_SCRIPT)}
    assert ops <= good


# Good input: each step runs on a fresh server and a fresh in-process client; every reply must
# be identical. Every operation of the dialect appears at least once.
S_SCRIPT: list[tuple[str, tuple[Any, ...]]] = [
    ("initialize", (0, 8)),
    ("initialize", (0, 4, "mamba")),
    ("exists", (0, ["a", "b"])),
    ("reserve_and_allocate_page_indices", (0, [("a", None), ("b", "a"), ("a", None)])),
    ("confirm_write", (0, [("a", 0), ("b", 1)], [])),
    ("exists", (0, ["a", "b", "c"])),
    ("get_page_indices", (0, ["b", "a", "zz"])),
    ("reserve_and_allocate_page_indices", (0, [(k, None) for k in "cdef"])),
    ("confirm_write", (0, [("c", 2)], [3, 4, 5])),
    ("reserve_and_allocate_page_indices", (0, [("a", None), ("g", None)], "mamba")),
    ("delete_keys", (0, ["a", "nope"])),
    ("get_page_indices", (0, ["a", "b", "c"])),
    ("clear", (0, "mamba")),
    ("exists", (0, ["a"], "mamba")),
    ("clear", (0,)),
    ("get_page_indices", (0, ["b", "c"])),
]
V_SCRIPT: list[tuple[str, tuple[Any, ...]]] = [
    ("initialize", (0, 0, "scheduler")),
    ("initialize", (0, 8)),
    ("initialize", (1, 8)),
    ("rank_registry", ()),
    ("allocate_pages_for_keys", (0, [("a", ""), ("b", "a"), "a"])),
    ("allocate_pages_for_keys", (1, [("a", ""), ("b", "a")])),
    ("confirm_write_for_keys", (0, [("a", 0), ("b", 1)])),
    ("batch_key_exists", (["a", "b"],)),
    ("confirm_write_for_keys", (1, [("a", 0)], [1])),
    ("batch_key_exists", (["a", "b"],)),
    ("get_key_locations", (0, ["b", "a", "zz"])),
    ("set_world_size", (3,)),
    ("batch_key_exists", (["a"],)),
    ("rank_registry", ()),
    ("set_world_size", (None,)),
    ("initialize", (5, 4)),
    ("rank_registry", ()),
    ("remove_rank", (5,)),
    ("remove_rank", (5,)),
    ("clear", ()),
    ("get_key_locations", (1, ["a"])),
    ("rank_registry", ()),
]


@pytest.mark.parametrize("dialect", ["s", "v"])
def test_same_results_in_process_and_over_http(fresh_server: Server, dialect: str) -> None:
    module = sglang if dialect == "s" else vllm
    remote = module.Hf3fsGlobalMetadataClient(fresh_server.url, max_retries=0)
    local = module.Hf3fsLocalMetadataClient(limits=RequestLimits(**LIMITS))
    for name, args in S_SCRIPT if dialect == "s" else V_SCRIPT:
        over_http, in_process = getattr(remote, name)(*args), getattr(local, name)(*args)
        assert over_http == in_process, (name, args)


def warning_headers(server: Server, path: str, body: dict[str, Any]) -> list[str]:
    resp = requests.post(server.url + path, json=body, timeout=30)
    assert resp.ok, resp.text
    return [v for k, v in resp.headers.items() if k.lower() == "x-kvmeta-warning"]


@pytest.mark.parametrize("dialect", ["s", "v"])
def test_caller_warnings_are_logged_in_process(
    fresh_server: Server, dialect: str, caplog: pytest.LogCaptureFixture
) -> None:
    """size_conflict and confirm_refused: the server's header text, logged by the client."""
    module = sglang if dialect == "s" else vllm
    local = module.Hf3fsLocalMetadataClient(limits=RequestLimits(**LIMITS))
    if dialect == "s":
        init, confirm = "/0/initialize", "/0/confirm_write"
        requests.post(fresh_server.url + init, json={"num_pages": 8}, timeout=30)
        conflict = warning_headers(fresh_server, init, {"num_pages": 9})
        refused = warning_headers(fresh_server, confirm, {"written_keys_to_confirm": [["a", 3]]})
        local.initialize(0, 8)
        with caplog.at_level(logging.WARNING, logger="kvmeta.client"):
            local.initialize(0, 9)
            local.confirm_write(0, [("a", 3)], [])
    else:
        init, confirm = "/rank/0/initialize", "/keys/confirm_write"
        requests.post(fresh_server.url + init, json={"num_pages": 8}, timeout=30)
        conflict = warning_headers(fresh_server, init, {"num_pages": 9})
        refused = warning_headers(fresh_server, confirm, {"rank": 0, "confirmations": [["a", 3]]})
        local.initialize(0, 8)
        with caplog.at_level(logging.WARNING, logger="kvmeta.client"):
            local.initialize(0, 9)
            local.confirm_write_for_keys(0, [("a", 3)])
    logged = [r.getMessage() for r in caplog.records if r.name == "kvmeta.client"]
    assert conflict and conflict[0].startswith("size_conflict: ")
    assert refused and refused[0].startswith("confirm_refused: ")
    assert logged == [conflict[0], refused[0]]
