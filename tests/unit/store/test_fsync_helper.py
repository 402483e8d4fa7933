"""The journal's fsync helper process: restarted when it dies, failures reach the waiters."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from kvmeta.errors import StorageError
from kvmeta.store.disk import fsync_link
from kvmeta.store.disk.recovery import recover
from tests.unit.store.durable_support import S0, open_backend, state


def test_a_killed_helper_is_replaced_and_nothing_is_lost(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path / "data", fsync="batch")
        j = b.journal
        assert j is not None and j._helper is not None
        try:
            await b.initialize(S0, 16)
            first = j._helper.pid
            os.kill(first, signal.SIGKILL)
            for _ in range(200):  # the loop notices the exit and starts a new helper
                await asyncio.sleep(0.01)
                if j._helper is not None and j._helper.pid != first:
                    break
            assert j._helper is not None and j._helper.pid != first
            out = await b.reserve(S0, ["a", "b"])
            await b.confirm(S0, [("a", out[0][1]), ("b", out[1][1])], [])
            seq = j.seq
            await j.wait(seq)  # durable through the new helper
            assert j.durable_seq >= seq
            expected = state(b)
        finally:
            await b.close()
        recovered = recover(tmp_path / "data", repair=False)
        assert dict(recovered.pools[S0][1]) == dict(expected[S0][1])

    asyncio.run(main())


def test_helper_stops_when_the_journal_closes(tmp_path: Path) -> None:
    async def main() -> int:
        b = await open_backend(tmp_path / "data", fsync="batch")
        assert b.journal is not None and b.journal._helper is not None
        helper = b.journal._helper.process
        await b.close()
        return helper.wait(timeout=5)

    assert asyncio.run(main()) == 0


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("import sys; sys.exit(3)", r"fsync helper process \(.*\) exited \(code 3\) 5 times"),
        (
            "import os\nwhile os.read(0, 65536): os.write(1, b'E disk on fire\\n')",
            "cannot fsync the journal",
        ),
    ],
)
def test_a_broken_helper_fails_the_waiters_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, message: str
) -> None:
    fake = tmp_path / "helper.py"
    fake.write_text(script)
    monkeypatch.setattr(fsync_link, "HELPER", str(fake))

    async def main() -> None:
        b = await open_backend(tmp_path / "data", fsync="batch")
        try:
            with pytest.raises(StorageError, match=message) as info:
                await asyncio.wait_for(b.initialize(S0, 16), timeout=10)
            assert "recovers by itself" in str(info.value)
            assert b.journal is not None
            with pytest.raises(StorageError):  # and stays failed: no write after a failure
                await b.journal.wait(b.journal.seq + 1)
        finally:
            await b.close()

    asyncio.run(main())


def test_never_mode_starts_no_helper(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path / "data", fsync="never")
        try:
            assert b.journal is not None and b.journal._helper is None
            await b.initialize(S0, 8)
        finally:
            await b.close()
        assert S0 in recover(tmp_path / "data", repair=False).pools

    asyncio.run(main())


def test_helper_runs_without_site_packages(tmp_path: Path) -> None:
    """It is started with ``-I -S``: it must need nothing beyond the standard library."""
    import subprocess

    target = tmp_path / "f"
    target.write_bytes(b"x")
    proc = subprocess.run(
        [sys.executable, "-I", "-S", fsync_link.HELPER],
        input=f"7 {target}\n".encode(),
        capture_output=True,
        timeout=20,
        check=True,
    )
    seq, micros = proc.stdout.split()
    assert int(seq) == 7 and int(micros) >= 0
