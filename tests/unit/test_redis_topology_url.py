"""Cluster and Sentinel ``--backend`` URLs: what they name, and a clear refusal for each
malformed form (at start-up, naming the URL part and the fix; passwords never shown)."""

from __future__ import annotations

import pytest

from kvmeta.errors import ConfigError
from kvmeta.store.redis.backend import RedisBackend
from kvmeta.store.redis.backend import check_url as check_url_reexported
from kvmeta.store.redis.url import check_url, parse_target, redact_url


def test_cluster_seeds_with_and_without_ports_and_credentials() -> None:
    t = parse_target("redis+cluster://user:pw@h1:7000,h2,[::1]:7002")
    assert t.mode == "cluster"
    assert t.hosts == (("h1", 7000), ("h2", 6379), ("::1", 7002))
    assert t.node_url("h9", 7009) == "redis://user:pw@h9:7009/0"
    assert t.node_url("::1", 1) == "redis://user:pw@[::1]:1/0"
    assert parse_target("redis+cluster://h:1/0").db == 0
    assert parse_target("redis+cluster://h:1?db=0").mode == "cluster"
    tls = parse_target("rediss+cluster://:pw@h:1?ssl_cert_reqs=none")
    assert tls.node_url("h", 1) == "rediss://:pw@h:1/0?ssl_cert_reqs=none"


def test_sentinel_hosts_name_database_and_sentinel_password() -> None:
    t = parse_target("redis+sentinel://:pw@s1:26380,s2/mymaster?db=3&sentinel_password=sp")
    assert t.mode == "sentinel"
    assert t.hosts == (("s1", 26380), ("s2", 26379))
    assert (t.master, t.db, t.sentinel_password) == ("mymaster", 3, "sp")
    # The data node's URL keeps the data password and database, not kvmeta's own parameters.
    assert t.node_url("10.0.0.5", 6379) == "redis://:pw@10.0.0.5:6379/3"


def test_plain_urls_stay_single() -> None:
    assert parse_target("redis://h:1/2").mode == "single"
    assert parse_target("redis://h:1/2").db == 2
    assert parse_target("unix:///tmp/r.sock?db=4").db == 4
    assert check_url_reexported is check_url  # store.redis keeps exporting it


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://h:1/2", "Redis Cluster has only database 0, the URL asks for 2"),
        ("redis+cluster://h:1?db=5", "Redis Cluster has only database 0"),
        ("redis+cluster://h:1/x", "the database 'x' is not a number"),
        ("redis+cluster://h:1,,h:2", "an empty host in the host list"),
        ("redis+cluster://h:1,h:port", "port 'port' of h is not a number"),
        ("redis+cluster://h:1,h:70000", "port 70000 of h is outside 1..65535"),
        ("redis+cluster://:1", "no host name in ':1'"),
        ("redis+sentinel://s1:26379,s2:26379", "no primary name"),
        ("redis+sentinel://s1:26379/", "no primary name"),
        ("redis+sentinel://s1:26379/m/3", "is not one primary name; give the database as ?db=N"),
        ("redis+sentinel://s1:26379/m?db=x", "the database 'x' is not a number"),
        ("redis+sentinal://s1:26379/m", "Expected `--backend` to be a redis://"),
        ("redis+cluster+sentinel://h:1/m", "redis+cluster://host:port"),
    ],
)
def test_malformed_topology_urls_are_refused_naming_the_part(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_url(url)
    assert says in str(info.value)
    assert info.value.field == "backend"
    with pytest.raises(ConfigError):
        RedisBackend(url)  # refused when built, before any connection


def test_passwords_are_redacted_in_every_form() -> None:
    url = "redis+sentinel://u:pw@s1:1,s2:2/m?sentinel_password=sp&db=1"
    shown = redact_url(url)
    assert "pw" not in shown and "sp" not in shown.replace("sentinel_password", "")
    assert shown.startswith("redis+sentinel://***:***@s1:1,s2:2/m?")
    assert redact_url("redis+cluster://:pw@h:1,h:2") == "redis+cluster://:***@h:1,h:2"
    with pytest.raises(ConfigError) as info:
        check_url("redis+cluster://:secret@h:1/3")
    assert "secret" not in str(info.value)
    assert "secret" not in RedisBackend("redis+cluster://:secret@h:1").describe
