"""A damaged data directory, for real: ``kvmeta check`` and start-up refuse it and name
``kvmeta check --repair``, which keeps every pool and drops every key; the server then starts
on it with every pool, no key, and hands out pages again."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import requests

from kvmeta.store.disk.codec import HEADER
from kvmeta.store.disk.recovery import list_data_dir
from tests.support import ServerProcess, child_env, kvmeta_check, until_released

SMALL = 8  # pages of the pool that evicts


def serve(data: Path, cwd: Path) -> ServerProcess:
    """A server on ``data`` with short leases, once the pages it holds after the restart
    (the previous run's leases) are free again."""
    server = ServerProcess(
        *("--data-dir", str(data), "--fsync", "always", "--read-lease", "0"),
        *("--reservation-ttl", "1"),
        cwd=cwd,
    ).start()
    until_released(server)
    return server


def write(server: ServerProcess, keys: list[str], namespace: str = "kv") -> dict[str, int]:
    """Reserve and confirm ``keys``; their pages."""
    body = {"keys": [[k, None] for k in keys], "namespace": namespace}
    out = server.post("/0/reserve_and_allocate_page_indices", body).json()["indices"]
    pairs = [[k, page] for k, (_, page) in zip(keys, out, strict=True)]
    assert all(page >= 0 for _, page in pairs), out
    confirm = {"written_keys_to_confirm": pairs, "namespace": namespace}
    assert server.post("/0/confirm_write", confirm).status_code in (200, 204)
    return dict((k, p) for k, p in pairs)


def fill(server: ServerProcess) -> list[str]:
    """Pools of both dialects, keys stored, deleted and evicted; every key ever written."""
    assert server.post("/0/initialize", {"num_pages": 64}).status_code in (200, 204)
    small = {"num_pages": SMALL, "namespace": "small"}
    assert server.post("/0/initialize", small).status_code in (200, 204)
    assert server.post("/1/initialize", {"num_pages": 32, "namespace": "mamba"}).ok
    vllm = {"role": "worker", "num_pages": 16, "world_size": 2}
    assert server.post("/rank/1/initialize", vllm).ok
    keys: list[str] = []
    for round_ in range(6):
        batch = [f"kv-{round_}-{i}" for i in range(4)]
        write(server, batch)
        keys += batch
        evicting = [f"small-{round_}-{i}" for i in range(4)]  # 24 keys through 8 pages
        write(server, evicting, "small")
        keys += evicting
        assert server.post("/0/delete_keys", {"keys": [batch[0]]}).ok
    return keys


def record_offsets(segment: Path) -> list[int]:
    """Where each framed record of ``segment`` starts."""
    data = segment.read_bytes()
    offsets, at = [], len(HEADER)
    while at < len(data):
        offsets.append(at)
        (length,) = struct.unpack_from("<I", data, at)
        at += 8 + length
    return offsets


def damage_middle_record(data: Path) -> Path:
    """Flip bytes in the payload of a record in the middle of the last journal segment."""
    segment = data / f"journal-{list_data_dir(data).segments[-1]:012d}.log"
    offsets = record_offsets(segment)
    assert len(offsets) > 10
    at = offsets[len(offsets) // 2] + 8 + 2
    raw = bytearray(segment.read_bytes())
    raw[at : at + 3] = bytes(b ^ 0xA5 for b in raw[at : at + 3])
    segment.write_bytes(bytes(raw))
    return segment


def start_refused(data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", "--data-dir", str(data), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )


def repair(data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "check", "--repair", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )


POOLS = [("s", 0, "kv", 64), ("s", 0, "small", SMALL), ("s", 1, "mamba", 32), ("v", 1, "", 16)]


def assert_pools_kept_and_empty(server: ServerProcess, keys: list[str]) -> None:
    """Every pool is there, with no key, and hands out pages again."""
    got = requests.get(server.url + "/v1/pools", timeout=30).json()
    pools = sorted((p["dialect"], p["rank"], p["namespace"], p["num_pages"]) for p in got["pools"])
    assert pools == sorted(POOLS)
    assert all(p["stored"] == 0 for p in got["pools"]), got["pools"]
    assert got["vllm"]["world_size"] == 2
    for namespace in ("kv", "small"):
        body = {"keys": keys, "namespace": namespace}
        found = server.post("/0/get_page_indices", body).json()["indices"]
        assert found == [None] * len(keys)
    pages = write(server, [f"new-{i}" for i in range(SMALL)], "small")
    assert sorted(pages.values()) == list(range(SMALL))
    assert server.post("/rank/1/initialize", {"role": "worker", "num_pages": 16}).ok


def test_damage_is_refused_naming_the_repair_which_keeps_pools_and_drops_keys(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    server = serve(data, tmp_path)
    try:
        keys = fill(server)
    finally:
        server.kill()  # SIGKILL: everything is in the journal
    segment = damage_middle_record(data)
    damaged = segment.read_bytes()

    check = kvmeta_check(data)
    assert check.returncode == 1, check.stdout + check.stderr
    assert segment.name in check.stderr and "kvmeta check --repair" in check.stderr
    assert "backup" not in check.stderr and "to start from the state" not in check.stderr
    refused = start_refused(data)
    assert refused.returncode == 2, refused.stderr
    assert segment.name in refused.stderr and "kvmeta check --repair" in refused.stderr
    assert segment.read_bytes() == damaged  # the evidence is left alone

    fixed = repair(data)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "kept rank 0 namespace 'small': 8 pages, no keys" in fixed.stdout
    assert "kept vllm rank 1: 16 pages, no keys" in fixed.stdout
    retired = [p for p in data.iterdir() if p.name.startswith("retired-")]
    assert len(retired) == 1 and (retired[0] / segment.name).read_bytes() == damaged
    check = kvmeta_check(data)
    assert check.returncode == 0, check.stdout + check.stderr

    server = serve(data, tmp_path)
    try:
        assert_pools_kept_and_empty(server, keys)
    finally:
        assert server.stop() == 0
    assert kvmeta_check(data).returncode == 0


def test_repair_refuses_a_directory_a_server_holds(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = serve(data, tmp_path)
    try:
        fill(server)
        fixed = repair(data)
        assert fixed.returncode == 2
        assert "in use by a running kvmeta server" in fixed.stderr
        assert server.post("/0/exists", {"keys": ["kv-5-1"]}).json() == {"exists": [True]}
    finally:
        server.kill()


def three_runs(data: Path, cwd: Path) -> list[str]:
    """Three runs each killed with SIGKILL (no final snapshot): journal segments 1, 2 and 3,
    each with stores, deletes and evictions; every key written."""
    keys: list[str] = []
    for run in range(3):
        server = serve(data, cwd)
        try:
            if run == 0:
                keys += fill(server)
            else:
                batch = [f"run{run}-{i}" for i in range(SMALL)]
                write(server, batch, "small")  # evicts the last run's keys
                assert server.post("/0/delete_keys", {"keys": keys[:2]}).ok
                keys += batch
        finally:
            server.kill()
    assert list_data_dir(data).segments == [1, 2, 3]
    assert list_data_dir(data).snapshots == []
    return keys


def assert_gap_refused(data: Path, missing: str) -> None:
    check = kvmeta_check(data)
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"{missing}: this journal segment is missing" in check.stderr
    assert f"kvmeta check --repair --data-dir {data}" in check.stderr
    refused = start_refused(data)
    assert refused.returncode == 2, refused.stderr
    assert f"{missing}: this journal segment is missing" in refused.stderr


def test_a_missing_middle_segment_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = three_runs(data, tmp_path)
    (data / "journal-000000000002.log").unlink()
    assert_gap_refused(data, "journal-000000000002.log")
    assert repair(data).returncode == 0
    server = serve(data, tmp_path)
    try:
        assert_pools_kept_and_empty(server, keys)
    finally:
        assert server.stop() == 0


def test_a_missing_last_segment_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = three_runs(data, tmp_path)
    (data / "journal-000000000003.log").unlink()
    assert_gap_refused(data, "journal-000000000003.log")
    assert repair(data).returncode == 0
    assert list_data_dir(data).snapshots == [4]  # above the segment HEAD names
    server = serve(data, tmp_path)
    try:
        assert_pools_kept_and_empty(server, keys)
    finally:
        assert server.stop() == 0


def backup_then_go_on(data: Path, backup: Path, cwd: Path) -> list[str]:
    """A server writes keys and stops; ``backup`` is a copy of its directory (cp -a, as a
    backup tool takes it); a second run then evicts and deletes the backed-up keys and hands
    their pages to new ones. Every key written."""
    server = serve(data, cwd)
    try:
        keys = fill(server)
    finally:
        assert server.stop() == 0
    shutil.copytree(data, backup)
    server = serve(data, cwd)
    try:
        batch = [f"after-{i}" for i in range(SMALL)]
        write(server, batch, "small")  # every page of the small pool changes hands
        assert server.post("/0/delete_keys", {"keys": keys}).ok
        keys += batch
    finally:
        server.kill()
    return keys


def assert_restore_refused(data: Path, why: str) -> None:
    check = kvmeta_check(data)
    assert check.returncode == 1, check.stdout + check.stderr
    assert why in check.stderr and f"kvmeta check --repair --data-dir {data}" in check.stderr
    refused = start_refused(data)
    assert refused.returncode == 2, refused.stderr
    assert why in refused.stderr


def test_a_restored_backup_of_the_directory_is_refused(tmp_path: Path) -> None:
    data, backup = tmp_path / "data", tmp_path / "backup"
    keys = backup_then_go_on(data, backup, tmp_path)
    data.rename(tmp_path / "data.damaged")
    shutil.copytree(backup, data)  # the whole directory, HEAD and all
    assert_restore_refused(data, "this is not the directory its HEAD file was written in")
    assert repair(data).returncode == 0
    server = serve(data, tmp_path)
    try:
        assert_pools_kept_and_empty(server, keys)
    finally:
        assert server.stop() == 0


def test_older_files_restored_into_the_directory_are_refused(tmp_path: Path) -> None:
    data, backup = tmp_path / "data", tmp_path / "backup"
    backup_then_go_on(data, backup, tmp_path)
    for path in data.glob("journal-*.log"):
        path.unlink()
    for path in data.glob("snapshot-*.snap"):
        path.unlink()
    for path in backup.glob("snapshot-*.snap"):
        shutil.copy2(path, data / path.name)
    assert_restore_refused(data, "older files restored over the directory")


def test_a_backup_restored_without_head_is_refused(tmp_path: Path) -> None:
    data, backup = tmp_path / "data", tmp_path / "backup"
    backup_then_go_on(data, backup, tmp_path)
    restored = tmp_path / "restored"
    restored.mkdir()
    for path in backup.glob("snapshot-*.snap"):
        shutil.copy2(path, restored / path.name)
    assert_restore_refused(restored, "HEAD: missing, while the snapshot was written by a kvmeta")
