"""``kvmeta serve --config FILE`` and ``KVMETA_CONFIG``, as an operator runs them: the file's
settings take effect, flags win over it, and a wrong file stops start-up with one line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import requests

from tests.support import ServerProcess, child_env

Make = Callable[..., ServerProcess]


def test_the_file_sets_what_no_flag_sets(make_server: Make, tmp_path: Path) -> None:
    config = tmp_path / "kvmeta.toml"
    config.write_text("in-memory = true\nmax-keys = 3\nmax-pages = 64\nread-lease = 0\n")
    server = make_server("--config", str(config), "--max-pages", "100")
    server.wait_for_log("tls: off")
    assert f"settings file: {config} (4 settings" in server.log
    assert "max_keys=3 " in server.log and "max_pages=100" in server.log  # the flag won
    assert "in memory only" in server.log
    too_many = server.post("/0/exists", {"keys": ["a", "b", "c", "d"]})
    assert too_many.status_code == 413 and "--max-keys" in too_many.text


def test_the_variable_names_the_file(make_server: Make, tmp_path: Path) -> None:
    config = tmp_path / "kvmeta.toml"
    config.write_text('in-memory = true\nlog-format = "json"\n')
    server = make_server(env={"KVMETA_CONFIG": str(config)})
    server.wait_for_log('"msg": "tls: off')
    assert requests.get(server.url + "/ready", timeout=10).status_code == 200


def test_a_wrong_file_stops_start_up_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "kvmeta.toml"
    config.write_text("in-memory = true\nread-leese = 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"kvmeta: error: {config} line 2: `read-leese` is not a kvmeta setting (did you mean "
        "`read-lease`?); the keys are the serve flags without the leading --"
    ]
