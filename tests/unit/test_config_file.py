"""The settings file (``--config`` / ``KVMETA_CONFIG``): keys are the serve flags, values go
through the flags' own checks, unknown keys and wrong types are refused naming the line and the
fix, and flags and ``KVMETA_*`` variables win over it. The annotated example in deploy/ is
loaded with the real parser, so it cannot drift from the flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from kvmeta.config import OPTIONS, Settings, add_arguments, settings_from_args, unknown_env
from kvmeta.config_file import (
    add_config_argument,
    config_path,
    file_key,
    load_config_file,
    parse_config_text,
)
from kvmeta.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "kvmeta.toml"
COMMENTED_KEY = re.compile(r"^# ([a-z][a-z0-9-]*) = (.+)$")


def _settings(
    text: str, argv: list[str] | None = None, env: dict[str, str] | None = None
) -> Settings:
    parser = argparse.ArgumentParser()
    add_config_argument(parser)
    add_arguments(parser)
    values = parse_config_text(text, "kvmeta.toml")
    return settings_from_args(parser.parse_args(argv or []), env or {}, values)


def _refusal(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, "kvmeta.toml")
    return info.value


# ---------------------------------------------------------------- the example in deploy/


def test_the_example_as_shipped_loads_and_changes_nothing() -> None:
    values = load_config_file(str(EXAMPLE))
    assert values == {}
    assert _settings(EXAMPLE.read_text()) == Settings()


def test_the_example_names_every_flag_once_with_its_default() -> None:
    """Uncommented, the example sets every option: each key is a flag, each value passes the
    flag's check, and a value shown for an option with a default is that default."""
    shown: dict[str, str] = {}
    for line in EXAMPLE.read_text().splitlines():
        match = COMMENTED_KEY.match(line)
        if match:
            assert match.group(1) not in shown, f"{match.group(1)} appears twice"
            shown[match.group(1)] = match.group(2)
    assert sorted(shown) == sorted(file_key(opt) for opt in OPTIONS)
    text = "\n".join(f"{key} = {value}" for key, value in shown.items())
    values = parse_config_text(text, "uncommented example")
    defaults = Settings()
    for opt in OPTIONS:
        default = getattr(defaults, opt.name)
        if opt.flag_only:
            assert shown[file_key(opt)] == "false" and opt.name not in values, opt.name
        elif default is None:
            assert values[opt.name][0], f"{opt.name}: show an example value"
        else:
            assert values[opt.name][0] == default, (opt.name, values[opt.name][0], default)


# ---------------------------------------------------------------- refusals


def test_an_unknown_key_is_refused_with_its_line_and_the_closest_key() -> None:
    err = _refusal("in-memory = true\n\n# leases\nread-leese = 0\n")
    assert "kvmeta.toml line 4" in str(err)
    assert "`read-leese` is not a kvmeta setting" in str(err)
    assert "did you mean `read-lease`?" in str(err)
    assert err.field == "config"


def test_the_underscore_spelling_points_at_the_dashed_key() -> None:
    err = _refusal('log_format = "json"\n')
    assert "line 1" in str(err) and "did you mean `log-format`?" in str(err)


def test_a_table_is_refused_at_its_header() -> None:
    err = _refusal('port = 1\n[serve]\nhost = "0.0.0.0"\n')
    assert "kvmeta.toml line 2" in str(err) and "`serve`" in str(err)
    assert "has no tables" in str(err)


@pytest.mark.parametrize(
    ("line", "field", "expected"),
    [
        (
            'read-lease = "5"',
            "read_lease",
            "`read-lease` must be a number (no quotes), got a string",
        ),
        ("port = 18000.5", "port", "`port` must be a whole number (no quotes), got a float"),
        (
            "workers = true",
            "workers",
            "`workers` must be a whole number (no quotes), got a boolean",
        ),
        ('in-memory = "yes"', "in_memory", "`in-memory` must be true or false (no quotes)"),
        ("backend = 6379", "backend", "`backend` must be a string in quotes, got an integer"),
        ("max-keys = [1, 2]", "max_keys", "`max-keys` must be a whole number (no quotes), got an"),
    ],
)
def test_a_wrong_type_is_refused_naming_the_key_and_the_type(
    line: str, field: str, expected: str
) -> None:
    err = _refusal("# settings\n" + line + "\n")
    assert "kvmeta.toml line 2" in str(err)
    assert expected in str(err)
    assert "write e.g. `" in str(err)
    assert err.field == field


