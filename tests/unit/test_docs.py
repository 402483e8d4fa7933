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
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore

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
    app = build_app(Settings(in_memory=True), Service(LocalBackend(MemoryStore())))
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


LINKED = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "benchmarks" / "README.md",
    *sorted(DOCS.glob("*.md")),
]
# The package index's description (pyproject's `readme`): README.md's opening for a page that
# shows the text alone, so every link in it is absolute; not a page of the docs.
INDEX_PAGE = DOCS / "pypi.md"
REPO_URL = re.compile(
    r"https://(?:github\.com/kvmeta/kvmeta/blob|raw\.githubusercontent\.com/kvmeta/kvmeta)"
    r"/main/([^)#\s]+)"
)


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


def test_the_index_description_links_absolutely_to_files_that_exist() -> None:
    """A package index shows docs/pypi.md without the repository around it: a relative link
    there leads nowhere, and a link into the repository must name a file it has."""
    targets = LINK.findall(INDEX_PAGE.read_text())
    assert targets
    relative = [t for t in targets if not t.startswith("https://")]
    assert not relative, f"docs/pypi.md: make these absolute (https://...): {relative}"
    missing = [t for t in targets if (m := REPO_URL.match(t)) and not (ROOT / m.group(1)).exists()]
    assert not missing, f"docs/pypi.md links to files the repository lacks: {missing}"


def test_every_test_the_guarantees_cite_exists() -> None:
    cited = set(re.findall(r"\b(test_\w+|Test\w+)\b", (DOCS / "guarantees.md").read_text()))
    cited = {name for name in cited if not name.endswith("_")}  # `test_failureN_...`
    source = "\n".join(f.read_text() for f in (ROOT / "tests").rglob("*.py"))
    defined = set(re.findall(r"^(?:async )?def (test_\w+)", source, re.M))
    defined |= set(re.findall(r"^(Test\w+) = ", source, re.M))
    files = {f.stem for f in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(name for name in cited if name not in defined and name not in files)
    assert not missing, f"docs/guarantees.md cites tests that do not exist: {missing}"


README_LIMIT = 12_288  # bytes: the README stays an entry page; the rest lives in docs/


def test_readme_stays_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, more than {README_LIMIT}: move the detail into a docs/ page "
        "and link it from the README's documentation table"
    )


def test_readme_names_the_two_commands_and_the_install() -> None:
    text = (ROOT / "README.md").read_text()
    for needle in ("./scripts/test", "kvmeta serve", "python3 -m venv .venv"):
        assert needle in text, f"README.md must show `{needle}`"


def test_every_docs_page_is_linked_from_both_indexes() -> None:
    readme = (ROOT / "README.md").read_text()
    index = (DOCS / "README.md").read_text()
    pages = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and p != INDEX_PAGE]
    unlinked = [f"README.md: {p}" for p in pages if f"(docs/{p}" not in readme]
    unlinked += [f"docs/README.md: {p}" for p in pages if f"({p}" not in index]
    assert not unlinked, f"link these pages: {unlinked}"


def test_every_serve_flag_is_in_the_flags_page() -> None:
    from kvmeta.cli import build_parser

    parser = build_parser()
    text = (DOCS / "flags.md").read_text()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    serve = sub.choices["serve"]  # type: ignore[attr-defined]
    flags = [s for a in serve._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) >= 30
    missing = [flag for flag in flags if flag != "--help" and f"`{flag}" not in text]
    assert not missing, f"document these flags in docs/flags.md: {missing}"


def _mermaid_blocks() -> list[str]:
    blocks = []
    for page in LINKED:
        blocks += re.findall(r"^```mermaid\n(.*?)^```", page.read_text(), re.M | re.S)
    return blocks


def test_the_diagrams_are_there() -> None:
    kinds = {block.split(None, 1)[0] for block in _mermaid_blocks()}
    assert {"flowchart", "sequenceDiagram"} <= kinds, f"diagrams found: {sorted(kinds)}"


# Words that describe who worked on the project, not the project. Spelled in pieces so that
# this file does not match itself.
PEOPLE = re.compile(r"\b(" + "sess" + r"ions?|help" + r"ers\b|the le" + r"ad\b)", re.I)


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_talk_about_the_project_only(page: Path) -> None:
    found = [m.group(0) for m in PEOPLE.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)} mentions {found}: describe the project instead"


def test_benchmarks_keep_one_current_table_per_benchmark() -> None:
    text = (ROOT / "benchmarks" / "README.md").read_text()
    words = ("Before/after", "Earlier results", "What changed", "used to")
    history = [w for w in words if w in text]
    assert not history, f"benchmarks/README.md keeps history: {history}; keep the current table"
    assert "## Scripts" in text


def test_journal_failure_sections_are_in_place() -> None:
    for page in ("troubleshooting.md", "durability.md"):
        assert "journal-failures" in _anchors(DOCS / page), f"docs/{page}: ## Journal failures"


# Microseconds are measurements of one machine: the user pages say what a thing does and link
# to benchmarks/README.md, which holds the figures with the commands that reproduce them.
MICROSECONDS = re.compile(r"\b\d[\d.,]*(?:-\d[\d.,]*)? ?(?:us|µs)\b")
USER_PAGES = [ROOT / "README.md", *(p for p in sorted(DOCS.glob("*.md")) if p.name != "testing.md")]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_leave_microsecond_figures_to_the_benchmarks(page: Path) -> None:
    found = MICROSECONDS.findall(page.read_text())
    assert not found, (
        f"{page.relative_to(ROOT)} quotes {found}: move the figure to benchmarks/README.md "
        "(with the command that reproduces it) and link the section instead"
    )


def _layout_section() -> str:
    text = (DOCS / "architecture.md").read_text()
    start = text.index("## Layout")
    return text[start : text.index("\n## ", start + 1)]


def test_the_architecture_layout_names_every_module() -> None:
    """A newcomer finds each module of the layered packages in docs/architecture.md's table."""
    layout = _layout_section()
    packages = ("core", "store", "service", "server", "events")
    src = ROOT / "src" / "kvmeta"
    modules = [m for pkg in packages for m in sorted((src / pkg).rglob("*.py"))]
    modules += [src / "config.py", src / "config_values.py", src / "errors.py"]
    missing = [
        str(m.relative_to(src))
        for m in modules
        if m.name != "__init__.py" and not re.search(rf"[`/]{re.escape(m.name)}`", layout)
    ]
    assert not missing, f"name these modules in docs/architecture.md's Layout table: {missing}"
