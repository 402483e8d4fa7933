"""``deploy/prometheus/alerts.yml``: the rules an operator needs are there, each complete, and
every metric their expressions name is one a live ``kvmeta serve`` exposes on ``/metrics``
(a data-directory server and a Redis-backed one together), or ``up``, which Prometheus itself
records. ``promtool check rules`` runs too where promtool is installed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import InProcessServer, Server

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_OWN = {"up"}  # recorded by Prometheus for each scrape, not exposed by a target

# PromQL words that are not metric names.
KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan", "sum", "min", "max", "avg", "count", "stddev", "stdvar",
    "topk", "bottomk", "quantile", "count_values", "group",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORD = re.compile(r"(?<![\w:.])[A-Za-z_:][\w:]*")


def metric_names(expr: str) -> list[str]:
    """The metric names a PromQL expression selects: not functions, keywords, label names in
    matchers or grouping lists, label values, durations or numbers."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    names = []
    for match in _WORD.finditer(text):
        word = match.group(0)
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if word.lower() in KEYWORDS or re.fullmatch(r"\d.*", word):
            continue
        names.append(word)
    return names


def alert_rules() -> list[dict[str, str]]:
    """Each ``- alert:`` with the keys under it (the file keeps each expression on one line,
    so no YAML library is needed)."""
    rules: list[dict[str, str]] = []
    for line in ALERTS.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("- alert:"):
            rules.append({"alert": stripped.split(":", 1)[1].strip()})
        elif rules and ":" in stripped and not stripped.startswith("#"):
            key, value = stripped.split(":", 1)
            rules[-1].setdefault(key.strip(), value.strip())
    return rules


def _exposed(server: Server) -> set[str]:
    assert requests.get(server.url + "/ready", timeout=30).status_code == 200
    server.post("/0/initialize", {"num_pages": 8})
    text = requests.get(server.url + "/metrics", timeout=30).text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def exposed(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[set[str]]:
    """Sample names of /metrics: a server with a data directory (journal series) and one on
    Redis (replication series, after a readiness probe)."""
    names: set[str] = set()
    for args in (["--data-dir", str(tmp_path_factory.mktemp("alerts"))], ["--backend", redis_url]):
        server = InProcessServer(*args, cwd=tmp_path_factory.mktemp("cwd")).start()
        try:
            names |= _exposed(server)
        finally:
            server.stop()
    yield names


def test_the_rules_an_operator_needs_are_there() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert {
        "KvmetaDown",
        "KvmetaNotReady",
        "KvmetaJournalFailed",
        "KvmetaRedisReplicasLow",
        "KvmetaFileDescriptorsNearLimit",
        "KvmetaNoHitsWhileWriting",
    } <= set(names)
    for rule in rules:
        assert {"expr", "for", "severity", "summary", "description"} <= set(rule), rule
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        assert metric_names(rule["expr"]), f"{rule['alert']} selects no metric"


def test_every_alerted_metric_is_exposed(exposed: set[str]) -> None:
    missing = []
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            if name in exposed or name in PROMETHEUS_OWN:
                continue
            hint = " (counters are exposed as NAME_total)" if name + "_total" in exposed else ""
            missing.append(f"{rule['alert']}: {name}{hint}")
    assert not missing, "metrics not in /metrics:\n" + "\n".join(missing)
    assert {"process_open_fds", "process_max_fds", "kvmeta_redis_replicas_min"} <= exposed


def test_the_name_parser_finds_names_and_only_names() -> None:
    expr = (
        'sum by (instance, le) (rate(kvmeta_a_bucket{x="kvmeta_b",op=~"g.*"}[5m] offset 1h)) '
        "> 2 * process_open_fds / on(job) group_left process_max_fds or absent(up{job='k'}) "
        "and kvmeta_c == bool 0.8"
    )
    assert metric_names(expr) == [
        "kvmeta_a_bucket",
        "process_open_fds",
        "process_max_fds",
        "up",
        "kvmeta_c",
    ]
