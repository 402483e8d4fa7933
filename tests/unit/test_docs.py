"""The documentation stands alone and keeps up with the code: nothing points outside the
repository, every route the server registers is in docs/protocol.md, every relative link
resolves (anchors into docs/ included), and every test docs/guarantees.md cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvmeta.config import Settings
from kvmeta.server.runner import build_app
from kvmeta.service.ops import Service
from kvmeta.store.memory import MemoryBackend, MemoryStore

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Spelled in pieces so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "SEMANTICS" + ".md", "PROTOCOL" + ".md")
SCANNED = ("README.md", "docs", "src", "tests", "benchmarks")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for file in sorted(path.rglob("*")):
            generated = "__pycache__" in file.parts or file.parent.name.endswith(".egg-info")
            if file.is_file() and not generated and file.suffix != ".pyc":
                files.append(file)
    return files


def test_nothing_points_outside_the_repository() -> None:
    found = []
    for file in _text_files():
        text = file.read_bytes().decode("utf-8", errors="ignore")
        for needle in FORBIDDEN:
            if needle in text:
                found.append(f"{file.relative_to(ROOT)}: {needle}")
    assert not found, f"point these at docs/protocol.md or docs/guarantees.md instead: {found}"


def _registered_routes() -> list[tuple[str, str]]:
    app = build_app(Settings(in_memory=True), Service(MemoryBackend(MemoryStore())))
    return app.routes()


def test_every_registered_route_is_in_the_protocol_page() -> None:
    text = (DOCS / "protocol.md").read_text()
    routes = _registered_routes()
    assert len(routes) >= 22  # both dialects and the operator routes
    missing = [
        f"{method} {pattern}"
        for method, pattern in routes
        if f"`{pattern}`" not in text and f"`{method} {pattern}`" not in text
    ]
    assert not missing, f"document these routes in docs/protocol.md: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


LINKED = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
            continue
        # Anchors are checked where the target is a page of docs/ (its headings are ours).
        if anchor and dest.parent == DOCS and dest.suffix == ".md":
            if anchor not in _anchors(dest):
                broken.append(f"{target} (no such heading in {dest.name})")
    assert not broken, f"broken links in {page.relative_to(ROOT)}: {broken}"


def test_every_test_the_guarantees_cite_exists() -> None:
    cited = set(re.findall(r"\b(test_\w+|Test\w+)\b", (DOCS / "guarantees.md").read_text()))
    cited = {name for name in cited if not name.endswith("_")}  # `test_failureN_...`
    source = "\n".join(f.read_text() for f in (ROOT / "tests").rglob("*.py"))
    defined = set(re.findall(r"^(?:async )?def (test_\w+)", source, re.M))
    defined |= set(re.findall(r"^(Test\w+) = ", source, re.M))
    files = {f.stem for f in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(name for name in cited if name not in defined and name not in files)
    assert not missing, f"docs/guarantees.md cites tests that do not exist: {missing}"
