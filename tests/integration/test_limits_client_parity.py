"""The in-process clients apply the server's limits: the same bad input raises the same error
class with the same message in-process as through kvmeta's HTTP client against a real server,
in each dialect's own field names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvmeta import sglang, vllm
from kvmeta.errors import KvmetaError
from kvmeta.service.limits import RequestLimits
from tests.support import ServerProcess

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

Call = Callable[[Any], Any]

S_CASES: dict[str, Call] = {
    "num_pages 0": lambda c: c.initialize(1, 0),
    "num_pages -3": lambda c: c.initialize(1, -3),
    "num_pages over --max-pages": lambda c: c.initialize(1, 101),
    "over --max-total-pages": lambda c: c.initialize(1, 51),
    "namespace characters": lambda c: c.initialize(1, 8, "bad ns!"),
    "namespace length": lambda c: c.initialize(1, 8, "n" * 13),
    "not initialized": lambda c: c.exists(9, ["a"]),
    "not initialized namespace": lambda c: c.get_page_indices(0, ["a"], "mamba"),
    "not initialized confirm": lambda c: c.confirm_write(0, [("a", 1)], [], "mamba"),
    "exists too many keys": lambda c: c.exists(0, FIVE),
    "exists long key": lambda c: c.exists(0, [LONG]),
    "reserve too many keys": lambda c: c.reserve_and_allocate_page_indices(
        0, [(k, None) for k in FIVE]
    ),
    "reserve long key": lambda c: c.reserve_and_allocate_page_indices(0, [(LONG, None)]),
    "get too many keys": lambda c: c.get_page_indices(0, FIVE),
    "delete long key": lambda c: c.delete_keys(0, [LONG]),
    "confirm page past the end": lambda c: c.confirm_write(0, [("a", 100)], []),
    "confirm negative page": lambda c: c.confirm_write(0, [("a", -1)], []),
    "release page past the end": lambda c: c.confirm_write(0, [], [0, 100]),
    "confirm too many entries": lambda c: c.confirm_write(
        0, [("a", 1), ("b", 2), ("c", 3)], [4, 5]
    ),
    "confirm long key": lambda c: c.confirm_write(0, [(LONG, 1)], []),
}

V_CASES: dict[str, Call] = {
    "num_pages 0": lambda c: c.initialize(1, 0),
    "num_pages over --max-pages": lambda c: c.initialize(1, 101),
    "over --max-total-pages": lambda c: c.initialize(1, 51),
    "role case": lambda c: c.initialize(1, 8, "Worker"),
    "world_size over --max-world-size": lambda c: c.initialize(1, 8, world_size=5),
    "world_size beyond int64": lambda c: c.initialize(1, 8, world_size=2**63 + 5),
    "rank outside world_size": lambda c: c.initialize(3, 8, world_size=2),
    "not initialized allocate": lambda c: c.allocate_pages_for_keys(9, [("a", "")]),
    "not initialized confirm": lambda c: c.confirm_write_for_keys(9, [("a", 1)]),
    "not initialized locations": lambda c: c.get_key_locations(9, ["a"]),
    "allocate too many keys": lambda c: c.allocate_pages_for_keys(0, [(k, "") for k in FIVE]),
    "allocate long key": lambda c: c.allocate_pages_for_keys(0, [(LONG, "")]),
    "allocate rank beyond int64": lambda c: c.allocate_pages_for_keys(2**63, [("a", "")]),
    "locations rank beyond int64": lambda c: c.get_key_locations(-(2**63) - 1, ["a"]),
    "confirm rank beyond int64": lambda c: c.confirm_write_for_keys(2**64, [("a", 1)]),
    "exists too many keys": lambda c: c.batch_key_exists(FIVE),
    "exists long key": lambda c: c.batch_key_exists([LONG]),
    "locations too many keys": lambda c: c.get_key_locations(0, FIVE),
    "confirm page past the end": lambda c: c.confirm_write_for_keys(0, [("a", 100)]),
    "release page past the end": lambda c: c.confirm_write_for_keys(0, [], [7, -2]),
    "confirm too many entries": lambda c: c.confirm_write_for_keys(
        0, [("a", 1), ("b", 2), ("c", 3)], [4, 5]
    ),
    "confirm long key": lambda c: c.confirm_write_for_keys(0, [(LONG, 1)]),
}


def limited_server() -> Iterator[ServerProcess]:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()]
    server = ServerProcess("--in-memory", *flags).start()
    yield server
    server.kill()


# One server per dialect: the page budget counts the pools of both.
s_server = pytest.fixture(scope="module")(limited_server)
v_server = pytest.fixture(scope="module", name="v_server")(limited_server)


def error_of(call: Call, client: Any) -> KvmetaError:
    with pytest.raises(KvmetaError) as info:
        call(client)
    return info.value


def stats_of(server: ServerProcess) -> Any:
    import requests

    return requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]


@pytest.mark.parametrize("case", list(S_CASES))
def test_sglang_same_error_in_process_and_over_http(s_server: ServerProcess, case: str) -> None:
    limited = s_server
    remote = sglang.Hf3fsGlobalMetadataClient(limited.url, max_retries=0)
    remote.initialize(0, 100)
    remote.initialize(2, 100)
    local = sglang.Hf3fsLocalMetadataClient(limits=RequestLimits(**LIMITS))
    local.initialize(0, 100)
    local.initialize(2, 100)
    before = stats_of(limited)
    over_http, in_process = error_of(S_CASES[case], remote), error_of(S_CASES[case], local)
    assert type(over_http) is type(in_process), (over_http, in_process)
    assert str(over_http) == str(in_process)
    assert "confirmations" not in str(in_process)
    assert stats_of(limited) == before


@pytest.mark.parametrize("case", list(V_CASES))
def test_vllm_same_error_in_process_and_over_http(v_server: ServerProcess, case: str) -> None:
    limited = v_server
    remote = vllm.Hf3fsGlobalMetadataClient(limited.url, max_retries=0)
    remote.initialize(0, 100)
    remote.initialize(2, 100)
    local = vllm.Hf3fsLocalMetadataClient(limits=RequestLimits(**LIMITS))
    local.initialize(0, 100)
    local.initialize(2, 100)
    before = stats_of(limited)
    over_http, in_process = error_of(V_CASES[case], remote), error_of(V_CASES[case], local)
    assert type(over_http) is type(in_process), (over_http, in_process)
    assert str(over_http) == str(in_process)
    assert "written_keys_to_confirm" not in str(in_process)
    assert stats_of(limited) == before
