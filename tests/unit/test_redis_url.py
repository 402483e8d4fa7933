"""Backend URL handling: the env fallback, scheme validation, password redaction, key tags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.config import add_arguments, settings_from_args
from kvmeta.errors import InvalidRequest
from kvmeta.store.redis.backend import RedisBackend, check_url, pool_prefix, redact_url


def _settings(argv: list[str], env: dict[str, str]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(argv), env)


def test_kvmeta_redis_url_is_the_fallback_backend() -> None:
    env = {"KVMETA_REDIS_URL": "redis://r1:6379/0"}
    assert _settings([], env).backend == "redis://r1:6379/0"  # type: ignore[attr-defined]
    both = dict(env, KVMETA_BACKEND="redis://r2:6379/0")
    assert _settings([], both).backend == "redis://r2:6379/0"  # type: ignore[attr-defined]
    flag = _settings(["--backend", "rediss://r3:6380/1"], both)
    assert flag.backend == "rediss://r3:6380/1"  # type: ignore[attr-defined]
    assert _settings(["--workers", "2"], env).workers == 2  # type: ignore[attr-defined]


def test_other_schemes_are_refused_naming_the_flag() -> None:
    with pytest.raises(
        InvalidRequest, match="Expected `--backend` to be a redis://, rediss:// or unix://"
    ):
        RedisBackend("http://user:pw@host:1/0")


def test_passwords_never_reach_logs() -> None:
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://user:pw@h:1/0") == "rediss://***:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    backend = RedisBackend("redis://:pw@h:1/0")
    assert "pw" not in backend.describe


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h:1/0?password=SECRET", "redis://h:1/0?password=***"),
        ("redis://h:1/0?db=2&username=SECRET&password=SECRET", None),
        ("unix:///run/r.sock?password=SECRET&db=1", "unix:///run/r.sock?password=***&db=1"),
        ("unix://:SECRET@/run/r.sock", "unix://:***@/run/r.sock"),
        ("redis://SECRET@h:1/0", "redis://***@h:1/0"),  # a user name alone
        ("redis://:p@SECRET@h:1/0", "redis://:***@h:1/0"),  # an unencoded @ in the password
        ("redis://h:1/0?PASS%77ORD=SECRET", "redis://h:1/0?PASS%77ORD=***"),  # encoded name
        ("redis://h:1/0?ssl_password=SECRET&ssl_keyfile=/k.pem", None),
        ("redis://h:1/0?auth_token=SECRET&client_secret=SECRET", None),
        ("redis+sentinel://s:1/m?sentinel_password=SECRET&password=SECRET", None),
        ("redis://h:1/0#password=SECRET", "redis://h:1/0#password=***"),
        ("redis://[::1:1/0?password=SECRET", "redis://***"),  # too malformed to split
    ],
)
def test_every_credential_form_is_redacted(url: str, shown: str | None) -> None:
    redacted = redact_url(url)
    assert "SECRET" not in redacted
    if shown is not None:
        assert redacted == shown
    assert "/k.pem" in redact_url("redis://h:1/0?ssl_keyfile=/k.pem")  # a path, not a secret
    assert redact_url("unix:///run/r.sock?db=1") == "unix:///run/r.sock?db=1"


def test_messages_about_a_url_hide_its_query_password(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_url(f"redis://h:1/x?password=SECRET&ssl_ca_certs={tmp_path}/none.pem")
    assert "SECRET" not in str(info.value) and "password=***" in str(info.value)
    assert "SECRET" not in RedisBackend("unix:///r.sock?password=SECRET").describe


def test_each_pool_has_its_own_hash_tag_and_vllm_shares_one() -> None:
    assert pool_prefix(PoolId("s", 0, "kv")) == "kvmeta:2:{s:0:kv}:"
    assert pool_prefix(PoolId("s", 1, "a}b{c:d")) == "kvmeta:2:{s:1:a%7Db%7Bc%3Ad}:"
    assert pool_prefix(PoolId("v", 3, "")) == "kvmeta:2:{v}:r3:"


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:1",
        "redis://h:1/",
        "redis://h:1/0",
        "redis://:pw@h:1/15",
        "rediss://h:1/3",
        "unix:///tmp/r.sock",
        "unix:///tmp/r.sock?db=2",
        "redis://h:1/0?socket_timeout=5",
    ],
)
def test_good_urls_pass(url: str) -> None:
    check_url(url)


@pytest.mark.parametrize(
    ("url", "part"),
    [
        ("redis://h:1/abc", "'/abc'"),
        ("redis://h:1/-1", "'/-1'"),
        ("redis://h:1/1/2", "'/1/2'"),
        ("redis://h:1/%C2%B2", "'/%C2%B2'"),  # a superscript two: a digit, not a number
        ("unix:///tmp/r.sock?db=x", "'db=x'"),
        ("redis://h:1/0?db=", "'db='"),
    ],
)
def test_a_database_that_is_not_a_number_names_the_url_part(url: str, part: str) -> None:
    with pytest.raises(InvalidRequest, match="the database " + re.escape(part)) as info:
        check_url(url)
    assert "databases are numbered 0..N-1" in str(info.value)


def test_a_port_out_of_range_is_named() -> None:
    with pytest.raises(InvalidRequest, match="out of range"):
        check_url("redis://h:70000/0")


def test_a_missing_tls_file_is_named_and_an_existing_one_passes(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    with pytest.raises(InvalidRequest, match=f"ssl_ca_certs={re.escape(str(ca))}: file not found"):
        check_url(f"rediss://:pw@h:1/0?ssl_ca_certs={ca}")
    ca.write_text("x")
    check_url(f"rediss://:pw@h:1/0?ssl_ca_certs={ca}")
    with pytest.raises(InvalidRequest, match="ssl_keyfile=/nope/key.pem: file not found") as info:
        check_url(f"rediss://:secret@h:1/0?ssl_certfile={ca}&ssl_keyfile=/nope/key.pem")
    assert "secret" not in str(info.value)


def test_local_state_options_with_a_backend_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="`--data-dir` conflicts with `--backend`"):
        _settings(["--backend", "redis://h:1/0", "--data-dir", "d"], {})
    with pytest.raises(InvalidRequest, match=r"`--in-memory` \(set by env KVMETA_IN_MEMORY\)"):
        _settings([], {"KVMETA_REDIS_URL": "redis://h:1/0", "KVMETA_IN_MEMORY": "1"})
    _settings(["--data-dir", "d"], {})  # without a backend it is the normal case


@pytest.mark.parametrize("url", ["redis://h:6379/0?protocol=3", "redis+cluster://h:1?protocol=3"])
def test_a_url_asking_for_resp3_is_refused_naming_the_parameter(url: str) -> None:
    with pytest.raises(InvalidRequest, match=r"protocol=3: kvmeta speaks RESP2"):
        check_url(url)
    check_url(url.replace("protocol=3", "protocol=2"))


def test_settings_and_bench_reports_hide_backend_credentials() -> None:
    from kvmeta.bench.launch import redact_args
    from kvmeta.config import Settings

    url = "redis://u:SECRET@h:1/0?password=SECRET"
    assert "SECRET" not in repr(Settings(backend=url))
    shown = redact_args(["--backend", url, f"--backend={url}", "--auth-token", "SECRET"])
    assert "SECRET" not in " ".join(shown)
    assert shown[1] == "redis://***:***@h:1/0?password=***"
