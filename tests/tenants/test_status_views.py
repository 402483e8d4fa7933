"""``/v1/status`` and ``/v1/pools`` give a tenant's admin token its own tenant's view, as
``/metrics`` does: its pools, the backend's kind and readiness; never the data directory or
the server-wide journal, fsync, snapshot and replication numbers, which the operator's token
(``--auth-token``) sees."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import Server
from tests.tenants.conftest import OPERATOR, Client, token

SERVER_WIDE = (
    "data_dir",
    "journal_failed",
    "last_fsync_seconds_ago",
    "journal_segment_bytes",
    "snapshot_age_seconds",
    "fsync",
    "role",
    "replicas",
)


def _status(client: Client, pools: int) -> dict[str, Any]:
    """``/v1/status`` once its pool rows (sampled every 2 s) show ``pools`` pools and the key
    stored in teamA's."""
    deadline = time.monotonic() + 30
    while True:
        doc: dict[str, Any] = client.get("/v1/status").json()
        stored = sum(p["stored"] for p in doc["pools"])
        if (len(doc["pools"]), stored) == (pools, 1) or time.monotonic() > deadline:
            return doc
        time.sleep(0.1)


def test_a_tenant_token_sees_its_own_view_and_the_operator_everything(
    tmp_path: Path, tenant_app: Callable[..., Server]
) -> None:
    data = tmp_path / "data-dir-of-the-operator"
    server = tenant_app("--data-dir", str(data), "--fsync", "always")
    op, a = Client(server.url, OPERATOR), Client(server.url, token("a_admin"))
    assert a.post("/0/initialize", {"num_pages": 4}).status_code == 204
    assert Client(server.url, token("b_admin")).post("/1/initialize", {"num_pages": 8}).ok
    reserved = a.post("/0/reserve_and_allocate_page_indices", {"keys": [["k", None]]}).json()
    page = reserved["indices"][0][1]
    assert a.post("/0/confirm_write", {"written_keys_to_confirm": [["k", page]]}).ok

    everything = _status(op, 2)
    backend = everything["backend"]
    assert backend["data_dir"] == str(data)
    assert backend["fsync"] == "always" and backend["journal_failed"] is False
    assert backend["durability"]["journal_records"] >= 3
    assert backend["durability"]["fsyncs"] >= 1
    assert everything["server"]["durability"] == str(data)
    assert str(data) in everything["server"]["backend"]
    assert {p["tenant"] for p in everything["pools"]} == {"teamA", "teamB"}

    doc = _status(a, 1)
    assert str(data) not in str(doc)
    assert doc["backend"]["durability"] == {}
    assert {k: doc["backend"][k] for k in SERVER_WIDE} == dict.fromkeys(SERVER_WIDE)
    assert doc["backend"]["describe"] == doc["backend"]["name"] == "memory+journal"
    assert doc["backend"]["ready"] is True
    assert doc["server"]["durability"] == doc["server"]["backend"] == "memory+journal"
    assert [(p["tenant"], p["rank"], p["stored"]) for p in doc["pools"]] == [("teamA", 0, 1)], doc
    assert doc["history"]["t"] == []  # every tenant's request rates together: the operator's

    pools = a.get("/v1/pools")
    assert str(data) not in pools.text
    assert pools.json()["server"]["durability"] == "memory+journal"
    assert [p["tenant"] for p in pools.json()["pools"]] == ["teamA"]
    assert op.get("/v1/pools").json()["server"]["durability"] == str(data)
