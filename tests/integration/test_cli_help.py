"""What a new user types first: ``--version``, ``--help`` that shows every flag's choices and
default, and a misspelt flag answered with the usage of the command it was given to."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvmeta import __version__
from kvmeta.config import OPTIONS, Settings
from tests.support import SRC


def kvmeta(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["COLUMNS"] = "200"  # one help line per flag
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_version() -> None:
    done = kvmeta("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvmeta {__version__}"


def test_serve_help_shows_every_flag_with_its_default_and_choices() -> None:
    done = kvmeta("serve", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps lines
    # one entry per option: its line and the wrapped lines under it
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", done.stdout.split("options:", 1)[1]):
        words = block.split()
        if not words:
            continue
        entries[words[0].rstrip(",")] = " ".join(words)
    defaults = Settings()
    for opt in OPTIONS:
        flag = "--" + opt.name.replace("_", "-")
        assert flag in entries, flag
        match = re.search(r"\(([^()]*default [^()]*)\)$", entries[flag])
        assert match, f"{flag}: no '(... default ...)' at the end of {entries[flag]!r}"
        default = getattr(defaults, opt.name)
        shown = str(default)
        if default is None or isinstance(default, bool):
            shown = "unset" if default is None else ("on" if default else "off")
        assert f"default {shown};" in match.group(1), (flag, match.group(1))
        assert f"env KVMETA_{opt.name.upper()}" in match.group(1), flag
        if opt.choices:
            assert "one of " + "|".join(opt.choices) in match.group(1), flag
            assert entries[flag].startswith(flag + " {" + ",".join(opt.choices) + "}"), flag
    for flag in ("--fsync {always,batch,never}", "--log-format {text,json}", "--log-level {"):
        assert flag in text


@pytest.mark.parametrize(
    ("command", "needle"),
    [("status", "default http://127.0.0.1:18000"), ("check", "default ./kvmeta-data")],
)
def test_other_commands_show_their_defaults(command: str, needle: str) -> None:
    done = kvmeta(command, "--help")
    assert done.returncode == 0, done.stderr
    assert needle in " ".join(done.stdout.split())


def test_misspelt_serve_flag_prints_serve_usage_and_the_closest_flag() -> None:
    done = kvmeta("serve", "--prot", "18001")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: kvmeta serve "), done.stderr
    assert "kvmeta serve: error: unrecognized arguments: --prot 18001" in done.stderr
    assert "did you mean --port?" in done.stderr
    done = kvmeta("status", "--ulr", "http://x")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: kvmeta status "), done.stderr
    assert "did you mean --url?" in done.stderr
