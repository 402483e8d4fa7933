"""Operator-layer pieces in isolation: token checks, latency buckets, the metric families
(including the durability statistics a journaling backend reports), the status table."""

from __future__ import annotations

import base64

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmeta._types import PoolId
from kvmeta.errors import ConfigError, Unauthorized
from kvmeta.server.access import Access
from kvmeta.server.http import Request
from kvmeta.server.metrics import LATENCY_BUCKETS, RouteStats, new_snapshot, render_metrics
from kvmeta.status import format_table
from kvmeta.store.base import PoolStats


def req(auth: bytes | None) -> Request:
    return Request("POST", "/0/exists", "", b"", auth)


def basic(user: str, password: str) -> bytes:
    return b"Basic " + base64.b64encode(f"{user}:{password}".encode())


@pytest.mark.parametrize(
    "header",
    [b"Bearer tok:en", b"bearer  tok:en ", basic("", "tok:en"), basic("any", "tok:en")],
)
def test_token_accepted_forms(header: bytes) -> None:
    auth = Access(None, "tok:en")
    auth(req(header))
    assert auth.failures == 0


@pytest.mark.parametrize(
    "header",
    [None, b"", b"Bearer", b"Bearer tok", basic("tok:en", ""), b"Basic ***", b"Digest tok:en"],
)
def test_token_refused_forms(header: bytes | None) -> None:
    auth = Access(None, "tok:en")
    with pytest.raises(Unauthorized) as info:
        auth(req(header))
    assert "tok:en" not in str(info.value)
    assert auth.failures == 1


def test_auth_token_alone_is_a_one_entry_table_with_its_own_messages() -> None:
    auth = Access(None, "tok:en")
    assert not auth.scoped and auth.table.scopes == {}
    (scope,) = auth.operator.scopes.values()
    assert scope.all_access and scope.tenant == ""
    with pytest.raises(Unauthorized, match="--auth-token / KVMETA_AUTH_TOKEN"):
        auth(req(None))
    with pytest.raises(Unauthorized, match="does not match the server's --auth-token"):
        auth(req(b"Bearer wrong"))
    assert auth.failures == 2


def test_empty_token_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="auth-token"):
        Access(None, "")


def test_latency_buckets_are_upper_bounds() -> None:
    rs = RouteStats("POST", "/{rank}/exists")
    rs.record(200, LATENCY_BUCKETS[0])  # exactly on a bound: that bucket (le)
    rs.record(200, LATENCY_BUCKETS[0] * 1.01)
    rs.record(404, 99.0)  # beyond every bound: +Inf only
    assert rs.buckets[0] == 1 and rs.buckets[1] == 1 and rs.buckets[-1] == 1
    assert rs.statuses == {200: 2, 404: 1}


def test_families_render_and_parse_with_durability() -> None:
    pool = PoolStats(
        PoolId("v", 3, ""),
        num_pages=10,
        free=6,
        reserved=1,
        stored=3,
        counters={"evictions": 2, "reservations_expired": 4, "exists_hits": 5},
        size_conflicts=1,
    )
    snap = new_snapshot(
        pools=[pool],
        durability={"fsyncs": 7, "fsync_seconds_total": 0.5, "fsync_seconds_max": 0.1, "new": 2},
        requests=[RouteStats("POST", "/keys/batch_exists")],
        auth_failures=3,
        info={"version": "x", "backend": "memory"},
        ready=True,
    )
    samples = {}
    for family in text_string_to_metric_families(render_metrics(snap).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    labels = (("dialect", "v"), ("namespace", ""), ("rank", "3"), ("tenant", ""))
    pages = (*labels[:3], ("state", "free"), ("tenant", ""))
    assert samples[("kvmeta_pool_pages", pages)] == 6
    assert samples[("kvmeta_pool_evictions_total", labels)] == 2
    assert samples[("kvmeta_pool_size_conflicts_total", labels)] == 1
    expired = (*labels[:2], ("outcome", "expired"), ("rank", "3"), ("tenant", ""))
    assert samples[("kvmeta_pool_reservations_total", expired)] == 4
    assert samples[("kvmeta_journal_fsyncs_total", ())] == 7
    assert samples[("kvmeta_journal_fsync_seconds_total", ())] == 0.5
    assert samples[("kvmeta_journal_fsync_seconds_max", ())] == 0.1
    assert samples[("kvmeta_durability_new", ())] == 2
    assert samples[("kvmeta_auth_failures_total", ())] == 3


def test_status_table_marks_size_conflicts() -> None:
    doc = {
        "server": {"version": "1", "backend": "memory", "durability": "in-memory", "epoch": "e1"},
        "pools": [
            {
                "dialect": "s",
                "rank": 0,
                "namespace": "kv",
                "num_pages": 100,
                "free": 25,
                "reserved": 0,
                "stored": 75,
                "hit_rate": 0.5,
                "size_conflicts": 2,
                "counters": {"evictions": 9},
            }
        ],
    }
    text = format_table("http://h:1", doc)
    assert text.splitlines()[0].endswith(", epoch e1")
    row = text.splitlines()[2]
    assert "[###############.....]" in row and "75.0%" in row and "50.0%" in row
    assert row.rstrip().endswith("SIZE") and "re-initialised" in text
    empty = format_table("http://h:1", {"server": {}, "pools": []})
    assert "no pools yet" in empty
