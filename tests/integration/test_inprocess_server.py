"""The in-process server the request -> reply tests use is the server ``kvmeta serve`` runs:
the same flags and refusals, the same start-up log, its own log apart from the test's, a clean
stop with the final snapshot, and per-process counters starting at zero."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from kvmeta.errors import ConfigError
from tests.support import InProcessServer, Server, child_env


def test_serves_every_dialect_and_logs_what_serve_logs(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--max-keys", "77")
    assert server.post("/0/initialize", {"num_pages": 4}).status_code == 204
    assert server.post("/rank/0/initialize", {"num_pages": 4}).status_code == 200
    assert requests.get(server.url + "/ready", timeout=10).json()["ready"] is True
    assert f"kvmeta listening on {server.url} (pid " in server.log
    assert "backend: memory" in server.log and "max_keys=77" in server.log


def test_a_refusal_at_start_is_the_one_kvmeta_serve_prints(tmp_path: Path) -> None:
    flags = ("--in-memory", "--data-dir", str(tmp_path / "data"))
    cli = subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", *flags, "--port", "0"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2
    with pytest.raises(ConfigError) as refused:
        InProcessServer(*flags).start()
    assert f"kvmeta: error: {refused.value}" in cli.stderr


def test_the_log_of_the_server_and_of_the_test_stay_apart(
    make_app: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    server = make_app("--in-memory")
    with caplog.at_level(logging.INFO):
        logging.getLogger("kvmeta.client").warning("a line of the test's own")
        server.post("/0/initialize", {"num_pages": 4})
        server.post("/0/initialize", {"num_pages": 5})  # the server logs a size conflict
        server.wait_for_log("re-initialised with num_pages=5")
    assert "a line of the test's own" in caplog.text
    assert "a line of the test's own" not in server.log
    assert "re-initialised" not in caplog.text and "listening" not in caplog.text


def test_stop_writes_the_final_snapshot_and_a_new_server_reads_it(
    make_app: Callable[..., Server], tmp_path: Path
) -> None:
    data = str(tmp_path / "data")
    first = make_app("--data-dir", data, "--fsync", "never")
    assert first.post("/0/initialize", {"num_pages": 4}).status_code == 204
    ((_, page),) = first.post(
        "/0/reserve_and_allocate_page_indices", {"keys": [["k", None]]}
    ).json()["indices"]
    assert first.post("/0/confirm_write", {"written_keys_to_confirm": [["k", page]]}).ok
    assert isinstance(first, InProcessServer) and first.stop() == 0
    assert "kvmeta stopped" in first.log
    again = make_app("--data-dir", data)
    assert again.post("/0/get_page_indices", {"keys": ["k"]}).json() == {"indices": [page]}


def test_per_process_counters_start_at_zero(make_app: Callable[..., Server]) -> None:
    def warned(server: Server) -> str:
        text = requests.get(server.url + "/metrics", timeout=10).text
        return next(ln for ln in text.splitlines() if 'kind="size_conflict"' in ln)

    first = make_app("--in-memory")
    first.post("/0/initialize", {"num_pages": 4})
    first.post("/0/initialize", {"num_pages": 5})
    assert warned(first).endswith(" 1.0")
    assert isinstance(first, InProcessServer)
    first.stop()
    assert warned(make_app("--in-memory")).endswith(" 0.0")
