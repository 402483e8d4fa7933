"""Configuration mistakes are ``ConfigError`` (a flag, a ``KVMETA_*`` variable, the
``--backend`` URL), and the path-rank error lives with every other error in ``kvmeta.errors``."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from kvmeta import errors
from kvmeta.cli import main
from kvmeta.config import Settings, add_arguments, settings_from_args
from kvmeta.errors import ConfigError, InvalidPathParameter, InvalidRequest, error_for_status
from kvmeta.server.app import parse_rank
from kvmeta.store.redis.backend import RedisBackend, check_url
from tests.support import SRC


def _settings(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(argv), env or {})


@pytest.mark.parametrize(
    ("argv", "env", "field", "message"),
    [
        (["--port", "70000"], {}, "port", "Expected `--port` (KVMETA_PORT)"),
        ([], {"KVMETA_READ_LEASE": "-1"}, "read_lease", "from env KVMETA_READ_LEASE"),
        (["--fsync", "sometimes"], {}, "fsync", "Expected `--fsync` in always|batch|never"),
        (["--fsync-timeout", "0"], {}, "fsync_timeout", "Expected `--fsync-timeout`"),
        (["--workers", "2"], {}, "workers", "`--workers` > 1 needs a shared `--backend`"),
        (["--backend", "redis://h:1/0", "--in-memory"], {}, "in_memory", "conflicts with"),
        (["--in-memory", "--data-dir", "d"], {}, "data_dir", "`--in-memory` conflicts with"),
        (["--in-memory"], {"KVMETA_DATA_DIR": "d"}, "data_dir", "(set by env KVMETA_DATA_DIR)"),
        (["--data-dir", "d"], {"KVMETA_IN_MEMORY": "1"}, "data_dir", "`--data-dir`"),
        (["--ssl-certfile", "c.pem"], {}, "ssl_certfile", "go together"),
        (["--eviction", "prefix", "--backend", "redis://h:1/0"], {}, "eviction", "scripts keep"),
        (["--eviction", "fifo"], {}, "eviction", "Expected `--eviction` in lru|prefix"),
        # absurd numbers: outside a sane range, named with the range
        (["--replica-ack-timeout", "1e300"], {}, "replica_ack_timeout", "0.001 to 31536000"),
        (["--header-timeout", "1e-300"], {}, "header_timeout", "from 0.001 to"),
        ([], {"KVMETA_READ_LEASE": "1e-5"}, "read_lease", "0 (off) or from 0.001"),
        (["--snapshot-interval", "1e12"], {}, "snapshot_interval", "(365 days)"),
        (["--max-keys", "1" + "0" * 20], {}, "max_keys", "at most 9,007,199,254,740,992"),
        (["--workers", "5000"], {}, "workers", "at most 1,024"),
        (["--min-replicas-ack", "-1"], {}, "min_replicas_ack", ">= 0"),
        (
            ["--snapshot-journal-bytes", "64MB"],
            {},
            "snapshot_journal_bytes",
            "e.g. 67108864 or 64MiB",
        ),
        (["--snapshot-journal-bytes=-1MiB"], {}, "snapshot_journal_bytes", "must be >= 0"),
        (["--snapshot-journal-ratio", "nan"], {}, "snapshot_journal_ratio", "from 0 (off) to"),
        (["--snapshot-journal-ratio", "1e300"], {}, "snapshot_journal_ratio", "to 1,000"),
        (["--snapshot-journal-bytes", "1" + "0" * 20], {}, "snapshot_journal_bytes", "at most"),
    ],
)
def test_a_bad_setting_is_a_config_error_naming_it(
    argv: list[str], env: dict[str, str], field: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        _settings(argv, env)
    assert info.value.field == field
    assert isinstance(info.value, InvalidRequest)  # callers catching the old class still do


def test_the_edges_of_the_ranges_are_accepted() -> None:
    edges = ["--reservation-ttl", "0.001", "--read-lease", "0", "--idle-timeout", "31536000"]
    settings = _settings([*edges, "--max-keys", str(1 << 53), "--min-replicas-ack", "0"])
    assert (settings.reservation_ttl, settings.read_lease) == (0.001, 0.0)
    assert settings.idle_timeout == 31536000 and settings.max_keys == 1 << 53


def test_the_eviction_default_is_prefix_locally_and_lru_on_redis() -> None:
    assert _settings([]).eviction == "prefix"
    assert _settings(["--in-memory"]).eviction == "prefix"
    assert _settings(["--backend", "redis://h:1/0"]).eviction == "lru"
    assert _settings([], {"KVMETA_BACKEND": "redis://h:1/0"}).eviction == "lru"
    assert _settings(["--eviction", "lru", "--backend", "redis://h:1/0"]).eviction == "lru"
    assert _settings(["--eviction", "lru"]).eviction == "lru"


def test_the_journal_budget_takes_bytes_with_a_unit() -> None:
    assert _settings(["--snapshot-journal-bytes", "64MiB"]).snapshot_journal_bytes == 64 << 20
    assert _settings(["--snapshot-journal-bytes", "1000"]).snapshot_journal_bytes == 1000
    env = {"KVMETA_SNAPSHOT_JOURNAL_BYTES": "1GiB", "KVMETA_SNAPSHOT_JOURNAL_RATIO": "0"}
    settings = _settings([], env)
    assert settings.snapshot_journal_bytes == 1 << 30 and settings.snapshot_journal_ratio == 0.0


def test_in_memory_keeps_its_sglang_persistence_file_and_the_default_data_dir() -> None:
    # --data-dir has a default, which an in-memory server simply does not use; and the
    # reference server's persistence file is a state file of its own, not a data directory.
    settings = _settings(["--in-memory", "--persistence-path", "state.json"])
    assert settings.in_memory and settings.persistence_path == "state.json"
    assert _settings([], {"KVMETA_IN_MEMORY": "0", "KVMETA_DATA_DIR": "d"}).data_dir == "d"


@pytest.mark.parametrize("url", ["http://h:1/0", "redis://h:1/abc", "redis://h:99999/0"])
def test_a_bad_backend_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_url(url)
    assert info.value.field == "backend"
    with pytest.raises(ConfigError):
        RedisBackend(url)


def test_serve_with_a_bad_setting_prints_one_line_and_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvmeta: error: Expected `--port`"), err


def test_the_same_from_a_real_process() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    env = {k: v for k, v in env.items() if not k.startswith("KVMETA_")}
    done = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--workers", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("kvmeta: error: `--workers` > 1 needs a shared `--backend`")
    assert done.stderr.count("\n") == 1, done.stderr


def test_the_path_rank_error_is_in_the_error_tree_with_its_status() -> None:
    assert "InvalidPathParameter" in errors.__all__ and "ConfigError" in errors.__all__
    assert issubclass(InvalidPathParameter, InvalidRequest) and InvalidPathParameter.status == 422
    with pytest.raises(InvalidPathParameter, match="Path parameter `rank` must be an integer"):
        parse_rank("abc")
    # A client maps the 422 back to the caller's-mistake class, as before.
    assert type(error_for_status(422, "Path parameter `rank` ...")) is InvalidRequest


def test_unknown_variables_are_named_with_the_closest_real_one() -> None:
    from kvmeta.config import unknown_env

    env = {
        "KVMETA_PORTT": "1",
        "KVMETA_ZZZZZZZZZZZZ": "1",
        "KVMETA_PORT": "1",  # a setting
        "KVMETA_REDIS_URL": "redis://h:1/0",  # read as a fallback for --backend
        "KVMETA_TEST_REDIS_SERVER": "valkey-server",  # the test suite's
        "HOME": "/root",
    }
    assert unknown_env(env) == [
        "KVMETA_PORTT is not a kvmeta setting (did you mean KVMETA_PORT?)",
        "KVMETA_ZZZZZZZZZZZZ is not a kvmeta setting (`kvmeta serve --help` lists them)",
    ]
