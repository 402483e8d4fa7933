"""Backend URL handling: the env fallback, scheme validation, password redaction, key tags."""

from __future__ import annotations

import argparse

import pytest

from kvmeta._types import PoolId
from kvmeta.config import add_arguments, settings_from_args
from kvmeta.errors import InvalidRequest
from kvmeta.store.redis import RedisBackend, pool_prefix, redact_url


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
    assert redact_url("rediss://user:pw@h:1/0") == "rediss://user:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    backend = RedisBackend("redis://:pw@h:1/0")
    assert "pw" not in backend.describe


def test_each_pool_has_its_own_hash_tag_and_vllm_shares_one() -> None:
    assert pool_prefix(PoolId("s", 0, "kv")) == "kvmeta:{s:0:kv}:"
    assert pool_prefix(PoolId("s", 1, "a}b{c:d")) == "kvmeta:{s:1:a%7Db%7Bc%3Ad}:"
    assert pool_prefix(PoolId("v", 3, "")) == "kvmeta:{v}:r3:"
