"""The shared checks: limits named in the caller's dialect, path ranks, body decoding with
unknown-field warnings, and all-or-nothing pool creation in the service."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvmeta._types import PoolId
from kvmeta.errors import InvalidPathParameter, InvalidRequest, PageOutOfRange, PayloadTooLarge
from kvmeta.server.app import BodyDecoder, parse_rank, reply
from kvmeta.server.http import Response
from kvmeta.service.limits import CONFIRM_FIELDS, RequestLimits
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore

S, V = CONFIRM_FIELDS["s"], CONFIRM_FIELDS["v"]


def test_page_range_is_named_in_each_dialect() -> None:
    store = MemoryStore()
    store.initialize(PoolId("v", 0, ""), 8)
    assert store.confirm(PoolId("v", 0, ""), [("a", 0), ("b", 7)], [3]) == 2  # in range
    refused = PageOutOfRange(8, 8, in_release=False).for_caller(V.pairs, V.reserve)
    assert refused.field == "confirmations"
    assert str(refused) == (
        "page 8 in `confirmations` is outside this pool's pages 0..7; confirm only pages "
        "returned by batch_allocate"
    )
    with pytest.raises(InvalidRequest, match="`pages_to_release`.*returned by reserve$"):
        raise PageOutOfRange(-1, 8, in_release=True).for_caller(S.pairs, S.reserve)


def test_confirm_entry_limit_names_the_dialects_fields() -> None:
    limits = RequestLimits(max_keys=2)
    with pytest.raises(PayloadTooLarge, match="^`confirmations` \\+ `pages_to_release` have 3"):
        limits.check_confirm([("a", 1), ("b", 2)], [3], V)
    with pytest.raises(PayloadTooLarge, match="^`written_keys_to_confirm` \\+ `pages_to_release`"):
        limits.check_confirm([("a", 1)], [2, 3], S)


def test_ranks_world_sizes_and_the_page_budget() -> None:
    limits = RequestLimits(max_world_size=8, max_total_pages=100, max_pages=50)
    limits.check_rank(2**63 - 1)
    limits.check_rank(-(2**63))
    with pytest.raises(InvalidRequest, match="signed 64-bit") as info:
        limits.check_rank(2**63)
    assert info.value.field == "rank"
    with pytest.raises(InvalidRequest, match="a number of about 5000 digits"):
        limits.check_rank(10**4999)
    with pytest.raises(InvalidRequest, match="--max-world-size") as info:
        limits.check_world_size(9)
    assert info.value.field == "world_size"
    limits.check_total_pages(60, 40)
    with pytest.raises(InvalidRequest, match="--max-total-pages 100") as info:
        limits.check_total_pages(60, 41)
    assert info.value.field == "num_pages"
    with pytest.raises(InvalidRequest, match="--max-pages"):
        limits.check_num_pages(51)


@pytest.mark.parametrize(
    ("segment", "rank"),
    [("0", 0), ("-1", -1), ("007", 7), ("9223372036854775807", 2**63 - 1), ("0" * 30 + "5", 5)],
)
def test_path_ranks_that_fit(segment: str, rank: int) -> None:
    assert parse_rank(segment) == rank


@pytest.mark.parametrize(
    "segment", ["9223372036854775808", "-9223372036854775809", "9" * 20, "1" * 5000, "x"]
)
def test_path_ranks_that_do_not_fit_are_422(segment: str) -> None:
    with pytest.raises(InvalidPathParameter) as info:
        parse_rank(segment)
    assert info.value.status == 422 and info.value.field == "rank"
    assert len(str(info.value)) < 300


class Body(msgspec.Struct, kw_only=True):
    keys: list[str]
    namespace: str = "kv"


def test_body_decoder_warns_about_unknown_fields_only() -> None:
    dec = BodyDecoder(Body, "{...}")
    body, warnings = dec.decode(b'{"keys": ["a"]}')
    assert (body.keys, body.namespace, warnings) == (["a"], "kv", [])
    body, warnings = dec.decode(b'{"keys": ["a"], "nmespace": "x", "zzz": 1}')
    assert (body.keys, body.namespace) == (["a"], "kv")
    ((kind, text),) = warnings
    assert kind == "unknown_field"
    assert "unknown field `nmespace` ignored; did you mean `namespace`?" in text
    assert "unknown field `zzz` ignored (this route reads `keys`, `namespace`)" in text
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        dec.decode(b'{"keys": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(InvalidRequest, match="at `\\$.keys"):
        dec.decode(b'{"keys": "a", "nmespace": 1}')


def test_warning_header_is_ascii_and_bounded() -> None:
    resp = reply(Response(204), [("unknown_field", "a\r\nX-Evil: 1 " + "\u00e9" * 1000)])
    ((name, value),) = resp.headers
    assert name == b"x-kvmeta-warning"
    assert b"\r" not in value and b"\n" not in value and len(value) <= 512
    assert reply(Response(204)).headers == ()


def test_pool_creation_is_all_or_nothing() -> None:
    store = MemoryStore()
    service = Service(
        LocalBackend(store), RequestLimits(max_pages=64, max_total_pages=100, max_world_size=4)
    )

    async def run() -> None:
        await service.initialize(PoolId("s", 0, "kv"), 64)
        for call in (
            service.initialize(PoolId("s", 1, "kv"), 37),  # over the budget
            service.initialize(PoolId("s", 2**63, "kv"), 8),  # rank beyond int64
            service.v_register(0, 8, 2**63 + 5),  # world size beyond the limit
            service.v_register(2**64, 8, None),
        ):
            with pytest.raises(InvalidRequest):
                await call
        # an existing pool re-initialises at a full budget; a pool that fits is created
        assert not (await service.initialize(PoolId("s", 0, "kv"), 64)).value.created
        assert (await service.v_register(0, 36, 4)).value.created

    asyncio.run(run())
    assert sorted(store.pools) == [PoolId("s", 0, "kv"), PoolId("v", 0, "")]
    assert store.vllm_world_size == 4
