"""``kvmeta check`` on a directory a running server holds says so and is not "ok"."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvmeta.store.base import IN_USE, CheckReport
from kvmeta.store.disk.check import check_data_dir
from tests.support import kvmeta_check
from tests.unit.store.durable_support import S0, crash, cycle, open_backend


def test_check_on_a_directory_in_use_notes_it_and_exits_3(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="always")
        try:
            await b.initialize(S0, 8)
            await cycle(b, S0, ["a"])
            report = check_data_dir(tmp_path)
            assert report.ok and report.in_use and report.exit_code == IN_USE
            assert any("in use by a running kvmeta server" in line for line in report.lines)
            run = kvmeta_check(tmp_path)  # another process, as an operator would run it
            assert run.returncode == IN_USE, run.stdout + run.stderr
            assert "in use" in run.stdout and "not definitive" in run.stdout
            assert "\nok\n" not in run.stdout
        finally:
            await crash(b)
        report = check_data_dir(tmp_path)
        assert report.ok and not report.in_use and report.exit_code == 0
        run = kvmeta_check(tmp_path)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok")

    asyncio.run(main())


def test_check_creates_no_lock_file(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "EPOCH").write_text("0123456789abcdef0123456789abcdef\n")  # a copy, no LOCK
    assert check_data_dir(tmp_path / "d").exit_code == 0
    assert not (tmp_path / "d" / "LOCK").exists()


def test_the_offline_check_and_the_backends_check_report_in_one_class(tmp_path: Path) -> None:
    """One report class: a problem found offline reads like one found by ``GET /v1/check``."""
    report = check_data_dir(tmp_path / "missing")
    assert type(report) is CheckReport
    assert not report.ok and report.exit_code == 1 and report.checked == 0
    assert CheckReport(problems=[], checked=2).exit_code == 0
    assert CheckReport(in_use=True).summary.startswith("no problem found")
