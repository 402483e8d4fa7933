"""``deploy/grafana``: the dashboard imports unchanged (a datasource input, unique panel ids,
a grid position and queries for every panel) and every metric that a panel or the instance
variable names is one that ``/metrics`` of a live ``kvmeta serve`` exposes (the alert rules:
test_alert_rules.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvmeta.client.sglang import Hf3fsGlobalMetadataClient
from tests.support import InProcessServer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvmeta.json"
TOKEN = "grafana-test-token"
METRIC = re.compile(r"(?<![A-Za-z0-9_:$])(kvmeta_[A-Za-z0-9_:]+)")
DS_UID = "${DS_PROMETHEUS}"


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in doc["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside
    return out


def _expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every query the dashboard holds."""
    doc = _dashboard()
    exprs = [
        (f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
        for p in _panels(doc)
        for t in p.get("targets", [])
    ]
    for var in doc["templating"]["list"]:
        query = var["query"]
        exprs.append(
            (f"variable {var['name']}", query["query"] if isinstance(query, dict) else query)
        )
    return exprs


def test_dashboard_is_importable_as_is() -> None:
    doc = _dashboard()
    (source,) = doc["__inputs"]
    assert source["type"] == "datasource" and source["pluginId"] == "prometheus"
    assert "${" + source["name"] + "}" == DS_UID
    assert isinstance(doc["schemaVersion"], int) and doc["schemaVersion"] >= 36
    assert doc["title"] and doc["uid"] and doc["id"] is None  # a new dashboard on import
    panels = _panels(doc)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    assert len(panels) >= 10
    cells: set[tuple[int, int]] = set()
    for p in panels:
        grid = p["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        for dx in range(grid["w"]):
            for dy in range(grid["h"]):
                cell = (grid["x"] + dx, grid["y"] + dy)
                assert cell not in cells, f"panel {p['title']!r} overlaps another at {cell}"
                cells.add(cell)
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == DS_UID, p["title"]
        targets = p["targets"]
        assert targets, f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in targets:
            assert t["datasource"]["uid"] == DS_UID and t["expr"].strip(), p["title"]
    for var in doc["templating"]["list"]:
        assert var["datasource"]["uid"] == DS_UID


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Sample name -> metric type of /metrics on a server with a data directory (journal
    metrics), auth on (auth failures) and a few requests served (pool series)."""
    data = tmp_path_factory.mktemp("grafana-data")
    server = InProcessServer("--data-dir", str(data), "--auth-token", TOKEN).start()
    try:
        client = Hf3fsGlobalMetadataClient(server.url, auth_token=TOKEN)
        client.initialize(0, 16)
        got = client.reserve_and_allocate_page_indices(0, [("a", None), ("b", None)])
        client.confirm_write(0, [("a", got[0][1])], [got[1][1]])
        client.get_page_indices(0, ["a", "zz"])
        client.exists(0, ["a"])
        assert requests.get(server.url + "/v1/pools", timeout=30).status_code == 401
        text = requests.get(server.url + "/metrics", auth=("", TOKEN), timeout=30).text
    finally:
        server.stop()
    samples: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = family.type
    yield samples


def test_every_queried_metric_is_exposed(exposed: dict[str, str]) -> None:
    missing = []
    for where, expr in _expressions():
        names = METRIC.findall(expr)
        assert names, f"{where} queries no kvmeta metric: {expr}"
        for name in names:
            if name not in exposed:
                hint = ""
                if name + "_total" in exposed:
                    hint = f" (counters are exposed as {name}_total)"
                elif name + "_bucket" in exposed:
                    hint = " (a histogram: query _bucket, _sum or _count)"
                missing.append(f"{where}: {name}{hint}")
            elif name.endswith("_bucket"):
                assert "histogram_quantile" in expr, f"{where}: buckets outside a quantile"
    assert not missing, "metrics not in /metrics:\n" + "\n".join(missing)


def test_the_name_check_catches_a_wrong_name(exposed: dict[str, str]) -> None:
    """The check above is not vacuous: bare histogram and counter names are not series."""
    assert "kvmeta_http_request_duration_seconds" not in exposed
    assert "kvmeta_http_request_duration_seconds_bucket" in exposed
    assert "kvmeta_pool_evictions" not in exposed and "kvmeta_pool_evictions_total" in exposed
    assert METRIC.findall('rate(kvmeta_a_total{x="kvmeta_b"}[5m])') == [
        "kvmeta_a_total",
        "kvmeta_b",
    ]
