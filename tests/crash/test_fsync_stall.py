"""A real ``kvmeta serve`` whose disk stops answering: its fsync helper is stopped with SIGSTOP,
so the journal's fsync never completes, as on a hung NFS/iSCSI mount or a dying disk.

The operator is promised: a change waiting for that fsync answers 503 ("the disk ... stopped
answering") once the fsync is older than ``--fsync-timeout``, while the disk still hangs;
``/ready`` is 503 (why only to a token holder) and ``/health`` says degraded, so a load
balancer stops routing; later changes are refused at once and change nothing; reads keep
working. When the fsync completes, readiness returns by itself, the refused changes can be
retried, and after a kill -9 and a restart every acknowledged confirm is there and
``kvmeta check`` passes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import requests

from tests.crash.faults import PAGES, Driver, cmdline, helper_pid, until
from tests.support import ServerProcess

pytestmark = pytest.mark.slow

TOKEN = "stall-test-token"
BOUND = 1.0  # --fsync-timeout, set through its KVMETA_FSYNC_TIMEOUT variable
MARGIN = 10.0  # for a loaded machine; the stall itself lasts until the test ends it


def _reserve_and_confirm(session: requests.Session, url: str, keys: list[str]) -> tuple:
    """One reserve and confirm of ``keys``: (confirm's status, its detail, the pairs)."""
    resp = session.post(
        f"{url}/0/reserve_and_allocate_page_indices",
        json={"keys": [[k, None] for k in keys]},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    pairs = [[k, p] for k, (_, p) in zip(keys, resp.json()["indices"], strict=True)]
    resp = session.post(
        f"{url}/0/confirm_write", json={"written_keys_to_confirm": pairs}, timeout=60
    )
    detail = resp.json()["detail"] if resp.status_code == 503 else ""
    return resp.status_code, detail, pairs


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_a_hung_fsync_answers_503_marks_unready_and_recovers_when_it_completes(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    server = ServerProcess(
        "--data-dir",
        str(data),
        "--fsync",
        "always",
        "--read-lease",
        "0",
        "--auth-token",
        TOKEN,
        env={"KVMETA_FSYNC_TIMEOUT": str(BOUND)},
        cwd=tmp_path,
    ).start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    session = requests.Session()
    session.headers.update(auth)
    stalled_session = requests.Session()
    stalled_session.headers.update(auth)
    try:
        url = server.url
        resp = session.post(f"{url}/0/initialize", json={"num_pages": PAGES}, timeout=30)
        assert resp.status_code in (200, 204), resp.text
        driver = Driver(server)
        for _ in range(3):
            assert driver.round(session) == 204
        helper = helper_pid(server)
        pool = ThreadPoolExecutor(1)
        os.kill(helper, signal.SIGSTOP)  # the disk stops answering
        try:
            stalled_keys = [f"stalled-{i}" for i in range(8)]
            started = time.monotonic()
            pending = pool.submit(_reserve_and_confirm, stalled_session, url, stalled_keys)
            wait([pending], timeout=BOUND + MARGIN)
            took = time.monotonic() - started
            assert pending.done(), (
                f"an --fsync always confirm got no answer within {BOUND + MARGIN} s while "
                f"the fsync helper was stopped (--fsync-timeout {BOUND})"
            )
            status, detail, stalled_pairs = pending.result()
            assert status == 503, (status, detail)
            assert took >= BOUND, f"answered after {took:.2f} s, before the bound"
            assert "stopped answering" in detail and str(data) in detail, detail

            # Not ready, and why only to a token holder; /health alive but degraded.
            probe = requests.get(url + "/ready", timeout=30)
            assert probe.status_code == 503 and probe.json() == {"ready": False}
            ready = session.get(url + "/ready", timeout=30)
            assert ready.status_code == 503, ready.text
            assert "stopped answering" in ready.json()["detail"]
            assert str(data) in ready.json()["detail"]
            health = requests.get(url + "/health", timeout=30)
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert str(data) in health.json()["reason"]
            metrics = session.get(url + "/metrics", timeout=30).text
            assert _metric(metrics, "kvmeta_journal_fsync_stalled") == 1.0
            assert _metric(metrics, "kvmeta_journal_fsync_pending_seconds") >= BOUND

            # The refused confirm stays applied in memory, as after a journal failure.
            exists = session.post(f"{url}/0/exists", json={"keys": stalled_keys}, timeout=30)
            assert exists.json() == {"exists": [True] * len(stalled_keys)}
            # Reads keep working; a later change is refused at once and changes nothing.
            some = sorted(driver.acked)[:4]
            got = session.post(f"{url}/0/get_page_indices", json={"keys": some}, timeout=30)
            assert got.json()["indices"] == [driver.acked[k] for k in some]
            started = time.monotonic()
            refused = session.post(f"{url}/0/delete_keys", json={"keys": some}, timeout=30)
            assert refused.status_code == 503 and "stopped answering" in refused.json()["detail"]
            assert time.monotonic() - started < MARGIN, "a change waited for the stalled disk"
            exists = session.post(f"{url}/0/exists", json={"keys": some}, timeout=30)
            assert exists.json() == {"exists": [True] * len(some)}
        finally:
            os.kill(helper, signal.SIGCONT)  # the disk answers again
            pool.shutdown()

        until(
            lambda: session.get(url + "/ready", timeout=30).status_code == 200,
            what="/ready once the fsync completed",
        )
        assert requests.get(url + "/health", timeout=30).json()["status"] == "ok"
        metrics = session.get(url + "/metrics", timeout=30).text
        assert _metric(metrics, "kvmeta_journal_fsync_stalled") == 0.0
        assert "the disk answers again" in server.log
        for _ in range(3):
            assert driver.round(session) == 204
        # The refused confirm, retried as engines do: confirms are idempotent.
        resp = session.post(
            f"{url}/0/confirm_write", json={"written_keys_to_confirm": stalled_pairs}, timeout=30
        )
        assert resp.status_code in (200, 204), resp.text
        driver.acked.update((k, p) for k, p in stalled_pairs)
    finally:
        session.close()
        stalled_session.close()
        server.kill()  # kill -9: no final snapshot
    driver.verify_after_restart(data, tmp_path, "always")


def test_sigterm_during_a_stall_exits_and_the_restart_finds_every_acknowledged_confirm(
    tmp_path: Path,
) -> None:
    """The final snapshot and the journal's last fsync would wait for the hung disk (and, on
    the event loop, keep a second signal from being handled): shutdown skips them."""
    data = tmp_path / "data"
    server = ServerProcess(
        "--data-dir", str(data), "--fsync", "always", "--fsync-timeout", str(BOUND), cwd=tmp_path
    ).start()
    helper = 0
    try:
        assert server.post("/0/initialize", {"num_pages": PAGES}).status_code in (200, 204)
        driver = Driver(server)
        with requests.Session() as session:
            for _ in range(3):
                assert driver.round(session) == 204
            helper = helper_pid(server)
            os.kill(helper, signal.SIGSTOP)
            until(lambda: driver.round(session) == 503, what="a change refused by the stall")
        started = time.monotonic()
        code = server.stop(signal.SIGTERM, timeout=BOUND + MARGIN)
        assert code == 0, server.log
        assert time.monotonic() - started < BOUND + MARGIN
        assert "no final snapshot" in server.log, server.log
    finally:
        if helper:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGCONT)
        server.kill()
    assert not Path(f"/proc/{helper}").exists() or b"fsync_helper" not in cmdline(helper)
    driver.verify_after_restart(data, tmp_path, "always")
