"""The operator-facing half of the ``Backend`` protocol: ``describe``, ``failure``,
``durability_stats`` and ``check`` are answered by every backend itself (the server calls them
plainly, it does not probe for them)."""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.store.base import Backend, CheckReport
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.redis.backend import RedisBackend
from tests.contract.conftest import Sync
from tests.unit.store.durable_support import crash, open_backend

S0 = PoolId("s", 0, "kv")
V0 = PoolId("v", 0, "")

_MEMBERS = sorted(
    {name for name in vars(Backend) if not name.startswith("_")} | set(Backend.__annotations__)
)


@pytest.mark.parametrize("cls", [LocalBackend, RedisBackend])
def test_every_backend_class_defines_every_protocol_member(cls: type) -> None:
    """On the class, not set per instance: a member the class lacks is a type error, not a
    ``getattr`` default the server falls back to."""
    missing = [name for name in _MEMBERS if not hasattr(cls, name)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name in ("check", "ready", "stats"):
        assert inspect.iscoroutinefunction(getattr(cls, name)), name
    assert not inspect.iscoroutinefunction(cls.durability_stats)


def test_every_backend_answers_the_operator_calls(backend: Sync) -> None:
    b = backend.backend
    # Never a URL's credentials (a temporary path may hold any letters, so look for the form).
    assert b.describe and not re.search(r"://[^/\s]*@", b.describe), b.describe
    assert b.failure is None
    if backend.kind == "durable":  # its journal's series in /metrics
        assert b.durability_stats()["journal_failed"] == 0
    else:
        assert b.durability_stats() == {}  # nothing kept on a local disk: no series in /metrics
    assert backend._run(b.check()) == CheckReport(problems=[], checked=0)
    backend.initialize(S0, 4)
    backend.v_register(0, 4, None)
    [(_, page)] = backend.reserve(S0, ["k"])
    backend.confirm(S0, [("k", page)], [])
    report = backend._run(b.check())
    assert report == CheckReport(problems=[], checked=2) and report.ok


def test_the_memory_check_names_a_broken_pool() -> None:
    backend = LocalBackend(MemoryStore())
    backend.store.initialize(S0, 4)
    backend.store.reserve(S0, ["a"])
    pool = backend.store.pool(S0)
    pool._stored["ghost"] = 3  # a key on a page the pool does not count as stored

    report = asyncio.run(backend.check())
    assert not report.ok and report.checked == 1
    assert len(report.problems) == 1 and report.problems[0].startswith(f"{S0}: ")


def test_the_memory_backend_describes_itself() -> None:
    assert LocalBackend(MemoryStore()).describe == "memory"


def test_the_durable_backend_reports_its_journal(tmp_path: Path) -> None:

    async def main() -> None:
        b = await open_backend(tmp_path)
        try:
            assert str(tmp_path) in b.describe and b.failure is None
            await b.initialize(S0, 4)
            stats = b.durability_stats()
            assert stats["journal_records"] == 1 and stats["journal_failed"] == 0
            assert await b.check() == CheckReport(problems=[], checked=1)
        finally:
            await crash(b)

    asyncio.run(main())
