"""The Dockerfile, checked by reading it (no image can be built where the tests run: no
container engine): its command line starts a real server, its port and health check are the
server's, it installs through the script CI's packaging test runs, and it runs as no root."""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests

from kvmeta.errors import ConfigError
from tests.deploy import product
from tests.packaging import test_install
from tests.support import ServerProcess, child_env, unused_port

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DOCKERFILE = product.ROOT / "Dockerfile"
DOCKERIGNORE = product.ROOT / ".dockerignore"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continued lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def _one(name: str, stage: str = "final") -> str:
    """The arguments of the only NAME instruction of the final stage (or of all stages)."""
    found = [args for word, args in _stage(stage) if word == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def _stage(which: str) -> list[tuple[str, str]]:
    ins = _instructions()
    starts = [i for i, (word, _) in enumerate(ins) if word == "FROM"]
    return ins[starts[-1] :] if which == "final" else ins


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _args() -> dict[str, str]:
    """ARG name -> default, of every stage."""
    out = {}
    for word, args in _instructions():
        if word == "ARG":
            name, _, default = args.partition("=")
            out[name] = default
    return out


def _command_line() -> tuple[list[str], list[str]]:
    return _exec_form(_one("ENTRYPOINT")), _exec_form(_one("CMD"))


def test_the_base_is_an_official_slim_python() -> None:
    froms = [args for word, args in _instructions() if word == "FROM"]
    assert len(froms) == 2, froms  # a build stage, and the image without build tools
    default = _args()["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.1[0-9]-slim", default), default
    requires = tomllib.loads((product.ROOT / "pyproject.toml").read_text())["project"]
    low = int(requires["requires-python"].removeprefix(">=3."))
    assert int(default.split(".")[1].split("-")[0]) >= low
    for line in froms:
        assert line.split()[0] == "${PYTHON_IMAGE}", line


def test_the_command_line_starts_a_durable_server_on_every_interface() -> None:
    entrypoint, cmd = _command_line()
    assert entrypoint[:2] == ["kvmeta", "serve"], entrypoint
    argv = entrypoint[2:] + cmd
    assert not product.unknown_flags(argv), product.serve_help()
    settings = product.resolve(argv, {})
    assert settings.host == "0.0.0.0"
    assert settings.data_dir == product.DATA_DIR and not settings.backend
    assert settings.port == product.default_port()


def test_arguments_given_to_the_image_replace_the_data_dir_for_a_shared_backend() -> None:
    """``docker run IMAGE --backend URL``: CMD is replaced, so the server starts; the data
    directory kept with a backend is refused with a message that says what to drop."""
    entrypoint, cmd = _command_line()
    assert "--data-dir" not in entrypoint, "an entry point --data-dir conflicts with --backend"
    settings = product.resolve(entrypoint[2:] + ["--backend", "redis://valkey:6379/0"], {})
    assert settings.backend == "redis://valkey:6379/0"
    with pytest.raises(ConfigError, match="Drop the local-state option"):
        product.resolve(entrypoint[2:] + cmd, {"KVMETA_BACKEND": "redis://valkey:6379/0"})


def test_the_data_dir_is_the_volume_and_the_user_is_not_root() -> None:
    _, cmd = _command_line()
    assert _exec_form(_one("VOLUME")) == [product.DATA_DIR]
    assert cmd[cmd.index("--data-dir") + 1] == product.DATA_DIR
    assert _one("WORKDIR") == product.DATA_DIR
    user = _one("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric non-root uid"
    assert gid.isdigit() and int(gid) != 0, user
    # The user exists in the image, and owns the data directory.
    run = " ".join(args for word, args in _stage("final") if word == "RUN")
    assert f"--uid {uid} " in run and f"--gid {gid} " in run, run
    assert re.search(rf"install -d -o kvmeta -g kvmeta -m 0700 {product.DATA_DIR}\b", run), run
    # Nothing after USER runs as root again.
    words = [word for word, _ in _stage("final")]
    assert "RUN" not in words[words.index("USER") :], words


def test_the_port_is_the_servers() -> None:
    assert _one("EXPOSE") == str(product.default_port())


def test_the_install_step_is_the_one_the_packaging_test_runs() -> None:
    runs = [shlex.split(args) for word, args in _stage("build") if word == "RUN"]
    steps = [cmd[i : i + 2] for cmd in runs for i, w in enumerate(cmd) if w == "scripts/package"]
    assert steps == [["scripts/package", "build"], ["scripts/package", "install"]], runs
    install = next(cmd for cmd in runs if "install" in cmd and "scripts/package" in cmd)
    assert install[-1] == "$KVMETA_EXTRAS", install
    # tests/packaging builds and installs through the same script.
    assert test_install.PACKAGE == product.ROOT / "scripts" / "package"
    assert "PACKAGE" in inspect.getsource(test_install.dist)
    assert "PACKAGE" in inspect.getsource(test_install._venv)
    assert os.access(test_install.PACKAGE, os.X_OK)
    # The default extras are the package's, and the image copies the venv it installed into.
    extras = tomllib.loads((product.ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    chosen = _args()["KVMETA_EXTRAS"].split(",")
    assert chosen and set(chosen) <= set(extras), chosen
    assert "--from=build /opt/kvmeta /opt/kvmeta" in _one("COPY")
    assert _one("ENV").startswith("PATH=/opt/kvmeta/bin:$PATH")


def test_the_build_context_holds_every_file_the_sdist_is_built_from() -> None:
    """The image's sdist is CI's: .dockerignore keeps out no file git tracks."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".git" in patterns

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for pattern in patterns:
            bare = pattern.removeprefix("**/")
            for prefix in prefixes:
                if fnmatch.fnmatch(prefix, pattern) or (
                    pattern.startswith("**/") and fnmatch.fnmatch(prefix.split("/")[-1], bare)
                ):
                    return True
        return False

    if (product.ROOT / ".git").exists():
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=product.ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    else:  # an unpacked sdist: its files are what a build needs
        tracked = [
            p.relative_to(product.ROOT).as_posix()
            for p in product.ROOT.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        ]
    assert "pyproject.toml" in tracked and "constraints/test.txt" in tracked
    assert not [path for path in tracked if ignored(path)]
    assert ignored(".git/HEAD") and ignored("src/kvmeta/__pycache__/cli.cpython-312.pyc")
    assert ignored(".venv-test/bin/python") and ignored("build/lib/kvmeta/cli.py")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = product.auth_server(tmp_path_factory.mktemp("dockerfile"))
    try:
        yield server
    finally:
        server.stop()


def _healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    """The HEALTHCHECK command as the image runs it, with KVMETA_PORT pointing at ``port``."""
    options, _, command = _one("HEALTHCHECK").partition("CMD ")
    argv = _exec_form(command)
    assert argv[0] == "python", argv  # the venv's, first on PATH
    env = {**child_env(), "KVMETA_PORT": str(port)}
    return subprocess.run(
        [sys.executable, *argv[1:]], capture_output=True, text=True, env=env, timeout=30
    )


def test_the_health_check_passes_on_a_server_with_auth_on(live: ServerProcess) -> None:
    options = _one("HEALTHCHECK").partition("CMD ")[0]
    assert "/health" in _one("HEALTHCHECK")
    timeout = re.search(r"--timeout=(\d+)s", options)
    assert timeout and "timeout=4" in _one("HEALTHCHECK") and int(timeout.group(1)) > 4
    done = _healthcheck(live.port)
    assert done.returncode == 0, done.stderr
    # Auth is on: a route that is not public refuses a client without a token.
    assert requests.get(live.url + "/v1/pools", timeout=30).status_code == 401


def test_the_health_check_fails_where_nothing_serves() -> None:
    done = _healthcheck(unused_port())
    assert done.returncode == 1 and "Connection refused" in done.stderr, done.stderr
