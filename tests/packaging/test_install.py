"""The product as users get it: the sdist and wheel built as a release would be, the wheel
installed into fresh venvs (no extras, then each extra alone), and its ``kvmeta`` command run
for real: a durable server answering one request of each dialect, ``status``, ``bench``,
``check``, the in-process clients, and the one-line message of each feature whose extra is
missing. Builds and installs go through scripts/package (constraints/test.txt's pins, so the
run is reproducible), the script the Dockerfile runs too.
"""

from __future__ import annotations

import email
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.support import SRC, unused_port

ROOT = SRC.parent

# Builds and installs, as the Dockerfile does them.
PACKAGE = ROOT / "scripts" / "package"
EXTRAS = ("redis", "events", "bench")
# The message a feature gives when its extra is not installed (errors.MissingExtra).
NEEDS = {
    "redis": ["serve", "--backend", "redis://127.0.0.1:1/0"],
    "events": ["events", "tcp://127.0.0.1:1", "--timeout", "1"],
    "bench": ["bench", "sweep", "--launch", "memory", "--values", "512", "--out", "chart"],
}


def _env() -> dict[str, str]:
    """The environment a user's shell has: none of this checkout on the path, no KVMETA_*."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVMETA_", "PYTHON", "VIRTUAL_ENV", "PIP_"))
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(*argv: str | Path, cwd: Path | None = None, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, env=_env(), cwd=cwd,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done.stdout


@dataclass
class Dist:
    wheel: Path
    sdist: Path


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    out = tmp_path_factory.mktemp("dist")
    _run(PACKAGE, "build", sys.executable, out, timeout=600)
    (wheel,) = out.glob("kvmeta-*.whl")
    (sdist,) = out.glob("kvmeta-*.tar.gz")
    return Dist(wheel, sdist)


@dataclass
class Venv:
    path: Path

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name

    def kvmeta(self, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin("kvmeta")), *argv], capture_output=True, text=True, env=_env(),
            cwd=cwd, timeout=180,
        )  # fmt: skip


def _venv(tmp: Path, dist: Dist, extra: str | None) -> Venv:
    venv = Venv(tmp / "venv")
    _run(sys.executable, "-m", "venv", venv.path)
    _run(PACKAGE, "install", venv.bin("python"), dist.wheel, extra or "", timeout=600)
    return venv


@pytest.fixture(scope="module")
def bare(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    return _venv(tmp_path_factory.mktemp("bare"), dist, None)


class Served:
    """``kvmeta serve`` from a venv, stopped with SIGTERM at the end."""

    def __init__(self, venv: Venv, *argv: str, cwd: Path) -> None:
        self.port = unused_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cwd / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(venv.bin("kvmeta")), "serve", "--port", str(self.port), *argv],
                stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=cwd,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if requests.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def post(self, path: str, body: object) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=10)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0, self.log.read_text()


def _one_request_of_each_dialect(server: Served) -> None:
    assert server.post("/0/initialize", {"num_pages": 8, "namespace": "kv"}).status_code == 204
    got = server.post(
        "/0/reserve_and_allocate_page_indices", {"keys": [["k1", ""]], "namespace": "kv"}
    ).json()
    assert got == {"indices": [[False, 0]]}
    confirm = {"written_keys_to_confirm": [["k1", 0]], "pages_to_release": [], "namespace": "kv"}
    assert server.post("/0/confirm_write", confirm).status_code == 204
    assert server.post("/0/get_page_indices", {"keys": ["k1"], "namespace": "kv"}).json() == {
        "indices": [0]
    }
    init = {"role": "worker", "num_pages": 8}
    assert server.post("/rank/0/initialize", init).status_code in (200, 204)
    got = server.post("/keys/batch_allocate", {"rank": 0, "keys": [["b1", ""]]}).json()
    assert got == {"rank": 0, "results": [["b1", 0]]}
    confirm = {"rank": 0, "confirmations": [["b1", 0]], "pages_to_release": []}
    assert server.post("/keys/confirm_write", confirm).status_code in (200, 204)
    got = server.post("/keys/get_locations", {"rank": 0, "keys": ["b1"]}).json()
    assert got["locations"] == [0]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pins() -> dict[str, str]:
    """Package -> version of constraints/test.txt."""
    pins = {}
    for line in (ROOT / "constraints" / "test.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[_norm(name)] = version.strip()
    return pins


def _missing_extra(venv: Venv, extra: str, cwd: Path) -> None:
    done = venv.kvmeta(*NEEDS[extra], cwd=cwd)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"pip install 'kvmeta[{extra}]'" in lines[0], lines[0]


def test_the_sdist_carries_the_tests_and_docs_and_both_render_on_an_index(dist: Dist) -> None:
    out = _run(sys.executable, "-m", "twine", "check", "--strict", dist.wheel, dist.sdist)
    assert out.count("PASSED") == 2, out
    with tarfile.open(dist.sdist) as tar:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    for needed in (
        "README.md", "pyproject.toml", "src/kvmeta/cli.py", "constraints/test.txt",
        "scripts/test", "tests/packaging/test_install.py", "docs/protocol.md",
        "scripts/package", "Dockerfile", ".dockerignore", "deploy/systemd/kvmeta.service",
        "deploy/kubernetes/overlays/durable/kustomization.yaml", "tests/deploy/test_kubernetes.py",
        "LICENSE", "CHANGELOG.md", "docs/pypi.md",
    ):  # fmt: skip
        assert needed in names, needed


# What a package index shows and filters on, as the wheel's METADATA must carry it.
CLASSIFIERS = (
    "Development Status :: 4 - Beta",
    "Framework :: AsyncIO",
    "Operating System :: POSIX :: Linux",
    "Programming Language :: Python :: 3.10",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: Python :: 3.13",
    "Typing :: Typed",
)
URLS = ("Homepage", "Documentation", "Source", "Changelog", "Issues")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_the_wheel_metadata_is_complete_for_an_index(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as zf:
        names = set(zf.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_string(zf.read(meta_name).decode())
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        license_text = zf.read(license_name).decode()
    assert "kvmeta/py.typed" in names
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert meta["License-Expression"] == "Apache-2.0", meta["License-Expression"]
    assert meta.get_all("License-File") == ["LICENSE"], meta.get_all("License-File")
    classifiers = meta.get_all("Classifier") or []
    missing = [c for c in CLASSIFIERS if c not in classifiers]
    assert not missing, f"classifiers missing: {missing}; the wheel has {classifiers}"
    # A "License ::" classifier next to License-Expression is refused by an index (PEP 639).
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert sorted(urls) == sorted(URLS), urls
    assert all(u.startswith("https://") for u in urls.values()), urls
    assert meta["Description-Content-Type"] == "text/markdown"
    description = meta.get_payload()
    assert isinstance(description, str) and "kvmeta serve" in description
    # An index shows the description without the repository: relative links lead nowhere.
    assert "](docs/" not in description and "](./" not in description
    links = MD_LINK.findall(description)
    assert links and not [t for t in links if not t.startswith("https://")], links


def test_a_bare_install_runs_every_command(bare: Venv, tmp_path: Path) -> None:
    done = bare.kvmeta("--version")
    assert done.returncode == 0 and done.stdout.startswith("kvmeta "), done.stderr
    installed = _run(bare.bin("python"), "-m", "pip", "freeze")
    for optional in ("redis", "hiredis", "pyzmq", "matplotlib"):
        assert f"\n{optional}==" not in f"\n{installed}", installed
    pins = _pins()
    for line in installed.splitlines():  # scripts/package installs the pinned versions
        name, _, version = line.partition("==")
        if _norm(name) in pins:
            assert version == pins[_norm(name)], f"{line}: constraints/test.txt pins {pins}"

    data = tmp_path / "data"
    server = Served(bare, "--data-dir", str(data), "--read-lease", "0", cwd=tmp_path)
    try:
        _one_request_of_each_dialect(server)
    finally:
        server.stop()
    check = bare.kvmeta("check", "--data-dir", str(data))
    assert check.returncode == 0, check.stdout + check.stderr

    again = Served(bare, "--data-dir", str(data), cwd=tmp_path)
    try:  # durable: the keys are there after the restart
        got = again.post("/0/get_page_indices", {"keys": ["k1"], "namespace": "kv"}).json()
        assert got == {"indices": [0]}
        status = bare.kvmeta("status", "--url", again.url, "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["ready"]["ready"] is True
        bench = bare.kvmeta(
            "bench", "--url", again.url, "--duration", "1", "--warmup", "0.2", "--clients", "1",
            "--json",
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        assert json.loads(bench.stdout)["requests"] > 0
    finally:
        again.stop()

    for extra in EXTRAS:
        _missing_extra(bare, extra, tmp_path)


def test_an_unknown_extra_is_refused_before_anything_is_installed(
    dist: Dist, tmp_path: Path
) -> None:
    venv = Venv(tmp_path / "venv")
    _run(sys.executable, "-m", "venv", venv.path)
    done = subprocess.run(
        [str(PACKAGE), "install", str(venv.bin("python")), str(dist.wheel), "redis,evnts"],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unknown extra 'evnts' (KVMETA_EXTRAS)" in done.stderr, done.stderr
    assert "redis, metrics, events" in done.stderr, done.stderr
    installed = _run(venv.bin("python"), "-m", "pip", "freeze")
    assert "kvmeta" not in installed and "redis" not in installed, installed


def test_the_in_process_clients_of_a_bare_install(bare: Venv) -> None:
    code = (
        "from kvmeta.sglang import Hf3fsLocalMetadataClient as S\n"
        "from kvmeta.vllm import Hf3fsLocalMetadataClient as V\n"
        "s = S(); s.initialize(0, 4, 'kv')\n"
        "(hit, page), = s.reserve_and_allocate_page_indices(0, [('k', '')], 'kv')\n"
        "s.confirm_write(0, [('k', page)], [], 'kv')\n"
        "print(s.get_page_indices(0, ['k'], 'kv'))\n"
    )
    assert _run(bare.bin("python"), "-c", code).strip() == "[0]"
    _run(bare.bin("python"), "-c", "from kvmeta.vllm import Hf3fsLocalMetadataClient")


def test_the_redis_extra_alone(dist: Dist, tmp_path: Path, redis_url: str) -> None:
    venv = _venv(tmp_path, dist, "redis")
    # An empty database: the worker's Redis is shared with every test run before this one.
    server = Served(venv, "--backend", redis_url, "--read-lease", "0", cwd=tmp_path)
    try:
        _one_request_of_each_dialect(server)
    finally:
        server.stop()
    for extra in ("events", "bench"):
        _missing_extra(venv, extra, tmp_path)


def test_the_events_extra_alone(dist: Dist, tmp_path: Path) -> None:
    venv = _venv(tmp_path, dist, "events")
    events, replay = (f"tcp://127.0.0.1:{unused_port()}" for _ in range(2))
    server = Served(
        venv, "--in-memory", "--events", events, "--events-replay", replay, "--read-lease", "0",
        cwd=tmp_path,
    )  # fmt: skip
    try:
        _one_request_of_each_dialect(server)
        # From sequence 0 on (the replay socket), so what was published before it joined counts.
        tail = venv.kvmeta(
            "events", events, "--replay", replay, "--from", "0", "--json", "--count", "3",
            "--timeout", "30",
        )  # fmt: skip
        assert tail.returncode == 0, tail.stderr
        assert tail.stdout.count("BlockStored") == 2, tail.stdout
    finally:
        server.stop()
    for extra in ("redis", "bench"):
        _missing_extra(venv, extra, tmp_path)


def test_the_bench_extra_alone(dist: Dist, tmp_path: Path) -> None:
    venv = _venv(tmp_path, dist, "bench")
    done = venv.kvmeta(
        "bench", "sweep", "--launch", "memory", "--values", "512", "--duration", "0.5",
        "--warmup", "0.1", "--clients", "1", "--out", str(tmp_path / "chart"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "chart.png").stat().st_size > 0
    assert json.loads((tmp_path / "chart.json").read_text())["results"]
    for extra in ("redis", "events"):
        _missing_extra(venv, extra, tmp_path)
