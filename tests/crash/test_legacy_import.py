"""The first-start import of an SGLang persistence file is all or nothing, for real: a disk that
fills up half-way through it, or a SIGKILL in the middle of writing it, leaves a data directory
the next start imports again, never a part of the file taken for the whole."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from kvmeta.store.disk.recovery import list_data_dir
from tests.crash.faults import fill, small_filesystem
from tests.support import ServerProcess, child_env, kvmeta_check

KEYS = 200_000
PAGES = 262_144


@pytest.fixture(scope="module")
def legacy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SGLang reference server's file: one pool of 200,000 keys (64 hex digits, as SGLang's
    page hashes), coldest first."""
    path = tmp_path_factory.mktemp("sglang") / "hf3fs_meta.json"
    pairs = [[f"{i:064x}", (i * 7) % PAGES] for i in range(KEYS)]
    path.write_text(
        json.dumps({"0": {"num_pages": PAGES, "free_pages": [], "key_to_index": pairs}})
    )
    return path


def serve_args(data: Path, legacy: Path) -> list[str]:
    return ["--data-dir", str(data), "--persistence-path", str(legacy), "--save-interval", "0"]


def start_fails(data: Path, legacy: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", *serve_args(data, legacy), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )


def assert_whole_import(data: Path, legacy: Path, cwd: Path) -> None:
    """A start finds every key of the file, on its page; and so does the next one."""
    for _ in range(2):
        server = ServerProcess(*serve_args(data, legacy), cwd=cwd).start(timeout=300)
        try:
            pools = requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]
            assert [(p["namespace"], p["stored"]) for p in pools] == [("kv", KEYS)]
            sample = [f"{i:064x}" for i in range(0, KEYS, 997)]
            got = server.post("/0/get_page_indices", {"keys": sample}).json()["indices"]
            assert got == [(i * 7) % PAGES for i in range(0, KEYS, 997)]
        finally:
            assert server.stop(timeout=120) == 0
    check = kvmeta_check(data)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_disk_that_fills_during_the_import_leaves_it_to_the_next_start(
    tmp_path: Path, legacy: Path
) -> None:
    with small_filesystem(tmp_path / "fs", "64m") as fs:
        data = fs / "data"
        filler = fill(fs, leave=8 * 1024 * 1024)  # the import needs about 15 MB
        failed = start_fails(data, legacy)
        assert failed.returncode != 0
        assert "No space left on device" in failed.stderr, failed.stderr
        assert "recovers by itself" not in failed.stderr
        assert "the import runs again at the next start" in failed.stderr
        assert list_data_dir(data).empty  # nothing of the import was kept
        filler.unlink()
        assert_whole_import(data, legacy, tmp_path)


def test_a_kill_while_the_import_is_written_leaves_it_to_the_next_start(
    tmp_path: Path, legacy: Path
) -> None:
    """SIGKILL at the second write into the file the import is written to (strace injects it
    at that system call: a deterministic point in the middle of the write)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("this test needs strace (apt-get install strace) to kill at a chosen write")
    data = tmp_path / "data"
    targets = [data / "journal-000000000001.log", data / "snapshot-000000000001.snap.tmp"]
    paths = [arg for target in targets for arg in ("-P", str(target))]
    killed = subprocess.run(
        [strace, "-f", "-qq", "-o", "/dev/null", *paths, "-e", "trace=write",
         "-e", "inject=write:signal=SIGKILL:when=2",
         sys.executable, "-m", "kvmeta", "serve", *serve_args(data, legacy), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )  # fmt: skip
    assert killed.returncode == -9 or killed.returncode == 137, killed.stderr
    assert any(target.exists() for target in targets)  # killed in the middle of writing it
    assert_whole_import(data, legacy, tmp_path)
