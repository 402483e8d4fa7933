"""``kvmeta bench`` as a new user meets it: errors, defaults, help, and what the report shows.

Real processes throughout (the bench command, the servers it drives); no timing assertions.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import SRC, ServerProcess, unused_port

ROOT = Path(__file__).resolve().parents[2]
_ENV = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}


def _run(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=_ENV, cwd=ROOT
    )


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return _run("-m", "kvmeta", "bench", *args, timeout=timeout)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_nothing_listening_at_url_is_one_clear_line(mode: str) -> None:
    url = f"http://127.0.0.1:{unused_port()}"
    proc = _bench(mode, "--url", url, "--duration", "1", "--values", "512", timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert url in lines[0]
    assert "kvmeta serve" in lines[0] and "--launch" in lines[0]
    assert proc.stdout == ""


def test_a_url_that_is_not_http_is_one_clear_line() -> None:
    proc = _bench("--url", "https://127.0.0.1:1", timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert len(_lines(proc.stderr)) == 1 and "--url" in proc.stderr


def test_sweep_without_matplotlib_fails_before_any_work(tmp_path: Path) -> None:
    stem = tmp_path / "sweep"
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kvmeta.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = _run(
        "-c",
        code,
        *("bench", "sweep", "--launch", "memory", "--values", "512", "--duration", "0.5"),
        *("--warmup", "0.1", "--clients", "1", "--out", str(stem)),
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "pip install 'kvmeta[bench]'" in proc.stderr
    assert len(_lines(proc.stderr)) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []  # no JSON, no PNG: nothing was run


@pytest.mark.parametrize("dialect", ["s", "v"])
def test_an_existing_pool_of_another_size_is_reported_as_measured(
    make_server: Callable[..., ServerProcess], dialect: str
) -> None:
    server = make_server("--in-memory", "--read-lease", "0")
    if dialect == "s":
        assert server.post("/0/initialize", {"num_pages": 8}).status_code == 204
    else:
        body = {"role": "worker", "num_pages": 8}
        assert server.post("/rank/0/initialize", body).status_code == 200
    common = ("--url", server.url, "--dialect", dialect, "--clients", "1", "--batch", "4")
    proc = _bench(*common, "--requests", "40", "--warmup", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["config"]["pool_pages"] == 8
    assert report["config"]["pool_pages_requested"] == 65536
    assert "8 pages" in proc.stderr and "65536" in proc.stderr
    # The table's pool column shows the measured pool too.
    proc = _bench(*common, "--requests", "40", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    header, row = _lines(proc.stdout)[:2]
    assert dict(zip(header.split(), row.split(), strict=False))["pool"] == "8"


def test_the_documented_first_command_measures_eviction_not_refusals() -> None:
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    first = next(line for line in readme.splitlines() if line.startswith("python -m kvmeta bench"))
    argv = first.split("#")[0].split()[4:]  # after "python -m kvmeta bench"
    assert argv == ["--launch"]
    proc = _bench(*argv, "--duration", "1", "--warmup", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["requests"] > 0
    assert report["refused_keys"] == 0, proc.stderr
    assert "--read-lease=0" in report["config"]["server_args"]


def test_refused_keys_are_printed_with_the_fix(make_server: Callable[..., ServerProcess]) -> None:
    # A read lease far longer than the run on a pool this cycle turns over many times: once
    # every page has been read, reserves find nothing evictable and keys are refused.
    server = make_server("--in-memory", "--read-lease", "600")
    args = ("--url", server.url, "--pool-pages", "128", "--clients", "1", "--batch", "64")
    proc = _bench(*args, "--requests", "100", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"(\d+) of (\d+) measured keys were refused", proc.stdout)
    assert match, proc.stdout
    assert 0 < int(match.group(1)) <= int(match.group(2))
    assert "--pool-pages 1048576" in proc.stdout and "--read-lease 0" in proc.stdout


def _help_blocks(text: str) -> dict[str, str]:
    """Each option's help block of an argparse help text, keyed by its first option string."""
    blocks: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  ") and not line.startswith("   ") and stripped.startswith("-"):
            current = stripped.split()[0].rstrip(",")
            blocks[current] = stripped
        elif line.startswith("  ") and not line.startswith("   ") and stripped.startswith("{"):
            current = "mode"
            blocks[current] = stripped
        elif current and line.startswith("    "):
            blocks[current] += " " + stripped
        else:
            current = ""
    return blocks


@pytest.mark.parametrize("mode", ["", "run", "sweep", "core", "noisy"])
def test_bench_help_lists_choices_and_defaults_for_every_flag(mode: str) -> None:
    proc = _bench(*filter(None, [mode]), "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    blocks = _help_blocks(proc.stdout)
    assert "--dialect" in blocks and "--pool-pages" in blocks and "mode" in blocks
    for name, block in blocks.items():
        if name == "-h":
            continue
        assert "default" in block, f"{name}: {block}"
    assert "{run,sweep,pair,core,noisy}" in blocks["mode"]
    assert "{durable,memory,redis}" in blocks["--b-launch"]
    assert "{abba,ab}" in blocks["--order"] and "default: 5" in blocks["--rounds"]
    assert "{s,v}" in blocks["--dialect"] and "default: s" in blocks["--dialect"]
    assert "{durable,memory,redis}" in blocks["--launch"]
    assert "{tcp,unix}" in blocks["--redis-transport"]
    assert "{pool,batch,clients,rate}" in blocks["--sweep"]
    assert "default: 64" in blocks["--batch"]


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")), ids=str
)
def test_every_benchmark_script_answers_help_without_running(script: str) -> None:
    proc = _run(str(ROOT / "benchmarks" / script), "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower(), proc.stdout
    assert "us/request" not in proc.stdout  # nothing was measured
