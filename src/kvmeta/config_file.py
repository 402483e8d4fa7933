"""``kvmeta serve --config FILE`` (or ``KVMETA_CONFIG``): the serve flags in a TOML file.

A key is a flag's name without the leading ``--`` (``read-lease = 0``, ``in-memory = true``,
``backend = "redis://..."``), so the file needs no documentation of its own beyond the flags
page and an operator can move a setting between the file, a flag and a ``KVMETA_*`` variable
without renaming it. The file is the lowest layer: every flag and variable wins over it.

Each value goes through the very check its flag does (``Option.parse`` and its choices), after a
type check of its own: TOML has types, and ``read-lease = "5"`` or ``port = 18000.5`` is a
mistake worth naming rather than a string to coerce. A key no flag has is refused with its line
and the closest real name, as a misspelt flag is: a setting silently ignored would leave the
server running with a default the operator believes they changed.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import stat
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvmeta.config import OPTIONS, Option, Settings
from kvmeta.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "CONFIG_ENV",
    "add_config_argument",
    "config_path",
    "file_key",
    "load_config_file",
    "parse_config_text",
]

CONFIG_ENV = "KVMETA_CONFIG"

_BY_KEY: dict[str, Option] = {opt.name.replace("_", "-"): opt for opt in OPTIONS}

# The first key of a ``key = value`` (or dotted ``key.sub = value``) line, bare or quoted, and
# the first key of a ``[table]`` / ``[[array]]`` header: enough to name the line of a key.
_KEY_LINE = re.compile(r"""^\s*(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*[.=]""")
_TABLE_LINE = re.compile(r"""^\s*\[\[?\s*(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))""")

_KIND_TEXT = {
    "boolean": "true or false (no quotes)",
    "integer": "a whole number (no quotes)",
    "number": "a number (no quotes)",
    "string": "a string in quotes",
    "strings": 'an array of strings (["a", "b"]) or one comma-separated string',
}


def file_key(opt: Option) -> str:
    """An option's key in the file: its flag without the ``--``."""
    return opt.name.replace("_", "-")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` on ``kvmeta serve``."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML file of settings: keys are these flags without the -- (read-lease = 0, "
        "in-memory = true); every flag and KVMETA_* variable wins over the file; see "
        f"deploy/kvmeta.toml (default unset; env {CONFIG_ENV})",
    )


def config_path(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str | None:
    """The settings file to read: ``--config``, else ``KVMETA_CONFIG``, else none."""
    env = os.environ if environ is None else environ
    given = getattr(args, "config", None)
    if given:
        return str(given)
    return env.get(CONFIG_ENV) or None


def _kind(opt: Option) -> str:
    """The TOML type an option's value must have, from its ``Settings`` field's type."""
    hint = typing.get_type_hints(Settings)[opt.name]
    types = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    if any(typing.get_origin(t) is tuple for t in types):
        return "strings"  # a flag that takes a comma-separated list
    if bool in types:
        return "boolean"
    if int in types:
        return "integer"
    if float in types:
        return "number"
    return "string"


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"a {type(value).__name__}"  # dates and times


def _fits(kind: str, value: Any) -> bool:
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False  # a bool is an int to Python, never to an operator
    if kind == "integer":
        return isinstance(value, int)
    if kind == "number":
        return isinstance(value, (int, float))
    if kind == "strings" and isinstance(value, list):
        return all(isinstance(v, str) and "," not in v for v in value)
    return isinstance(value, str)


def _as_text(value: Any) -> str:
    """A checked value as a flag would carry it, for the flag's own parser."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # inf and nan stay recognisable, and are refused as flags are
    if isinstance(value, list):
        return ",".join(value)  # as the flag takes it
    return str(value)


def _example(opt: Option, kind: str) -> str:
    """``key = value`` as the file would say it, from the option's default where it has one."""
    default = getattr(Settings(), opt.name)
    if kind == "strings":
        shown = '["...", "..."]'
    elif default is None:
        shown = '"..."'
    elif kind == "boolean":
        shown = "true"
    elif kind == "string":
        shown = f'"{default}"'
    elif isinstance(default, float) and default.is_integer():
        shown = str(int(default))
    else:
        shown = _as_text(default)
    return f"{file_key(opt)} = {shown}"


def _key_lines(text: str) -> dict[str, int]:
    """Line number (1-based) of each top-level key and table header, first occurrence."""
    lines: dict[str, int] = {}
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        table = _TABLE_LINE.match(line)
        if table:
            in_table = True
            lines.setdefault(next(g for g in table.groups() if g is not None), number)
            continue
        key = _KEY_LINE.match(line)
        if key and not in_table:
            lines.setdefault(next(g for g in key.groups() if g is not None), number)
    return lines


def _check(opt: Option, key: str, value: Any, where: str) -> Any:
    """The value the flag's own parser makes of ``value``, or a ConfigError naming the key."""
    kind = _kind(opt)
    flag = "--" + key
    if not _fits(kind, value):
        raise ConfigError(
            f"{where}: `{key}` must be {_KIND_TEXT[kind]}, got {_type_name(value)} ({value!r}); "
            f"write e.g. `{_example(opt, kind)}`",
            opt.name,
        )
    try:
        parsed = opt.parse(_as_text(value))
    except ValueError as exc:
        raise ConfigError(
            f"{where}: `{key}` = {value!r} is not a valid value for {flag}: {exc}", opt.name
        ) from None
    if opt.choices and parsed not in opt.choices:
        raise ConfigError(
            f"{where}: `{key}` must be one of {'|'.join(opt.choices)} (as {flag}), got {value!r}",
            opt.name,
        )
    return parsed


def parse_config_text(text: str, path: str = "config file") -> dict[str, tuple[Any, str]]:
    """Check a settings file's text; option name -> (value, where it was set).

    A boolean switch set to ``false`` is left out: that is its default, and leaving it out keeps
    ``in-memory = false`` next to ``backend = ...`` from counting as a conflict.

    Raises:
        ConfigError: not TOML, a key no flag has (with its line and the closest key), a value
            of the wrong type, or one its flag would refuse; naming the key and the fix.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid TOML: {exc}; write one `key = value` per line", "config"
        ) from None
    lines = _key_lines(text)
    values: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        where = f"{path} line {lines[key]}" if key in lines else path
        opt = _BY_KEY.get(key)
        if opt is None:
            close = difflib.get_close_matches(key, list(_BY_KEY), n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else "`kvmeta serve --help` lists them"
            table = "; the file has no tables: write `key = value` lines" * isinstance(value, dict)
            raise ConfigError(
                f"{where}: `{key}` is not a kvmeta setting ({hint}){table}; the keys are the "
                "serve flags without the leading --",
                "config",
            )
        parsed = _check(opt, key, value, where)
        if opt.flag_only and parsed is False:
            continue
        values[opt.name] = (parsed, where)
    return values


def load_config_file(path: str) -> dict[str, tuple[Any, str]]:
    """Read and check the settings file at ``path`` (see ``parse_config_text``).

    Raises:
        ConfigError: the file cannot be read; it sets ``auth-token`` and group or others may
            read it; or its content is wrong.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"cannot read the settings file {path} (--config / {CONFIG_ENV}): {reason}; "
            "check the path",
            "config",
        ) from None
    values = parse_config_text(text, path)
    if "auth_token" in values and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{values['auth_token'][1]}: `auth-token` is in a file that group or others may "
            f"read (mode {stat.S_IMODE(mode):04o}): run `chmod 600 {path}`, or give the token "
            "in KVMETA_AUTH_TOKEN instead",
            "auth_token",
        )
    return values
