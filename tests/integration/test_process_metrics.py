"""``/metrics`` carries the standard ``process_*`` series and ``python_info`` of the process that
answers, next to ``kvmeta_*``, so stock dashboards and alert rules work on kvmeta; a tenant's
view of ``/metrics`` leaves them out, like every server-wide series."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ServerProcess

Make = Callable[..., ServerProcess]
SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)


def _samples(text: str) -> dict[str, tuple[dict[str, str], float]]:
    return {
        s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    }


def _max_open_files(pid: int) -> int:
    limits = Path(f"/proc/{pid}/limits").read_text()
    match = re.search(r"^Max open files\s+(\d+)", limits, re.M)
    assert match, limits
    return int(match.group(1))


def test_process_series_are_the_servers(make_server: Make) -> None:
    before = time.time()
    server = make_server("--in-memory")
    samples = _samples(requests.get(server.url + "/metrics", timeout=30).text)
    for name in SERIES:
        assert name in samples, f"{name} not in /metrics"
    assert samples["process_max_fds"][1] == _max_open_files(server.pid)
    open_fds = samples["process_open_fds"][1]
    assert 3 <= open_fds <= len(os.listdir(f"/proc/{server.pid}/fd")) + 8
    assert samples["process_resident_memory_bytes"][1] > 1 << 20
    assert before - 5 <= samples["process_start_time_seconds"][1] <= time.time()
    labels, value = samples["python_info"]
    assert value == 1 and labels["implementation"] == "CPython" and labels["version"]
    assert "kvmeta_ready" in samples  # next to kvmeta's own


def test_a_tenants_view_has_no_process_series(make_server: Make, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        '[[tokens]]\ntoken = "tenant-a-admin-0123456"\ntenant = "teamA"\n'
        'rights = ["read", "write", "admin"]\n'
    )
    tokens.chmod(0o600)
    server = make_server("--in-memory", "--auth-file", str(tokens))
    headers = {"Authorization": "Bearer tenant-a-admin-0123456"}
    text = requests.get(server.url + "/metrics", headers=headers, timeout=30).text
    assert "kvmeta_pool" in text or "kvmeta_tenant" in text
    assert "process_" not in text and "python_info" not in text