@pytest.mark.parametrize(
    ("line", "field", "expected"),
    [
        ("read-lease = -1", "read_lease", "not a valid value for --read-lease: must be >= 0"),
        ("port = 70000", "port", "--port: a TCP port is 0..65535"),
        ("reservation-ttl = 0", "reservation_ttl", "must be > 0 seconds"),
        ("fsync-timeout = nan", "fsync_timeout", "must be a finite number"),
        ('fsync = "sometimes"', "fsync", "must be one of always|batch|never (as --fsync)"),
        ('events = "udp://x:1"', "events", "a ZeroMQ address"),
        ("drain-seconds = -5", "drain_seconds", "must be >= 0"),
    ],
)
def test_a_value_the_flag_refuses_is_refused_the_same_way(
    line: str, field: str, expected: str
) -> None:
    err = _refusal(line)
    assert "kvmeta.toml line 1" in str(err) and expected in str(err)
    assert err.field == field


def test_a_list_flag_takes_an_array_or_a_comma_separated_string() -> None:
    as_array = _settings('allowed-hosts = ["kvmeta.internal", "*.svc.local"]')
    as_string = _settings('allowed-hosts = "kvmeta.internal,*.svc.local"')
    assert as_array.allowed_hosts == as_string.allowed_hosts == ("kvmeta.internal", "*.svc.local")
    err = _refusal("allowed-hosts = [1, 2]")
    assert "`allowed-hosts` must be an array of strings" in str(err)
    err = _refusal('allowed-hosts = ["http://x:1"]')
    assert "not a valid value for --allowed-hosts" in str(err) and "'http://x:1'" in str(err)


def test_a_file_that_is_no_toml_names_the_line() -> None:
    err = _refusal("port = 1\nhost = \n")
    assert "kvmeta.toml is not valid TOML" in str(err) and "line 2" in str(err)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the settings file .*: No such file"):
        load_config_file(str(tmp_path / "nope.toml"))


def test_a_token_in_a_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvmeta.toml"
    path.write_text('in-memory = true\nauth-token = "0123456789abcdef"\n')
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"line 2: `auth-token` .*\(mode 0644\).*chmod 600"):
        load_config_file(str(path))
    path.chmod(0o600)
    assert load_config_file(str(path))["auth_token"][0] == "0123456789abcdef"


# ---------------------------------------------------------------- merging


def test_flags_and_variables_win_over_the_file() -> None:
    text = "read-lease = 1\nport = 1\nmax-keys = 7\nfsync = 'never'\nhash-index = true\n"
    got = _settings(text, ["--port", "3"], {"KVMETA_READ_LEASE": "2", "KVMETA_FSYNC": "always"})
    assert (got.read_lease, got.port, got.fsync) == (2.0, 3, "always")
    assert got.max_keys == 7 and got.hash_index is True  # from the file: nothing else set them


def test_the_conventional_redis_variable_wins_over_the_file() -> None:
    got = _settings('backend = "redis://file:1/0"', env={"KVMETA_REDIS_URL": "redis://env:2/0"})
    assert got.backend == "redis://env:2/0"
    assert _settings('backend = "redis://file:1/0"').backend == "redis://file:1/0"


def test_a_conflict_names_the_line_that_set_each_side() -> None:
    with pytest.raises(ConfigError) as info:
        _settings('in-memory = true\ndata-dir = "d"\n')
    assert "`--in-memory` (set by kvmeta.toml line 1)" in str(info.value)
    assert "`--data-dir` (set by kvmeta.toml line 2)" in str(info.value)


def test_a_switch_written_false_is_its_default_and_no_conflict() -> None:
    got = _settings('in-memory = false\nbackend = "redis://h:1/0"\naccess-log = false\n')
    assert got.backend == "redis://h:1/0" and not got.in_memory and not got.access_log


def test_the_flag_names_the_file_and_else_the_variable() -> None:
    parser = argparse.ArgumentParser()
    add_config_argument(parser)
    env = {"KVMETA_CONFIG": "/etc/kvmeta.toml"}
    assert config_path(parser.parse_args([]), env) == "/etc/kvmeta.toml"
    assert config_path(parser.parse_args(["--config", "a.toml"]), env) == "a.toml"
    assert config_path(parser.parse_args([]), {}) is None
    assert unknown_env(env) == []  # KVMETA_CONFIG is a kvmeta variable


def test_every_option_has_a_file_type() -> None:
    """Each option's type comes from its Settings field: a new flag needs nothing here."""
    text: dict[str, Any] = {}
    for opt in OPTIONS:
        default = getattr(Settings(), opt.name)
        if isinstance(default, bool) or default is None:
            continue
        literal = f'"{default}"' if isinstance(default, str) else str(default)
        text[file_key(opt)] = literal
    values = parse_config_text("\n".join(f"{k} = {v}" for k, v in text.items()))
    assert len(values) == len(text)
