"""What the deployment files (Dockerfile, deploy/kubernetes, deploy/systemd) are checked against:
the real ``kvmeta serve``. Its ``--help`` gives the flags, their ``KVMETA_*`` variables and the
default port; its own argument parser and settings merge say whether a command line and
environment start a server or are refused; a live server with auth on says which routes answer
a client that sends no token (a probe)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvmeta.cli import build_parser
from kvmeta.config import Settings, settings_from_args
from tests.support import SRC, ServerProcess, child_env

ROOT = SRC.parent
DATA_DIR = "/var/lib/kvmeta"
TOKEN = "deploy-test-token-of-the-operator"


@functools.cache
def serve_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--help"],
        capture_output=True, text=True, env={**child_env(), "COLUMNS": "100"}, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def serve_flags() -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", serve_help()))


def serve_env() -> set[str]:
    """The ``KVMETA_*`` variables ``kvmeta serve`` reads, as its help names them."""
    return set(re.findall(r"\benv\s+(KVMETA_[A-Z0-9_]+)", serve_help()))


def default_port() -> int:
    found = re.search(r"--port PORT\s.*?\(default (\d+); env\s+KVMETA_PORT\)", serve_help(), re.S)
    assert found, serve_help()
    return int(found.group(1))


def flags_of(argv: Iterable[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]


def unknown_flags(argv: Iterable[str]) -> list[str]:
    known = serve_flags()
    return [flag for flag in flags_of(argv) if flag not in known]


def resolve(argv: list[str], env: Mapping[str, str]) -> Settings:
    """The settings ``kvmeta serve ARGV`` starts with in ENV (the real parser and merge;
    raises ConfigError where the server would refuse to start)."""
    args, extra = build_parser().parse_known_args(["serve", *argv])
    assert not extra, f"kvmeta serve does not take {extra}"
    return settings_from_args(args, environ=env)


def write_tokens_file(path: Path) -> Path:
    path.write_text('[[tokens]]\ntoken = "tenant-token-of-team-a"\ntenant = "teamA"\n')
    os.chmod(path, 0o600)
    return path


def auth_server(tmp: Path) -> ServerProcess:
    """A durable server with both kinds of auth on, as the manifests and unit run it."""
    tokens = write_tokens_file(tmp / "tokens.toml")
    return ServerProcess(
        "--data-dir", str(tmp / "data"), "--auth-token", TOKEN, "--auth-file", str(tokens),
        cwd=tmp,
    ).start()  # fmt: skip
