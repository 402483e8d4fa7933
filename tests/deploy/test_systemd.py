"""deploy/systemd/kvmeta.service: ``systemd-analyze verify`` finds nothing to say about it and
``systemd-analyze security`` rates its exposure low (where systemd-analyze is installed); its
command line, variables and reload signal are the real server's, and its limits fit the
server's defaults."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kvmeta.errors import ConfigError
from tests.deploy import product
from tests.deploy.test_dockerfile import _one
from tests.support import ServerProcess

UNIT = product.ROOT / "deploy" / "systemd" / "kvmeta.service"
ENV_EXAMPLE = product.ROOT / "deploy" / "systemd" / "env.example"
# The venv scripts/package installs into, as in the image.
KVMETA = "/opt/kvmeta/bin/kvmeta"
# Exposure score (0 safest .. 10) that `systemd-analyze security` may not exceed (its
# --threshold counts tenths).
EXPOSURE = 2.0


def _unit() -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def _service(key: str) -> str:
    (value,) = _unit()["Service"][key]
    return value


def _exec_start() -> list[str]:
    argv = shlex.split(_service("ExecStart"))
    assert argv[:2] == [KVMETA, "serve"], argv
    return argv[2:]


def test_the_command_line_is_a_durable_server_in_the_state_directory() -> None:
    argv = _exec_start()
    assert not product.unknown_flags(argv), product.serve_help()
    settings = product.resolve(argv, {})
    state = "/var/lib/" + _service("StateDirectory")
    assert settings.data_dir == state == product.DATA_DIR == _service("WorkingDirectory")
    assert not settings.backend
    # A shared backend from the environment file is refused with the fix (drop --data-dir).
    with pytest.raises(ConfigError, match="conflicts with `--backend`"):
        product.resolve(argv, {"KVMETA_BACKEND": "redis://valkey:6379/0"})
    # The venv path is the image's.
    assert _one("ENV").startswith(f"PATH={Path(KVMETA).parent}:")


def test_every_variable_it_names_is_one_the_server_reads() -> None:
    named = re.findall(r"^#?(KVMETA_[A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), re.M)
    assert {"KVMETA_HOST", "KVMETA_AUTH_TOKEN", "KVMETA_AUTH_FILE"} <= set(named)
    assert set(named) <= product.serve_env(), sorted(product.serve_env())
    assert _service("EnvironmentFile") == "-/etc/kvmeta/env"
    for line in _unit()["Service"].get("Environment", []):
        name = line.split("=", 1)[0]
        assert name in product.serve_env(), line


def test_a_simple_service_of_its_own_user_with_the_hardening() -> None:
    assert _service("Type") == "simple"
    assert _service("User") == _service("Group") == "kvmeta"
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "RestrictSUIDSGID": "yes",
        "CapabilityBoundingSet": "",
        "UMask": "0077",
    }
    assert {key: _service(key) for key in expected} == expected
    assert _service("Restart") == "on-failure"
    assert _service("KillSignal") == "SIGTERM"
    assert int(_service("TimeoutStopSec")) >= 30  # the snapshot written at shutdown


def test_the_open_file_limit_leaves_the_default_connection_cap_whole() -> None:
    help_text = product.serve_help()
    found = re.search(r"--max-connections MAX_CONNECTIONS\s.*?\(default (\d+);", help_text, re.S)
    assert found
    # runner.connection_cap: the cap is the soft limit minus 64 descriptors kept in reserve.
    assert int(_service("LimitNOFILE")) - 64 >= int(found.group(1))


def _stub_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at an executable that exists here (verify checks it)."""
    stub = tmp_path / "kvmeta"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    unit = tmp_path / "kvmeta.service"
    unit.write_text(UNIT.read_text().replace(KVMETA, str(stub)))
    return unit


def _analyze() -> str:
    found = shutil.which("systemd-analyze")
    assert found, "systemd-analyze is not on PATH: install Debian's systemd package"
    return found


def test_systemd_analyze_verify_has_nothing_to_say(tmp_path: Path) -> None:
    analyze = _analyze()
    done = subprocess.run(
        [analyze, "verify", str(_stub_unit(tmp_path))], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    # verify exits 0 on unknown keys and bad values too: only its silence means a clean unit.
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_systemd_analyze_verify_would_say_so(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key and a bad value are reported."""
    analyze = _analyze()
    unit = _stub_unit(tmp_path)
    text = unit.read_text().replace("ProtectSystem=strict", "ProtectSystem=sideways")
    unit.write_text(text.replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert "NoNewPrivilege" in done.stderr and "sideways" in done.stderr, done.stderr


def test_systemd_analyze_security_rates_it_safe(tmp_path: Path) -> None:
    analyze = _analyze()
    done = subprocess.run(
        [analyze, "security", "--offline=true", f"--threshold={round(EXPOSURE * 10)}", "--no-pager",
         str(_stub_unit(tmp_path))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    score = re.search(r"Overall exposure level for kvmeta\.service: ([\d.]+)", done.stdout)
    assert score, done.stdout + done.stderr
    assert done.returncode == 0 and float(score.group(1)) <= EXPOSURE, done.stdout


@pytest.fixture
def live(tmp_path: Path) -> Iterator[ServerProcess]:
    server = product.auth_server(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_reload_makes_the_server_read_the_tokens_file_again(
    live: ServerProcess, tmp_path: Path
) -> None:
    """ExecReload, run as systemd runs it ($MAINPID: the server's pid)."""
    added = "a-token-added-while-serving"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        tokens.read_text()
        + f'\n[[tokens]]\ntoken = "{added}"\ntenant = "teamB"\nrights = ["read", "admin"]\n'
    )
    pools = live.url + "/v1/pools"
    assert requests.get(pools, auth=("", added), timeout=30).status_code == 401
    argv = [a.replace("$MAINPID", str(live.pid)) for a in shlex.split(_service("ExecReload"))]
    assert argv == ["/bin/kill", f"-{signal.SIGHUP.name.removeprefix('SIG')}", str(live.pid)]
    assert os.access(argv[0], os.X_OK)
    subprocess.run(argv, check=True, timeout=30)
    live.wait_for_log("reloaded: 2 tokens")
    got = requests.get(pools, auth=("", added), timeout=30)
    assert got.status_code == 200, got.text
