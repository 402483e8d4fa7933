"""``kvmeta bench --backend-url`` reads a Redis URL as the server reads ``--backend``: one
parser (``store.redis.url``), so a URL the server takes is one the benchmark takes, and a
refusal names the benchmark's own flag."""

from __future__ import annotations

import pytest

from kvmeta.bench.redisstat import check_backend_url
from kvmeta.errors import ConfigError, InvalidRequest
from kvmeta.store.redis.url import check_url

# Each a URL the server's parser accepts or refuses for a reason of its own: a database that
# is not a number, a Cluster database other than 0, a port out of range, RESP3, a Sentinel
# group over TLS, a Sentinel URL without a primary name, another scheme.
URLS = [
    "redis://127.0.0.1:6379/0",
    "redis://:pw@127.0.0.1:6379/0?password=pw",
    "unix:///tmp/redis.sock?db=1",
    "redis+cluster://a:7000,b:7001",
    "redis+sentinel://s1:26379,s2:26379/mymaster?db=0",
    "rediss+sentinel://s1:26379/mymaster",
    "redis://127.0.0.1:6379/abc",
    "redis+cluster://a:7000/3",
    "redis://127.0.0.1:99999/0",
    "redis://127.0.0.1:6379/0?protocol=3",
    "redis+sentinel://s1:26379",
    "x://",
]


def _refusal(check: object, url: str) -> str | None:
    try:
        check(url)  # type: ignore[operator]
    except InvalidRequest as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("url", URLS)
def test_the_benchmark_takes_exactly_the_urls_the_server_takes(url: str) -> None:
    server = _refusal(check_url, url)
    bench = _refusal(check_backend_url, url)
    assert (bench is None) == (server is None), (url, server, bench)
    if server is not None:
        assert bench == server.replace("`--backend`", "`--backend-url`").replace(
            " (env KVMETA_BACKEND or KVMETA_REDIS_URL)", ""
        )


def test_a_refused_backend_url_names_the_benchmark_flag_and_hides_the_password() -> None:
    with pytest.raises(ConfigError) as caught:
        check_backend_url("redis://:sekrit@127.0.0.1:6379/abc")
    assert caught.value.field == "backend_url"
    assert "`--backend-url` URL redis://:***@127.0.0.1:6379/abc" in str(caught.value)
    assert "database '/abc' is not a number" in str(caught.value)
    assert "sekrit" not in str(caught.value)
    with pytest.raises(ConfigError, match="Expected `--backend-url` to be a redis://") as other:
        check_backend_url("x://")
    assert "KVMETA_BACKEND" not in str(other.value)  # (the server's variable, not the bench's)
