"""SGLang persistence file: both pool-name forms import; kvmeta writes it back for rollback."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path

import pytest

from kvmeta._types import PoolId, normalize_namespace
from kvmeta.errors import StorageError
from kvmeta.store.disk.legacy import read_legacy, write_legacy
from kvmeta.store.disk.recovery import list_data_dir, recover
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state

LEGACY = {
    "0": {"num_pages": 4, "free_pages": [2, 3], "key_to_index": [["old", 1], ["new", 0]]},
    "1:mamba": {"num_pages": 2, "free_pages": [1], "key_to_index": [["m", 0]]},
}


def test_reads_both_pool_name_forms(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(LEGACY))
    assert read_legacy(path) == [
        (S0, 4, [("old", 1), ("new", 0)]),
        (PoolId("s", 1, "mamba"), 2, [("m", 0)]),
    ]


# SGLang >= 0.5.11 clients send ``str(PoolName.X)`` as the namespace; its reference server
# files each pool under that text.
ENUM_FORMS = {
    "0:PoolName.KV": PoolId("s", 0, "kv"),
    "0:PoolName.MAMBA": PoolId("s", 0, "mamba"),
    "1:PoolName.INDEXER": PoolId("s", 1, "indexer"),
    "2:PoolName.DEEPSEEK_V4_C1": PoolId("s", 2, "deepseek_v4_c1"),
}


def test_enum_pool_names_import_where_requests_find_them(tmp_path: Path) -> None:
    """A request naming ``PoolName.KV`` reaches pool ``kv``: the import files it there too."""
    path = tmp_path / "state.json"
    doc = {name: {"num_pages": 2, "key_to_index": [[name, 1]]} for name in ENUM_FORMS}
    path.write_text(json.dumps(doc))
    pools = read_legacy(path)
    assert [pid for pid, _, _ in pools] == list(ENUM_FORMS.values())
    for (pid, _, entries), name in zip(pools, ENUM_FORMS, strict=True):
        assert pid.namespace == normalize_namespace(name.partition(":")[2])
        assert entries == [(name, 1)]


@pytest.mark.parametrize("enum_first", [True, False])
def test_a_pool_under_both_names_imports_the_enum_form(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, enum_first: bool
) -> None:
    """A reference server that served SGLang before and after 0.5.11 holds pools "0:kv" and
    "0:PoolName.KV"; today's clients wrote the latter last. One pool is imported, whichever
    comes first in the file, and the other is named in a warning."""
    current = ("0:PoolName.KV", {"num_pages": 4, "key_to_index": [["new", 2]]})
    old = ("0:kv", {"num_pages": 4, "key_to_index": [["old", 2], ["older", 3]]})
    path = tmp_path / "state.json"
    path.write_text(json.dumps(dict([current, old] if enum_first else [old, current])))
    with caplog.at_level(logging.WARNING, logger="kvmeta.store.disk.legacy"):
        assert read_legacy(path) == [(S0, 4, [("new", 2)])]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "'0:kv'" in warning and "'0:PoolName.KV'" in warning and "2 keys" in warning


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ({"x": {"num_pages": 1}}, "`x`"),
        ({"0": {"num_pages": 0}}, "`0.num_pages`"),
        ({"0": {"num_pages": 2, "key_to_index": [["a"]]}}, "`0.key_to_index[0]`"),
    ],
)
def test_bad_file_names_the_place(tmp_path: Path, doc: object, where: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(StorageError, match=re.escape(where)):
        read_legacy(path)


def test_write_round_trips_and_skips_vllm_pools(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    write_legacy(path, [(S0, 3, [("a", 2)]), (PoolId("v", 0, ""), 3, [("h", 0)])])
    assert json.loads(path.read_text()) == {
        "0": {"num_pages": 3, "free_pages": [0, 1], "key_to_index": [["a", 2]]}
    }


def test_imported_on_first_start_only_and_rewritten_at_shutdown(tmp_path: Path) -> None:
    legacy = tmp_path / "state.json"
    legacy.write_text(json.dumps(LEGACY))
    data = tmp_path / "data"

    async def main() -> None:
        b = await open_backend(data, persistence_path=legacy)
        try:
            assert state(b)[S0] == (4, [("old", 1), ("new", 0)])
            assert b.store.pool(PoolId("s", 1, "mamba")).page_of("m") == 0
            await cycle(b, S0, ["x"])
        finally:
            await b.close()
        written = json.loads(legacy.read_text())
        assert written["0"]["key_to_index"] == [["old", 1], ["new", 0], ["x", 2]]
        assert written["1:mamba"]["key_to_index"] == [["m", 0]]
        legacy.write_text(json.dumps({"0": {"num_pages": 4, "key_to_index": [["z", 0]]}}))
        b = await open_backend(data, persistence_path=legacy)  # data dir wins now
        try:
            assert state(b)[S0] == (4, [("old", 1), ("new", 0), ("x", 2)])
        finally:
            await b.close()

    asyncio.run(main())


def test_the_import_is_one_snapshot_written_before_any_journal_record(tmp_path: Path) -> None:
    """All or nothing: the snapshot is renamed into place whole, and the journal starts after
    it (tests/crash/test_legacy_import.py fills the disk and kills the server half-way)."""
    legacy = tmp_path / "state.json"
    legacy.write_text(json.dumps(LEGACY))
    data = tmp_path / "data"

    async def main() -> None:
        b = await open_backend(data, persistence_path=legacy)
        try:
            listing = list_data_dir(data)
            assert listing.snapshots == [1] and listing.segments == []
            assert b.journal is not None and b.journal.records == 0
        finally:
            await crash(b)
        state = recover(data, repair=False)
        assert state.pools[S0] == (4, {"old": 1, "new": 0}) and state.records == 0

    asyncio.run(main())


def test_in_memory_mode_imports_at_every_start_and_writes_back(tmp_path: Path) -> None:
    from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
    from kvmeta.store.disk.memory import MemoryStore

    legacy = tmp_path / "state.json"
    legacy.write_text(json.dumps(LEGACY))

    async def main() -> None:
        b = LocalBackend(
            MemoryStore(read_lease=0.0),
            DurabilityOptions(data_dir=None, persistence_path=legacy, save_interval=0.05),
        )
        await b.start()
        try:
            assert b.journal is None and state(b)[S0] == (4, [("old", 1), ("new", 0)])
            await cycle(b, S0, ["x"])
            for _ in range(200):  # until a periodic save has run (every 0.05 s)
                if ["x", 2] in json.loads(legacy.read_text())["0"]["key_to_index"]:
                    break
                await asyncio.sleep(0.05)
            assert ["x", 2] in json.loads(legacy.read_text())["0"]["key_to_index"]
        finally:
            await b.close()

    asyncio.run(main())
